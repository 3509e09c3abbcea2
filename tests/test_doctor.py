"""jaxserve doctor's checks on given evidence (the live run is in demos/05_tune_and_doctor)."""

from __future__ import annotations

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
