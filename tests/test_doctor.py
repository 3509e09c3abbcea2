"""jaxserve doctor: its checks on given evidence, its plan's time estimate, its --help, and a
--quick run against the bundled model that says what it does (also in demos/05_tune_and_doctor)."""

from __future__ import annotations

import argparse
import os
import re

import pytest

from jaxserve.bench.stats import RequestResult
from jaxserve.doctor import (
    FAIL,
    PASS,
    WARN,
    check_dashboard,
    check_load,
    check_long_prompt,
    check_preemptions,
    check_prefix_caching,
    combine,
    histogram_quantile,
    metric_samples,
    shareable_fraction,
)
from jaxserve.tune.trace import Trace, TraceRequest


def _exposition(ns: str, ttft_counts: dict[str, int], waiting=0.0, with_kv=True) -> str:
    lines = [f"# TYPE {ns}:time_to_first_token_seconds histogram"]
    for le, c in ttft_counts.items():
        lines.append(f'{ns}:time_to_first_token_seconds_bucket{{le="{le}",model_name="m"}} {c}')
    lines += [
        f'{ns}:time_to_first_token_seconds_count{{model_name="m"}} {max(ttft_counts.values())}',
        f'{ns}:time_to_first_token_seconds_sum{{model_name="m"}} 1.0',
        f"# TYPE {ns}:num_requests_waiting gauge",
        f'{ns}:num_requests_waiting{{model_name="m"}} {waiting}',
        f"# TYPE {ns}:prefix_cache_hits counter",
        f'{ns}:prefix_cache_hits_total{{model_name="m"}} 5',
        f"# TYPE {ns}:prefix_cache_queries counter",
        f'{ns}:prefix_cache_queries_total{{model_name="m"}} 10',
    ]
    if with_kv:
        lines += [
            f"# TYPE {ns}:kv_cache_usage_perc gauge",
            f'{ns}:kv_cache_usage_perc{{model_name="m"}} 0.3',
        ]
    return "\n".join(lines) + "\n"


def test_histogram_quantile_interpolates_between_scrapes():
    before = metric_samples(_exposition("vllm", {"0.1": 0, "1.0": 0, "+Inf": 0}))
    after = metric_samples(_exposition("vllm", {"0.1": 50, "1.0": 100, "+Inf": 100}))
    name = "time_to_first_token_seconds_bucket"
    assert histogram_quantile(before[name], after[name], 0.5) == pytest.approx(0.1)
    assert histogram_quantile(before[name], after[name], 0.75) == pytest.approx(0.55)
    assert histogram_quantile(after[name], after[name], 0.5) is None  # nothing observed between


@pytest.mark.parametrize("ns", ["jaxserve", "vllm"])
def test_dashboard_reads_either_namespace(ns):
    before = _exposition(ns, {"0.1": 0, "1.0": 0, "+Inf": 0})
    after = _exposition(ns, {"0.1": 9, "1.0": 10, "+Inf": 10})
    figures = {"peak_waiting": 3, "peak_kv_cache_usage": 0.4, "prefix_cache_hit_rate": 0.5}
    c = check_dashboard(before, after, 0.5, figures)
    assert c.status == PASS and c.evidence["namespace"] == ns
    assert 0.1 < c.evidence["server_ttft_p99_s"] <= 1.0
    no_kv = _exposition(ns, {"0.1": 9, "1.0": 10, "+Inf": 10}, with_kv=False)
    c = check_dashboard(before, no_kv, 0.5, figures)
    assert c.status == FAIL and c.evidence["missing"] == ["KV usage"]
    assert check_dashboard(before, None, 0.5, figures).status == FAIL


def _result(ttft, latency, tokens, ok=True, kind=""):
    return RequestResult(ok, 10, tokens, ttft, latency, [], 0.0, "" if ok else "HTTP 400: x", kind)


def test_load_check_judges_slos_and_failures():
    good = [_result(0.1, 1.0, 10) for _ in range(10)]
    assert check_load(good, 2.0, 1.0, 0.5)[0].status == PASS
    assert check_load(good, 2.0, 0.05, 0.5)[0].status == FAIL  # TTFT p99 0.1 s > 0.05 s
    assert check_load(good, 2.0, None, None)[0].status == WARN  # nothing to judge against
    failed = check_load([*good, _result(0, 0, 0, ok=False)], 2.0, 1.0, 0.5)[0]
    assert failed.status == FAIL and "HTTP 400" in failed.evidence["first_error"]


def test_preemption_and_prefix_and_long_prompt_checks():
    assert check_preemptions({"preemptions": 0}, 100).status == PASS
    assert check_preemptions({"preemptions": 1}, 100).status == WARN
    assert check_preemptions({"preemptions": 9}, 100).status == FAIL
    assert check_preemptions({}, 100).status == WARN
    system = list(range(1, 33))
    trace = Trace([TraceRequest(0, system + [100 + i] * 16, 4) for i in range(3)])
    # Requests 2 and 3 find the 32 system tokens (two 16-token blocks) of 48 each.
    assert shareable_fraction(trace, 16) == pytest.approx(64 / 144)
    ok = {"prefix_cache_hit_rate": 0.4, "prefix_cache_queries": 144}
    assert check_prefix_caching(ok, trace, 16, "True").status == PASS
    low = {"prefix_cache_hit_rate": 0.1, "prefix_cache_queries": 144}
    assert check_prefix_caching(low, trace, 16, None).status == WARN
    off = {"prefix_cache_hit_rate": None, "prefix_cache_queries": 0}
    assert check_prefix_caching(off, trace, 16, "False").status == FAIL
    shorts = [_result(0.1, 1.1, 11, kind="short") for _ in range(3)]
    long = _result(0.8, 0.9, 2, kind="long")
    assert check_long_prompt([*shorts, long], 1.0, 0.2).status == PASS
    assert check_long_prompt([*shorts, long], 0.5, 0.2).status == FAIL
    assert check_long_prompt([*shorts, long], 1.0, 0.05).status == WARN  # shorts' TPOT 0.1 s
    assert check_long_prompt(shorts, 1.0, 0.2).status == FAIL  # no long request answered


def test_combine_shifts_follow_up_indices():
    a = Trace([TraceRequest(0, [1], 1), TraceRequest(0, [1, 2], 1, after=0)])
    both = combine([a, a], "x")
    assert [r.after for r in both.requests] == [None, 0, None, 2]


# Each traffic flag's default and --quick value, as --help must show them.
TRAFFIC_HELP = {
    "--num-prompts": "(default: 60; --quick: 8)",
    "--input-len": "(default: 128; --quick: 32)",
    "--output-len": "(default: 64; --quick: 16)",
    "--long-input-len": "(default: 2048; --quick: 256)",
    "--long-output-len": "(default: 64; --quick: 16)",
    "--long-fraction": "(default: 0.1; --quick: 0.25)",
    "--request-rate": "(default: 4.0; --quick: 8.0)",
    "--num-conversations": "(default: 8; --quick: 3)",
    "--turns": "(default: 3; --quick: 2)",
    "--system-len": "(default: 256; --quick: 64)",
}


def test_help_shows_every_flags_default_and_quick_value(capsys):
    from jaxserve.cli import main

    with pytest.raises(SystemExit):
        main(["doctor", "--help"])
    helps = {}
    for block in re.split(r"\n  (?=--)", capsys.readouterr().out):  # one block per flag
        helps[block.split()[0].rstrip(",")] = " ".join(block.split())
    for flag, shown in TRAFFIC_HELP.items():
        assert shown in helps[flag], helps[flag]
    for flag in ("--base-url", "--api-key", "--slo-ttft-p99", "--long-prompt-len", "--seed"):
        assert "default" in helps[flag], helps[flag]


def _parse(*argv: str) -> argparse.Namespace:
    from jaxserve.doctor import add_doctor_parser, resolve_traffic

    return resolve_traffic(
        add_doctor_parser(argparse.ArgumentParser().add_subparsers()).parse_args(argv)
    )


def test_quick_fills_only_the_flags_left_out():
    from jaxserve.doctor import TRAFFIC

    args = _parse("--quick", "--num-prompts", "5")
    assert args.num_prompts == 5 and args.input_len == 32
    full = _parse()
    assert {n: getattr(full, n) for n in TRAFFIC} == {n: v[0] for n, v in TRAFFIC.items()}
    assert [f"(default: {d}; --quick: {q})" for d, q, _ in TRAFFIC.values()] == list(
        TRAFFIC_HELP.values()
    )


def test_speed_and_estimate_from_probes():
    from jaxserve.doctor import Speed, estimate_trace_s, speed_from_probes

    short = RequestResult(True, 100, 5, 0.2, 0.6, [0.1] * 4)
    long = RequestResult(True, 1100, 1, 1.2, 1.2)
    speed = speed_from_probes(short, long)
    assert speed.ttft_s == pytest.approx(0.1) and speed.prefill_s_per_token == pytest.approx(1e-3)
    assert speed.tpot_s == pytest.approx(0.1)
    with pytest.raises(ValueError, match="HTTP 400"):
        speed_from_probes(short, _result(0, 0, 0, ok=False))
    flat = Speed(ttft_s=1.0, prefill_s_per_token=0.0, tpot_s=0.5)
    # Two requests at once (3 s each alone) and a follow-up 1 s after the first: 3 + 1 + 3.
    trace = Trace(
        [
            TraceRequest(0.0, [1] * 10, 5),
            TraceRequest(0.0, [1] * 10, 5),
            TraceRequest(0.0, [1] * 10, 5, after=0, think_s=1.0),
        ]
    )
    assert estimate_trace_s(trace, flat) == pytest.approx(7.0)
    capped = Trace(trace.requests[:2] * 3, max_concurrency=1)  # 6 x 3 s, one at a time
    assert estimate_trace_s(capped, flat) == pytest.approx(18.0)
    # Prefill that batching cannot hide: 3 x 1000 prompt tokens at 1 ms each beat the 1 s
    # each request takes alone.
    heavy = Trace([TraceRequest(0.0, [1] * 1000, 1) for _ in range(3)])
    assert estimate_trace_s(heavy, Speed(0.0, 1e-3, 0.0)) == pytest.approx(3.0)
    assert estimate_trace_s(Trace([]), flat) == 0.0


MODEL_DIR = os.path.join(os.path.dirname(__file__), "..", "checkpoints", "tiny-llama")


@pytest.mark.slow
def test_quick_run_against_the_bundled_model_talks_and_finishes(capsys):
    if not os.path.isfile(os.path.join(MODEL_DIR, "config.json")):
        pytest.skip("the bundled model is missing")
    from jaxserve.bench import DEMO_ENGINE_ARGS, BackgroundServer
    from jaxserve.cli import build_parser
    from jaxserve.doctor import run_doctor
    from jaxserve.engine.llm import LLM

    with BackgroundServer(LLM(**DEMO_ENGINE_ARGS)) as server:
        argv = ["doctor", "--base-url", server.url, "--quick", "--slo-ttft-p99", "30"]
        code = run_doctor(build_parser(argv).parse_args(argv))
    out, err = capsys.readouterr()
    assert code in (0, 1)
    said = [line for line in err.splitlines() if line.startswith("doctor: ")]
    assert re.search(r"probe: TTFT .* estimated run time about \d+ s", said[2]), said
    for i, what in enumerate(("load test", "multi-turn", "long prompt"), 1):
        assert any(line.startswith(f"doctor: [{i}/3] {what}") and "about" in line for line in said)
        assert any(
            line.startswith(f"doctor: [{i}/3] {what}") and "done in" in line for line in said
        )
    assert re.match(r"doctor: finished in \d+ s \(estimated \d+ s\)", said[-1]), said
    assert "requests: 100%" not in err and "load test (checks 1-3): 100%" in err  # the bars
    assert len(re.findall(r"^\[(PASS|WARN|FAIL)\] \d ", out, re.M)) == 5, out
