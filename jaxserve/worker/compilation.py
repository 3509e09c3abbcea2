"""Compiling the runner's step: the jitted step functions, the persistent compilation cache,
activation profiling for KV-pool sizing, and warm-up.

The step functions are module-level jits. Their static half is a ``StepGraph`` (the model's
graphdef and the attention backend), hashed by identity so a call hashes no model graph; each
runner holds one, so each runner has its own executables. Each function counts its traces on
the ``StepGraph`` (a trace is a new executable, compiled or loaded from the persistent cache),
which is how a runner knows which variants it has compiled.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.core.kv_cache_groups import KVCacheLayout
from jaxserve.model.attention import PagedAttentionMetadata
from jaxserve.model.layers.lora import LoraBatch
from jaxserve.model.sharding import gather_logits
from jaxserve.sampling_params import MAX_LOGPROBS, SamplingParams
from jaxserve.worker.batch_builder import seq_bucket
from jaxserve.worker.kv_cache_alloc import (
    KVCacheSpec,
    allocate_kv_caches,
    device_memory,
    kv_cache_shapes,
    log_kv_cache_spec,
    min_over_processes,
    size_kv_cache,
)
from jaxserve.worker.sampler import prompt_logprobs, sample
from jaxserve.worker.sampling_metadata import SamplingMetadata, SamplingRow
from jaxserve.worker.spec_decode import accept_on_device
from jaxserve.worker.step_inputs import StepInputs

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig
    from jaxserve.model.arch_config import ModelArchConfig
    from jaxserve.worker.batch_builder import InputBatch

logger = logging.getLogger(__name__)

PROMPT_LOGPROBS_CHUNK = 256
"""Prompt positions whose full-vocabulary logits exist at once in the prompt-logprobs head."""

# Everyday sampler variants compiled at warm-up, per sequence bucket (see SamplingMetadata).
WARMUP_SAMPLING = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=1.0, top_k=50),
    SamplingParams(temperature=1.0, top_p=0.9),
)


@dataclasses.dataclass(eq=False)
class StepGraph:
    """The static argument of the step functions (hashed and compared by identity).

    Attributes:
      graphdef: the model's nnx graphdef (its state is passed to each call).
      state_def: the treedef of that state: the step functions take its leaves (a flat list,
        ``ModelRunner.params``), which a call flattens in C++, where an ``nnx.State`` argument
        costs a Python visit per Variable on every call (~2 ms at 1B shapes, 146 leaves, on CPU).
      backend: the attention backend (``jaxserve.model.attention.ATTENTION_BACKENDS``).
      max_seqs: the largest sequence bucket (the fixed shape of ``StepInputs.prev_tokens``).
      interpret: run the Pallas kernel in Pallas interpret mode (``--pallas-interpret``).
      mesh: the tensor-parallel mesh when it has more than one device (attention per shard
        under shard_map, logits gathered before the sampler), else None.
      kv_layout: per layer, ``(KV-cache group, pool array pair)``
        (``PagedAttentionMetadata.kv_layout``); None: one group, a pair per layer.
      traces: traces per step function ("forward", "sampler", "prompt_logprobs").
    """

    graphdef: nnx.GraphDef
    backend: str
    max_seqs: int  # the largest sequence bucket: sample_step pads its tokens to it
    interpret: bool = False
    mesh: Mesh | None = None
    state_def: Any = None
    kv_layout: tuple[tuple[int, int], ...] | None = None
    traces: collections.Counter = dataclasses.field(default_factory=collections.Counter)


@functools.partial(jax.jit, static_argnames="graph", donate_argnames="kv_caches")
def forward_step(
    graph: StepGraph,
    params: list,
    kv_caches: list,
    inputs: StepInputs,
    lora: LoraBatch | None = None,
):
    """``(params, kv_caches, inputs) -> (logits [S, V] f32, hidden [T, E], kv_caches)``;
    ``params``: the model state's leaves (``graph.state_def``); the KV caches are donated and
    updated in place. ``lora``: the step's adapter batch (#33), None (its own trace, the
    base model's work only) when no token uses an adapter."""
    graph.traces["forward"] += 1
    model = merge_model(graph, params)
    hidden, kv_caches = model(
        step_input_ids(inputs), inputs.positions, kv_caches, step_metadata(graph, inputs, lora)
    )  # [T, E]
    logits = gather_logits(model.compute_logits(hidden[inputs.logits_indices]), graph.mesh)
    return logits, hidden, kv_caches


@functools.partial(jax.jit, static_argnames="graph", donate_argnames="kv_caches")
def forward_hidden_step(graph: StepGraph, params: list, kv_caches: list, inputs: StepInputs):
    """``forward_step`` without the LM head: ``(hidden [T, E], kv_caches)``. A verification
    step of a small bucket runs it, then ``verify_logits_step`` reads the head once for the
    sampled and the verified rows together (the head is most of a small step's weights)."""
    graph.traces["forward_hidden"] += 1
    model = merge_model(graph, params)
    return model(step_input_ids(inputs), inputs.positions, kv_caches, step_metadata(graph, inputs))


@functools.partial(jax.jit, static_argnames="graph")
def verify_logits_step(
    graph: StepGraph,
    params: list,
    hidden: jax.Array,
    logits_indices: jax.Array,
    spec_indices: jax.Array,
):
    """Speculative decoding, one LM-head pass: ``hidden [T, E]`` (``forward_hidden_step``'s),
    ``logits_indices [S]`` (``StepInputs``) and ``spec_indices [R * W]`` int32
    (``VerifyPlan.indices``) -> ``(logits [S, V], spec_logits [R * W, V])`` float32, what
    ``forward_step`` and ``spec_logits_step`` return for them, from one ``[S + R * W, E]``
    matmul instead of two reads of the head."""
    graph.traces["verify_logits"] += 1
    model = merge_model(graph, params)
    rows = jnp.concatenate([logits_indices, spec_indices])
    logits = gather_logits(model.compute_logits(hidden[rows]), graph.mesh)
    num_seqs = logits_indices.shape[0]
    return logits[:num_seqs], logits[num_seqs:]


def merge_model(graph: StepGraph, params: list) -> nnx.Module:
    """Inside a step function: the model of ``graph`` with the state leaves ``params``."""
    return nnx.merge(graph.graphdef, jax.tree.unflatten(graph.state_def, params))


def step_metadata(
    graph: StepGraph, inputs: StepInputs, lora: LoraBatch | None = None
) -> PagedAttentionMetadata:
    """Inside a step function: the step's attention metadata (its views of ``inputs``, and
    its LoRA adapter batch or None)."""
    return PagedAttentionMetadata(
        slot_mapping=inputs.slot_mapping,
        block_tables=inputs.block_tables,
        context_lens=inputs.context_lens,
        query_start_loc=inputs.query_start_loc,
        num_seqs=inputs.num_seqs,
        backend=graph.backend,
        interpret=graph.interpret,
        mesh=graph.mesh,
        kv_layout=graph.kv_layout,
        lora=lora,
    )


def step_input_ids(inputs: StepInputs) -> jax.Array:
    """Inside a step function: ``[T]`` token ids, those sampled by the previous step (async
    scheduling) taken straight from its output."""
    prev = inputs.prev_index  # [T]
    return jnp.where(prev >= 0, inputs.prev_tokens[jnp.maximum(prev, 0)], inputs.input_ids)


@functools.partial(jax.jit, static_argnames=("graph", "pooling_type"))
def pool_step(
    graph: StepGraph,
    hidden: jax.Array,
    query_start_loc: jax.Array,
    logits_indices: jax.Array,
    pooling_type: str,
) -> jax.Array:
    """The pooling runner's head: per sequence of the step, its chunk's share of the pooled
    vector, float32 ``[S, E]``. ``hidden [T, E]`` (the forward's, after the final norm),
    ``query_start_loc [S + 1]`` and ``logits_indices [S]`` int32 (``StepInputs``).

    LAST: the hidden state of the chunk's last token; CLS: of its first token; MEAN: the sum
    over the chunk's tokens (the runner adds the chunks up and divides by the prompt length).
    Padding sequences (empty chunks) get a sum of zeros or an arbitrary row; nobody reads them.
    """
    graph.traces["pool"] += 1
    h = hidden.astype(jnp.float32)
    if pooling_type == "LAST":
        return h[logits_indices]
    if pooling_type == "CLS":
        return h[query_start_loc[:-1]]
    num_seqs = logits_indices.shape[0]
    # token t belongs to sequence i where query_start_loc[i] <= t < query_start_loc[i + 1];
    # padding tokens (past the last real one) fall into segment S, dropped
    seg = jnp.searchsorted(query_start_loc[1:], jnp.arange(h.shape[0]), side="right")
    return jax.ops.segment_sum(h, seg, num_segments=num_seqs + 1)[:num_seqs]


@functools.partial(jax.jit, static_argnames="graph")
def sample_step(graph: StepGraph, logits: jax.Array, md: SamplingMetadata):
    """:func:`jaxserve.worker.sampler.sample`, one executable per sampler variant.

    Returns ``(SamplerOutput, tokens [graph.max_seqs] int32)``: the second is the sampled
    tokens padded to the fixed shape the next step's ``StepInputs.prev_tokens`` has."""
    graph.traces["sampler"] += 1
    out = sample(logits, md)
    padded = jnp.zeros(graph.max_seqs, jnp.int32).at[: out.token_ids.shape[0]].set(out.token_ids)
    return out, padded


@jax.jit
def gather_rows(hidden: jax.Array, indices: jax.Array) -> jax.Array:
    """``hidden [T, E]``, ``indices [N]`` int32 -> ``hidden[indices]`` ``[N, E]`` (its own small
    executable per (T, N), so the logits after it compile per N alone)."""
    return hidden[indices]


@functools.partial(jax.jit, static_argnames="graph")
def spec_logits_step(graph: StepGraph, params: list, hidden: jax.Array):
    """Speculative decoding: the target's logits at the verified positions, ``hidden [R * W,
    E]`` (``gather_rows`` of the forward's at ``VerifyPlan.indices``) -> f32 ``[R * W, V]``."""
    graph.traces["spec_logits"] += 1
    model = merge_model(graph, params)
    return gather_logits(model.compute_logits(hidden), graph.mesh)


@functools.partial(jax.jit, static_argnames="graph")
def spec_sample_step(graph: StepGraph, logits: jax.Array, md: SamplingMetadata):
    """Speculative decoding: :func:`jaxserve.worker.sampler.sample` over the verified
    positions (``logits [R * W, V]``, ``md`` from ``SamplingMetadata.expand``)."""
    graph.traces["spec_sampler"] += 1
    return sample(logits, md)


@functools.partial(jax.jit, static_argnames="graph")
def prompt_logprobs_step(graph: StepGraph, params: list, hidden: jax.Array, targets: jax.Array):
    """Raw-model logprob, rank and top-``MAX_LOGPROBS`` of each target token.

    ``hidden [T, E]`` (the forward's), ``targets [T]`` int32 (-1 = not scored; scored as token
    0 and ignored) -> LogprobsTensors over T rows, computed ``PROMPT_LOGPROBS_CHUNK`` rows at a
    time so only ``[chunk, V]`` logits exist at once.
    """
    graph.traces["prompt_logprobs"] += 1
    model = merge_model(graph, params)
    t = hidden.shape[0]
    chunk = min(PROMPT_LOGPROBS_CHUNK, t & -t)

    def one(args):
        h, tgt = args
        logits = gather_logits(model.compute_logits(h), graph.mesh)  # [chunk, V]
        return prompt_logprobs(logits, jnp.maximum(tgt, 0), MAX_LOGPROBS)

    out = jax.lax.map(
        one, (hidden.reshape(t // chunk, chunk, -1), targets.reshape(t // chunk, chunk))
    )
    return jax.tree.map(lambda x: x.reshape(t, *x.shape[2:]), out)


class RunnerFields(Protocol):
    """The fields of the model runner (``jaxserve.worker.model_runner.ModelRunner``) that these
    functions read and set: they take the runner itself, typed by what they touch (the runner
    module imports this one, not the other way round)."""

    config: EngineConfig
    arch: ModelArchConfig
    dtype: np.dtype
    kv_dtype: np.dtype
    mesh: Mesh
    kv_sharding: jax.sharding.Sharding
    graph: StepGraph
    params: list  # the state's leaves (StepGraph.state_def)
    block_size: int
    max_num_seqs: int
    max_model_len: int
    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    input_batch: InputBatch
    warmup_sampling: tuple[SamplingParams, ...]
    kv_head_dim: int
    kv_layout: KVCacheLayout
    kv_spec: KVCacheSpec | None
    kv_caches: list | None
    aot_forward: dict[int, Any]
    aot_forward_hidden: dict[int, Any]
    one_head_buckets: frozenset[int]
    aot_prompt_logprobs: dict[int, Any]
    aot_draft_prefill: dict[int, Any]
    draft: Any  # jaxserve.worker.draft_model.DraftModel | None
    num_spec_tokens: int
    warm_buckets: set[int]
    compile_seconds: float


def configure_compilation_cache(cache_dir: str) -> None:
    """Turns on JAX's persistent compilation cache in ``cache_dir`` ("" leaves it off); every
    compile is cached (``jax_persistent_cache_min_compile_time_secs = 0``)."""
    if not cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def padding_inputs(runner: RunnerFields, token_bucket: int) -> StepInputs:
    """All-padding inputs of a token bucket and its sequence bucket (they write nothing)."""
    return StepInputs.padding(
        token_bucket,
        seq_bucket(token_bucket, runner.max_num_seqs),
        runner.input_batch.max_blocks_per_req,
        runner.graph.max_seqs,
        len(runner.kv_layout.groups),
    )


def _probe_spec(runner: RunnerFields, num_blocks: int) -> KVCacheSpec:
    arch, dtype = runner.arch, runner.kv_dtype
    num_tensors = runner.kv_layout.num_tensors
    return KVCacheSpec(
        num_blocks=num_blocks,
        block_size=runner.block_size,
        num_layers=num_tensors,
        num_kv_heads=arch.num_kv_heads,
        head_dim=runner.kv_head_dim,
        dtype=dtype.name,
        bytes_per_token=2 * num_tensors * arch.num_kv_heads * runner.kv_head_dim * dtype.itemsize,
        source="probe",
        num_shards=runner.mesh.size,
    )


def peak_activation_bytes(
    outputs: int, forward_temp: int, sampler_temp: int, prompt_logprobs_temp: int
) -> int:
    """The step's peak activation bytes from its parts (``profile_peak_activation_bytes``
    measures them; ``jaxserve plan`` estimates them): the forward's outputs that do not alias
    the KV caches stay live while the sampler and the prompt-logprobs head run, so the peak is
    those outputs plus the largest of the three temporaries."""
    return outputs + max(forward_temp, sampler_temp, prompt_logprobs_temp)


def profile_peak_activation_bytes(runner: RunnerFields) -> int:
    """Peak activation memory of the largest token bucket's step, bytes, from
    ``memory_analysis()`` of its compiled parts.

    The forward's outputs that do not alias the donated KV caches (logits, hidden) stay live
    while the sampler and the prompt-logprobs head run after it, so the peak is those outputs
    plus the largest temporaries of the three (forward; the sampler's costliest variant, top-p
    with 20 logprobs; the prompt-logprobs head). The forward is lowered against a small
    stand-in pool (its activations do not depend on the pool size), with a throwaway
    ``StepGraph`` so these traces do not count as the runner's executables.
    """
    graph = dataclasses.replace(runner.graph, traces=collections.Counter())
    t_max = runner.token_buckets[-1]
    s_max = seq_bucket(t_max, runner.max_num_seqs)
    probe = _probe_spec(runner, 2 * runner.input_batch.max_blocks_per_req + 1)
    fwd = forward_step.lower(
        graph,
        runner.params,
        kv_cache_shapes(probe, runner.kv_sharding),
        padding_inputs(runner, t_max),
    ).compile()
    fwd_mem = fwd.memory_analysis()
    outputs = int(fwd_mem.output_size_in_bytes) - int(fwd_mem.alias_size_in_bytes)
    logits = jax.ShapeDtypeStruct((s_max, runner.arch.vocab_size), jnp.float32)
    worst = SamplingParams(temperature=1.0, top_p=0.9, logprobs=MAX_LOGPROBS)
    md = SamplingMetadata.from_params([SamplingRow(worst, 0, 0, (), ())], pad_to=s_max)
    sampler = sample_step.lower(graph, logits, md).compile()
    sampler_temp = int(sampler.memory_analysis().temp_size_in_bytes)
    hidden = jax.ShapeDtypeStruct((t_max, runner.arch.hidden_size), runner.dtype)
    targets = np.zeros(t_max, np.int32)
    plp = prompt_logprobs_step.lower(graph, runner.params, hidden, targets).compile()
    plp_temp = int(plp.memory_analysis().temp_size_in_bytes)
    peak = peak_activation_bytes(outputs, int(fwd_mem.temp_size_in_bytes), sampler_temp, plp_temp)
    logger.info(
        "profiled step activations (T=%d): peak %.1f MiB = outputs %.1f MiB + max(forward temp "
        "%.1f, sampler temp %.1f, prompt-logprobs temp %.1f) MiB",
        t_max,
        peak / 2**20,
        outputs / 2**20,
        fwd_mem.temp_size_in_bytes / 2**20,
        sampler_temp / 2**20,
        plp_temp / 2**20,
    )
    return peak


def initialize_kv_cache(runner: RunnerFields) -> KVCacheSpec:
    """Sizes the runner's KV pool (``kv_cache_alloc``), allocates it into ``runner.kv_caches``
    and logs it. On a device with memory stats and without ``num_gpu_blocks_override``, first
    profiles the largest bucket's activation memory (one extra compile). With a draft model
    (speculative decoding) the blocks are sized for both pools and the draft's is allocated too
    (its activations, smaller than the target's, are not profiled).

    Raises:
      ValueError: the memory left holds fewer than 2 blocks.
    """
    cache = runner.config.cache
    arch = runner.arch
    peak = 0
    devices = [d for d in runner.mesh.devices.flat if d.process_index == jax.process_index()]
    if cache.num_gpu_blocks_override is None and device_memory(devices[0]) is not None:
        t0 = time.perf_counter()
        peak = profile_peak_activation_bytes(runner)
        runner.compile_seconds += time.perf_counter() - t0
    spec = size_kv_cache(
        runner.config,
        arch,
        runner.kv_layout,
        runner.kv_head_dim,
        runner.kv_dtype,
        device=devices,
        peak_activation_bytes=peak,
        num_shards=runner.mesh.size,
        extra_bytes_per_token=0 if runner.draft is None else runner.draft.bytes_per_token,
    )
    if jax.process_count() > 1:  # every process must allocate the same pool
        spec = dataclasses.replace(spec, num_blocks=min_over_processes(spec.num_blocks))
    log_kv_cache_spec(spec)
    runner.kv_spec = spec
    runner.kv_caches = allocate_kv_caches(spec, runner.kv_sharding)
    if runner.draft is not None:  # its own pool, with the target's blocks
        runner.draft.allocate(
            runner.draft.spec(spec.num_blocks, spec.block_size, runner.mesh.size),
            runner.kv_sharding,
        )
    return spec


def warmup(runner: RunnerFields, *, progress: bool = True) -> float:
    """Compiles ahead of time (loads from the persistent cache when warm) the forward and the
    prompt-logprobs head for every token bucket, largest first, into ``runner.aot_forward`` /
    ``runner.aot_prompt_logprobs``, and compiles and runs the runner's warm-up sampler variants
    for every sequence bucket on zero logits. Returns the seconds spent; logs them. The pooling
    runner compiles ``pool_step`` per token bucket instead of the sampler and prompt-logprobs
    head, which it never runs.

    Requires ``initialize_kv_cache`` first.
    """
    assert runner.kv_caches is not None, "initialize_kv_cache() before warmup()"
    from jaxserve.logging_config import progress_bar_class

    tqdm = progress_bar_class()

    graph, state = runner.graph, runner.params
    t0 = time.perf_counter()
    warm_seqs: set[int] = set()
    bar = tqdm(
        list(reversed(runner.token_buckets)),
        desc="compiling step buckets",
        unit="bucket",
        disable=not progress,
    )
    for size in bar:
        bar.set_postfix_str(f"T={size}")
        # Compiled ahead of time, not run: running a large bucket costs far more than loading
        # it from the persistent cache (CPU, T=8192: ~160 s vs ~4 s under load), and a warm
        # restart paid it every time. Steps of a warm bucket call these executables.
        fwd = forward_step.lower(
            graph, state, runner.kv_caches, padding_inputs(runner, size)
        ).compile()
        runner.aot_forward[size] = fwd
        lora_slots = getattr(runner, "lora_slots", None)
        if lora_slots is not None:  # the step with adapter tokens (#33): its own executable
            runner.aot_forward_lora[size] = forward_step.lower(
                graph,
                state,
                runner.kv_caches,
                padding_inputs(runner, size),
                lora_slots.padding_batch(size),
            ).compile()
        logits_info, hidden_info, _ = fwd.out_info
        pooling_type = getattr(runner, "pooling_type", None)
        if pooling_type is not None:  # the pooling runner's head, on zero hidden states; it
            # never samples nor scores prompt tokens
            hidden = jax.device_put(
                np.zeros(hidden_info.shape, hidden_info.dtype), hidden_info.sharding
            )
            pad = padding_inputs(runner, size)
            jax.block_until_ready(
                pool_step(graph, hidden, pad.query_start_loc, pad.logits_indices, pooling_type)
            )
            runner.warm_buckets.add(size)
            continue
        targets = np.full(size, -1, np.int32)
        runner.aot_prompt_logprobs[size] = prompt_logprobs_step.lower(
            graph, state, hidden_info, targets
        ).compile()
        draft = runner.draft
        if draft is not None:  # the draft runs over every target step's tokens
            runner.aot_draft_prefill[size] = draft.compile_prefill(
                padding_inputs(runner, size), runner.kv_sharding
            )
        s = seq_bucket(size, runner.max_num_seqs)
        if s not in warm_seqs:
            warm_seqs.add(s)
            # Zero logits committed to the forward's output sharding, as real logits are (the
            # sampler's jit cache keys on it).
            logits = jax.device_put(
                np.zeros(logits_info.shape, logits_info.dtype), logits_info.sharding
            )
            for params in runner.warmup_sampling:
                md = SamplingMetadata.from_params([SamplingRow(params, 0, 0, (), ())], pad_to=s)
                jax.block_until_ready(sample_step(graph, logits, md))
        runner.warm_buckets.add(size)
    bar.close()
    if runner.num_spec_tokens:
        warmup_speculative(runner)
    seconds = time.perf_counter() - t0
    runner.compile_seconds += seconds
    logger.info(
        "warm-up: compiled %d token buckets and %d sequence buckets in %.1f s",
        len(runner.token_buckets),
        len(runner.seq_buckets),
        seconds,
    )
    return seconds


SPEC_WARMUP_ROWS = 16
"""Speculative decoding's row buckets compiled at warm-up go up to this many requests with
drafts (or ``disable_by_batch_size``, if smaller); larger ones compile on first use (logged)."""


def spec_row_buckets(runner: RunnerFields, token_bucket: int | None = None) -> list[int]:
    """Speculative decoding's row buckets R (powers of two) that warm-up compiles: up to
    ``SPEC_WARMUP_ROWS`` requests with drafts in one step, ``max_num_seqs``,
    ``disable_by_batch_size`` and, in a step of ``token_bucket`` tokens, half of them (each has
    its token and a draft or more)."""
    spec = runner.config.speculative
    most = min(runner.max_num_seqs, SPEC_WARMUP_ROWS)
    if spec is not None and spec.disable_by_batch_size is not None:
        most = min(most, spec.disable_by_batch_size)
    if token_bucket is not None:
        most = min(most, max(token_bucket // 2, 1))
    out, r = [], 1
    while r < most:
        out.append(r)
        r *= 2
    return out + [r]


ONE_HEAD_ROWS = 1
"""Verification steps of up to this many drafted requests (all-drafts steps: R x (1 + K)
tokens) read the LM head once (``one_head_buckets``). Each bucket this covers compiles one more
forward at warm-up (~7 s each for SmolLM2 on the 2-core CPU: 3 buckets at K = 4; one bucket,
16 tokens, with the GPU's ladder), so it covers the case where the head weighs most, a lone
request's verification."""


def one_head_buckets(runner: RunnerFields) -> list[int]:
    """The token buckets whose verification steps read the LM head once
    (``forward_hidden_step`` + ``verify_logits_step``): from 2 tokens (the least a verified
    sequence carries) to the first bucket that holds an all-drafts step of ``ONE_HEAD_ROWS``
    requests. Small steps are where the head weighs most (a batch-1 verification on CPU: the
    forward's head over its sequence bucket, then the drafts' over 1 + K rows); larger buckets
    keep ``forward_step`` and read the head again for the drafts (``spec_logits_step``), since
    each bucket here costs one more forward executable at warm-up."""
    rows = min(spec_row_buckets(runner)[-1], ONE_HEAD_ROWS)
    most = rows * (runner.num_spec_tokens + 1)
    out = []
    for t in runner.token_buckets:
        if t >= 2:
            out.append(t)
        if t >= most:
            break
    return out


def warmup_speculative(runner: RunnerFields) -> None:
    """Compiles the one-head forward of ``one_head_buckets`` ahead of time, and runs, on
    all-padding inputs, the speculative step functions of the warm row buckets
    (``spec_row_buckets``): the gather of the verified positions' hidden states (per token
    bucket), their logits (the one-head pass's too) and sampler variants, and with a draft
    model its device-side acceptance and its proposals. Each input is the output of the step
    function that feeds it at serving time (jit caches key on how an argument is placed)."""
    graph, state, k = runner.graph, runner.params, runner.num_spec_tokens
    width = k + 1
    gathered: dict[int, jax.Array] = {}
    last = None
    # (steps with adapter tokens run the LoRA forward, whose head stays in it)
    one_head = runner.one_head_buckets
    for size in runner.token_buckets:
        logits_info, hidden_info, _ = runner.aot_forward[size].out_info
        hidden = jax.device_put(
            np.zeros(hidden_info.shape, hidden_info.dtype), hidden_info.sharding
        )
        if size in one_head:
            pad = padding_inputs(runner, size)
            fwd = forward_hidden_step.lower(graph, state, runner.kv_caches, pad).compile()
            runner.aot_forward_hidden[size] = fwd
            hidden_h = jax.device_put(
                np.zeros(hidden_info.shape, hidden_info.dtype), fwd.out_info[0].sharding
            )
            for r in spec_row_buckets(runner, size):
                jax.block_until_ready(
                    verify_logits_step(
                        graph, state, hidden_h, pad.logits_indices, np.zeros(r * width, np.int32)
                    )
                )
        for r in spec_row_buckets(runner, size):
            gathered[r] = gather_rows(hidden, np.zeros(r * width, np.int32))
        if last is None:
            logits = jax.device_put(
                np.zeros(logits_info.shape, logits_info.dtype), logits_info.sharding
            )
            md = SamplingMetadata.from_params(
                [SamplingRow(runner.warmup_sampling[0], 0, 0, (), ())], pad_to=logits_info.shape[0]
            )
            _, last = sample_step(graph, logits, md)  # the padded tokens a draft continues
    samples = {}
    for r in spec_row_buckets(runner):
        logits = spec_logits_step(graph, state, gathered[r])
        for params in runner.warmup_sampling:
            md = SamplingMetadata.from_params([SamplingRow(params, 0, 0, (), ())], pad_to=r)
            samples[r] = spec_sample_step(graph, logits, md.expand(np.arange(r), width))
        jax.block_until_ready(samples[r])
    draft = runner.draft
    if draft is None:
        return
    p = runner.input_batch.max_blocks_per_req
    tables = np.zeros((len(runner.kv_layout.groups), graph.max_seqs, p), np.int32)  # [G, S, P]
    ctx = np.zeros(graph.max_seqs, np.int32)
    for r in spec_row_buckets(runner):
        rows = np.zeros(r, np.int32)
        accepted = accept_on_device(last, samples[r].token_ids, rows, np.zeros((r, k), np.int32))
        jax.block_until_ready(accepted)
        if draft.num_rows(r) == r:
            for tokens, num_accepted in ((last, None), accepted):  # without and with drafts
                jax.block_until_ready(
                    draft.propose(tables, ctx, tokens, num_accepted, rows[:0], rows[:0], num_rows=r)
                )
