"""jaxserve tune: the replay through the real scheduler, the step-time fit, traces, the CLI."""

from __future__ import annotations

import json
import math

import pytest

from jaxserve.bench.workloads import TokenSource
from jaxserve.cli import main
from jaxserve.tune.grid import grid_settings, recommend
from jaxserve.tune.simulate import Setting, simulate
from jaxserve.tune.step_model import FEATURES, StepSample, StepTimeModel
from jaxserve.tune.trace import Trace, TraceRequest, load_jsonl_trace, preset_trace

SOURCE = TokenSource(500)
FLAT = StepTimeModel((0.01, 0.0, 0.0, 0.0, 0.0))  # every step 10 ms


def _setting(**kw):
    base = dict(
        max_num_batched_tokens=16,
        max_num_seqs=4,
        long_prefill_token_threshold=0,
        num_gpu_blocks=64,
        max_model_len=256,
    )
    return Setting(**{**base, **kw})


def test_replay_times_follow_the_scheduler_steps_exactly():
    # 40 prompt tokens in 16-token steps: 3 steps to the first token, then one per token.
    trace = Trace([TraceRequest(0.0, list(range(1, 41)), 5)])
    r = simulate(trace, _setting(), FLAT)
    assert r.num_steps == 7 and r.output_tokens == 5
    assert r.ttft_s == [pytest.approx(0.03)]
    assert r.tpot_s == [pytest.approx(0.01)] and r.itl_s == [pytest.approx(0.01)] * 4
    assert r.duration_s == pytest.approx(0.07)


def test_replay_sees_prefix_hits_preemptions_and_the_concurrency_cap():
    shared = list(range(1, 65))
    reqs = [TraceRequest(0.01 * i, shared + [100 + i] * 8, 8) for i in range(6)]
    on = simulate(Trace(reqs), _setting(max_num_batched_tokens=64), FLAT)
    off = simulate(
        Trace(reqs), _setting(max_num_batched_tokens=64, enable_prefix_caching=False), FLAT
    )
    assert on.prefix_hit_rate > 0.5 and off.prefix_hit_rate is None
    assert on.duration_s < off.duration_s  # hits skip prefill steps
    one = simulate(Trace(reqs, max_concurrency=1), _setting(max_num_batched_tokens=64), FLAT)
    assert one.peak_running == 1
    big = [TraceRequest(0.0, [10 + i] * 99, 60) for i in range(4)]
    tight = simulate(Trace(big), _setting(num_gpu_blocks=24, max_num_batched_tokens=64), FLAT)
    assert tight.preemptions > 0 and tight.num_requests == 4


def test_follow_up_turns_wait_for_their_predecessor():
    trace = preset_trace(
        "multi-turn",
        SOURCE,
        0,
        num_conversations=1,
        turns=2,
        system_len=32,
        input_len=8,
        output_len=4,
        request_rate=math.inf,
    )
    assert trace.requests[1].after == 0
    assert trace.requests[1].prompt[: len(trace.requests[0].prompt)] == trace.requests[0].prompt
    r = simulate(trace, _setting(), FLAT)
    # Turn 2 is sent 0.5 s (think time) after turn 1's last token.
    assert r.duration_s > 0.5 + 2 * 4 * 0.01


def test_rejected_requests_are_counted_not_served():
    trace = Trace([TraceRequest(0.0, [1] * 300, 4), TraceRequest(0.0, [2] * 10, 4)])
    r = simulate(trace, _setting(), FLAT)
    assert r.rejected == 1 and r.num_requests == 1


def test_step_model_fit_recovers_coefficients_and_round_trips(tmp_path):
    true = (0.002, 0.0001, 0.00005, 0.0003, 0.000001)
    samples = []
    for tb in (16, 32, 64, 128):
        for seqs in (1, 2, 4, 8):
            for ctx, sb in ((100 * seqs, 8), (700 + 5 * tb, 16)):
                t = true[0] + true[1] * tb + true[2] * sb + true[3] * seqs + true[4] * ctx
                samples.append(StepSample(tb, seqs, ctx, tb, sb, t))
    model = StepTimeModel.fit(samples)
    assert model.coef == pytest.approx(true, rel=1e-6, abs=1e-9)
    assert model.rel_error_p50 < 1e-6
    path = tmp_path / "m.json"
    model.save(str(path))
    assert StepTimeModel.load(str(path)).coef == pytest.approx(model.coef)
    path.write_text('{"coef_s": [1, 2]}')
    with pytest.raises(ValueError, match="calibration"):
        StepTimeModel.load(str(path))
    with pytest.raises(ValueError, match="calibration"):
        StepTimeModel.fit(samples[: len(FEATURES) - 1])
    # One max_num_seqs in the calibration: the sequence bucket never varies and its cost is
    # indistinguishable from the base cost, which takes it.
    fixed = [s for s in samples if s.seq_bucket == 8]
    coef = StepTimeModel.fit(fixed).coef
    assert coef[2] == 0 and coef[0] == pytest.approx(true[0] + 8 * true[2])


def test_jsonl_trace_prefixes_and_conversations(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [
        {
            "arrival_time": 0,
            "prompt_len": 5,
            "output_len": 3,
            "shared_prefix": "sys",
            "prefix_len": 20,
        },
        {
            "arrival_time": 1,
            "prompt_len": 6,
            "output_len": 3,
            "shared_prefix": "sys",
            "prefix_len": 20,
        },
        {"arrival_time": 2, "prompt_len": 4, "output_len": 2, "conversation_id": "c"},
        {"arrival_time": 3, "prompt_len": 4, "output_len": 2, "conversation_id": "c"},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    t = load_jsonl_trace(str(path), SOURCE)
    a, b, c1, c2 = t.requests
    assert a.prompt[:20] == b.prompt[:20] and len(a.prompt) == 25 and len(b.prompt) == 26
    assert c2.after == 2 and c2.prompt[:4] == c1.prompt and len(c2.prompt) == 4 + 2 + 4
    path.write_text('{"prompt_len": 3}\n')
    with pytest.raises(ValueError, match="line 1.*output_len"):
        load_jsonl_trace(str(path), SOURCE)


def test_recommend_best_under_slo():
    rows = [
        {
            "requests": 5,
            "rejected": 0,
            "output_throughput": 100.0,
            "ttft_ms_p99": 900.0,
            "tpot_ms_p99": 20.0,
        },
        {
            "requests": 5,
            "rejected": 0,
            "output_throughput": 80.0,
            "ttft_ms_p99": 300.0,
            "tpot_ms_p99": 20.0,
        },
        {
            "requests": 5,
            "rejected": 1,
            "output_throughput": 200.0,
            "ttft_ms_p99": 10.0,
            "tpot_ms_p99": 1.0,
        },
    ]
    assert recommend(rows, None, None)[0] is rows[0]
    assert recommend(rows, 0.5, None)[0] is rows[1]
    assert recommend(rows, 0.1, None) == (None, [])


def test_grid_settings_carry_the_target_backends_buckets():
    """Each simulated setting steps in the buckets its runner would compile: on the CPU's
    backend the default ladder starts at one token (a lone decode is a 1-token step, not 16),
    with the Pallas kernels at 16; configured buckets are kept while they reach the budget."""
    grids = {"max_num_batched_tokens": [64, 256]}
    cpu = grid_settings(_setting(), grids, (), "xla")
    assert [s.token_buckets for s in cpu] == [
        (1, 2, 4, 8, 16, 32, 64),
        (1, 2, 4, 8, 16, 32, 64, 128, 256),
    ]
    gpu = grid_settings(_setting(), grids, (), "pallas-gpu")
    assert [s.token_buckets[0] for s in gpu] == [16, 16]
    tpu = grid_settings(_setting(), {"max_num_batched_tokens": [100]}, (), "pallas-tpu")
    assert tpu[0].token_buckets[-1] == 104  # the TPU kernel's multiple of 8
    kept = grid_settings(_setting(), grids, (8, 128), "xla")
    assert [s.token_buckets for s in kept] == [(8, 128), (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    # a one-token decode of the CPU ladder is its own step shape in the replay
    trace = Trace([TraceRequest(0.0, list(range(1, 9)), 4)])
    per_bucket = StepTimeModel((0.0, 0.001, 0.0, 0.0, 0.0))  # 1 ms per padded token
    assert (
        simulate(trace, cpu[0], per_bucket).tpot_s[0]
        < simulate(trace, gpu[0], per_bucket).tpot_s[0]
    )


def test_cli_grid_json_plot_and_recommendation(tmp_path, capsys):
    calib = tmp_path / "calib.json"
    StepTimeModel((0.005, 0.0002, 0.0, 0.001, 0.0)).save(str(calib))
    out, plot = tmp_path / "tune.json", tmp_path / "tune.png"
    argv = [
        "tune",
        "--workload",
        "mixed",
        "--num-prompts",
        "12",
        "--input-len",
        "32",
        "--output-len",
        "8",
        "--long-input-len",
        "128",
        "--long-output-len",
        "8",
        "--request-rate",
        "20",
        "--calibration",
        str(calib),
        "--max-model-len",
        "256",
        "--num-gpu-blocks-override",
        "64",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens-grid",
        "32,64",
        "--enable-prefix-caching-grid",
        "on,off",
        "--slo-ttft-p99",
        "5",
        "--output-json",
        str(out),
        "--plot",
        str(plot),
    ]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    report = json.loads(out.read_text())
    assert len(report["results"]) == 4
    best = report["recommended"]
    assert best["output_throughput"] == max(r["output_throughput"] for r in report["results"])
    assert plot.stat().st_size > 0
    assert "recommended: --max-num-batched-tokens" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main([*argv[:-4], "--max-num-seqs-grid", "4,x"])
    assert exc.value.code == 2


def test_cli_says_when_every_setting_refuses_requests(tmp_path, capsys):
    """Long requests over --max-model-len disqualify every setting: the CLI says which limit
    refused them and how many, not only that no setting met the SLOs (exit 0, as documented)."""
    calib = tmp_path / "calib.json"
    StepTimeModel((0.005, 0.0002, 0.0, 0.001, 0.0)).save(str(calib))
    argv = ["tune", "--workload", "mixed", "--num-prompts", "12", "--input-len", "32"]
    argv += ["--output-len", "8", "--long-input-len", "400", "--long-output-len", "8"]
    argv += ["--long-fraction", "0.5", "--request-rate", "20", "--calibration", str(calib)]
    argv += ["--max-model-len", "256", "--num-gpu-blocks-override", "64", "--max-num-seqs", "4"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "every setting refused requests" in out and "--max-model-len 256" in out
    assert "recommended:" not in out


def test_preset_trace_is_what_bench_serve_sends():
    """validate.bench_serve_preset relies on it: same preset, sizes and seed -> same requests."""
    from jaxserve.bench.commands import resolve, workload_spec
    from jaxserve.bench.workloads import make_requests, poisson_arrivals
    from jaxserve.cli import build_parser

    sizes = dict(num_prompts=6, input_len=8, output_len=4, long_input_len=20, long_output_len=3)
    sizes.update(long_fraction=0.5, request_rate=2.0)
    argv = ["bench", "serve", "--preset", "mixed", "--seed", "3", "--vocab-size", "500"]
    for k, v in sizes.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    args = build_parser(argv).parse_args(argv)
    sent = make_requests(workload_spec(args), SOURCE)
    times = poisson_arrivals(len(sent), resolve(args, "request_rate"), args.seed)
    trace = preset_trace("mixed", SOURCE, 3, **sizes)
    assert [r.prompt for r in trace.requests] == [r.prompt for r in sent]
    assert [r.output_len for r in trace.requests] == [r.output_len for r in sent]
    assert [r.arrival_s for r in trace.requests] == times
