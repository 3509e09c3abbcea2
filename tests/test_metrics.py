"""EngineMetrics: names, values from SchedulerStats and RequestOutputs, exposition parsing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.config import CacheConfig
from jaxserve.engine.llm_engine import EngineStats
from jaxserve.metrics import (
    METRIC_NAMES,
    NAMESPACES,
    EngineMetrics,
    merge_expositions,
    token_count_buckets,
)
from jaxserve.request_output import CompletionOutput, RequestMetrics, RequestOutput


def _samples(metrics: EngineMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            out[(sample.name, labels)] = sample.value
    return out


def _output(rid, new_tokens, *, finished=False, reason=None, t=None, prompt=(1, 2, 3), n=1):
    m = RequestMetrics(
        arrival_time=10.0,
        first_scheduled_time=10.5,
        first_token_time=t[0] if t else None,
        last_token_time=t[-1] if t else None,
        finished_time=t[-1] if finished else None,
    )
    outs = [
        CompletionOutput(index=k, delta_token_ids=list(range(new_tokens)), finish_reason=reason)
        for k in range(n)
    ]
    return RequestOutput(
        request_id=rid,
        prompt=None,
        prompt_token_ids=list(prompt),
        prompt_logprobs=None,
        outputs=outs,
        finished=finished,
        metrics=m,
    )


def test_gauges_and_counters_from_stats():
    metrics = EngineMetrics("m", CacheConfig(block_size=16))
    metrics.record_step(
        EngineStats(
            num_running_reqs=3,
            num_waiting_reqs=2,
            kv_cache_usage=0.25,
            prefix_cache_queries_total=64,
            prefix_cache_hits_total=32,
            num_preemptions_total=1,
            num_prompt_tokens_total=10,
            num_generation_tokens_total=4,
        ),
        [],
    )
    stats = EngineStats(
        num_running_reqs=1,
        kv_cache_usage=0.5,
        prefix_cache_queries_total=80,
        prefix_cache_hits_total=48,
        num_preemptions_total=3,
        num_prompt_tokens_total=10,
        num_generation_tokens_total=9,
    )
    metrics.record_step(stats, [])
    metrics.record_step(
        stats, []
    )  # no step in between: the totals did not grow, nothing counted twice
    s = _samples(metrics)
    assert s[("jaxserve:num_requests_running", ())] == 1
    assert s[("jaxserve:num_requests_waiting", ())] == 0
    assert s[("jaxserve:kv_cache_usage_perc", ())] == 0.5
    assert s[("jaxserve:num_preemptions_total", ())] == 3
    assert s[("jaxserve:prefix_cache_queries_total", ())] == 80
    assert s[("jaxserve:prefix_cache_hits_total", ())] == 48
    assert s[("jaxserve:prompt_tokens_total", ())] == 10
    assert s[("jaxserve:generation_tokens_total", ())] == 9
    info = [k for k in s if k[0] == "jaxserve:cache_config_info"]
    assert len(info) == 1 and ("block_size", "16") in info[0][1] and s[info[0]] == 1
    assert not any(name.endswith("_created") for name, _ in s)


def _spec_stats(drafts: int, tokens: int, accepted: int, per_pos: tuple) -> EngineStats:
    return EngineStats(
        spec_decode_num_drafts_total=drafts,
        spec_decode_num_draft_tokens_total=tokens,
        spec_decode_num_accepted_tokens_total=accepted,
        spec_decode_num_accepted_tokens_per_pos_total=per_pos,
    )


def test_speculative_decoding_counters_every_position():
    """vLLM's spec-decode families: totals grow by their difference; every draft position is a
    sample from the first step that reports it, zero or not."""
    metrics = EngineMetrics("m", namespace="vllm")
    metrics.record_step(_spec_stats(2, 6, 3, (2, 1, 0)), [])
    s = _samples(metrics)
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [s[(per_pos, (("position", str(i)),))] for i in range(3)] == [2, 1, 0]
    metrics.record_step(_spec_stats(3, 9, 6, (3, 2, 1)), [])
    s = _samples(metrics)
    assert s[("vllm:spec_decode_num_drafts_total", ())] == 3
    assert s[("vllm:spec_decode_num_draft_tokens_total", ())] == 9
    assert s[("vllm:spec_decode_num_accepted_tokens_total", ())] == 6
    assert [s[(per_pos, (("position", str(i)),))] for i in range(3)] == [3, 2, 1]


def test_latencies_tokens_and_finish_reasons():
    metrics = EngineMetrics("m")
    metrics.record_step(None, [_output("a", 0)])  # prefill chunk, no token yet
    metrics.record_step(None, [_output("a", 1, t=[11.0])])  # TTFT 1.0, queue 0.5
    metrics.record_step(None, [_output("a", 1, t=[11.0, 11.2])])  # ITL 0.2
    # two steps' tokens in one output (--stream-interval): two gaps of 0.15
    metrics.record_step(None, [_output("a", 2, t=[11.0, 11.5], finished=True, reason="stop", n=2)])
    metrics.record_abort("b", 2)
    s = _samples(metrics)
    assert s[("jaxserve:time_to_first_token_seconds_count", ())] == 1
    assert s[("jaxserve:time_to_first_token_seconds_sum", ())] == 1.0
    assert s[("jaxserve:request_queue_time_seconds_sum", ())] == 0.5
    assert s[("jaxserve:inter_token_latency_seconds_count", ())] == 3
    assert abs(s[("jaxserve:inter_token_latency_seconds_sum", ())] - 0.5) < 1e-9
    assert s[("jaxserve:e2e_request_latency_seconds_sum", ())] == 1.5
    assert s[("jaxserve:request_success_total", (("finished_reason", "stop"),))] == 2
    assert s[("jaxserve:request_success_total", (("finished_reason", "abort"),))] == 2
    assert s[("jaxserve:request_success_total", (("finished_reason", "length"),))] == 0


def test_registries_are_independent():
    a, b = EngineMetrics("a"), EngineMetrics("b")
    a.record_step(EngineStats(num_preemptions_total=5), [])
    assert _samples(a)[("jaxserve:num_preemptions_total", ())] == 5
    assert _samples(b)[("jaxserve:num_preemptions_total", ())] == 0


def _families(metrics: EngineMetrics) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_every_family_under_each_namespace(namespace):
    metrics = EngineMetrics(
        "m", CacheConfig(block_size=16, num_gpu_blocks=100), namespace=namespace
    )
    families = _families(metrics)  # parses with prometheus_client's own parser
    assert set(families) == {f"{namespace}:{name}" for name in METRIC_NAMES}
    info = families[f"{namespace}:cache_config_info"].samples[0].labels
    assert info["block_size"] == "16" and info["num_gpu_blocks"] == "100"


def test_unknown_namespace_is_refused():
    with pytest.raises(ValueError, match="metrics_namespace"):
        EngineMetrics("m", namespace="sglang")


def test_per_request_families_at_finish():
    metrics = EngineMetrics("m", namespace="vllm", max_model_len=100)
    out = _output("a", 1, t=[11.0, 12.0], finished=True, reason="length", prompt=range(7), n=2)
    out.metrics.num_generation_tokens = 9
    out.outputs[0].token_ids = [1] * 5  # the longest sample
    out.outputs[1].token_ids = [1] * 4
    metrics.record_step(None, [out])
    s = _samples(metrics)
    assert s[("vllm:request_prompt_tokens_sum", ())] == 7
    assert s[("vllm:request_prompt_tokens_bucket", (("le", "10.0"),))] == 1
    assert s[("vllm:request_prompt_tokens_bucket", (("le", "5.0"),))] == 0
    assert s[("vllm:request_generation_tokens_sum", ())] == 9
    assert s[("vllm:request_max_num_generation_tokens_sum", ())] == 5
    assert s[("vllm:request_prefill_time_seconds_sum", ())] == 0.5  # scheduled 10.5, token 11
    assert s[("vllm:request_decode_time_seconds_sum", ())] == 1.0
    assert s[("vllm:request_inference_time_seconds_sum", ())] == 1.5
    assert s[("vllm:time_per_output_token_seconds_sum", ())] == 0.25  # 1.0 s / (5 - 1)
    assert max(token_count_buckets(100)) == 100 and token_count_buckets(100)[:4] == (1, 2, 5, 10)


DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "jaxserve-dashboard.json"


def _queried_metrics(node) -> set[str]:
    """Every ``vllm:`` name in the dashboard's queries (panel targets and template variables)."""
    if isinstance(node, dict):
        found = set()
        for key, value in node.items():
            if key in ("expr", "definition", "query") and isinstance(value, str):
                found |= set(re.findall(r"vllm:[A-Za-z0-9_:]+", value))
            else:
                found |= _queried_metrics(value)
        return found
    if isinstance(node, list):
        return set().union(*(_queried_metrics(v) for v in node)) if node else set()
    return set()


def test_grafana_dashboard_queries_only_metrics_we_serve():
    queried = _queried_metrics(json.loads(DASHBOARD.read_text()))
    metrics = EngineMetrics("m", CacheConfig(block_size=16, num_gpu_blocks=10), namespace="vllm")
    served = {s.name for f in _families(metrics).values() for s in f.samples}
    assert queried and queried <= served, sorted(queried - served)
    # It covers the seed's dashboard: waiting depth, preemptions, KV usage, prefix hit rate,
    # TTFT and TPOT quantiles.
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_per_output_token_seconds_bucket",
    ):
        assert name in queried, name


def test_merged_expositions_keep_each_engine_apart():
    a, b = EngineMetrics("m", namespace="vllm"), EngineMetrics("m", namespace="vllm")
    a.record_step(EngineStats(num_running_reqs=2, prefix_cache_hits_total=5), [])
    b.record_step(EngineStats(num_running_reqs=3, prefix_cache_hits_total=7), [])
    merged = merge_expositions({"0": a.render().decode(), "1": b.render().decode()}, "engine")
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    assert set(families) == {f"vllm:{name}" for name in METRIC_NAMES} - {"vllm:cache_config_info"}
    running = {s.labels["engine"]: s.value for s in families["vllm:num_requests_running"].samples}
    assert running == {"0": 2, "1": 3}
    hits = families["vllm:prefix_cache_hits"].samples
    assert sorted(s.value for s in hits) == [5, 7] and hits[0].name.endswith("_total")
    assert merged.count("# TYPE vllm:prefix_cache_hits_total counter") == 1
