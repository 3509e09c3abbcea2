"""The stats schema: SchedulerStats, EngineStats and the step metric families all come from its
rows, so a row added there reaches every layer (pure Python, no engine)."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.scheduler import Scheduler
from jaxserve.metrics import METRIC_NAMES, REQUEST_FAMILIES, EngineMetrics
from jaxserve.stats_schema import (
    COUNTER,
    COUNTER_TOTALS,
    EXPORTED,
    GAUGE,
    SCHEDULER,
    SCHEDULER_TO_ENGINE,
    STATS,
    EngineStats,
    SchedulerStats,
)


def test_rows_are_unique_and_build_both_stats_types():
    names = [s.name for s in STATS]
    assert len(names) == len(set(names))
    sched_fields = [f.name for f in dataclasses.fields(SchedulerStats)]
    assert sched_fields == [s.name for s in STATS if s.source == SCHEDULER]
    engine_fields = {f.name for f in dataclasses.fields(EngineStats)}
    for name in SCHEDULER_TO_ENGINE:
        assert name in engine_fields and name in sched_fields
    for name, total in COUNTER_TOTALS:
        assert {name, total} <= engine_fields
    # The scheduler's own figures stay out of EngineStats, with no running total.
    for stat in STATS:
        if not stat.engine:
            assert stat.name not in engine_fields and stat.name + "_total" not in engine_fields


def test_scheduler_fills_every_row():
    with pytest.raises(TypeError):
        SchedulerStats()  # every field required: a row make_stats forgets fails at once
    sched = Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(block_size=16), 8)
    stats = sched.make_stats()
    assert isinstance(stats, SchedulerStats) and stats.num_steps == 0


def test_every_exported_row_feeds_its_family_with_its_help():
    values = {}
    kwargs = {}
    for i, stat in enumerate(EXPORTED, start=1):
        if stat.kind == GAUGE:
            kwargs[stat.name] = values[stat.metric] = i / 100
        elif stat.type is tuple:  # a counter per position: one sample per position
            assert stat.kind == COUNTER
            kwargs[stat.name + "_total"] = values[stat.metric + "_total"] = (10 * i, 10 * i + 1)
        else:
            assert stat.kind == COUNTER
            kwargs[stat.name + "_total"] = values[stat.metric + "_total"] = 10 * i
    metrics = EngineMetrics("m", namespace="vllm")
    metrics.record_step(EngineStats(**kwargs), [])
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    assert set(families) == {f"vllm:{n}" for n in METRIC_NAMES} - {"vllm:cache_config_info"}
    assert set(METRIC_NAMES) == {s.metric for s in EXPORTED} | set(REQUEST_FAMILIES) | {
        "cache_config_info"
    }
    for stat in EXPORTED:
        family = families[f"vllm:{stat.metric}"]
        assert family.documentation == stat.doc
        assert family.type == stat.kind
        suffix = "_total" if stat.kind == COUNTER else ""
        if stat.type is tuple:
            by_position = {int(s.labels["position"]): s.value for s in family.samples}
            assert by_position == dict(enumerate(values[stat.metric + suffix])), stat.name
            continue
        (sample,) = family.samples
        assert sample.value == values[stat.metric + suffix], stat.name
