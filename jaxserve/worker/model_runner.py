"""The model runner: persistent batch -> padded step -> jitted forward + sampler -> runner output.

One step (``execute_model``):

1. ``BatchBuilder.update_states`` applies the SchedulerOutput to the persistent ``InputBatch``
   (new rows, appended block ids and token ids, dropped finished/preempted rows).
2. ``BatchBuilder.build`` gathers the step's tokens with numpy and pads them to a token bucket T
   (sequence bucket S), and the sampling rows become a ``SamplingMetadata`` (numpy).
3. The jitted forward ``(state, kv_caches, inputs) -> (logits [S, V] f32, hidden [T, E],
   kv_caches)`` runs the paged model (new K/V written through the slot mapping) with the KV
   caches donated, so the pool is updated in place; the jitted sampler then draws the tokens on
   device. Both are dispatched back to back, no host sync in between.
4. One ``jax.device_get`` brings back the sampled token ids (and logprobs / prompt logprobs when
   a request asked for them), which become the ``ModelRunnerOutput``.

Why two jitted functions rather than one: the sampler has static variants (greedy, top-k/top-p,
penalties, logprobs widths; see ``SamplingMetadata``). Inside one jit each variant would recompile
the whole model for every token bucket; split, the model compiles once per token bucket and a
sampler variant costs one small compile per sequence bucket. The price is the ``[S, V]`` float32
logits round trip through device memory between the two (S x V x 4 bytes).

Compilation (the jitted step functions, the persistent compilation cache, activation profiling
for KV sizing, warm-up) lives in ``jaxserve.worker.compilation``. After warm-up a step in an
unknown bucket is a bug (assertion); rarer sampler variants (penalties, logit bias, logprobs
widths) compile on first use and are logged.

Async scheduling (the engine's default) splits a step into ``dispatch`` (steps 1-3, returning at
once) and ``collect`` (step 4). The engine dispatches step N+1 before it collects step N, so the
host's scheduling, batch building and output processing overlap the device's work. A request's
token sampled by step N is then unknown to the host when step N+1 is built: its input comes from
step N's sampled tokens on the device (``StepInputs.prev_index`` / ``prev_tokens``), and
``collect`` writes it into the persistent batch once it lands.

Pooling runner (``--runner pooling``, embeddings): every request is prompt-only
(``max_tokens=0``); the step runs the same forward, then ``pool_step`` instead of the sampler:
each sequence's chunk of final-norm hidden states becomes its share of the pooled vector (LAST,
CLS, or a MEAN sum added up here across prefill chunks). The step that completes a prompt puts
its float32 vector in ``ModelRunnerOutput.pooler_output`` and a placeholder token (0) in
``sampled_token_ids``, which ends the prompt-only request in the scheduler.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.core.kv_cache_groups import make_kv_cache_layout
from jaxserve.core.kv_cache_utils import load_beats_recompute
from jaxserve.core.runner_output import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    ModelRunnerOutput,
    OneTokenEach,
    TokenLogprobs,
)
from jaxserve.lora.manager import LoRAManager
from jaxserve.model.attention import cache_head_dim, token_bucket_multiple
from jaxserve.model.attention_backends import resolve_attention_backend
from jaxserve.model.layers.moe import attach_expert_load_recorder
from jaxserve.model.quant_config import kv_cache_dtype_name
from jaxserve.model.sharding import kv_cache_sharding, make_mesh, place_model
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker import compilation, sleep_mode
from jaxserve.worker.batch_builder import (
    BatchBuilder,
    InputBatch,
    StepBatch,
    backend_token_buckets,
    seq_bucket,
)
from jaxserve.worker.compilation import (
    WARMUP_SAMPLING,
    StepGraph,
    forward_hidden_step,
    forward_step,
    gather_rows,
    pool_step,
    prompt_logprobs_step,
    sample_step,
    spec_logits_step,
    spec_sample_step,
    verify_logits_step,
)
from jaxserve.worker.draft_model import DraftModel
from jaxserve.worker.kv_offload import HostKVCache, num_host_blocks, staging_memory_kind
from jaxserve.worker.lora_slots import LoRASlots, enable_model_lora
from jaxserve.worker.ngram_proposer import NgramProposer
from jaxserve.worker.sampling_metadata import SamplingMetadata, SamplingRow
from jaxserve.worker.spec_decode import VerifyPlan, accept, accept_on_device, plan_verification

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig, SpeculativeConfig
    from jaxserve.core.sched_output import SchedulerOutput
    from jaxserve.model.arch_config import ModelArchConfig
    from jaxserve.structured import StepTokenMask
    from jaxserve.worker.kv_cache_alloc import KVCacheSpec

logger = logging.getLogger(__name__)


def _uses_penalties(params: SamplingParams) -> bool:
    return (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    )


@dataclasses.dataclass
class PendingStep:
    """A dispatched step whose results are still on (or coming from) the device.

    Attributes:
      batch: the step's StepBatch.
      sampled: the sampler's output (device arrays, copying to the host).
      plp: prompt-logprob tensors or None.
      params: ``[num_reqs]`` each sequence's SamplingParams, captured at dispatch (rows may
        change hands before ``collect``).
      row_epochs: ``[num_reqs]`` int64, ``InputBatch.row_epoch`` of the rows at dispatch.
      index: req_id -> sequence index, when every sequence samples (else None); shared with
        the next steps while the batch stays the same (read-only).
      row_changes: ``InputBatch.row_changes`` at dispatch.
      verify: speculative decoding: the step's VerifyPlan (None: no drafts in it).
      spec_sampled: the verified positions' sampler output (device arrays), or None.
      speculate: ``SchedulerOutput.speculate``: propose drafts after the step.
      draft_seqs: the draft model's proposing sequences (indices into the step's), or None.
      draft_ids: their drafts, int32 ``[R, K]`` on the device, or None.
      pool_keys: pooling runner: ``[num_reqs]`` (req_id, its pooling epoch) at dispatch, and
        ``prompt_lens`` their prompt lengths; None otherwise.
    """

    batch: StepBatch
    sampled: object
    plp: object
    params: list[SamplingParams]
    row_epochs: np.ndarray
    index: dict[str, int] | None = None
    row_changes: int = -1
    verify: VerifyPlan | None = None
    spec_sampled: object = None
    speculate: bool = False
    draft_seqs: list[int] | None = None
    draft_ids: object = None
    pool_keys: list[tuple[str, int]] | None = None
    prompt_lens: np.ndarray | None = None


@dataclasses.dataclass
class StepTiming:
    """Cumulative seconds of the runner's steps (for benchmarks and metrics).

    Attributes:
      num_steps: steps that ran the model.
      host_s: host time of ``dispatch`` (row updates, batch build, sampling metadata, launch).
      launch_s: the part of ``host_s`` spent launching the jitted calls (argument transfer and
        dispatch; on an accelerator the device then runs them while the host goes on).
      aside_cpu_s: thread CPU seconds of launches and result waits (on a CPU "device" a launch
        may run part of the step inline); the engine subtracts them from its host CPU time.
      device_s: time ``collect`` waits for the results (device work + transfer not hidden
        behind host work).
      output_s: turning the results into the ModelRunnerOutput.
      idle_s: seconds the device sat without a step, from the end of a ``collect`` that left
        nothing in flight to the next launch (host work on the critical path: what async
        scheduling hides when it can dispatch step N+1 before collecting step N).
      num_idle_gaps: launches that ended such a gap.
    """

    num_steps: int = 0
    host_s: float = 0.0
    launch_s: float = 0.0
    aside_cpu_s: float = 0.0
    device_s: float = 0.0
    output_s: float = 0.0
    idle_s: float = 0.0
    num_idle_gaps: int = 0


class ModelRunner:
    """Runs the paged model for the scheduler's steps, on one device or on a tensor-parallel
    mesh (``config.parallel.tensor_parallel_size``; one program over all its devices).

    Args:
      model: the Flax NNX model (``jaxserve.model.load_model``); split once into a static
        graphdef and a state pytree that is passed to every step.
      arch: its ModelArchConfig (attention shape for the KV pool).
      config: the resolved EngineConfig (scheduler budget and max_num_seqs, block size, memory
        knobs, runner knobs).
      warmup_sampling: SamplingParams whose sampler variants ``warmup`` compiles for every
        sequence bucket (default: greedy, plain sampling, top-k, top-p).

    Raises:
      ValueError: a bad attention backend or token bucket list (named), or a model whose heads
        cannot be split over the mesh (naming both numbers).
    """

    def __init__(
        self,
        model: nnx.Module,
        arch: ModelArchConfig,
        config: EngineConfig,
        *,
        warmup_sampling: tuple[SamplingParams, ...] = WARMUP_SAMPLING,
    ) -> None:
        self.config = config
        self.dtype = jnp.dtype(getattr(model, "dtype", jnp.float32))
        # the KV cache's element dtype: the model's, or FP8 (--kv-cache-dtype)
        self.kv_dtype = jnp.dtype(kv_cache_dtype_name(config.cache.cache_dtype, self.dtype.name))
        self.device = jax.local_devices()[0]
        # Tensor parallel: the mesh, the weights placed on it, heads replicated if needed
        # (model/sharding.py). ``step_mesh`` is None on one device: no shard_map, no gather.
        self.mesh = make_mesh(config.parallel.tensor_parallel_size)
        # Multi-LoRA (#33): adapter pools in the projections before placement, so they shard
        # like their base layers (worker/lora_slots.py)
        lora = config.lora
        lora_targets = (
            None if lora is None else enable_model_lora(model, lora.max_loras, lora.max_lora_rank)
        )
        model, self.arch = place_model(
            model, arch, self.mesh, config.parallel.enable_expert_parallel
        )
        # MoE models, opt-in: tokens per expert counted on the host (model/expert_load.py).
        self.expert_load = (
            attach_expert_load_recorder(model) if config.observability.expert_load_metrics else None
        )
        self.step_mesh = self.mesh if self.mesh.size > 1 else None
        self.kv_sharding = kv_cache_sharding(self.mesh)
        self.backend = resolve_attention_backend(
            config.runner.attention_backend,
            self.device.platform,
            interpret=config.runner.pallas_interpret,
        )
        self.interpret = config.runner.pallas_interpret
        self.kv_head_dim = cache_head_dim(self.backend, arch.head_dim)
        compilation.configure_compilation_cache(config.runner.compilation_cache_dir)
        self.graphdef, self.state = nnx.split(model)
        # the step functions take the state's leaves (see StepGraph.state_def)
        self.params, state_def = jax.tree.flatten(self.state)
        self.lora_slots: LoRASlots | None = None
        self.lora: LoRAManager | None = None  # the adapters' registry, host tier, slots
        self._lora_of: dict[str, str] = {}  # request id -> its adapter (requests with one)
        self.aot_forward_lora: dict[int, Any] = {}
        if lora is not None:
            self.lora_slots = LoRASlots(
                model, lora_targets, self.state, lambda: self.params, lora.max_loras, lora.backend
            )
            self.lora = LoRAManager(
                lora.max_loras,
                lora.max_cpu_loras,
                lora.max_lora_rank,
                lora_targets,
                self.lora_slots.write_slot,
            )
            for name, path, _parent in lora.lora_modules:
                self.lora.register(name, path)
        sched = config.scheduler
        self.block_size = config.cache.block_size
        self.max_num_seqs = sched.max_num_seqs
        self.max_model_len = sched.max_model_len
        # KV-cache groups (jaxserve/core/kv_cache_groups.py): the scheduler gets their windows
        # (CacheConfig.kv_cache_groups), the step each layer's group and pool array pair.
        self.kv_layout = make_kv_cache_layout(
            arch.layer_sliding_windows,
            hybrid=not config.cache.disable_hybrid_kv_cache_manager,
            max_model_len=sched.max_model_len,
        )
        self.token_buckets = backend_token_buckets(
            self.backend, config.runner.token_buckets, sched.max_num_batched_tokens
        )
        self.seq_buckets = tuple(
            sorted({seq_bucket(t, self.max_num_seqs) for t in self.token_buckets})
        )
        # max_seqs: the largest sequence bucket, the fixed shape of StepInputs.prev_tokens
        self.graph = StepGraph(
            self.graphdef,
            self.backend,
            self.seq_buckets[-1],
            self.interpret,
            self.step_mesh,
            state_def=state_def,
            kv_layout=self.kv_layout.layer_kv if len(self.kv_layout.groups) > 1 else None,
        )
        self.input_batch = InputBatch(
            sched.max_num_seqs, sched.max_model_len, self.block_size, len(self.kv_layout.groups)
        )
        self.builder = BatchBuilder(self.input_batch, self.token_buckets, self.max_num_seqs)
        self.warmup_sampling = warmup_sampling
        self.kv_spec: KVCacheSpec | None = None
        self.kv_caches: list | None = None
        self.host_kv: HostKVCache | None = None  # KV offloading's host tier (None: off)
        self.sleep_state: sleep_mode.SleepState | None = None  # set while asleep
        self.timing = StepTiming()
        self.compile_seconds = 0.0
        self.warm_buckets: set[int] = set()  # token buckets compiled by warmup()
        # token bucket -> executable compiled ahead of time by warmup(); steps call these
        self.aot_forward: dict[int, Any] = {}
        # token bucket -> the forward without the LM head, for verification steps that read
        # the head once (compilation.one_head_buckets; speculative decoding only)
        self.aot_forward_hidden: dict[int, Any] = {}
        self.aot_prompt_logprobs: dict[int, Any] = {}
        self._seeds: dict[str, int] = {}
        # ((req_ids, S), SamplingMetadata, StepBatch) of the latest step, when its rows allow the
        # metadata's reuse (see _sampling_metadata)
        self._md_cache: tuple | None = None
        self._one_each: dict[tuple[int, int], np.ndarray] = {}  # (n, S) -> 1 on [:n], 0 after
        self._rng = np.random.default_rng(config.model.seed)
        # The last dispatched step's sampled tokens ([S_max] int32, on the device) and each
        # sampling request's index in them: the inputs of tokens still in flight.
        self._prev_tokens: jax.Array | None = None
        self._prev_index: dict[str, int] = {}
        # The last dispatched StepBatch and its rows' SamplingParams: a steady-decode step is
        # built from them (BatchBuilder.build_steady).
        self._last_batch: StepBatch | None = None
        self._last_params: list[SamplingParams] = []
        self.num_spec_tokens = 0
        self.ngram: NgramProposer | None = None
        self.set_speculative_config(config.speculative)
        self.draft: DraftModel | None = None  # attach_draft_model
        # Sampling steps dispatched and not collected, and when the latest collect left none
        # (StepTiming.idle_s).
        self._num_in_flight = 0
        self._idle_since: float | None = None
        self.aot_draft_prefill: dict[int, Any] = {}
        # The draft's cache per row: positions whose draft K/V is valid (see _draft_prefill),
        # and whether any step ran without the draft (cached blocks may lack its K/V since).
        self._draft_len = np.zeros(sched.max_num_seqs, np.int64)
        self._draft_skipped = False
        # Pooling runner: "LAST" / "MEAN" / "CLS" (None: the generate runner); the partial
        # pooled vectors of prompts still being prefilled (MEAN: the sum so far; CLS: the first
        # token's), and an epoch per request, bumped when it is preempted, so that a chunk
        # still in flight then is not added to its recomputation.
        model_config = config.model
        self.pooling_type = model_config.pooling_type if model_config.runner == "pooling" else None
        self._pool_partial: dict[str, np.ndarray] = {}
        self._pool_epoch: dict[str, int] = {}
        logger.info(
            "model runner: attention backend %s%s, KV head dim %d, KV dtype %s, token buckets "
            "%s, sequence buckets %s, KV-cache groups %s (%d array pairs)",
            self.backend,
            " (Pallas interpret mode)" if self.interpret else "",
            self.kv_head_dim,
            self.kv_dtype.name,
            self.token_buckets,
            self.seq_buckets,
            [(g.sliding_window or "full", len(g.layers)) for g in self.kv_layout.groups],
            self.kv_layout.num_tensors,
        )

    # ------------------------------------------------------------------ start-up

    def profile_peak_activation_bytes(self) -> int:
        """Peak activation memory of the largest bucket's step, bytes
        (:func:`jaxserve.worker.compilation.profile_peak_activation_bytes`)."""
        return compilation.profile_peak_activation_bytes(self)

    def initialize_kv_cache(self) -> KVCacheSpec:
        """Sizes, allocates and logs the KV pool (:func:`jaxserve.worker.compilation.initialize_kv_cache`).

        Raises:
          ValueError: the memory left holds fewer than 2 blocks.
        """
        return compilation.initialize_kv_cache(self)

    def initialize_host_kv_cache(self, size_gib: float) -> int:
        """Allocates the host tier of KV offloading, ``size_gib`` GiB of host memory (after
        ``initialize_kv_cache``); returns its blocks (0: off, nothing allocated).

        Raises:
          ValueError: size_gib > 0 holds not even one block (names the block size in bytes), or
            several processes form the mesh.
        """
        if size_gib <= 0:
            return 0
        if jax.process_count() > 1:
            raise ValueError(
                "kv_offloading_size: KV offloading runs in one process only (the host copies "
                "gather every shard to this host); not with --num-processes > 1"
            )
        spec = self.kv_spec
        block_bytes = spec.block_size * spec.bytes_per_token
        n = num_host_blocks(size_gib, block_bytes)
        if n < 1:
            raise ValueError(
                f"kv_offloading_size: {size_gib} GiB holds no KV block ({block_bytes} bytes each)"
            )
        self.host_kv = HostKVCache(n, self.kv_caches, staging_memory_kind(self.device))
        if self.config.runner.warmup:  # larger (rarer) copy counts compile on first use
            self.kv_caches = self.host_kv.warmup(self.kv_caches, min(spec.num_blocks, 256))
        logger.info(
            "KV offloading: %d host blocks (%.3f GiB, %d tokens) behind %d device blocks; "
            "copies staged through %s",
            n,
            n * block_bytes / 2**30,
            n * spec.block_size,
            spec.num_blocks,
            self.host_kv.memory_kind or "numpy (no pinned host memory kind on this device)",
        )
        return n

    def measure_offload_costs(self) -> tuple[float, float, float]:
        """KV offloading's resume cost model, timed on this machine after ``warmup`` (about
        ten small calls: well under a second on CPU at the bundled model's shapes).

        Recompute: one prefill of a single T-token sequence from position 0 (T: the largest
        warm token bucket <= 512 that fits max_model_len) through the warm forward, writing
        nothing (every slot -1; its attention reads the null block), median of 3 after one
        untimed run, divided by T; a lower bound for a resume's chunks, which start deeper
        in the context. Load: :meth:`HostKVCache.probe_load` with up to 16 blocks.

        Returns:
          (load seconds per call, load seconds per block, recompute seconds per token); all 0
          when offloading is off or warm-up did not run (nothing to time without compiling).
        """
        host_kv = self.host_kv
        warm = sorted(self.aot_forward)
        if host_kv is None or not warm:
            return 0.0, 0.0, 0.0
        fits = [t for t in warm if t <= min(512, self.max_model_len)]
        size = fits[-1] if fits else warm[0]
        inputs = compilation.padding_inputs(self, size)
        n = min(size, self.max_model_len, self.input_batch.max_blocks_per_req * self.block_size)
        inputs.positions[:n] = np.arange(n, dtype=np.int32)
        inputs.query_start_loc[1:] = n
        inputs.context_lens[0] = n
        inputs.logits_indices[0] = n - 1
        fwd = self.aot_forward[size]
        runs = []
        for _ in range(4):
            t0 = time.perf_counter()
            logits, _, self.kv_caches = fwd(self.params, self.kv_caches, inputs)
            jax.block_until_ready((logits, self.kv_caches))
            runs.append(time.perf_counter() - t0)
        per_token = sorted(runs[1:])[1] / n
        num_blocks = min(16, 1 << (self.kv_spec.num_blocks.bit_length() - 1))  # compiled
        self.kv_caches, per_call, per_block = host_kv.probe_load(self.kv_caches, num_blocks)
        costs = (self.block_size, per_call, per_block, per_token)
        min_load = next((k for k in range(1, 4097) if load_beats_recompute(k, *costs)), None)
        logger.info(
            "KV offloading cost probe: load %.1f us per call + %.1f us per block (%.2f GB/s), "
            "recompute %.2f us per token (T=%d): a resume loads %s",
            per_call * 1e6,
            per_block * 1e6,
            host_kv.block_bytes / per_block / 1e9 if per_block else float("inf"),
            per_token * 1e6,
            n,
            "never" if min_load is None else f"{min_load}+ host blocks (recomputes fewer)",
        )
        return per_call, per_block, per_token

    def warmup(self, *, progress: bool = True) -> float:
        """Compiles every bucket before serving; returns the seconds spent
        (:func:`jaxserve.worker.compilation.warmup`). Requires ``initialize_kv_cache`` first."""
        return compilation.warmup(self, progress=progress)

    def attach_draft_model(
        self, model: nnx.Module, arch: ModelArchConfig, d2t: np.ndarray | None = None
    ) -> None:
        """Speculative decoding with a draft model (``--speculative-config`` method
        ``draft_model``): places it beside the target, before ``initialize_kv_cache`` (which
        sizes the blocks for both pools and allocates the draft's).

        ``d2t``: a reduced LM head's id offsets (``draft_model.read_d2t``), or None.

        Raises:
          ValueError: its vocabulary is not the target's, its heads cannot be split over
            the mesh, or its reduced head and ``d2t`` disagree (``speculative_config.model``
            named); the target has no full-attention KV-cache group (``draft_kv_group``).
        """
        assert self.kv_caches is None, "attach_draft_model() before initialize_kv_cache()"
        kv_group = self.draft_kv_group()
        if arch.vocab_size != self.arch.vocab_size:
            raise ValueError(
                f"speculative_config.model: the draft model's vocabulary ({arch.vocab_size} "
                f"tokens) is not the target's ({self.arch.vocab_size}); it must share the "
                "tokenizer"
            )
        try:
            self.draft = DraftModel(
                model,
                arch,
                mesh=self.mesh,
                step_mesh=self.step_mesh,
                backend=self.backend,
                interpret=self.interpret,
                num_speculative_tokens=self.num_spec_tokens,
                token_multiple=token_bucket_multiple(self.backend),
                kv_group=kv_group,
                d2t=d2t,
            )
        except ValueError as e:
            raise ValueError(f"speculative_config.model: {e}") from None
        logger.info(
            "draft model: %d layers, hidden %d, %d KV heads of %d, LM head over %d tokens; K = %d",
            arch.num_layers,
            arch.hidden_size,
            self.draft.arch.num_kv_heads,
            arch.head_dim,
            arch.draft_vocab_size or arch.vocab_size,
            self.num_spec_tokens,
        )

    def draft_kv_group(self) -> int:
        """The target's KV-cache group whose block tables hold a draft model's cache: the first
        full-attention group (module docstring of ``worker/draft_model.py``).

        Raises:
          ValueError: every layer of the target slides (the hybrid KV cache keeps no group whose
            tables hold a whole sequence); one line naming ``--speculative-config``.
        """
        windows = self.kv_layout.sliding_windows
        for g, window in enumerate(windows):
            if window is None:
                return g
        raise ValueError(
            "--speculative-config: a draft model needs a full-attention KV-cache group for its "
            f"cache, and every layer of this model slides (group windows {list(windows)}); use "
            '"method": "ngram", or --disable-hybrid-kv-cache-manager'
        )

    def set_speculative_config(self, spec: SpeculativeConfig | None) -> None:
        """Speculative decoding's K (0 = off) and, for the n-gram method, its proposer (the
        engine tests share one runner between engines with and without it)."""
        self.num_spec_tokens = 0 if spec is None else spec.num_speculative_tokens
        # the token buckets whose verification steps read the LM head once
        self.one_head_buckets = (
            frozenset(compilation.one_head_buckets(self)) if self.num_spec_tokens else frozenset()
        )
        self.ngram = (
            NgramProposer(
                spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
            )
            if spec is not None and spec.method == "ngram"
            else None
        )

    def reset_requests(self) -> None:
        """Forgets every request's row (e.g. before serving a new scheduler after the previous
        one was dropped); the KV pool's contents are left as they are."""
        for req_id in list(self.input_batch.req_id_to_row):
            self.input_batch.remove_request(req_id)
        self._seeds.clear()
        self._md_cache = None
        self._prev_index = {}
        self._last_batch = None
        self._pool_partial.clear()
        self._pool_epoch.clear()
        self._num_in_flight, self._idle_since = 0, None  # a dropped engine's step is forgotten

    def sleep(self, level: int) -> None:
        """Frees the device memory of the weights (level 1: kept in host memory; level 2:
        dropped) and of the KV pool (:func:`jaxserve.worker.sleep_mode.sleep`). The runner
        must hold no request.

        Raises:
          ValueError: level not 1 or 2, or already asleep.
        """
        sleep_mode.sleep(self, level)

    def wake_up(self, tags: list[str] | None = None, load: sleep_mode.Loader | None = None) -> bool:
        """Puts back the weights and / or the KV pool (``tags``: "weights", "kv_cache"; None:
        both) without recompiling; True once both are (:func:`jaxserve.worker.sleep_mode.wake_up`).

        Raises:
          ValueError: an unknown tag, or level-2 weights that cannot be reloaded as compiled.
        """
        lora = self.config.lora
        if lora is not None and load is not None:  # a level-2 reload gets the pools again
            inner = load

            def load():
                model, arch = inner()
                enable_model_lora(model, lora.max_loras, lora.max_lora_rank)
                return model, arch

        awake = sleep_mode.wake_up(self, tags, load)
        if self.lora is not None:
            self.lora.forget_slots()  # reloaded pools are zeros: adapters are written again
        return awake

    @property
    def is_sleeping(self) -> bool:
        """True from ``sleep`` until every tag woke up."""
        return self.sleep_state is not None

    def compile_counts(self) -> dict[str, int]:
        """Executables this runner has traced per step function (a test checks serving adds
        none); profiling's probe compiles are not counted."""
        traces = self.graph.traces
        names = ("forward", "sampler", "prompt_logprobs", "pool")
        if self.num_spec_tokens:
            names += ("spec_logits", "spec_sampler")
        counts = {name: traces[name] for name in names}
        if self.draft is not None:
            draft = self.draft.graph.traces
            counts.update(
                draft_prefill=draft["draft_prefill"], draft_propose=draft["draft_propose"]
            )
        return counts

    # ------------------------------------------------------------------ one step

    def execute_model(
        self, sched: SchedulerOutput, token_mask: StepTokenMask | None = None
    ) -> ModelRunnerOutput:
        """Runs one scheduled step and returns the sampled tokens (see the module docstring):
        ``collect(dispatch(sched, token_mask))``.

        ``token_mask``: the step's token masks of constrained requests (structured outputs,
        allowed_token_ids, bad_words), from ``TokenMaskManager.step_mask``; the sampler only
        samples allowed tokens on those rows.

        Raises:
          AssertionError: the step needs a token bucket that was not warmed up (only when
            warm-up ran), or the scheduler output disagrees with the persistent batch.
        """
        return self.collect(self.dispatch(sched, token_mask))

    def dispatch(
        self, sched: SchedulerOutput, token_mask: StepTokenMask | None = None
    ) -> PendingStep | None:
        """Applies ``sched`` to the persistent batch and launches its jitted step without
        waiting for it; returns the handle ``collect`` takes (None for an empty step).

        Async scheduling calls this for step N+1 before ``collect`` of step N: a request's token
        sampled by step N then feeds step N+1 on the device (``StepInputs.prev_tokens``).

        Raises:
          AssertionError: as ``execute_model``.
        """
        t0 = time.perf_counter()
        self.builder.update_states(sched)
        if sched.scheduled_new_reqs or sched.finished_req_ids or sched.preempted_req_ids:
            # a row changed hands: its id may now name another request
            self._md_cache = None
        for req_id in sched.finished_req_ids:
            self._seeds.pop(req_id, None)
            self._lora_of.pop(req_id, None)
        if self.lora is not None:
            for new in sched.scheduled_new_reqs:
                if new.lora_name is not None:
                    self._lora_of[new.req_id] = new.lora_name
        if self.pooling_type is not None:
            self._forget_pooling(sched)
        host_kv = self.host_kv if sched.kv_transfers is not None else None
        if host_kv is not None:  # saves, then loads, before the forward reads or writes a block
            self.kv_caches = host_kv.start(self.kv_caches, sched.kv_transfers)
        if sched.is_empty:
            if host_kv is not None:
                host_kv.finish()
            return None
        batch = None
        prev_batch = self._last_batch
        if sched.steady_decode:  # the previous step's batch, one position on
            batch = self.builder.build_steady(sched, prev_batch, self._prev_tokens)
        steady = batch is not None
        if not steady:
            batch = self.builder.build(sched, self._prev_index, self._prev_tokens)
        self._last_batch = batch
        if self.warm_buckets:
            assert batch.token_bucket in self.warm_buckets, (
                f"bucket {batch.token_bucket} was not compiled"
            )
        if self.pooling_type is not None:
            return self._dispatch_pooling(batch, t0)
        md = self._sampling_metadata(batch, token_mask, follows=prev_batch if steady else None)

        graph = self.graph
        lora = self._lora_batch(batch) if self.lora is not None else None
        t1, c1 = time.perf_counter(), time.thread_time()
        if not self._num_in_flight and self._idle_since is not None:
            self.timing.idle_s += t1 - self._idle_since
            self.timing.num_idle_gaps += 1
        self._num_in_flight += 1
        verify = plan_verification(batch, self.num_spec_tokens)
        one_head = (
            verify is not None and lora is None and batch.token_bucket in self.one_head_buckets
        )
        spec_logits = None
        if lora is not None:  # adapter tokens in the step (#33)
            aot = self.aot_forward_lora.get(batch.token_bucket)
            args = (self.params, self.kv_caches, batch.inputs, lora)
            logits, hidden, self.kv_caches = (
                aot(*args) if aot is not None else forward_step(graph, *args)
            )
        elif one_head:  # a small verification step: the LM head read once
            aot = self.aot_forward_hidden.get(batch.token_bucket)
            args = (self.params, self.kv_caches, batch.inputs)
            hidden, self.kv_caches = (
                aot(*args) if aot is not None else forward_hidden_step(graph, *args)
            )
            logits, spec_logits = verify_logits_step(
                graph, self.params, hidden, batch.inputs.logits_indices, verify.indices
            )
        elif (aot := self.aot_forward.get(batch.token_bucket)) is not None:
            logits, hidden, self.kv_caches = aot(self.params, self.kv_caches, batch.inputs)
        else:
            logits, hidden, self.kv_caches = forward_step(
                graph, self.params, self.kv_caches, batch.inputs
            )
        draft = self.draft
        if draft is not None:
            self._draft_prefill(sched, batch)
        num_variants = graph.traces["sampler"]
        sampled, self._prev_tokens = sample_step(graph, logits, md)
        if graph.traces["sampler"] != num_variants:
            logger.info(
                "compiled a sampler variant on first use: S=%d greedy=%s penalties=%s logit_bias=%s "
                "logprobs=%s filters=%s full_sort=%s token_mask=%s",
                batch.seq_bucket,
                md.all_greedy,
                md.any_penalties,
                md.any_logit_bias,
                md.max_logprobs,
                md.any_top_k_top_p_min_p,
                md.needs_full_sort,
                md.any_token_mask,
            )
        spec_sampled = None
        if verify is not None:  # the drafts' positions, sampled as the sampler above would
            if spec_logits is None:  # a larger bucket: the head again, at the drafts
                spec_hidden = gather_rows(hidden, verify.indices)
                spec_logits = spec_logits_step(graph, self.params, spec_hidden)
            spec_sampled = spec_sample_step(
                graph, spec_logits, md.expand(verify.rows, verify.width)
            )
        plp = None
        if batch.prompt_logprob_targets is not None:
            # (the AOT executable was compiled for forward_step's hidden states; the one-head
            # forward's may be placed otherwise on a mesh: its jit then compiles on first use)
            aot = None if one_head else self.aot_prompt_logprobs.get(batch.token_bucket)
            targets = batch.prompt_logprob_targets
            plp = (
                aot(self.params, hidden, targets)
                if aot is not None
                else prompt_logprobs_step(graph, self.params, hidden, targets)
            )
        draft_seqs = draft_ids = None
        if draft is not None and sched.speculate:
            draft_seqs, draft_ids = self._propose_draft(batch, verify, spec_sampled)
        for x in jax.tree.leaves((sampled, plp, spec_sampled, draft_ids)):
            x.copy_to_host_async()
        self.timing.launch_s += time.perf_counter() - t1
        self.timing.aside_cpu_s += time.thread_time() - c1
        ib = self.input_batch
        index = None
        if steady:  # the same requests in the same rows and order as the previous step
            params, index = self._last_params, self._prev_index
        else:
            mask = batch.sample_mask
            req_ids = batch.req_ids
            if mask.all():  # every sequence samples (decode): no filtering
                self._prev_index = index = dict(zip(req_ids, range(len(req_ids))))
            else:
                seqs = np.nonzero(mask)[0].tolist()
                self._prev_index = dict(zip([req_ids[i] for i in seqs], seqs))
            params = self._last_params = list(map(ib.params.__getitem__, batch.rows.tolist()))
        t2 = time.perf_counter()
        self.timing.host_s += t2 - t0
        return PendingStep(
            batch,
            sampled,
            plp,
            params,
            ib.row_epoch[batch.rows],
            index,
            ib.row_changes,
            verify,
            spec_sampled,
            sched.speculate,
            draft_seqs,
            draft_ids,
        )

    def _lora_batch(self, batch: StepBatch):
        """The step's ``LoraBatch`` (its adapters put into device slots first), or None when
        no request of the step has an adapter."""
        lora_of = self._lora_of
        if not lora_of:
            return None
        names = [lora_of.get(r) for r in batch.req_ids]
        used = {n for n in names if n is not None}
        if not used:
            return None
        slots = self.lora.activate(used)
        seq_slots = np.array([-1 if n is None else slots[n] for n in names], np.int32)
        return self.lora_slots.step_batch(seq_slots, batch.num_scheduled, batch.token_bucket)

    def _forget_pooling(self, sched: SchedulerOutput) -> None:
        """Drops the partial pooled vectors of finished and preempted requests (a preempted one
        is recomputed from its first token) and moves their epoch on."""
        for req_id in sched.finished_req_ids:
            self._pool_partial.pop(req_id, None)
            self._pool_epoch.pop(req_id, None)
        for req_id in sched.preempted_req_ids:
            self._pool_partial.pop(req_id, None)
            self._pool_epoch[req_id] = self._pool_epoch.get(req_id, 0) + 1

    def _dispatch_pooling(self, batch: StepBatch, t0: float) -> PendingStep:
        """The pooling runner's launch: the forward, then ``pool_step`` (no sampler)."""
        graph = self.graph
        t1, c1 = time.perf_counter(), time.thread_time()
        if not self._num_in_flight and self._idle_since is not None:
            self.timing.idle_s += t1 - self._idle_since
            self.timing.num_idle_gaps += 1
        self._num_in_flight += 1
        aot = self.aot_forward.get(batch.token_bucket)
        if aot is not None:
            _, hidden, self.kv_caches = aot(self.params, self.kv_caches, batch.inputs)
        else:
            _, hidden, self.kv_caches = forward_step(
                graph, self.params, self.kv_caches, batch.inputs
            )
        inputs = batch.inputs
        pooled = pool_step(
            graph, hidden, inputs.query_start_loc, inputs.logits_indices, self.pooling_type
        )
        pooled.copy_to_host_async()
        self.timing.launch_s += time.perf_counter() - t1
        self.timing.aside_cpu_s += time.thread_time() - c1
        self._prev_index = {}
        ib = self.input_batch
        epoch = self._pool_epoch
        keys = [(r, epoch.get(r, 0)) for r in batch.req_ids]
        self.timing.host_s += time.perf_counter() - t0
        return PendingStep(
            batch,
            pooled,
            None,
            [],
            ib.row_epoch[batch.rows],
            row_changes=ib.row_changes,
            pool_keys=keys,
            prompt_lens=ib.num_prompt_tokens[batch.rows].copy(),
        )

    def _collect_pooling(self, pending: PendingStep) -> ModelRunnerOutput:
        """The pooling runner's results: each completed prompt's pooled vector (float32
        ``[hidden_size]``, before normalisation) and a placeholder token that ends it."""
        batch = pending.batch
        t1, c1 = time.perf_counter(), time.thread_time()
        pooled = np.asarray(jax.device_get(pending.sampled))
        t2 = time.perf_counter()
        self.timing.aside_cpu_s += time.thread_time() - c1
        kind = self.pooling_type
        partial, epoch = self._pool_partial, self._pool_epoch
        live = self.input_batch.req_id_to_row
        ends = (batch.start_positions + batch.num_scheduled).tolist()
        starts = batch.start_positions.tolist()
        prompt_lens = pending.prompt_lens.tolist()
        out: dict[str, np.ndarray] = {}
        sampled: list[list[int]] = []
        for i, (req_id, key_epoch) in enumerate(pending.pool_keys):
            if key_epoch != epoch.get(req_id, 0) or req_id not in live:
                sampled.append([])  # preempted or gone since dispatch: the chunk is stale
                continue
            vec = pooled[i]
            if kind == "MEAN":
                before = partial.get(req_id)
                if before is not None:
                    vec = before + vec
            elif kind == "CLS" and starts[i] > 0:
                vec = partial.get(req_id, vec)
            if ends[i] >= prompt_lens[i]:
                partial.pop(req_id, None)
                out[req_id] = vec / prompt_lens[i] if kind == "MEAN" else vec
                sampled.append([0])
            else:
                partial[req_id] = vec
                sampled.append([])
        timing = self.timing
        timing.num_steps += 1
        timing.device_s += t2 - t1
        timing.output_s += time.perf_counter() - t2
        return ModelRunnerOutput(
            req_ids=batch.req_ids,
            req_id_to_index=dict(zip(batch.req_ids, range(batch.num_reqs))),
            sampled_token_ids=sampled,
            pooler_output=out,
        )

    def collect(self, pending: PendingStep | None) -> ModelRunnerOutput:
        """Waits for a dispatched step's results and returns its ModelRunnerOutput; records the
        sampled tokens in the persistent batch (rows still held by the same request)."""
        if pending is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        if pending.pool_keys is not None:
            return self._collect_pooling(pending)
        batch = pending.batch
        t1, c1 = time.perf_counter(), time.thread_time()
        sampled, plp, spec_sampled, draft_ids = jax.device_get(
            (pending.sampled, pending.plp, pending.spec_sampled, pending.draft_ids)
        )
        if self.host_kv is not None:
            # This step's saves ran before it; under async scheduling the pending ones may be
            # the next step's: not waited for here (the next start() finishes them).
            self.host_kv.finish(wait=False)
        t2 = time.perf_counter()
        self.timing.aside_cpu_s += time.thread_time() - c1
        output = self._make_output(pending, sampled, plp, spec_sampled)
        # The sampled tokens join their rows, unless the row changed hands or moved on.
        ib = self.input_batch
        rows, ends = batch.rows, batch.start_positions + batch.num_scheduled
        if batch.num_spec is not None:
            ends = ends - batch.num_spec  # drafts are not known tokens: they follow them
        if pending.row_changes == ib.row_changes and output.sampled_flat is not None:
            # no row changed hands since dispatch, every sequence sampled: two checks, not four
            keep = (ib.num_tokens[rows] == ends) & (ends < ib.max_model_len)
        else:
            keep = (
                batch.sample_mask
                & (ib.row_epoch[rows] == pending.row_epochs)
                & (ib.num_tokens[rows] == ends)
                & (ends < ib.max_model_len)
            )
        if keep.all():
            ib.token_ids[rows, ends] = sampled.token_ids[: batch.num_reqs]
            ib.num_tokens[rows] = ends + 1
        elif keep.any():
            ib.token_ids[rows[keep], ends[keep]] = sampled.token_ids[: batch.num_reqs][keep]
            ib.num_tokens[rows[keep]] = ends[keep] + 1
        if pending.verify is not None:  # a drafted row's tokens: its accepted drafts, then one
            for i in pending.verify.seqs.tolist():
                if keep[i]:
                    tokens = output.sampled_token_ids[i]
                    row, end = rows[i], ends[i]
                    assert end + len(tokens) <= ib.max_model_len, "a row overflows max_model_len"
                    ib.token_ids[row, end : end + len(tokens)] = tokens
                    ib.num_tokens[row] = end + len(tokens)
        if pending.speculate and self.ngram is not None:
            output.draft_token_ids = self._propose_ngram(pending, keep)
        elif pending.draft_seqs is not None:
            req_ids = batch.req_ids
            output.draft_token_ids = {
                req_ids[i]: draft_ids[r].tolist()
                for r, i in enumerate(pending.draft_seqs)
                if keep[i]
            }
        t3 = time.perf_counter()
        timing = self.timing
        timing.num_steps += 1
        timing.device_s += t2 - t1
        timing.output_s += t3 - t2
        self._num_in_flight -= 1
        if not self._num_in_flight:
            self._idle_since = t3
        return output

    def _draft_prefill(self, sched: SchedulerOutput, batch: StepBatch) -> None:
        """Keeps the draft's cache up with the target's while speculation is on.

        A speculating step runs the draft over the step's tokens, after catching up the rows
        whose draft cache is behind the step's start (tokens computed while speculation was
        off, by ``disable_by_batch_size``, in ``catch_up`` pieces). A step that does not
        speculate skips the draft: at a large batch it would cost a share of every step for
        drafts nobody uses. A new row starts with its prefix-cache hit valid for the draft
        unless some step ever skipped it (a cached block may then lack the draft's K/V: its
        hit is caught up from position 0)."""
        ib, draft = self.input_batch, self.draft
        to_row = ib.req_id_to_row
        for new in sched.scheduled_new_reqs:
            self._draft_len[to_row[new.req_id]] = (
                0 if self._draft_skipped else new.num_computed_tokens
            )
        if not sched.speculate:
            self._draft_skipped = True
            return
        behind = self._draft_len[batch.rows] < batch.start_positions
        if behind.any():
            self._draft_catch_up(batch, np.flatnonzero(behind))
        draft.prefill(batch.inputs, self.aot_draft_prefill.get(batch.token_bucket))
        self._draft_len[batch.rows] = batch.start_positions + batch.num_scheduled

    def _draft_catch_up(self, batch: StepBatch, seqs: np.ndarray) -> None:
        """Runs the draft over the positions ``[draft_len, start)`` of the step's sequences
        ``seqs``, in pieces of at most the largest token bucket (a row's pieces in order)."""
        most = self.token_buckets[-1]
        rows = batch.rows[seqs]
        ids = [batch.req_ids[i] for i in seqs.tolist()]
        pos = self._draft_len[rows].copy()
        end = batch.start_positions[seqs]
        while True:
            left = end - pos
            todo = np.flatnonzero(left > 0)
            if todo.size == 0:
                break
            take = np.zeros(len(todo), np.int64)
            room = most
            for j, i in enumerate(todo.tolist()):  # fill one piece, rows in order
                take[j] = min(left[i], room)
                room -= take[j]
                if room == 0:
                    break
            keep = take > 0
            todo, take = todo[keep], take[keep]
            piece = self.builder.build_from_arrays(
                [ids[i] for i in todo.tolist()], rows[todo], pos[todo], take
            )
            self.draft.prefill(piece.inputs, self.aot_draft_prefill.get(piece.token_bucket))
            pos[todo] += take

    def _propose_draft(
        self, batch: StepBatch, verify: VerifyPlan | None, spec_sampled
    ) -> tuple[list[int] | None, jax.Array | None]:
        """Dispatches the draft model's proposals for the next step of each request that
        samples in ``batch`` and whose sampling allows speculation; returns (their sequence
        indices, the drafts on the device), or (None, None) when none proposes."""
        ib = self.input_batch
        seqs = [
            i
            for i in np.flatnonzero(batch.sample_mask).tolist()
            if not ib.params[batch.rows[i]].needs_output_history
        ]
        if not seqs:
            return None, None
        last, num_accepted = self._prev_tokens, None
        if verify is not None:  # the accepted drafts and the token after them, on the device
            last, num_accepted = accept_on_device(
                last, spec_sampled.token_ids, verify.rows, verify.drafts
            )
        num_spec = np.zeros(len(seqs), np.int32)
        if batch.num_spec is not None:
            num_spec[:] = batch.num_spec[seqs]
        inputs = batch.inputs
        drafts = self.draft.propose(
            inputs.block_tables,
            inputs.context_lens,
            last,
            num_accepted,
            np.asarray(seqs),
            num_spec,
        )
        return seqs, drafts

    def _propose_ngram(self, pending: PendingStep, keep: np.ndarray) -> dict[str, list[int]]:
        """N-gram drafts for the next step of each request that sampled in ``pending`` (its row
        just took the tokens) and whose sampling allows speculation."""
        batch, ib = pending.batch, self.input_batch
        drafts: dict[str, list[int]] = {}
        propose = self.ngram.propose
        for i in np.flatnonzero(keep & batch.sample_mask).tolist():
            if pending.params[i].needs_output_history:
                continue
            row = batch.rows[i]
            drafts[batch.req_ids[i]] = propose(ib.token_ids[row, : ib.num_tokens[row]])
        return drafts

    def _seed(self, req_id: str, params: SamplingParams) -> int:
        if params.seed is not None:
            return params.seed
        seed = self._seeds.get(req_id)
        if seed is None:  # drawn once per request, kept across preemptions
            seed = self._seeds[req_id] = int(self._rng.integers(0, 2**63))
        return seed

    def _token_bitmask(self, batch: StepBatch, mask: StepTokenMask | None) -> np.ndarray | None:
        """int32 [S, ceil(V / 32)] in batch order (all ones on unmasked rows), or None."""
        if mask is None:
            return None
        words = (self.arch.vocab_size + 31) // 32
        out = np.full((batch.seq_bucket, words), -1, np.int32)
        index = {r: i for i, r in enumerate(batch.req_ids)}
        rows = [index[r] for r in mask.req_ids]
        w = min(words, mask.bitmask.shape[1])
        out[rows, :w] = mask.bitmask[:, :w]
        out[rows, w:] = 0  # ids the tokenizer does not know are never allowed on masked rows
        return out

    def _sampling_metadata(
        self,
        batch: StepBatch,
        token_mask: StepTokenMask | None = None,
        follows: StepBatch | None = None,
    ) -> SamplingMetadata:
        """The step's SamplingMetadata (``SamplingMetadata.from_params`` over the rows).

        Steady decode reuses the previous step's metadata: when the same requests run in the
        same order and bucket, and none uses penalties or is still under ``min_tokens`` (the
        only row fields that follow the output), only ``step_index`` and the token masks
        change. ``follows``: the previous step's batch when ``batch`` was built from it
        (``BatchBuilder.build_steady``): every row's step index is then one more than there.
        """
        ib = self.input_batch
        n = batch.num_reqs
        cache = self._md_cache
        if (
            follows is not None
            and token_mask is None
            and cache is not None
            and cache[2] is follows
            and not cache[1].any_token_mask
        ):
            md = copy.copy(cache[1])  # frozen: a copy with step_index set (see below)
            one = self._one_each.get((n, batch.seq_bucket))
            if one is None:
                one = self._one_each[(n, batch.seq_bucket)] = np.zeros(batch.seq_bucket, np.int32)
                one[:n] = 1
            object.__setattr__(md, "step_index", md.step_index + one)
            self._md_cache = (cache[0], md, batch)
            return md
        step_index = np.zeros(batch.seq_bucket, np.int32)
        # the output index of the token each row samples (counts a token still in flight; a
        # partial prompt chunk samples nothing: 0)
        ends = batch.start_positions + batch.num_scheduled
        if batch.num_spec is not None:
            ends = ends - batch.num_spec  # a drafted row samples after its known tokens first
        step_index[:n] = np.maximum(ends - ib.num_prompt_tokens[batch.rows], 0)
        bitmask = self._token_bitmask(batch, token_mask)
        key = (tuple(batch.req_ids), batch.seq_bucket)
        if cache is not None and cache[0] == key:
            md = copy.copy(cache[1])  # frozen: a copy with three fields set (cheaper
            # than dataclasses.replace, which runs __init__ over every field)
            object.__setattr__(md, "step_index", step_index)
            if bitmask is not None:
                object.__setattr__(md, "token_bitmask", bitmask)
                object.__setattr__(md, "any_token_mask", True)
            elif md.any_token_mask:  # the cached one had masks: back to the placeholder
                object.__setattr__(
                    md, "token_bitmask", np.full((batch.seq_bucket, 1), -1, np.int32)
                )
                object.__setattr__(md, "any_token_mask", False)
            self._md_cache = (key, md, batch)
            return md
        rows = []
        eos = None
        stable = True
        for req_id, row, index in zip(batch.req_ids, batch.rows.tolist(), step_index.tolist()):
            params = ib.params[row]
            n_prompt, n_tok = int(ib.num_prompt_tokens[row]), int(ib.num_tokens[row])
            rows.append(
                SamplingRow(
                    params,
                    self._seed(req_id, params),
                    index,
                    ib.token_ids[row, n_prompt:n_tok],
                    ib.token_ids[row, :n_prompt],
                )
            )
            eos = ib.eos_token_ids[row] if eos is None else eos
            stable = stable and index >= params.min_tokens and not _uses_penalties(params)
        md = SamplingMetadata.from_params(
            rows, pad_to=batch.seq_bucket, eos_token_id=eos, token_bitmask=bitmask
        )
        self._md_cache = (key, md, batch) if stable else None
        return md

    def _make_output(
        self, pending: PendingStep, sampled, plp, spec_sampled=None
    ) -> ModelRunnerOutput:
        batch, params = pending.batch, pending.params
        n = batch.num_reqs
        tokens = sampled.token_ids[:n].tolist()
        flat = index = None
        verify = pending.verify
        if verify is not None:  # drafted rows: their accepted drafts and one token each
            mask = batch.sample_mask.tolist()
            sampled_ids = [[t] if m else [] for t, m in zip(tokens, mask)]
            for i, ids in zip(verify.seqs.tolist(), accept(verify, spec_sampled.token_ids)):
                sampled_ids[i] = ids
        elif batch.sample_mask.all():
            mask = [True] * n
            sampled_ids = OneTokenEach(tokens)
            flat, index = tokens, pending.index
        else:
            mask = batch.sample_mask.tolist()
            sampled_ids = [[t] if m else [] for t, m in zip(tokens, mask)]
        logprobs = None
        if sampled.logprobs is not None:
            lp = sampled.logprobs
            logprobs = []
            for i in range(n):
                k = params[i].logprobs
                if k is None or not mask[i]:
                    logprobs.append([])
                    continue
                logprobs.append([_token_logprobs(lp, i, tokens[i], k)])
            if verify is not None:  # each kept token's logprobs at its own position
                slp = spec_sampled.logprobs
                for r, i in enumerate(verify.seqs.tolist()):
                    k = params[i].logprobs
                    if k is not None:
                        base = r * verify.width
                        logprobs[i] = [
                            _token_logprobs(slp, base + j, t, k)
                            for j, t in enumerate(sampled_ids[i])
                        ]
        prompt_lps: dict[str, list[TokenLogprobs]] = {}
        if plp is not None:
            targets = batch.prompt_logprob_targets
            starts = np.concatenate([[0], np.cumsum(batch.num_scheduled)[:-1]])
            for i in range(n):
                k = params[i].prompt_logprobs
                if k is None:
                    continue
                lo = int(starts[i])
                idx = lo + np.nonzero(targets[lo : lo + int(batch.num_scheduled[i])] >= 0)[0]
                if len(idx) == 0:
                    continue
                prompt_lps[batch.req_ids[i]] = [
                    TokenLogprobs(
                        token_ids=[int(targets[j])] + plp.top_ids[j, :k].tolist(),
                        logprobs=[float(plp.token_logprobs[j])] + plp.top_logprobs[j, :k].tolist(),
                        rank=int(plp.token_ranks[j]),
                    )
                    for j in idx.tolist()
                ]
        return ModelRunnerOutput(
            req_ids=batch.req_ids,
            req_id_to_index=dict(zip(batch.req_ids, range(n))) if index is None else index,
            sampled_token_ids=sampled_ids,
            logprobs=logprobs,
            prompt_logprobs_dict=prompt_lps,
            sampled_flat=flat,
        )


def _token_logprobs(lp, i: int, token: int, k: int) -> TokenLogprobs:
    """Row ``i`` of a host ``LogprobsTensors``: the chosen ``token`` and the top ``k``."""
    return TokenLogprobs(
        token_ids=[token] + lp.top_ids[i, :k].tolist(),
        logprobs=[float(lp.token_logprobs[i])] + lp.top_logprobs[i, :k].tolist(),
        rank=int(lp.token_ranks[i]),
    )
