"""The benchmark client and helpers: percentile math and workloads on fixed inputs, the streaming
client against a scripted SSE server, and ``jaxserve bench serve`` / ``run_throughput`` /
``run_timeline`` on the bundled model (one engine for the module, servers around variants of it)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from jaxserve.bench.client import completion_payload, send_completion
from jaxserve.bench.metrics_scrape import parse_metrics, run_figures, snapshot
from jaxserve.bench.serve import format_table
from jaxserve.bench.stats import RequestResult, compute_metrics, summarize
from jaxserve.bench.workloads import (
    BenchRequest,
    TokenSource,
    WorkloadSpec,
    make_requests,
    poisson_arrivals,
)

# ---- statistics ---------------------------------------------------------------------------------


def test_summarize_fixed_numbers():
    s = summarize([0.1, 0.2, 0.3, 0.4], percentiles=(50, 90, 99, 99.9))
    assert s["mean"] == pytest.approx(250.0)
    assert s["median"] == pytest.approx(250.0)
    assert s["std"] == pytest.approx(math.sqrt((150**2 + 50**2 + 50**2 + 150**2) / 4))
    # linear interpolation: rank q/100 * (n - 1) between the sorted values
    assert s["p50"] == pytest.approx(250.0)
    assert s["p90"] == pytest.approx(300.0 + 0.7 * 100.0)
    assert s["p99"] == pytest.approx(300.0 + 0.97 * 100.0)
    assert s["p99.9"] == pytest.approx(300.0 + 0.997 * 100.0)
    assert summarize([]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}
    with pytest.raises(ValueError, match="percentiles"):
        summarize([1.0], percentiles=(101,))


def test_compute_metrics_fixed_requests():
    results = [
        RequestResult(
            success=True, prompt_len=10, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1] * 4
        ),
        RequestResult(
            success=True, prompt_len=20, output_tokens=3, ttft=0.3, latency=0.7, itl=[0.1, 0.3]
        ),
        RequestResult(success=True, prompt_len=30, output_tokens=1, ttft=0.2, latency=0.2, itl=[]),
        RequestResult(success=False, prompt_len=99, error="HTTP 500"),
    ]
    m = compute_metrics(results, duration_s=2.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 9)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(34.5)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    # TPOT = (e2e - TTFT) / (out - 1), only for requests with out > 1: 100 ms and 200 ms
    assert m["mean_tpot_ms"] == pytest.approx(150.0)
    assert m["median_tpot_ms"] == pytest.approx(150.0)
    # every ITL gap pooled: 4 x 100 ms, 100 ms, 300 ms
    assert m["mean_itl_ms"] == pytest.approx(1000 * 0.8 / 6)
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert m["p99_itl_ms"] == pytest.approx(100.0 + 0.95 * 200.0)
    assert m["mean_e2el_ms"] == pytest.approx(1000 * 1.4 / 3)
    with pytest.raises(ValueError, match="duration_s"):
        compute_metrics(results, 0.0)


# ---- workloads ----------------------------------------------------------------------------------

SOURCE = TokenSource(4096, special_ids=(0, 1, 2))


def test_random_workload_lengths_and_ids():
    reqs = make_requests(
        WorkloadSpec(kind="random", num_prompts=20, input_len=33, output_len=7), SOURCE
    )
    assert all(len(r.prompt) == r.prompt_len == 33 and r.output_len == 7 for r in reqs)
    ids = np.concatenate([r.prompt for r in reqs])
    assert ids.min() >= 3 and ids.max() < 4096
    spec = WorkloadSpec(num_prompts=3, seed=5)
    assert make_requests(spec, SOURCE) == make_requests(spec, SOURCE)
    assert make_requests(spec, SOURCE) != make_requests(dataclasses.replace(spec, seed=6), SOURCE)
    varied = make_requests(
        WorkloadSpec(num_prompts=200, input_len=100, output_len=50, range_ratio=0.5), SOURCE
    )
    assert min(r.prompt_len for r in varied) >= 50 and max(r.prompt_len for r in varied) <= 150
    assert len({r.prompt_len for r in varied}) > 10


def test_shared_prefix_and_mixed_workloads():
    reqs = make_requests(
        WorkloadSpec(
            kind="shared-prefix",
            num_prompts=6,
            prefix_len=40,
            num_prefixes=2,
            input_len=8,
            output_len=4,
        ),
        SOURCE,
    )
    assert all(r.prompt_len == 48 for r in reqs)
    assert reqs[0].prompt[:40] == reqs[2].prompt[:40] == reqs[4].prompt[:40]
    assert reqs[1].prompt[:40] == reqs[3].prompt[:40] != reqs[0].prompt[:40]
    assert reqs[0].prompt[40:] != reqs[2].prompt[40:]
    mixed = make_requests(
        WorkloadSpec(
            kind="mixed",
            num_prompts=20,
            input_len=8,
            output_len=4,
            long_input_len=64,
            long_output_len=16,
            long_fraction=0.25,
        ),
        SOURCE,
    )
    long = [r for r in mixed if r.kind == "long"]
    assert len(long) == 5 and all(r.prompt_len == 64 and r.output_len == 16 for r in long)
    assert all(r.prompt_len == 8 and r.output_len == 4 for r in mixed if r.kind == "short")


def test_workload_errors_name_the_field():
    with pytest.raises(ValueError, match="input_len"):
        WorkloadSpec(input_len=0)
    with pytest.raises(ValueError, match="prefix_len"):
        WorkloadSpec(kind="shared-prefix", prefix_len=0)
    with pytest.raises(ValueError, match="workload"):
        WorkloadSpec(kind="sharegpt")
    with pytest.raises(ValueError, match="request_rate"):
        poisson_arrivals(3, 0.0)
    with pytest.raises(ValueError, match="prompt_format"):
        make_requests(WorkloadSpec(num_prompts=1, prompt_format="text"), SOURCE)  # no tokenizer


def test_poisson_arrivals():
    assert poisson_arrivals(4, math.inf) == [0.0] * 4
    times = poisson_arrivals(4000, 20.0, seed=1)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    assert np.mean(np.diff(times)) == pytest.approx(1 / 20.0, rel=0.1)


# ---- /metrics scraping --------------------------------------------------------------------------

EXPOSITION = """# TYPE {p}num_requests_running gauge
{p}num_requests_running{{model_name="m"}} {running}
# TYPE {p}num_requests_waiting gauge
{p}num_requests_waiting{{model_name="m"}} {waiting}
# TYPE {p}kv_cache_usage_perc gauge
{p}kv_cache_usage_perc{{model_name="m",engine="0"}} {kv}
{p}kv_cache_usage_perc{{model_name="m",engine="1"}} 0.1
# TYPE {p}num_preemptions counter
{p}num_preemptions_total{{model_name="m"}} {pre}
# TYPE {p}prefix_cache_queries counter
{p}prefix_cache_queries_total{{model_name="m"}} {queries}
# TYPE {p}prefix_cache_hits counter
{p}prefix_cache_hits_total{{model_name="m"}} {hits}
"""


@pytest.mark.parametrize("prefix", ["jaxserve:", "vllm:"])
def test_metrics_deltas_and_peaks(prefix):
    def snap(**kw):
        return snapshot(parse_metrics(EXPOSITION.format(p=prefix, **kw)))

    before = snap(running=0, waiting=0, kv=0.0, pre=3, queries=100, hits=10)
    during = [
        (0.5, snap(running=4, waiting=7, kv=0.9, pre=4, queries=150, hits=30)),
        (1.0, snap(running=6, waiting=2, kv=0.5, pre=5, queries=200, hits=50)),
    ]
    after = snap(running=0, waiting=0, kv=0.0, pre=5, queries=300, hits=70)
    fig = run_figures(before, after, during)
    assert fig["preemptions"] == 2
    assert fig["prefix_cache_hit_rate"] == pytest.approx(60 / 200)
    assert (fig["peak_waiting"], fig["peak_running"], fig["peak_kv_cache_usage"]) == (7, 6, 0.9)
    assert fig["timeline"]["waiting"] == [7, 2]
    no_queries = run_figures(before, before, [])
    assert no_queries["prefix_cache_hit_rate"] is None and no_queries["preemptions"] == 0


SPEC_EXPOSITION = """# TYPE {p}spec_decode_num_drafts counter
{p}spec_decode_num_drafts_total{{model_name="m"}} {drafts}
# TYPE {p}spec_decode_num_draft_tokens counter
{p}spec_decode_num_draft_tokens_total{{model_name="m"}} {tokens}
# TYPE {p}spec_decode_num_accepted_tokens counter
{p}spec_decode_num_accepted_tokens_total{{model_name="m"}} {acc}
# TYPE {p}spec_decode_num_accepted_tokens_per_pos counter
{p}spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} {p0}
{p}spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="1"}} {p1}
"""


@pytest.mark.parametrize("prefix", ["jaxserve:", "vllm:"])
def test_speculative_decoding_figures(prefix):
    def snap(**kw):
        return snapshot(parse_metrics(SPEC_EXPOSITION.format(p=prefix, **kw)))

    before = snap(drafts=10, tokens=20, acc=5, p0=4, p1=1)
    after = snap(drafts=110, tokens=220, acc=155, p0=94, p1=61)  # 100 drafts of 2 tokens
    spec = run_figures(before, after, [])["spec_decode"]
    assert spec["num_drafts"] == 100 and spec["draft_tokens"] == 200
    assert spec["accepted_tokens"] == 150
    assert spec["acceptance_rate"] == pytest.approx(75.0)
    assert spec["acceptance_length"] == pytest.approx(2.5)  # 1 + 150 / 100
    assert spec["per_position_acceptance_rates"] == pytest.approx([0.9, 0.6])
    assert run_figures(before, before, [])["spec_decode"] is None  # no draft in the run
    table = format_table(
        {
            "completed": 1, "failed": 0, "request_rate": "inf", "max_concurrency": 1,
            "duration": 1.0, "total_input_tokens": 1, "total_output_tokens": 1,
            "request_throughput": 1.0, "output_throughput": 1.0, "total_token_throughput": 1.0,
            "percentiles": [], "server": run_figures(before, after, []),
            **{f"{s}_{k}_ms": 1.0 for s in ("mean", "median") for k in ("ttft", "tpot", "itl", "e2el")},
        }
    )  # fmt: skip
    assert "Acceptance length:" in table and "2.50" in table and "Position 1:" in table


# ---- the client against a scripted server --------------------------------------------------------


def _sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


async def _scripted(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    mode = body["prompt"]
    if mode == "http-error":
        return web.json_response({"error": {"message": "boom"}}, status=500)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await asyncio.sleep(0.05)
    await resp.write(b": keep-alive comment\n\n")
    for k in range(4):
        if k:
            await asyncio.sleep(0.03)
        await resp.write(_sse({"choices": [{"index": 0, "text": f"t{k}", "finish_reason": None}]}))
    if mode == "stream-error":
        await resp.write(_sse({"error": {"message": "engine died"}}))
    if mode == "usage":
        await resp.write(
            _sse({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 6}})
        )
    await resp.write(_sse(b"[DONE]"))
    return resp


def _run_scripted(prompts):
    async def main():
        import aiohttp

        app = web.Application()
        app.router.add_post("/v1/completions", _scripted)
        async with TestServer(app) as server, aiohttp.ClientSession() as session:
            url = str(server.make_url("/v1/completions"))
            out = []
            for prompt in prompts:
                req = BenchRequest(prompt, prompt_len=3, output_len=4, kind="k")
                out.append(
                    await send_completion(
                        session, url, completion_payload("m", req), req, start_time=1.5
                    )
                )
            return out

    return asyncio.run(main())


def test_client_times_chunks_and_counts_tokens():
    with_usage, without, http_error, stream_error = _run_scripted(
        ["usage", "plain", "http-error", "stream-error"]
    )
    for r in (with_usage, without):
        assert r.success and r.error == "" and r.kind == "k" and r.start_time == 1.5
        assert 0.05 <= r.ttft < r.latency
        assert len(r.itl) == 3 and all(g >= 0.025 for g in r.itl)
        assert r.latency == pytest.approx(r.ttft + sum(r.itl))
    assert (with_usage.output_tokens, with_usage.prompt_len) == (6, 11)  # the server's usage wins
    assert (without.output_tokens, without.prompt_len) == (
        4,
        3,
    )  # else chunks / the request's count
    assert not http_error.success and "HTTP 500" in http_error.error and "boom" in http_error.error
    assert not stream_error.success and "engine died" in stream_error.error


def test_payload():
    body = completion_payload(
        "m", BenchRequest([5, 6], 2, 9), ignore_eos=True, temperature=0.5, extra_body={"top_k": 3}
    )
    assert body == {
        "model": "m",
        "prompt": [5, 6],
        "max_tokens": 9,
        "temperature": 0.5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "top_k": 3,
    }


def test_cli_flags_and_presets():
    from jaxserve.bench.commands import resolve, workload_spec
    from jaxserve.cli import build_parser

    argv = ["bench", "serve", "--preset", "mixed", "--input-len", "12", "--num-prompts", "5"]
    args = build_parser(argv).parse_args(argv)
    spec = workload_spec(args)
    assert (spec.kind, spec.input_len, spec.num_prompts, spec.long_input_len) == (
        "mixed",
        12,
        5,
        2048,
    )
    assert resolve(args, "request_rate") == 4.0 and resolve(args, "max_concurrency") is None
    argv = [
        "bench",
        "throughput",
        "--max-num-seqs",
        "4",
        "--workload",
        "shared-prefix",
        "--prefix-len",
        "8",
    ]
    args = build_parser(argv).parse_args(argv)
    assert args.max_num_seqs == 4 and workload_spec(args).prefix_len == 8
    assert math.isinf(resolve(args, "request_rate"))


# ---- on the bundled model ----------------------------------------------------------------------

MODEL_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "tiny-llama")


@pytest.fixture(scope="module")
def llm():
    if not os.path.isfile(os.path.join(MODEL_DIR, "config.json")):
        pytest.skip("the bundled model is missing")
    from jaxserve.bench import DEMO_ENGINE_ARGS
    from jaxserve.engine.llm import LLM

    return LLM(**DEMO_ENGINE_ARGS)


@pytest.fixture
def server(llm):
    """A server around a fresh engine variant (empty prefix cache) of the module's model."""
    from jaxserve.bench import BackgroundServer, engine_variant

    srv = BackgroundServer(engine_variant(llm))
    yield srv
    assert srv.close() == 0


def _bench(server, tmp_path, *flags):
    from jaxserve.cli import main

    path = tmp_path / "result.json"
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "bench",
                "serve",
                "--base-url",
                server.url,
                "--metrics-interval",
                "0.05",
                "--result-file",
                str(path),
                *flags,
            ]
        )
    assert exit_info.value.code == 0
    return json.loads(path.read_text())


def test_bench_serve_random(server, tmp_path, capsys):
    r = _bench(
        server,
        tmp_path,
        "--workload",
        "random",
        "--input-len",
        "12",
        "--output-len",
        "5",
        "--num-prompts",
        "4",
        "--request-rate",
        "inf",
    )
    out = capsys.readouterr().out
    assert (
        "Serving Benchmark Result" in out
        and "Mean TTFT (ms):" in out
        and "Peak KV-cache usage" in out
    )
    assert r["model"] == "tiny-llama" and r["workload"]["kind"] == "random"
    assert (r["completed"], r["failed"]) == (4, 0) and r["errors"] == [""] * 4
    assert (
        r["output_lens"] == [5] * 4 and r["input_lens"] == [12] * 4
    )  # ignore_eos: exactly --output-len
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (48, 20)
    for ttft, e2e, itl in zip(r["ttfts"], r["e2els"], r["itls"]):
        assert 0 < ttft < e2e and 1 <= len(itl) <= 4 and e2e == pytest.approx(ttft + sum(itl))
    assert (
        0 < r["mean_ttft_ms"] <= r["p99_ttft_ms"] and 0 < r["mean_tpot_ms"] and 0 < r["mean_itl_ms"]
    )
    assert r["mean_ttft_ms"] < r["mean_e2el_ms"]
    assert r["output_throughput"] == pytest.approx(20 / r["duration"])
    s = r["server"]
    # Peaks come from polling /metrics, which a sub-second run can fall between: only their range
    # is certain here (run_figures' peak arithmetic is checked on fixed samples elsewhere).
    assert (
        s["preemptions"] == 0 and 0 <= s["peak_running"] <= 4 and 0 <= s["peak_kv_cache_usage"] <= 1
    )
    assert s["prefix_cache_queries"] == 48


def test_bench_serve_shared_prefix_hits(server, tmp_path):
    r = _bench(
        server,
        tmp_path,
        "--workload",
        "shared-prefix",
        "--prefix-len",
        "48",
        "--num-prefixes",
        "1",
        "--input-len",
        "8",
        "--output-len",
        "3",
        "--num-prompts",
        "4",
        "--max-concurrency",
        "1",
    )
    assert r["completed"] == 4 and r["output_lens"] == [3] * 4 and r["input_lens"] == [56] * 4
    s = r["server"]
    # One at a time: requests 2-4 find the prefix's 3 full blocks (48 tokens) in the cache.
    assert s["prefix_cache_hit_rate"] == pytest.approx(3 * 48 / (4 * 56))
    assert s["peak_running"] <= 1  # sampled; may miss a sub-second run entirely


def test_bench_serve_mixed_text_prompts_under_concurrency_cap(server, tmp_path):
    r = _bench(
        server,
        tmp_path,
        "--preset",
        "mixed",
        "--input-len",
        "6",
        "--output-len",
        "3",
        "--long-input-len",
        "60",
        "--long-output-len",
        "6",
        "--long-fraction",
        "0.5",
        "--num-prompts",
        "6",
        "--prompt-format",
        "text",
        "--request-rate",
        "50",
        "--max-concurrency",
        "2",
    )
    assert r["completed"] == 6 and r["max_concurrency"] == 2 and r["request_rate"] == 50.0
    assert sorted(r["kinds"]) == ["long"] * 3 + ["short"] * 3
    assert all(n == (6 if k == "long" else 3) for n, k in zip(r["output_lens"], r["kinds"]))
    assert all(n > 20 if k == "long" else n < 20 for n, k in zip(r["input_lens"], r["kinds"]))
    assert r["server"]["peak_running"] <= 2


def test_bench_serve_reports_failures(server, tmp_path, capsys):
    from jaxserve.cli import main

    # Prompts longer than max_model_len (256) are refused with a 400: every request fails.
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "bench",
                "serve",
                "--base-url",
                server.url,
                "--input-len",
                "300",
                "--num-prompts",
                "2",
                "--num-warmup",
                "0",
                "--no-metrics",
            ]
        )
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    assert "Failed requests:                         2" in out and "(not available)" in out


def test_run_throughput(llm):
    from jaxserve.bench import format_throughput, run_throughput

    spec = WorkloadSpec(
        kind="shared-prefix",
        num_prompts=6,
        prefix_len=32,
        num_prefixes=1,
        input_len=4,
        output_len=5,
        seed=123,
    )
    reqs = make_requests(spec, TokenSource.from_tokenizer(llm.get_tokenizer()))
    r = run_throughput(llm, reqs)
    assert (r["num_requests"], r["total_input_tokens"], r["total_output_tokens"]) == (
        6,
        6 * 36,
        6 * 5,
    )
    assert r["requests_per_s"] == pytest.approx(6 / r["elapsed_s"])
    assert r["total_tokens_per_s"] == pytest.approx(246 / r["elapsed_s"])
    assert 0 < r["prefix_cache_hit_rate"] < 1 and r["preemptions"] == 0
    assert format_throughput(r).startswith("Throughput: ")


def test_timeline_small_pool_preempts(llm):
    from jaxserve.bench import engine_variant, run_timeline

    reqs = make_requests(
        WorkloadSpec(kind="random", num_prompts=4, input_len=30, output_len=20, seed=7),
        TokenSource.from_tokenizer(llm.get_tokenizer()),
    )
    # 4 x 50 tokens need 16 blocks; 7 usable blocks hold two requests at most.
    tl = run_timeline(engine_variant(llm, num_gpu_blocks=8), reqs)
    cols = tl.columns()
    # Usage is read after each step, when a preempted request's blocks are already free.
    assert (
        cols["preemptions"][-1] > 0
        and max(cols["kv_cache_usage"]) >= 5 / 7
        and max(cols["num_waiting"]) >= 1
    )
    assert all(0 <= u <= 1 for u in cols["kv_cache_usage"])
    assert cols["num_finished"][-1] == 4 and cols["num_running"][-1] == 0
    assert all(b >= a for a, b in zip(cols["t"], cols["t"][1:]))
    assert [r.output_tokens for r in tl.requests] == [20] * 4
    m = tl.metrics()
    assert m["completed"] == 4 and m["mean_ttft_ms"] < m["mean_e2el_ms"]
    assert sum(cols["num_scheduled_tokens"]) >= 4 * 49  # recompute after preemption adds tokens


def test_engine_variant_checks_knobs(llm):
    from jaxserve.bench import engine_variant

    with pytest.raises(ValueError, match="unknown knob.*block_size"):
        engine_variant(llm, block_size=32)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine_variant(llm, max_num_batched_tokens=128)  # above the largest token bucket (64)
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine_variant(llm, max_num_seqs=9)
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        engine_variant(llm, num_gpu_blocks=65)
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine_variant(llm, max_num_seqs=0)  # SchedulerConfig's own check
    engine = engine_variant(
        llm,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=8,
        num_gpu_blocks=10,
        enable_prefix_caching=False,
    )
    cfg = engine.engine_config
    assert (cfg.scheduler.max_num_batched_tokens, cfg.scheduler.long_prefill_token_threshold) == (
        16,
        8,
    )
    assert (cfg.cache.num_gpu_blocks, cfg.cache.enable_prefix_caching) == (10, False)
