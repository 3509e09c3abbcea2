"""Prometheus metrics of one engine, with vLLM's names under the ``jaxserve:`` prefix.

Source: vLLM V1's ``v1/metrics/loggers.py`` (PrometheusStatLogger): the same metric names
(``vllm:`` -> ``jaxserve:``), label ``model_name``, and histogram buckets. Counters gain the
``_total`` suffix in the exposition, as prometheus_client writes them
(``jaxserve:prompt_tokens_total``, ``jaxserve:request_success_total{finished_reason="stop"}``).

``--metrics-namespace vllm`` (``EngineMetrics(namespace="vllm")``) serves the same families
under vLLM's own prefix (``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``,
``vllm:cache_config_info{block_size,num_gpu_blocks,...}``), so an endpoint picker (the Gateway
API Inference Extension, llm-d) or vLLM's Grafana dashboard reads them unchanged. The names
are written once: the step families (gauges and counters from the engine's stats) in
``jaxserve/stats_schema.py``, the per-request families here; :data:`METRIC_NAMES` lists them
all; only the prefix changes.

Each :class:`EngineMetrics` owns its ``CollectorRegistry``, so several servers (or tests) in one
process do not collide. Updates come from the engine thread after each step
(:meth:`EngineMetrics.record_step`); prometheus_client's metric objects are thread-safe, so the
HTTP thread may render :meth:`EngineMetrics.render` at any time.

Sources: gauges and counters come from ``LLMEngine.get_stats()`` (an ``EngineStats``): gauges
as read, counters from its running ``*_total`` fields (the recorder adds the growth since the
previous call, so calling it without a step in between counts nothing twice). Latencies and
finish reasons come from the RequestOutputs' ``RequestMetrics``.

Times are seconds (``time.monotonic()`` differences):
  TTFT = first_token_time - arrival_time; ITL = time between consecutive token-producing steps
  of a request; e2e = finished_time - arrival_time; queue = first_scheduled_time - arrival_time.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from jaxserve.model.expert_load import ExpertLoadRecorder, max_over_mean
from jaxserve.stats_schema import EXPORTED, GAUGE

if TYPE_CHECKING:
    from jaxserve.config import CacheConfig
    from jaxserve.request_output import RequestOutput
    from jaxserve.stats_schema import EngineStats

PREFIX = "jaxserve:"
"""Prefix of the default namespace."""

NAMESPACES = ("jaxserve", "vllm")
"""Values of ``--metrics-namespace``: the prefix before ``:`` in every metric name."""

REQUEST_FAMILIES = (
    "request_success",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "time_per_output_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_inference_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_max_num_generation_tokens",
)
"""The families fed from the RequestOutputs (finish reasons, latencies, lengths)."""

EXPERT_LOAD_FAMILIES = ("moe_expert_tokens", "moe_expert_load_max_over_mean")
"""The opt-in MoE families (``--expert-load-metrics``, ``EngineMetrics.add_expert_load``); not
in ``METRIC_NAMES``, since only a MoE engine with the flag has them."""

METRIC_NAMES = (
    *(stat.metric for stat in EXPORTED),
    *REQUEST_FAMILIES,
    "cache_config_info",
)
"""Every metric family an engine always exports, without its namespace (counters get
``_total`` in the exposition)."""

# vLLM V1's buckets (seconds).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

FINISHED_REASONS = ("stop", "length", "abort", "error")


def token_count_buckets(max_value: int) -> tuple[int, ...]:
    """1-2-5 buckets up to ``max_value`` (vLLM's ``build_1_2_5_buckets``): 1, 2, 5, 10, 20, ...

    Used for the per-request token-count histograms (prompt and generation lengths).
    """
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            value = m * scale
            if value > max_value:
                return tuple(out)
            out.append(value)
        scale *= 10


@dataclasses.dataclass
class _RequestState:
    """What the recorder remembers of a running request between steps."""

    ttft_recorded: bool = False
    last_token_time: float | None = None
    max_sample_tokens: int = 0  # most tokens of one sample so far (n > 1: the longest)
    sample_tokens: dict[int, int] = dataclasses.field(default_factory=dict)  # by sample index


class EngineMetrics:
    """The server's Prometheus metrics, fed from the engine thread.

    Args:
      model_name: value of the ``model_name`` label (the served model name).
      cache_config: the resolved CacheConfig; its knobs become labels of
        ``<namespace>:cache_config_info`` (value 1). None leaves that metric out.
      namespace: "jaxserve" (default) or "vllm" (vLLM's names, for routers and dashboards
        built for vLLM).
      max_model_len: top of the token-count histograms' buckets (prompt and generation
        lengths), tokens.

    Attributes:
      registry: this server's own ``CollectorRegistry``.
      prefix: ``namespace + ":"``.

    Raises:
      ValueError: an unknown namespace.
    """

    def __init__(
        self,
        model_name: str,
        cache_config: CacheConfig | None = None,
        *,
        namespace: str = "jaxserve",
        max_model_len: int = 2048,
    ) -> None:
        if namespace not in NAMESPACES:
            raise ValueError(
                f"metrics_namespace must be one of {', '.join(NAMESPACES)}, got {namespace!r}"
            )
        # No ``*_created`` series (vLLM does the same; the switch is process-wide).
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.prefix = prefix = namespace + ":"
        labels = ["model_name"]
        reg = self.registry
        # The step families, one per exported row of the stats schema, in its order: a gauge
        # set from its field, a counter grown from its ``_total`` field.
        self._gauges: list[tuple[str, Any]] = []
        self._counters: list[tuple[str, Any]] = []
        self._position_counters: list[tuple[str, Any, str]] = []
        for stat in EXPORTED:
            if stat.kind == GAUGE:
                family = Gauge(prefix + stat.metric, stat.doc, labels, registry=reg)
                self._gauges.append((stat.name, family.labels(model_name)))
            elif stat.type is tuple:  # a counter per position
                family = Counter(
                    prefix + stat.metric, stat.doc, labels + ["position"], registry=reg
                )
                self._position_counters.append((stat.name + "_total", family, model_name))
            else:
                family = Counter(prefix + stat.metric, stat.doc, labels, registry=reg)
                self._counters.append((stat.name + "_total", family.labels(model_name)))
        success = Counter(
            prefix + "request_success",
            "Finished samples, by finish reason.",
            labels + ["finished_reason"],
            registry=reg,
        )
        self.request_success = {
            reason: success.labels(model_name, reason) for reason in FINISHED_REASONS
        }
        self.time_to_first_token = Histogram(
            prefix + "time_to_first_token_seconds",
            "Time to first token (TTFT), seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.inter_token_latency = Histogram(
            prefix + "inter_token_latency_seconds",
            "Inter-token latency (ITL), seconds.",
            labels,
            buckets=ITL_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.e2e_request_latency = Histogram(
            prefix + "e2e_request_latency_seconds",
            "End-to-end request latency, seconds.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.request_queue_time = Histogram(
            prefix + "request_queue_time_seconds",
            "Time from arrival to first scheduling, seconds.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.time_per_output_token = Histogram(
            prefix + "time_per_output_token_seconds",
            "Mean time per output token after the first (TPOT) of a finished request, seconds.",
            labels,
            buckets=ITL_BUCKETS,
            registry=reg,
        ).labels(model_name)
        phases = (
            ("request_inference_time_seconds", "first scheduling to finish"),
            ("request_prefill_time_seconds", "first scheduling to first token"),
            ("request_decode_time_seconds", "first token to last token"),
        )
        self.request_inference_time, self.request_prefill_time, self.request_decode_time = (
            Histogram(
                prefix + name,
                f"Time from {what} of a finished request, seconds.",
                labels,
                buckets=REQUEST_LATENCY_BUCKETS,
                registry=reg,
            ).labels(model_name)
            for name, what in phases
        )
        token_buckets = token_count_buckets(max(1, max_model_len))
        lengths = (
            ("request_prompt_tokens", "Prompt tokens of a finished request."),
            ("request_generation_tokens", "Generated tokens of a finished request (all samples)."),
            (
                "request_max_num_generation_tokens",
                "Generated tokens of a finished request's longest sample.",
            ),
        )
        self.request_prompt_tokens, self.request_generation_tokens, self.request_max_gen = (
            Histogram(prefix + name, help_text, labels, buckets=token_buckets, registry=reg).labels(
                model_name
            )
            for name, help_text in lengths
        )
        if cache_config is not None:
            knobs = {
                f.name: str(getattr(cache_config, f.name)) for f in dataclasses.fields(cache_config)
            }
            info = Gauge(
                prefix + "cache_config_info",
                "Information of the KV cache configuration.",
                list(knobs),
                registry=reg,
            )
            info.labels(**knobs).set(1)
        self._requests: dict[str, _RequestState] = {}
        self._totals: dict[str, float] = {}
        self._lock = threading.Lock()
        self._lora_info: Gauge | None = None  # record_lora_info, made on first use
        self._lora_labels: tuple[str, str, str] | None = None

    def record_step(self, stats: EngineStats | None, outputs: Iterable[RequestOutput]) -> None:
        """Folds one engine step into the metrics (called from the engine thread).

        Args:
          stats: the engine's ``EngineStats`` (gauges now; counters as ``*_total`` running
            sums), or None.
          outputs: the step's RequestOutputs of requests a client still waits for.
        """
        with self._lock:
            if stats is not None:
                self._record_stats(stats)
            for output in outputs:
                self._record_output(output)

    def record_lora_info(self, running: list[str], waiting: list[str], max_loras: int) -> None:
        """Sets ``<namespace>:lora_requests_info`` (vLLM's, for routers: labels
        ``running_lora_adapters`` and ``waiting_lora_adapters``, comma-separated adapter
        names, and ``max_lora``; value: the Unix time of the update), replacing the previous
        label set when it changed (#33)."""
        labels = (",".join(running), ",".join(waiting), str(max_loras))
        with self._lock:
            if self._lora_info is None:
                self._lora_info = Gauge(
                    self.prefix + "lora_requests_info",
                    "Running stats on LoRA requests.",
                    ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
                    registry=self.registry,
                )
            if labels != self._lora_labels:
                if self._lora_labels is not None:
                    self._lora_info.remove(*self._lora_labels)
                self._lora_labels = labels
            self._lora_info.labels(*labels).set(time.time())

    def record_abort(self, request_id: str, num_samples: int) -> None:
        """Counts a request the client abandoned (``finished_reason="abort"``, one per sample)."""
        with self._lock:
            self._requests.pop(request_id, None)
            self.request_success["abort"].inc(num_samples)

    def add_expert_load(self, recorder: ExpertLoadRecorder) -> None:
        """Exports a MoE model's expert load (``--expert-load-metrics``) from ``recorder``
        (``jaxserve.model.expert_load``), read at each scrape: the counter
        ``moe_expert_tokens{layer, expert}`` (tokens routed since start) and the gauge
        ``moe_expert_load_max_over_mean{layer}`` (the busiest expert's tokens over the mean,
        over the steps since the previous scrape; 1 is perfect balance; absent when no token
        passed)."""
        self.registry.register(_ExpertLoadCollector(self.prefix, self.model_name, recorder))

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)

    content_type = CONTENT_TYPE_LATEST

    def _record_stats(self, stats: EngineStats) -> None:
        for name, gauge in self._gauges:
            gauge.set(getattr(stats, name, 0.0))
        for name, counter in self._counters:
            total = getattr(stats, name, 0)
            grown = total - self._totals.get(name, 0)
            self._totals[name] = total
            if grown > 0:
                counter.inc(grown)
        for name, family, model_name in self._position_counters:
            totals = getattr(stats, name, ())
            for pos, total in enumerate(totals):
                key = f"{name}[{pos}]"
                grown = total - self._totals.get(key, 0)
                self._totals[key] = total
                child = family.labels(model_name, str(pos))  # every position shows, 0 or not
                if grown > 0:
                    child.inc(grown)

    def _record_output(self, output: RequestOutput) -> None:
        state = self._requests.setdefault(output.request_id, _RequestState())
        new_tokens = 0  # most new tokens of one sample: steps this output covers
        for completion in output.outputs:  # counted from the deltas, whatever the output kind
            added = len(completion.delta_token_ids)
            count = state.sample_tokens.get(completion.index, 0) + added
            # a cumulative or final-only output lists them all
            count = state.sample_tokens[completion.index] = max(count, len(completion.token_ids))
            new_tokens = max(new_tokens, added)
            state.max_sample_tokens = max(state.max_sample_tokens, count)
        m = output.metrics
        if m is not None:
            if not state.ttft_recorded and m.first_token_time is not None:
                self.time_to_first_token.observe(max(0.0, m.first_token_time - m.arrival_time))
                if m.first_scheduled_time is not None:
                    self.request_queue_time.observe(
                        max(0.0, m.first_scheduled_time - m.arrival_time)
                    )
                state.ttft_recorded = True
            elif (
                new_tokens
                and state.last_token_time is not None
                and m.last_token_time is not None
                and m.last_token_time > state.last_token_time
            ):
                # an output of several steps' tokens (--stream-interval): one gap per step
                gap = (m.last_token_time - state.last_token_time) / new_tokens
                for _ in range(new_tokens):
                    self.inter_token_latency.observe(gap)
            if m.last_token_time is not None:
                state.last_token_time = m.last_token_time
        if output.finished:
            for completion in output.outputs:
                reason = completion.finish_reason or "stop"
                counter = self.request_success.get(reason)
                if counter is not None:
                    counter.inc()
            if m is not None and m.finished_time is not None:
                self.e2e_request_latency.observe(max(0.0, m.finished_time - m.arrival_time))
                if not state.ttft_recorded and m.first_scheduled_time is not None:
                    self.request_queue_time.observe(
                        max(0.0, m.first_scheduled_time - m.arrival_time)
                    )
                self._record_finished(output, m, state)
            del self._requests[output.request_id]

    def _record_finished(self, output: RequestOutput, m: Any, state: _RequestState) -> None:
        """The per-request families vLLM's dashboard reads, observed once at the finish."""
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(m.num_generation_tokens)
        self.request_max_gen.observe(state.max_sample_tokens)
        if m.first_scheduled_time is not None:
            self.request_inference_time.observe(max(0.0, m.finished_time - m.first_scheduled_time))
            if m.first_token_time is not None:
                self.request_prefill_time.observe(
                    max(0.0, m.first_token_time - m.first_scheduled_time)
                )
        if m.first_token_time is not None and m.last_token_time is not None:
            decode = max(0.0, m.last_token_time - m.first_token_time)
            self.request_decode_time.observe(decode)
            if state.max_sample_tokens > 1:
                self.time_per_output_token.observe(decode / (state.max_sample_tokens - 1))


class _ExpertLoadCollector:
    """A custom collector over an ``ExpertLoadRecorder`` (see ``EngineMetrics.add_expert_load``).
    The gauge's interval starts at the previous ``collect``."""

    def __init__(self, prefix: str, model_name: str, recorder: ExpertLoadRecorder) -> None:
        self.prefix, self.model_name, self.recorder = prefix, model_name, recorder
        self._seen = recorder.totals()
        self._lock = threading.Lock()

    def collect(self):
        totals = self.recorder.totals()
        with self._lock:
            recent, self._seen = totals - self._seen, totals
        tokens = CounterMetricFamily(
            self.prefix + "moe_expert_tokens",
            "Tokens routed to each expert of each MoE layer (top-k: k per token), real tokens.",
            labels=["model_name", "layer", "expert"],
        )
        balance = GaugeMetricFamily(
            self.prefix + "moe_expert_load_max_over_mean",
            "Per MoE layer, the busiest expert's tokens over the mean since the previous scrape "
            "(1 = balanced).",
            labels=["model_name", "layer"],
        )
        ratio = max_over_mean(recent)
        for row, layer in enumerate(self.recorder.layers):
            for expert, count in enumerate(totals[row]):
                tokens.add_metric([self.model_name, str(layer), str(expert)], float(count))
            if ratio[row] == ratio[row]:  # not NaN: some token passed
                balance.add_metric([self.model_name, str(layer)], float(ratio[row]))
        yield tokens
        yield balance

    def describe(self):
        return []


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def merge_expositions(texts: dict[str, str], label: str) -> str:
    """One Prometheus text exposition from several engines' (the Ray ingress's ``/metrics``).

    Args:
      texts: engine key -> that engine's exposition (all with the same families).
      label: the label telling them apart (``engine="<key>"`` on every sample).

    Returns:
      The merged exposition (one HELP/TYPE per family, every engine's samples under it).

    Raises:
      ValueError: a text is not a valid exposition.
    """
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.utils import floatToGoString

    families: dict[str, tuple[str, str, list[str]]] = {}
    for key, text in texts.items():
        for family in text_string_to_metric_families(text):
            name = family.name + ("_total" if family.type == "counter" else "")
            entry = families.setdefault(name, (family.type, family.documentation, []))
            for sample in family.samples:
                labels = {**sample.labels, label: key}
                rendered = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                entry[2].append(f"{sample.name}{{{rendered}}} {floatToGoString(sample.value)}")
    lines = []
    for name, (kind, doc, samples) in families.items():
        help_text = doc.replace("\\", "\\\\").replace("\n", "\\n")
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]
    return "\n".join(lines) + "\n"
