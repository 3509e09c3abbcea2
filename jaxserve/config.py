"""One config module: frozen dataclasses checked in ``__post_init__``, CLI flags derived from fields.

``EngineArgs`` is the flat set of user-facing knobs (vLLM's flag names: ``--max-num-batched-tokens``,
``--long-prefill-token-threshold``, ...). The server, the batch CLI and ``LLM(**kwargs)`` all build an
``EngineArgs`` and turn it into the per-component configs once the model's own config is known
(``EngineArgs.create_engine_config``). Defaults are the design card's starting values.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any, Literal

from jaxserve.model.attention_backends import (
    ATTENTION_BACKEND_CHOICES,
    canonical_attention_backend,
)
from jaxserve.model.quant_config import KV_CACHE_DTYPE_CHOICES, QUANTIZATION_CHOICES
from jaxserve.pooling import (
    CONVERT_CHOICES,
    POOLING_TYPES,
    RUNNER_CHOICES,
    resolve_pooler_config,
    resolve_runner,
)
from jaxserve.sampling_params import MAX_LOGPROBS, SamplingParams

SchedulingPolicy = Literal["fcfs", "priority"]


def _architecture(path: str) -> str:
    """The first ``architectures`` entry of a HF model directory's config.json ("" otherwise)."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        return ""
    import json  # local: only here

    with open(config_path) as f:
        names = json.load(f).get("architectures") or [""]
    return str(names[0])


def _default_compilation_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxserve", "xla")


TOOL_CALL_PARSERS = ("llama3_json", "hermes", "mistral")
"""Names of ``--tool-call-parser`` (vLLM's), see ``jaxserve.serving.tool_calls``."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Which weights to serve and how.

    Attributes:
      model: path of a HF model directory, of our orbax layout or of a .gguf file (see
        jaxserve.model.loader).
      dtype: "auto" (the checkpoint's torch_dtype), "float32" or "bfloat16".
      load_format: "auto", "safetensors", "orbax", "gguf" or "dummy" (random weights of the config).
      served_model_name: the name clients send as ``model``; defaults to the directory name.
      max_model_len: longest sequence (prompt + output) in tokens (>= 0; the dataclass
        accepts 0, ``EngineArgs.create_engine_config`` always sets the resolved length).
      seed: engine seed for requests without their own.
      tool_call_parser: how chat turns the model's tool-call text into ``tool_calls``:
        "llama3_json", "hermes" (Qwen2.5 / Qwen3 ``<tool_call>``), "mistral" (``[TOOL_CALLS]``),
        or "" (no parser: ``tool_choice: "auto"`` is refused; "required" and named functions
        work without one).
      runner: "generate" (completions / chat) or "pooling" (embeddings: ``/v1/embeddings``,
        ``/pooling``, ``/v1/score``; nothing is sampled), resolved from ``--runner`` /
        ``--convert`` (``jaxserve.pooling.resolve_runner``).
      pooling_type: "LAST", "MEAN" or "CLS" (pooling runner; ``jaxserve.pooling``).
      pooling_normalize: L2-normalise embeddings by default (pooling runner).
      structured_outputs_bounded_numbers: JSON numbers a schema leaves unbounded are bounded
        (integers within int64, floats with |x| <= 1e15 and at most 9 decimals; see
        ``jaxserve.structured.json_numbers``), so forced JSON always finishes; a
        request may say otherwise (``structured_outputs.bounded_numbers``).
      served_model_aliases: further names clients may send as ``model`` (``--served-model-name
        A B C``: A is ``served_model_name``, B and C the aliases).
      tokenizer: a tokenizer directory or file to use instead of the model's; "" = the model's.
      enable_sleep_mode: the engine may be put to sleep (``POST /sleep``: weights to host
        memory or dropped, KV cache freed) and woken up.
      quantization: weight quantization (``jaxserve.model.quant_config``): "auto" (the
        checkpoint's: compressed-tensors, GGUF blocks kept quantized, else none), "none",
        "int8", "fp8" (quantize on load), "compressed-tensors" or "gguf".

    Raises:
      ValueError: an unknown dtype, load_format, tool_call_parser, quantization, runner or
      pooling_type, or a
        negative max_model_len (naming it).
    """

    model: str
    dtype: str = "auto"
    load_format: str = "auto"
    served_model_name: str = ""
    max_model_len: int = 0
    seed: int = 0
    tool_call_parser: str = ""
    runner: str = "generate"
    pooling_type: str = "LAST"
    pooling_normalize: bool = True
    structured_outputs_bounded_numbers: bool = True
    served_model_aliases: tuple[str, ...] = ()
    tokenizer: str = ""
    enable_sleep_mode: bool = False
    quantization: str = "auto"

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                f"got {self.quantization!r}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.load_format not in ("auto", "safetensors", "orbax", "gguf", "dummy"):
            raise ValueError(
                f"load_format must be auto, safetensors, orbax, gguf or dummy, got {self.load_format!r}"
            )
        if self.max_model_len < 0:
            raise ValueError(
                f"max_model_len must be >= 0 (0: not resolved yet), got {self.max_model_len}"
            )
        if self.tool_call_parser not in ("", *TOOL_CALL_PARSERS):
            raise ValueError(
                f"tool_call_parser must be one of {list(TOOL_CALL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )
        if self.runner not in ("generate", "pooling"):
            raise ValueError(f"runner must be generate or pooling, got {self.runner!r}")
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}"
            )


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache (PagedAttention, Kwon et al. 2023; vLLM's CacheConfig).

    Attributes:
      block_size: tokens per KV block.
      gpu_memory_utilization: fraction of device memory the engine may use (weights, peak
        activations and the KV pool together).
      num_gpu_blocks_override: use exactly this many blocks instead of sizing from memory.
      enable_prefix_caching: reuse cached blocks of identical prefixes.
      watermark: fraction of blocks kept free against newly admitted requests.
      num_gpu_blocks: resolved pool size (set by the runner after profiling); 0 = unknown yet.
      kv_offloading_size: GiB of host memory for the host KV tier (KV offloading); 0 = off.
      kv_offloading_backend: how the host tier is kept: "native" (our own host block pool).
      num_host_blocks: resolved host-tier size in blocks (set by the runner); 0 = off.
      cache_dtype: ``--kv-cache-dtype``: "auto" (the model dtype), "fp8" / "fp8_e4m3"
        (float8_e4m3fn) or "fp8_e5m2": an FP8 cache holds about twice the blocks of bfloat16
        in the same memory (vLLM's field name, so ``cache_config_info`` carries it as vLLM's).
      weight_bytes: resolved device bytes of the model's weights (set by the engine after
        loading; 0 = unknown yet), beside ``num_gpu_blocks`` in ``cache_config_info``.
      offload_load_s_per_call, offload_load_s_per_block, offload_recompute_s_per_token: the
        resume cost model, seconds, measured by the runner's start-up probe after warm-up
        (``ModelRunner.measure_offload_costs``): a resumed preempted request loads its host
        blocks when ``per_call + n * per_block <= n * block_size * per_token``, else
        recomputes them. All 0 = unmeasured (it always loads).
      disable_hybrid_kv_cache_manager: keep every layer's KV for the whole context in one
        block table (vLLM's flag). Off (the default), layers are grouped by attention kind and
        a sliding-window group keeps only its window's blocks (``jaxserve/core/
        kv_cache_groups.py``). Unlike vLLM's flag, it also turns off the window's block
        freeing of a model whose layers all share one window (Mistral), so on and off are the
        same cache otherwise.
      kv_cache_groups: resolved KV-cache groups (set by the engine from the model's layers):
        each group's sliding window in tokens, None for full attention; () = one
        full-attention group.

    Raises:
      ValueError: block_size not in (8, 16, 32, 64, 128), gpu_memory_utilization outside
        (0, 1], num_gpu_blocks_override < 2, watermark outside [0, 1), kv_offloading_size < 0,
        an unknown kv_offloading_backend or cache_dtype (naming the field; cache_dtype as the
        flag, kv_cache_dtype), or a kv_cache_groups window < 1 (naming the field).
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    watermark: float = 0.0
    num_gpu_blocks: int = 0
    kv_offloading_size: float = 0.0
    kv_offloading_backend: str = "native"
    num_host_blocks: int = 0
    cache_dtype: str = "auto"
    weight_bytes: int = 0
    offload_load_s_per_call: float = 0.0
    offload_load_s_per_block: float = 0.0
    offload_recompute_s_per_token: float = 0.0
    disable_hybrid_kv_cache_manager: bool = False
    kv_cache_groups: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(
                f"num_gpu_blocks_override must be >= 2, got {self.num_gpu_blocks_override}"
            )
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if not self.kv_offloading_size >= 0.0:
            raise ValueError(f"kv_offloading_size must be >= 0 GiB, got {self.kv_offloading_size}")
        if self.cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, "
                f"got {self.cache_dtype!r}"
            )
        if self.kv_offloading_backend != "native":
            raise ValueError(
                f"kv_offloading_backend must be 'native', got {self.kv_offloading_backend!r}"
            )
        if any(w is not None and w < 1 for w in self.kv_cache_groups):
            raise ValueError(
                f"kv_cache_groups: sliding windows must be >= 1 token, got {self.kv_cache_groups}"
            )


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """The token-budget scheduler (vLLM V1's SchedulerConfig).

    Attributes:
      max_num_batched_tokens: tokens computed per step, all requests together.
      max_num_seqs: requests per step.
      long_prefill_token_threshold: most tokens one request may take in one step (chunked
        prefill); 0 means no cap beyond the budget.
      enable_chunked_prefill: cut prompts longer than the budget into chunks; when off, a
        waiting prompt must fit the budget whole.
      policy: "fcfs" or "priority" (by (priority, arrival time); smaller priority is more urgent).
      max_model_len: longest sequence (prompt + output) in tokens.
      max_waiting_requests: the server answers 503 above this many waiting requests (0 = no cap).
      async_scheduling: plan and dispatch step N+1 while step N runs on the device (the
        engine's outputs come one step behind; see ``LLMEngine.step``).
      stream_interval: output tokens a streamed request buffers per output (one SSE chunk);
        its first token and its final output are never held back (vLLM's ``stream_interval``).

    Raises:
      ValueError: max_num_batched_tokens, max_num_seqs, max_model_len or stream_interval < 1,
        long_prefill_token_threshold or max_waiting_requests < 0, or an unknown policy
        (reported as ``scheduling_policy``, the CLI flag's name).
    """

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    long_prefill_token_threshold: int = 4096
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    max_model_len: int = 2048
    max_waiting_requests: int = 0
    async_scheduling: bool = True
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.policy!r}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")

    @property
    def chunk_limit(self) -> int:
        """Most tokens one request may be scheduled in one step."""
        limit = self.max_num_batched_tokens
        if self.long_prefill_token_threshold > 0:
            limit = min(limit, self.long_prefill_token_threshold)
        return limit


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """The model runner: attention backend, shape buckets, compilation cache.

    Attributes:
      attention_backend: one of ``ATTENTION_BACKEND_CHOICES``: "auto" (pallas-tpu on TPU,
        pallas-gpu on GPU, xla on CPU), "pallas" (the platform's kernel), "pallas-gpu",
        "pallas-tpu" or "xla" (jnp attention compiled by XLA, any platform); the deprecated
        "reference" is stored as "xla".
      pallas_interpret: run the chosen Pallas kernel in Pallas interpret mode (any platform;
        on CPU the TPU kernel goes through Pallas' TPU interpreter). Slow; for tests.
      token_buckets: padded step sizes in tokens (ascending); empty = derived from the budget.
      compilation_cache_dir: persistent JAX compilation cache ("" disables it).
      warmup: compile every bucket before serving.

    Raises:
      ValueError: an unknown attention_backend, or token_buckets not strictly ascending
        positive integers.
    """

    attention_backend: str = "auto"
    pallas_interpret: bool = False
    token_buckets: tuple[int, ...] = ()
    compilation_cache_dir: str = dataclasses.field(default_factory=_default_compilation_cache_dir)
    warmup: bool = True

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKEND_CHOICES:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKEND_CHOICES)}, "
                f"got {self.attention_backend!r}"
            )
        object.__setattr__(
            self, "attention_backend", canonical_attention_backend(self.attention_backend)
        )
        if list(self.token_buckets) != sorted(set(self.token_buckets)) or any(
            b < 1 for b in self.token_buckets
        ):
            raise ValueError(
                f"token_buckets must be ascending positive integers, got {self.token_buckets}"
            )


@dataclasses.dataclass(frozen=True)
class ObservabilityConfig:
    """What the engine tells the outside: metric names and KV-cache events.

    Attributes:
      metrics_namespace: "jaxserve" or "vllm", the prefix of every ``/metrics`` name
        (jaxserve/metrics.py).
      kv_events_endpoint: ZMQ address the engine publishes KV-cache events to
        (jaxserve/kv_events.py); "" publishes nothing. ``tcp://*:PORT`` binds 127.0.0.1,
        ``tcp://0.0.0.0:PORT`` every interface (with a warning), ``tcp://HOST:PORT`` connects.
      kv_events_include_token_ids: a request with a ``cache_salt`` publishes its blocks' token
        ids too (by default its ``BlockStored`` events carry hashes only).
      data_parallel_rank: this engine's replica index (labels its KV events; a bound endpoint's
        port is offset by it).
      expert_load_metrics: count the tokens routed to each expert of a MoE model on the host
        and export them (``jaxserve.model.expert_load``); off by default, since it costs a
        device-to-host copy per MoE layer per step.

    Raises:
      ValueError: an unknown namespace, an endpoint that is not ``tcp://``, ``ipc://`` or
        ``inproc://``, or a negative rank (naming the field).
    """

    metrics_namespace: str = "jaxserve"
    kv_events_endpoint: str = ""
    kv_events_include_token_ids: bool = False
    data_parallel_rank: int = 0
    expert_load_metrics: bool = False

    def __post_init__(self) -> None:
        if self.metrics_namespace not in ("jaxserve", "vllm"):
            raise ValueError(
                f"metrics_namespace must be jaxserve or vllm, got {self.metrics_namespace!r}"
            )
        if self.kv_events_endpoint and not self.kv_events_endpoint.startswith(
            ("tcp://", "ipc://", "inproc://")
        ):
            raise ValueError(
                f"kv_events_endpoint must be a ZMQ address like tcp://HOST:PORT, got "
                f"{self.kv_events_endpoint!r}"
            )
        if self.data_parallel_rank < 0:
            raise ValueError(f"data_parallel_rank must be >= 0, got {self.data_parallel_rank}")


GENERATION_DEFAULT_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
"""``generation_config.json`` keys that become request defaults (with ``max_new_tokens``)."""

GENERATION_CONFIG_SOURCES = ("auto", "vllm")
"""``--generation-config`` values besides a directory: ``auto`` reads the model's
``generation_config.json``, ``vllm`` uses the neutral defaults (vLLM's names)."""


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    """How the OpenAI-compatible layer treats requests (vLLM's frontend flags); read by
    ``jaxserve.serving`` through ``ServingInfo``, wherever the engine runs (one process, Ray
    replicas, run-batch).

    Attributes:
      chat_template: ``--chat-template``: a Jinja template file, or the template itself (text
        with ``{``, ``}`` or a newline, vLLM's rule); "" = the tokenizer's own.
      generation_config: ``--generation-config``: "auto" (default sampling parameters from the
        model's ``generation_config.json``), "vllm" (none: neutral defaults) or a directory
        holding a ``generation_config.json``.
      max_logprobs: most ``logprobs`` / ``top_logprobs`` / ``prompt_logprobs`` a request may
        ask for (0..``MAX_LOGPROBS``, the sampler's width).
      enable_auto_tool_choice: chat's ``tool_choice: "auto"`` is served (needs
        ``ModelConfig.tool_call_parser``, as in vLLM).
      return_tokens_as_token_ids: logprobs name tokens ``"token_id:{id}"`` instead of their
        text (for tokens that do not decode to text on their own).
      enable_log_requests: log each request's id, prompt and sampling parameters at INFO.
      max_log_len: characters (and token ids) of a prompt a request log line shows; 0 = all.

    Raises:
      ValueError: max_logprobs outside [0, MAX_LOGPROBS], a negative max_log_len, or a
        generation_config that is not auto, vllm or a directory (naming the field).
    """

    chat_template: str = ""
    generation_config: str = "auto"
    max_logprobs: int = MAX_LOGPROBS
    enable_auto_tool_choice: bool = False
    return_tokens_as_token_ids: bool = False
    enable_log_requests: bool = False
    max_log_len: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"max_logprobs must be in [0, {MAX_LOGPROBS}] (the sampler's top-k width), "
                f"got {self.max_logprobs}"
            )
        if self.max_log_len < 0:
            raise ValueError(f"max_log_len must be >= 0, got {self.max_log_len}")
        source = self.generation_config
        if source not in GENERATION_CONFIG_SOURCES and not os.path.isdir(source):
            raise ValueError(
                f"generation_config must be auto, vllm or a directory holding a "
                f"generation_config.json, got {source!r} (no such directory)"
            )

    def default_sampling_params(self, model_path: str) -> dict[str, Any]:
        """The sampling parameters a request gets for the fields it leaves out (vLLM's
        ``get_diff_sampling_param``): the ``generation_config.json`` keys ``temperature``,
        ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``presence_penalty``,
        ``frequency_penalty``, and ``max_new_tokens`` as ``max_tokens`` (a cap, as in vLLM), of
        the model directory (``auto``) or of ``generation_config`` (a directory); {} for
        ``vllm``, or when the file is absent (``auto`` only).

        Raises:
          ValueError: the file is not a JSON object, a value is out of range, or a
            ``generation_config`` directory has no generation_config.json (naming the path).
        """
        if self.generation_config == "vllm":
            return {}
        folder = model_path if self.generation_config == "auto" else self.generation_config
        path = os.path.join(folder, "generation_config.json")
        if not os.path.isfile(path):
            if self.generation_config == "auto":
                return {}
            raise ValueError(f"generation_config: {folder} has no generation_config.json")
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"generation_config: {path} is not readable JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"generation_config: {path} is not a JSON object")
        keys = {k: k for k in GENERATION_DEFAULT_KEYS} | {"max_new_tokens": "max_tokens"}
        found = {ours: data[key] for key, ours in keys.items() if data.get(key) is not None}
        try:
            SamplingParams(**found)
        except (TypeError, ValueError) as e:
            raise ValueError(f"generation_config: {path}: {e}") from None
        return found


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over devices and processes (vLLM's ParallelConfig).

    Attributes:
      tensor_parallel_size: devices of the 1-D ``("model",)`` mesh the weights, KV heads and
        attention heads are split over (``jaxserve.model.sharding``).
      enable_expert_parallel: a MoE model's experts are split over the same devices (``E / N``
        whole experts each) instead of each expert's width; attention stays tensor-parallel.
      distributed_coordinator: ``HOST:PORT`` of process 0's coordinator for a multi-process
        (multi-host) mesh, or None for one process.
      num_processes: processes forming the mesh (``jax.distributed.initialize``).
      process_id: this process's index; process 0 runs the scheduler, tokenizer and server,
        the others only run the steps it sends them (``jaxserve.distributed``).

    Raises:
      ValueError: tensor_parallel_size or num_processes < 1, process_id outside
        [0, num_processes), or several processes without a coordinator (naming the flag).
    """

    tensor_parallel_size: int = 1
    distributed_coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"process_id must be in [0, {self.num_processes}) (num_processes), "
                f"got {self.process_id}"
            )
        if self.num_processes > 1 and not self.distributed_coordinator:
            raise ValueError(
                "distributed_coordinator (HOST:PORT of process 0) is required when "
                f"num_processes > 1 (got num_processes={self.num_processes})"
            )
        if self.distributed_coordinator and ":" not in self.distributed_coordinator:
            raise ValueError(
                f"distributed_coordinator must be HOST:PORT, got {self.distributed_coordinator!r}"
            )


SPECULATIVE_METHODS = ("ngram", "draft_model")
"""Values of ``--speculative-config``'s ``method`` (vLLM's names)."""


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (Leviathan et al. 2023; Chen et al. 2023), vLLM's ``--speculative-config``.

    A proposer guesses up to ``num_speculative_tokens`` (K) next tokens of a decoding request;
    the target model scores them all in one step (1 + K query tokens) and keeps the longest
    prefix its own sampler agrees with, plus one token of its own (docs/ARCHITECTURE.md,
    "Speculative decoding").

    Attributes:
      method: "ngram" (prompt lookup: the K tokens that followed the latest earlier occurrence
        of the sequence's last n tokens) or "draft_model" (a small model with the same
        vocabulary, run greedily for K tokens, with its own paged KV cache on the target's
        block tables).
      num_speculative_tokens: K, draft tokens per request per step (>= 1).
      prompt_lookup_max, prompt_lookup_min: ngram: the longest and shortest n tried (n from
        max down to min; the longest match wins). vLLM's defaults: 5 and 5 when neither is
        given, the other's value when one is missing.
      model: draft_model: the draft model's path (HF directory, our orbax layout or .gguf); its
        vocabulary must be the target's.
      disable_by_batch_size: speculation is skipped in a step while more than this many
        requests are running or waiting (None: never); vLLM V0's knob.

    Raises:
      ValueError: an unknown method, K < 1, lookup sizes < 1 or min > max, ngram fields with
        draft_model or the reverse, draft_model without a model, disable_by_batch_size < 1
        (each message starts with ``speculative_config.<field>``).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"speculative_config.{field}: {why}")

        if self.method not in SPECULATIVE_METHODS:
            raise bad("method", f"must be one of {list(SPECULATIVE_METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if value is None and name != "num_speculative_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(name, f"must be an integer, got {value!r}")
            if value < 1:
                raise bad(name, f"must be >= 1, got {value}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise bad(
                "num_speculative_tokens",
                f"must be <= {MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}",
            )
        if self.method == "ngram":
            if self.model is not None:
                raise bad("model", "is for method draft_model, not ngram")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = 5
            lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
            if lo > hi:
                raise bad("prompt_lookup_min", f"({lo}) must be <= prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        else:
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, name) is not None:
                    raise bad(name, "is for method ngram, not draft_model")
            if not isinstance(self.model, str) or not self.model:
                raise bad("model", "method draft_model needs the draft model's path")
        size = self.disable_by_batch_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise bad("disable_by_batch_size", f"must be an integer >= 1, got {size!r}")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request needs beyond its step's tokens for the proposer's own writes: the
        draft model writes K/V for its K - 1 further inputs after the step's last token (plus
        the bonus token's, when every draft is accepted); n-gram writes none."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parses ``--speculative-config`` (a JSON object with vLLM's field names).

        ``method`` may be left out when ``model`` is given (then "draft_model", as vLLM
        detects it).

        Raises:
          ValueError: not a JSON object, an unknown field, a missing field or a bad value
            (named: ``speculative_config.<field>: ...``).
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"speculative_config: not valid JSON ({e.msg} at char {e.pos})"
            ) from None
        if not isinstance(data, dict):
            raise ValueError(
                f"speculative_config: must be a JSON object, got {type(data).__name__}"
            )
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(
                f"speculative_config.{unknown[0]}: unknown field (known: {', '.join(names)})"
            )
        if "method" not in data and data.get("model"):
            data = {**data, "method": "draft_model"}
        for name in ("method", "num_speculative_tokens"):
            if data.get(name) is None:
                raise ValueError(f"speculative_config.{name}: required")
        return cls(**data)


MAX_SPECULATIVE_TOKENS = 16
"""Most draft tokens per request per step (``num_speculative_tokens``)."""


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (#33), vLLM's ``--enable-lora`` and its knobs.

    Attributes:
      max_loras: adapters resident on the device at once (slots of the pool; a step uses at
        most this many distinct adapters).
      max_cpu_loras: adapters kept read in host memory (>= max_loras).
      max_lora_rank: the pool's rank; adapters of a larger rank are refused.
      lora_modules: ``(name, path, base_model_name)`` of each adapter served from start-up
        (base_model_name: its ``parent`` in ``/v1/models``; None: the served model).
      backend: how the delta is computed (``jaxserve.model.layers.lora.LORA_BACKENDS``).

    Raises:
      ValueError: a knob out of range or a repeated adapter name (named ``max_loras``, ...).
    """

    max_loras: int = 1
    max_cpu_loras: int = 1
    max_lora_rank: int = 16
    lora_modules: tuple[tuple[str, str, str | None], ...] = ()
    backend: str = "sgmv"

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}")
        names = [m[0] for m in self.lora_modules]
        if len(set(names)) < len(names):
            raise ValueError(f"lora_modules: an adapter name is repeated in {names}")

    @staticmethod
    def parse_modules(items: list[str] | tuple[str, ...] | None) -> tuple:
        """``--lora-modules`` items, each ``name=path`` or a JSON object ``{"name": ...,
        "path": ..., "base_model_name": ...}`` -> ``((name, path, base_model_name), ...)``.

        Raises:
          ValueError: a malformed item (``lora_modules: ...`` naming it).
        """
        out = []
        for item in items or ():
            if isinstance(item, str) and item.lstrip().startswith("{"):
                try:
                    data = json.loads(item)
                except json.JSONDecodeError as e:
                    raise ValueError(f"lora_modules: not valid JSON {item!r} ({e.msg})") from None
                if (
                    not isinstance(data, dict)
                    or not isinstance(data.get("name"), str)
                    or not (isinstance(data.get("path"), str))
                ):
                    raise ValueError(f"lora_modules: {item!r} needs string name and path")
                unknown = set(data) - {"name", "path", "base_model_name"}
                if unknown:
                    raise ValueError(f"lora_modules: unknown field {sorted(unknown)[0]!r}")
                out.append((data["name"], data["path"], data.get("base_model_name")))
                continue
            name, sep, path = str(item).partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules: expected name=path or a JSON object, got {item!r}")
            out.append((name, path, None))
        return tuple(out)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """All resolved configs of one engine.

    Attributes:
      ledger_history: finished requests whose ledgers the engine keeps (a ring; 0 = none).
      parallel: tensor parallel size and the multi-process layout.
      serving: how the OpenAI-compatible layer treats requests.
      speculative: speculative decoding, or None (off).
      lora: multi-LoRA serving, or None (``--enable-lora`` off).
    """

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    runner: RunnerConfig
    observability: ObservabilityConfig = dataclasses.field(default_factory=ObservabilityConfig)
    ledger_history: int = 1000
    parallel: ParallelConfig = ParallelConfig()
    serving: ServingConfig = ServingConfig()
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None

    def __post_init__(self) -> None:
        if self.ledger_history < 0:
            raise ValueError(f"ledger_history must be >= 0, got {self.ledger_history}")
        if self.lora is not None and self.model.runner == "pooling":
            raise ValueError("enable_lora: LoRA adapters are served by --runner generate only")


def _has_tokenizer_files(path: str) -> bool:
    """True when ``path`` (``--tokenizer``) is a tokenizer file, a ``.gguf`` file, or a
    directory holding tokenizer.json or tokenizer.model."""
    if os.path.isfile(path):
        return path.endswith((".json", ".model", ".gguf"))
    return any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model"))


def _meta(help_text: str, **kw: Any) -> dict[str, Any]:
    return {"help": help_text, **kw}


@dataclasses.dataclass
class EngineArgs:
    """User-facing engine knobs; each field is a CLI flag (``--field-name``) and an ``LLM`` kwarg.

    ``model=None`` means the bundled checkpoint. ``max_model_len=None`` means the model's
    ``max_position_embeddings``.
    """

    model: str | None = dataclasses.field(
        default=None,
        metadata=_meta(
            "model directory (HF or our orbax layout), .gguf file, Hugging Face Hub id "
            "(org/name: downloaded, or read from the cache with HF_HUB_OFFLINE=1), or 'smollm2' "
            "(the demo-model extra); default: the bundled checkpoint",
            positional=True,
        ),
    )
    revision: str | None = dataclasses.field(
        default=None,
        metadata=_meta(
            "Hub model ids: the branch, tag or commit to use; default: the default branch"
        ),
    )
    download_dir: str | None = dataclasses.field(
        default=None,
        metadata=_meta(
            "Hub model ids: the cache directory to download into and read from; default: "
            "the Hugging Face cache (HF_HUB_CACHE, HF_HOME)"
        ),
    )
    dtype: str = dataclasses.field(
        default="auto",
        metadata=_meta("weights and activations dtype", choices=["auto", "float32", "bfloat16"]),
    )
    load_format: str = dataclasses.field(
        default="auto",
        metadata=_meta(
            "weights format; dummy = random weights of the config",
            choices=["auto", "safetensors", "orbax", "gguf", "dummy"],
        ),
    )
    served_model_name: str | list[str] | None = dataclasses.field(
        default=None,
        metadata=_meta(
            "model name(s) clients send as model: the first is the one reported, the others "
            "are aliases; default: the model directory's name",
            nargs="+",
        ),
    )
    tokenizer: str | None = dataclasses.field(
        default=None,
        metadata=_meta("tokenizer directory or file to use instead of the model's"),
    )
    max_model_len: int | None = dataclasses.field(
        default=None,
        metadata=_meta(
            "longest sequence (prompt + output), tokens; default: the model's max_position_embeddings"
        ),
    )
    seed: int = dataclasses.field(default=0, metadata=_meta("engine sampling seed"))
    tool_call_parser: str = dataclasses.field(
        default="",
        metadata=_meta(
            "chat tool-call format to parse into tool_calls for tool_choice auto: llama3_json "
            "(Llama 3.1/3.2 templates), hermes (Qwen2.5/Qwen3 <tool_call>), mistral "
            "([TOOL_CALLS], Mistral v0.3+); auto also needs a chat template that renders tools "
            "(SmolLM2's and the bundled model's do not: use tool_choice required or a named "
            "function); default: none (tool_choice auto is refused)",
            choices=["", *TOOL_CALL_PARSERS],
        ),
    )
    runner: str = dataclasses.field(
        default="auto",
        metadata=_meta(
            "generate (completions, chat) or pooling (embeddings: /v1/embeddings, /pooling, "
            "/v1/score); auto: pooling for a *Model architecture or --convert embed",
            choices=list(RUNNER_CHOICES),
        ),
    )
    convert: str = dataclasses.field(
        default="auto",
        metadata=_meta(
            "embed: serve a causal-LM checkpoint as an embedding model (implies --runner pooling)",
            choices=list(CONVERT_CHOICES),
        ),
    )
    pooler_config: str | None = dataclasses.field(
        default=None,
        metadata=_meta(
            'pooling runner: JSON {"pooling_type": "LAST"|"MEAN"|"CLS", "normalize": bool}; '
            "default: the checkpoint's sentence-transformers config, else LAST normalised"
        ),
    )
    structured_outputs_bounded_numbers: bool = dataclasses.field(
        default=True,
        metadata=_meta(
            "bound JSON numbers a schema leaves unbounded (integers within int64, floats "
            "|x| <= 1e15 with at most 9 decimals) so forced JSON finishes; a request may "
            "override it with structured_outputs.bounded_numbers"
        ),
    )
    enable_auto_tool_choice: bool = dataclasses.field(
        default=False,
        metadata=_meta('serve chat tool_choice "auto" (needs --tool-call-parser, as in vLLM)'),
    )
    chat_template: str | None = dataclasses.field(
        default=None,
        metadata=_meta(
            "chat template: a Jinja file, or the template itself (text with { } or a newline); "
            "default: the tokenizer's"
        ),
    )
    generation_config: str = dataclasses.field(
        default="auto",
        metadata=_meta(
            "default sampling parameters: auto (the model's generation_config.json), vllm "
            "(none), or a directory holding a generation_config.json"
        ),
    )
    max_logprobs: int = dataclasses.field(
        default=MAX_LOGPROBS,
        metadata=_meta(
            f"most logprobs / top_logprobs / prompt_logprobs a request may ask for "
            f"(0-{MAX_LOGPROBS})"
        ),
    )
    return_tokens_as_token_ids: bool = dataclasses.field(
        default=False,
        metadata=_meta('logprobs name tokens "token_id:ID" instead of their text'),
    )
    enable_log_requests: bool = dataclasses.field(
        default=False,
        metadata=_meta("log each request's id, prompt and sampling parameters"),
    )
    max_log_len: int = dataclasses.field(
        default=0,
        metadata=_meta("prompt characters / token ids a request log line shows (0: all)"),
    )
    enable_sleep_mode: bool = dataclasses.field(
        default=False,
        metadata=_meta(
            "serve POST /sleep, /wake_up and GET /is_sleeping: weights to host memory (level 1) "
            "or dropped (level 2), KV cache freed"
        ),
    )
    quantization: str = dataclasses.field(
        default="auto",
        metadata=_meta(
            "weight quantization: auto (the checkpoint's: compressed-tensors config, GGUF "
            "blocks kept quantized, else none), none (GGUF dequantized on load), int8 "
            "(weight-only, per-channel), fp8 (e4m3 weights per-channel, embedding and LM head "
            "wide; per-token fp8 activations on GPUs with FP8 matmuls, weight-only elsewhere), "
            "compressed-tensors, gguf",
            choices=list(QUANTIZATION_CHOICES),
        ),
    )
    block_size: int = dataclasses.field(default=16, metadata=_meta("tokens per KV block"))
    kv_cache_dtype: str = dataclasses.field(
        default="auto",
        metadata=_meta(
            "KV cache element type: auto (the model dtype), fp8 / fp8_e4m3, fp8_e5m2 "
            "(per-tensor k/v scales: the checkpoint's k_scale/v_scale, else 1.0)",
            choices=list(KV_CACHE_DTYPE_CHOICES),
        ),
    )
    gpu_memory_utilization: float = dataclasses.field(
        default=0.9,
        metadata=_meta("fraction of device memory for weights, activations and the KV cache"),
    )
    num_gpu_blocks_override: int | None = dataclasses.field(
        default=None, metadata=_meta("KV blocks to allocate, instead of sizing from memory")
    )
    enable_prefix_caching: bool = dataclasses.field(
        default=True, metadata=_meta("reuse KV blocks of identical prompt prefixes")
    )
    kv_offloading_size: float = dataclasses.field(
        default=0.0,
        metadata=_meta("GiB of host memory for KV blocks evicted from the device (0: off)"),
    )
    kv_offloading_backend: str = dataclasses.field(
        default="native",
        metadata=_meta(
            "KV offloading implementation: native (our host block pool); vLLM's flag, kept so "
            "vLLM command lines run (its other value, lmcache, is not implemented)",
            choices=["native"],
        ),
    )
    disable_hybrid_kv_cache_manager: bool = dataclasses.field(
        default=False,
        metadata=_meta(
            "keep every layer's KV for the whole context; default: sliding-window layers keep "
            "only their window's KV blocks (a block table per attention kind)"
        ),
    )
    max_num_batched_tokens: int = dataclasses.field(
        default=8192, metadata=_meta("token budget per step")
    )
    max_num_seqs: int = dataclasses.field(default=256, metadata=_meta("most requests per step"))
    long_prefill_token_threshold: int = dataclasses.field(
        default=4096, metadata=_meta("most tokens one request may take per step (chunked prefill)")
    )
    enable_chunked_prefill: bool = dataclasses.field(
        default=True, metadata=_meta("cut long prompts into chunks across steps")
    )
    scheduling_policy: str = dataclasses.field(
        default="fcfs", metadata=_meta("request order", choices=["fcfs", "priority"])
    )
    max_waiting_requests: int = dataclasses.field(
        default=0, metadata=_meta("answer 503 above this many waiting requests (0: no cap)")
    )
    async_scheduling: bool = dataclasses.field(
        default=True,
        metadata=_meta("plan and dispatch step N+1 while step N runs (outputs one step behind)"),
    )
    stream_interval: int = dataclasses.field(
        default=1,
        metadata=_meta(
            "output tokens buffered per streamed chunk; the first token and the final chunk are "
            "never held back"
        ),
    )
    attention_backend: str = dataclasses.field(
        default="auto",
        metadata=_meta(
            "attention implementation; auto: pallas-tpu on TPU, pallas-gpu on GPU, xla on CPU; "
            "pallas: the platform's kernel; xla: jnp attention compiled by XLA (any platform); "
            "reference: deprecated name of xla",
            choices=list(ATTENTION_BACKEND_CHOICES),
        ),
    )
    pallas_interpret: bool = dataclasses.field(
        default=False,
        metadata=_meta("run the chosen Pallas kernel in Pallas interpret mode (CPU tests; slow)"),
    )
    compilation_cache_dir: str | None = dataclasses.field(
        default=None,
        metadata=_meta(
            "persistent XLA compilation cache ('' disables); default: ~/.cache/jaxserve/xla"
        ),
    )
    token_buckets: str | None = dataclasses.field(
        default=None,
        metadata=_meta(
            "comma-separated padded step sizes in tokens; default: powers of two up to the "
            "budget, from 1 on the CPU's xla backend (16 with the Pallas kernels)"
        ),
    )
    warmup: bool = dataclasses.field(
        default=True, metadata=_meta("compile every bucket before serving")
    )
    # Observability (#14): names the routers read, KV events for KV-aware routers.
    metrics_namespace: str = dataclasses.field(
        default="jaxserve",
        metadata=_meta(
            "prefix of the /metrics names; vllm serves vLLM's names (vllm:num_requests_waiting, ...)",
            choices=["jaxserve", "vllm"],
        ),
    )
    kv_events_endpoint: str = dataclasses.field(
        default="",
        metadata=_meta(
            "publish KV-cache events (vLLM's format, ZMQ PUB + msgpack) here: tcp://*:PORT binds "
            "127.0.0.1, tcp://0.0.0.0:PORT every interface (warned), tcp://HOST:PORT connects; "
            "'' publishes nothing"
        ),
    )
    kv_events_include_token_ids: bool = dataclasses.field(
        default=False,
        metadata=_meta(
            "KV events of requests with a cache_salt carry their token ids too (default: block "
            "hashes only, since token ids are the prompt)"
        ),
    )
    data_parallel_rank: int = dataclasses.field(
        default=0,
        metadata=_meta(
            "this engine's replica index (the Ray deployment sets it); labels KV events and "
            "offsets a bound --kv-events-endpoint port"
        ),
    )
    ledger_history: int = dataclasses.field(
        default=1000,
        metadata=_meta("finished requests whose ledgers GET /v1/requests/{id}/ledger serves"),
    )
    tensor_parallel_size: int = dataclasses.field(
        default=1,
        metadata=_meta(
            "devices to split the model over (attention heads, MLP width, vocabulary, KV heads)"
        ),
    )
    enable_expert_parallel: bool = dataclasses.field(
        default=False,
        metadata=_meta(
            "MoE models: split the experts over the --tensor-parallel-size devices (whole "
            "experts each) instead of each expert's width; attention stays tensor-parallel"
        ),
    )
    expert_load_metrics: bool = dataclasses.field(
        default=False,
        metadata=_meta(
            "MoE models: count the tokens routed to each expert and export them on /metrics "
            "(moe_expert_tokens, moe_expert_load_max_over_mean); a device-to-host copy per MoE "
            "layer per step"
        ),
    )
    distributed_coordinator: str | None = dataclasses.field(
        default=None,
        metadata=_meta("HOST:PORT of process 0 for a multi-process (multi-host) mesh"),
    )
    num_processes: int = dataclasses.field(
        default=1, metadata=_meta("processes forming the mesh (multi-host)")
    )
    process_id: int = dataclasses.field(
        default=0,
        metadata=_meta("this process's index; 0 serves, the others run the steps it sends"),
    )
    speculative_config: str | dict | None = dataclasses.field(
        default=None,
        metadata=_meta(
            "speculative decoding, a JSON object (vLLM's): "
            '{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N, '
            '"prompt_lookup_min": M} or {"method": "draft_model", "model": PATH, '
            '"num_speculative_tokens": K}; optional "disable_by_batch_size": B (off while more '
            "than B requests run or wait); default: off"
        ),
    )

    enable_lora: bool = dataclasses.field(
        default=False, metadata=_meta("serve LoRA adapters (--lora-modules, load endpoints)")
    )
    lora_modules: list[str] | None = dataclasses.field(
        default=None,
        metadata=_meta(
            "LoRA adapters to serve, each name=path or a JSON object "
            '{"name": N, "path": P, "base_model_name": B}; repeatable',
            nargs="+",
            action="extend",
        ),
    )
    max_loras: int = dataclasses.field(
        default=1, metadata=_meta("LoRA adapters resident on the device at once (one step's)")
    )
    max_cpu_loras: int | None = dataclasses.field(
        default=None, metadata=_meta("LoRA adapters kept in host memory (default: max_loras)")
    )
    max_lora_rank: int = dataclasses.field(
        default=16, metadata=_meta("largest LoRA rank served (the device pool's rank)")
    )

    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser, *, positional_model: bool = True
    ) -> None:
        """Adds one flag per field (``--max-num-batched-tokens`` ...); bools get ``--no-`` forms."""
        for field in dataclasses.fields(cls):
            meta = dict(field.metadata)
            help_text = meta.pop("help", None)
            positional = meta.pop("positional", False)
            if positional and positional_model:
                parser.add_argument(field.name, nargs="?", default=field.default, help=help_text)
                continue
            flag = "--" + field.name.replace("_", "-")
            if field.type in ("bool", bool):
                parser.add_argument(
                    flag,
                    action=argparse.BooleanOptionalAction,
                    default=field.default,
                    help=help_text,
                )
                continue
            kind = {"int": int, "int | None": int, "float": float}.get(str(field.type), str)
            parser.add_argument(flag, type=kind, default=field.default, help=help_text, **meta)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """Builds EngineArgs from a parsed namespace (extra attributes are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in names}
        served = values.get("served_model_name")
        if isinstance(served, list) and len(served) == 1:
            values["served_model_name"] = served[0]  # one name stays a string
        return cls(**values)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """Builds EngineArgs from ``LLM(**kwargs)``.

        Raises:
          ValueError: an unknown keyword (names it).
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def resolved_model_path(self) -> str:
        """The local path ``model`` names (``jaxserve.model.resolve_model_path``: the bundled
        checkpoint when None, the demo model's GGUF for ``"smollm2"``, a Hub id's snapshot at
        ``revision`` in ``download_dir`` or the Hub's cache).

        Raises:
          ValueError: ``"smollm2"`` without the demo-model extra installed (says how to install);
            a Hub id that cannot be had (ModelLoadError: one line saying why).
        """
        from jaxserve.model.resolve import resolve_model_path  # local: keeps this module light

        return resolve_model_path(self.model, self.revision, self.download_dir)

    def check(self, need_tokenizer: bool = True) -> EngineConfig:
        """Checks the model path and every flag value before anything heavy is loaded
        (``jaxserve.model.preflight``); returns the engine config they resolve to.

        Raises:
          ValueError (ModelLoadError included): names the path or flag and what to do.
        """
        from jaxserve.model.preflight import check_model_path  # local: jax-free, but not tiny

        path = self.resolved_model_path()
        max_len = check_model_path(
            path, self.load_format, need_tokenizer and not self.tokenizer, self.quantization
        )
        config = self.create_engine_config(max_len)
        if self.tokenizer and not _has_tokenizer_files(self.tokenizer):
            raise ValueError(
                f"tokenizer: no tokenizer found at {self.tokenizer!r} (a directory with "
                "tokenizer.json or tokenizer.model, one of those files, or a .gguf file)"
            )
        if self.chat_template:
            from jaxserve.tokenizer.chat_template import load_chat_template

            load_chat_template(self.chat_template)  # unreadable or not Jinja: named
        config.serving.default_sampling_params(path)  # a bad generation_config.json, named
        spec = config.speculative
        if spec is not None and spec.method == "draft_model":
            try:
                check_model_path(spec.model, self.draft_load_format, need_tokenizer=False)
            except ValueError as e:
                raise ValueError(f"speculative_config.model: {e}") from None
        return config

    @property
    def draft_load_format(self) -> str:
        """How a draft model loads: random weights of its config when the target's do
        (``--load-format dummy``, for timing at real shapes), else as its files say."""
        return "dummy" if self.load_format == "dummy" else "auto"

    def create_engine_config(self, model_max_len: int) -> EngineConfig:
        """Resolves the per-component configs once the model's own max length is known.

        Args:
          model_max_len: the model's ``max_position_embeddings``.

        Raises:
          ValueError: a knob is out of range (names it), or max_model_len exceeds the model's.
        """
        path = self.resolved_model_path()
        max_len = self.max_model_len or model_max_len
        if max_len > model_max_len:
            raise ValueError(
                f"max_model_len ({max_len}) exceeds the model's max_position_embeddings ({model_max_len})"
            )
        names = self.served_model_name
        names = [names] if isinstance(names, str) else list(names or [])
        if any(not isinstance(n, str) or not n for n in names) or len(set(names)) < len(names):
            raise ValueError(
                f"served_model_name must be distinct non-empty names, got {self.served_model_name!r}"
            )
        from jaxserve.model.hub import is_hub_id

        if names:
            name = names[0]
        elif is_hub_id(self.model):  # vLLM's default: the id clients already know
            name = str(self.model)
        else:
            name = os.path.basename(os.path.normpath(self.model or path))
        if not names and name.lower().endswith(".gguf"):
            name = name[: -len(".gguf")]  # "SmolLM2-135M-Instruct.Q4_1"
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError(
                "enable_auto_tool_choice needs tool_call_parser (pass --tool-call-parser with "
                "--enable-auto-tool-choice, as vLLM requires)"
            )
        buckets: tuple[int, ...] = ()
        if self.token_buckets:
            try:
                buckets = tuple(int(b) for b in self.token_buckets.split(","))
            except ValueError:
                raise ValueError(
                    f"token_buckets must be comma-separated integers, got {self.token_buckets!r}"
                ) from None
        runner = resolve_runner(self.runner, self.convert, _architecture(path))
        pooler = resolve_pooler_config(path, self.pooler_config) if runner == "pooling" else None
        # MEAN and CLS read every prompt token's hidden state: a prefix-cache hit would skip some
        prefix_caching = self.enable_prefix_caching and (
            pooler is None or pooler.pooling_type == "LAST"
        )
        cache_dir = (
            _default_compilation_cache_dir()
            if self.compilation_cache_dir is None
            else self.compilation_cache_dir
        )
        return EngineConfig(
            model=ModelConfig(
                model=path,
                dtype=self.dtype,
                load_format=self.load_format,
                served_model_name=name,
                max_model_len=max_len,
                seed=self.seed,
                tool_call_parser=self.tool_call_parser,
                runner=runner,
                pooling_type=pooler.pooling_type if pooler else "LAST",
                pooling_normalize=pooler.normalize if pooler else True,
                structured_outputs_bounded_numbers=self.structured_outputs_bounded_numbers,
                served_model_aliases=tuple(names[1:]),
                tokenizer=self.tokenizer or "",
                enable_sleep_mode=self.enable_sleep_mode,
                quantization=self.quantization,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=prefix_caching,
                kv_offloading_size=self.kv_offloading_size,
                kv_offloading_backend=self.kv_offloading_backend,
                disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager,
                cache_dtype=self.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                enable_chunked_prefill=self.enable_chunked_prefill,
                policy=self.scheduling_policy,
                max_model_len=max_len,
                max_waiting_requests=self.max_waiting_requests,
                async_scheduling=self.async_scheduling,
                stream_interval=self.stream_interval,
            ),
            runner=RunnerConfig(
                attention_backend=self.attention_backend,
                pallas_interpret=self.pallas_interpret,
                token_buckets=buckets,
                compilation_cache_dir=cache_dir,
                warmup=self.warmup,
            ),
            observability=ObservabilityConfig(
                metrics_namespace=self.metrics_namespace,
                kv_events_endpoint=self.kv_events_endpoint,
                kv_events_include_token_ids=self.kv_events_include_token_ids,
                data_parallel_rank=self.data_parallel_rank,
                expert_load_metrics=self.expert_load_metrics,
            ),
            ledger_history=self.ledger_history,
            parallel=self.parallel_config(),
            serving=ServingConfig(
                chat_template=self.chat_template or "",
                generation_config=self.generation_config,
                max_logprobs=self.max_logprobs,
                enable_auto_tool_choice=self.enable_auto_tool_choice,
                return_tokens_as_token_ids=self.return_tokens_as_token_ids,
                enable_log_requests=self.enable_log_requests,
                max_log_len=self.max_log_len,
            ),
            speculative=self.speculative(),
            lora=self.lora_config(),
        )

    def lora_config(self) -> LoRAConfig | None:
        """The LoRAConfig of the ``--enable-lora`` flags; None when off.

        Raises:
          ValueError: LoRA knobs without ``--enable-lora``, or a bad knob (named).
        """
        if not self.enable_lora:
            if self.lora_modules:
                raise ValueError("lora_modules: needs --enable-lora")
            return None
        return LoRAConfig(
            max_loras=self.max_loras,
            max_cpu_loras=self.max_cpu_loras or self.max_loras,
            max_lora_rank=self.max_lora_rank,
            lora_modules=LoRAConfig.parse_modules(self.lora_modules),
        )

    def speculative(self) -> SpeculativeConfig | None:
        """The SpeculativeConfig of ``speculative_config`` (a JSON string, or a dict from
        ``LLM(speculative_config={...})``), checked against the other flags; None when off.

        Raises:
          ValueError: a bad speculative config (``speculative_config.<field>: ...``), or a
            draft model together with KV offloading (its host tier keeps the target's K/V only).
        """
        raw = self.speculative_config
        if raw is None or raw == "":
            return None
        spec = SpeculativeConfig.from_json(raw if isinstance(raw, str) else json.dumps(raw))
        if spec.method == "draft_model" and self.kv_offloading_size > 0:
            raise ValueError(
                "speculative_config.method: draft_model cannot be combined with "
                "--kv-offloading-size (the host tier keeps the target's K/V only)"
            )
        return spec

    def parallel_config(self) -> ParallelConfig:
        """The ParallelConfig of these args (checked; needed before the model loads, to start
        the distributed runtime).

        Raises:
          ValueError: an out-of-range parallel knob (names it).
        """
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            enable_expert_parallel=self.enable_expert_parallel,
            distributed_coordinator=self.distributed_coordinator,
            num_processes=self.num_processes,
            process_id=self.process_id,
        )
