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
logits round trip through device memory between the two (S x V x 4 bytes, ~128 MiB at S = 256
and a 128k vocabulary: tens of microseconds on an H200).

Compilation: ``warmup`` compiles the forward for every token bucket (largest first), the
prompt-logprobs head for every token bucket, and the everyday sampler variants (greedy; plain
sampling; top-k <= 128; full sort for top-p) for every sequence bucket, with a tqdm bar, using
the persistent compilation cache (``RunnerConfig.compilation_cache_dir``). After warm-up a step
in an unknown bucket is a bug (assertion); rarer sampler variants (penalties, logit bias,
logprobs widths) compile on first use and are logged.

Not done: overlapping the host work of step N+1 with the device work of step N (vLLM's async
scheduling). The host waits for each step's tokens before scheduling the next.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.core.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput, TokenLogprobs
from jaxserve.model.attention import PagedAttentionMetadata
from jaxserve.sampling_params import MAX_LOGPROBS, SamplingParams
from jaxserve.worker.batch_builder import (
    BatchBuilder,
    InputBatch,
    StepBatch,
    StepInputs,
    resolve_token_buckets,
    seq_bucket,
)
from jaxserve.worker.kv_cache_alloc import (
    KVCacheSpec,
    allocate_kv_caches,
    determine_kv_cache_spec,
    device_memory,
    kv_cache_shapes,
    log_kv_cache_spec,
)
from jaxserve.worker.sampler import prompt_logprobs, sample
from jaxserve.worker.sampling_metadata import SamplingMetadata, SamplingRow

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig
    from jaxserve.core.sched_output import SchedulerOutput
    from jaxserve.model.config import ModelArchConfig

logger = logging.getLogger(__name__)

jax.tree_util.register_dataclass(
    StepInputs, data_fields=[f.name for f in dataclasses.fields(StepInputs)], meta_fields=[]
)

PROMPT_LOGPROBS_CHUNK = 256
"""Prompt positions whose full-vocabulary logits exist at once in the prompt-logprobs head."""

# Everyday sampler variants compiled at warm-up, per sequence bucket (see SamplingMetadata).
_WARMUP_SAMPLING = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=1.0, top_k=50),
    SamplingParams(temperature=1.0, top_p=0.9),
)


def _uses_penalties(params: SamplingParams) -> bool:
    return (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    )


def resolve_attention_backend(name: str, platform: str) -> str:
    """The attention backend to run: "auto" -> "pallas" on GPU/TPU, "reference" on CPU
    (``platform == "cpu"``); "pallas" / "reference" as named.

    Raises:
      ValueError: for any other name (naming ``attention_backend``).
    """
    if name == "auto":
        return "reference" if platform == "cpu" else "pallas"
    if name not in ("pallas", "reference"):
        raise ValueError(f"attention_backend must be auto, pallas or reference, got {name!r}")
    return name


def configure_compilation_cache(cache_dir: str) -> None:
    """Turns on JAX's persistent compilation cache in ``cache_dir`` ("" leaves it off); every
    compile is cached (``jax_persistent_cache_min_compile_time_secs = 0``)."""
    if not cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@dataclasses.dataclass
class StepTiming:
    """Cumulative seconds of the runner's steps (for benchmarks and metrics).

    Attributes:
      num_steps: steps that ran the model.
      host_s: host time before dispatch (row updates, batch build, sampling metadata).
      device_s: dispatch until the results are on the host (device work + transfer).
      output_s: turning the results into the ModelRunnerOutput.
    """

    num_steps: int = 0
    host_s: float = 0.0
    device_s: float = 0.0
    output_s: float = 0.0


class ModelRunner:
    """Runs the paged model on one device for the scheduler's steps.

    Args:
      model: the Flax NNX model (``jaxserve.model.load_model``); split once into a static
        graphdef and a state pytree that is passed to every step.
      arch: its ModelArchConfig (attention shape for the KV pool).
      config: the resolved EngineConfig (scheduler budget and max_num_seqs, block size, memory
        knobs, runner knobs).
      warmup_sampling: SamplingParams whose sampler variants ``warmup`` compiles for every
        sequence bucket (default: greedy, plain sampling, top-k, top-p).

    Raises:
      ValueError: a bad attention backend or token bucket list (named).
    """

    def __init__(
        self,
        model: nnx.Module,
        arch: ModelArchConfig,
        config: EngineConfig,
        *,
        warmup_sampling: tuple[SamplingParams, ...] = _WARMUP_SAMPLING,
    ) -> None:
        self.config = config
        self.arch = arch
        self.dtype = jnp.dtype(getattr(model, "dtype", jnp.float32))
        self.device = jax.local_devices()[0]
        self.backend = resolve_attention_backend(
            config.runner.attention_backend, self.device.platform
        )
        configure_compilation_cache(config.runner.compilation_cache_dir)
        self.graphdef, self.state = nnx.split(model)
        sched = config.scheduler
        self.block_size = config.cache.block_size
        self.max_num_seqs = sched.max_num_seqs
        self.max_model_len = sched.max_model_len
        self.token_buckets = resolve_token_buckets(
            config.runner.token_buckets, sched.max_num_batched_tokens
        )
        self.seq_buckets = tuple(
            sorted({seq_bucket(t, self.max_num_seqs) for t in self.token_buckets})
        )
        self.input_batch = InputBatch(sched.max_num_seqs, sched.max_model_len, self.block_size)
        self.builder = BatchBuilder(self.input_batch, self.token_buckets, self.max_num_seqs)
        self.warmup_sampling = warmup_sampling
        self.kv_spec: KVCacheSpec | None = None
        self.kv_caches: list | None = None
        self.timing = StepTiming()
        self.compile_seconds = 0.0
        self._warm_buckets: set[int] = set()
        self._seeds: dict[str, int] = {}
        self._md_cache: tuple | None = None  # ((req_ids, S), SamplingMetadata) of a steady batch
        self._rng = np.random.default_rng(config.model.seed)
        self._forward = jax.jit(self._forward_impl, donate_argnums=(1,))
        self._sample = jax.jit(sample)
        self._prompt_logprobs = jax.jit(self._prompt_logprobs_impl)
        logger.info(
            "model runner: attention backend %s, token buckets %s, sequence buckets %s",
            self.backend,
            self.token_buckets,
            self.seq_buckets,
        )

    # ------------------------------------------------------------------ jitted functions

    def _forward_impl(self, state: nnx.State, kv_caches: list, inputs: StepInputs):
        """``(state, kv_caches, inputs) -> (logits [S, V] f32, hidden [T, E], kv_caches)``."""
        model = nnx.merge(self.graphdef, state)
        metadata = PagedAttentionMetadata(
            slot_mapping=inputs.slot_mapping,
            block_tables=inputs.block_tables,
            context_lens=inputs.context_lens,
            query_start_loc=inputs.query_start_loc,
            num_seqs=inputs.num_seqs,
            backend=self.backend,
        )
        hidden, kv_caches = model(inputs.input_ids, inputs.positions, kv_caches, metadata)  # [T, E]
        logits = model.compute_logits(hidden[inputs.logits_indices])  # [S, V]
        return logits, hidden, kv_caches

    def _prompt_logprobs_impl(self, state: nnx.State, hidden: jax.Array, targets: jax.Array):
        """Raw-model logprob, rank and top-``MAX_LOGPROBS`` of each target token.

        ``hidden [T, E]`` (the forward's), ``targets [T]`` int32 (-1 = not scored; scored as
        token 0 and ignored) -> LogprobsTensors over T rows, computed ``PROMPT_LOGPROBS_CHUNK``
        rows at a time so only ``[chunk, V]`` logits exist at once.
        """
        model = nnx.merge(self.graphdef, state)
        t = hidden.shape[0]
        chunk = min(PROMPT_LOGPROBS_CHUNK, t & -t)

        def one(args):
            h, tgt = args
            return prompt_logprobs(model.compute_logits(h), jnp.maximum(tgt, 0), MAX_LOGPROBS)

        out = jax.lax.map(
            one, (hidden.reshape(t // chunk, chunk, -1), targets.reshape(t // chunk, chunk))
        )
        return jax.tree.map(lambda x: x.reshape(t, *x.shape[2:]), out)

    # ------------------------------------------------------------------ start-up

    def _dummy_inputs(self, token_bucket: int) -> StepInputs:
        """All-padding inputs of a bucket: one sequence of one token whose slot is -1."""
        b = self.input_batch
        s = seq_bucket(token_bucket, self.max_num_seqs)
        qsl = np.ones(s + 1, np.int32)
        qsl[0] = 0
        ctx = np.zeros(s, np.int32)
        ctx[0] = 1
        return StepInputs(
            input_ids=np.zeros(token_bucket, np.int32),
            positions=np.zeros(token_bucket, np.int32),
            slot_mapping=np.full(token_bucket, -1, np.int32),
            block_tables=np.zeros((s, b.max_blocks_per_req), np.int32),
            context_lens=ctx,
            query_start_loc=qsl,
            num_seqs=np.asarray(1, np.int32),
            logits_indices=np.zeros(s, np.int32),
        )

    def profile_peak_activation_bytes(self) -> int:
        """Peak activation memory of the largest token bucket's step, bytes, from
        ``memory_analysis()`` of its compiled parts. The forward's outputs that do not alias the
        donated KV caches (logits, hidden) stay live while the sampler and the prompt-logprobs
        head run after it, so the peak is those outputs plus the largest temporaries of the
        three (forward; the sampler's costliest variant, top-p with 20 logprobs; the
        prompt-logprobs head). The forward is lowered against a small stand-in pool: its
        activations do not depend on the pool size.
        """
        t_max = self.token_buckets[-1]
        s_max = seq_bucket(t_max, self.max_num_seqs)
        probe = self._spec_with_blocks(2 * self.input_batch.max_blocks_per_req + 1)
        fwd = self._forward.lower(
            self.state, kv_cache_shapes(probe), self._dummy_inputs(t_max)
        ).compile()
        fwd_mem = fwd.memory_analysis()
        outputs = int(fwd_mem.output_size_in_bytes) - int(fwd_mem.alias_size_in_bytes)
        logits = jax.ShapeDtypeStruct((s_max, self.arch.vocab_size), jnp.float32)
        worst = SamplingParams(temperature=1.0, top_p=0.9, logprobs=MAX_LOGPROBS)
        md = SamplingMetadata.from_params([SamplingRow(worst, 0, 0, (), ())], pad_to=s_max)
        sampler_temp = int(
            self._sample.lower(logits, md).compile().memory_analysis().temp_size_in_bytes
        )
        hidden = jax.ShapeDtypeStruct((t_max, self.arch.hidden_size), self.dtype)
        plp = self._prompt_logprobs.lower(self.state, hidden, np.zeros(t_max, np.int32)).compile()
        plp_temp = int(plp.memory_analysis().temp_size_in_bytes)
        peak = outputs + max(int(fwd_mem.temp_size_in_bytes), sampler_temp, plp_temp)
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

    def _spec_with_blocks(self, num_blocks: int) -> KVCacheSpec:
        a = self.arch
        return KVCacheSpec(
            num_blocks=num_blocks,
            block_size=self.block_size,
            num_layers=a.num_layers,
            num_kv_heads=a.num_kv_heads,
            head_dim=a.head_dim,
            dtype=self.dtype.name,
            bytes_per_token=2 * a.num_layers * a.num_kv_heads * a.head_dim * self.dtype.itemsize,
            source="probe",
        )

    def initialize_kv_cache(self) -> KVCacheSpec:
        """Sizes the KV pool (``kv_cache_alloc``), allocates it and logs it.

        On a device with memory stats and without ``num_gpu_blocks_override``, first profiles
        the largest bucket's activation memory (one extra compile).

        Raises:
          ValueError: the memory left holds fewer than 2 blocks.
        """
        cache = self.config.cache
        peak = 0
        if cache.num_gpu_blocks_override is None and device_memory(self.device) is not None:
            t0 = time.perf_counter()
            peak = self.profile_peak_activation_bytes()
            self.compile_seconds += time.perf_counter() - t0
        spec = determine_kv_cache_spec(
            num_layers=self.arch.num_layers,
            num_kv_heads=self.arch.num_kv_heads,
            head_dim=self.arch.head_dim,
            dtype=self.dtype,
            block_size=self.block_size,
            gpu_memory_utilization=cache.gpu_memory_utilization,
            num_gpu_blocks_override=cache.num_gpu_blocks_override,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            device=self.device,
            peak_activation_bytes=peak,
        )
        log_kv_cache_spec(spec)
        self.kv_spec = spec
        self.kv_caches = allocate_kv_caches(spec, self.device)
        return spec

    def warmup(self, *, progress: bool = True) -> float:
        """Compiles (and runs once, on all-padding inputs that write nothing) the forward and the
        prompt-logprobs head for every token bucket, largest first, and the warm-up sampler
        variants for every sequence bucket. Returns the seconds spent; logs them.

        Requires ``initialize_kv_cache`` first.
        """
        assert self.kv_caches is not None, "initialize_kv_cache() before warmup()"
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        warm_seqs: set[int] = set()
        bar = tqdm(
            list(reversed(self.token_buckets)),
            desc="compiling step buckets",
            unit="bucket",
            disable=not progress,
        )
        for size in bar:
            bar.set_postfix_str(f"T={size}")
            inputs = self._dummy_inputs(size)
            logits, hidden, self.kv_caches = self._forward(self.state, self.kv_caches, inputs)
            targets = np.full(size, -1, np.int32)
            jax.block_until_ready(self._prompt_logprobs(self.state, hidden, targets))
            s = seq_bucket(size, self.max_num_seqs)
            if s not in warm_seqs:
                warm_seqs.add(s)
                for params in self.warmup_sampling:
                    md = SamplingMetadata.from_params([SamplingRow(params, 0, 0, (), ())], pad_to=s)
                    jax.block_until_ready(self._sample(logits, md))
            self._warm_buckets.add(size)
        bar.close()
        seconds = time.perf_counter() - t0
        self.compile_seconds += seconds
        logger.info(
            "warm-up: compiled %d token buckets and %d sequence buckets in %.1f s",
            len(self.token_buckets),
            len(self.seq_buckets),
            seconds,
        )
        return seconds

    def reset_requests(self) -> None:
        """Forgets every request's row (e.g. before serving a new scheduler after the previous
        one was dropped); the KV pool's contents are left as they are."""
        for req_id in list(self.input_batch.req_id_to_row):
            self.input_batch.remove_request(req_id)
        self._seeds.clear()
        self._md_cache = None

    def compile_counts(self) -> dict[str, int]:
        """Executables cached per jitted function (a test checks serving adds none)."""
        return {
            "forward": self._forward._cache_size(),
            "sampler": self._sample._cache_size(),
            "prompt_logprobs": self._prompt_logprobs._cache_size(),
        }

    # ------------------------------------------------------------------ one step

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one scheduled step and returns the sampled tokens (see the module docstring).

        Raises:
          AssertionError: the step needs a token bucket that was not warmed up (only when
            warm-up ran), or the scheduler output disagrees with the persistent batch.
        """
        t0 = time.perf_counter()
        self.builder.update_states(sched)
        if sched.scheduled_new_reqs or sched.finished_req_ids or sched.preempted_req_ids:
            self._md_cache = None  # a row changed hands: its id may now name another request
        for req_id in sched.finished_req_ids:
            self._seeds.pop(req_id, None)
        if sched.is_empty:
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self.builder.build(sched)
        if self._warm_buckets:
            assert batch.token_bucket in self._warm_buckets, (
                f"bucket {batch.token_bucket} was not compiled"
            )
        md = self._sampling_metadata(batch)
        t1 = time.perf_counter()

        logits, hidden, self.kv_caches = self._forward(self.state, self.kv_caches, batch.inputs)
        num_variants = self._sample._cache_size()
        sampled = self._sample(logits, md)
        if self._sample._cache_size() != num_variants:
            logger.info(
                "compiled a sampler variant on first use: S=%d greedy=%s penalties=%s logit_bias=%s "
                "logprobs=%s filters=%s full_sort=%s",
                batch.seq_bucket,
                md.all_greedy,
                md.any_penalties,
                md.any_logit_bias,
                md.max_logprobs,
                md.any_top_k_top_p_min_p,
                md.needs_full_sort,
            )
        plp = None
        if batch.prompt_logprob_targets is not None:
            plp = self._prompt_logprobs(self.state, hidden, batch.prompt_logprob_targets)
        sampled, plp = jax.device_get((sampled, plp))
        t2 = time.perf_counter()

        output = self._make_output(batch, sampled, plp)
        t3 = time.perf_counter()
        timing = self.timing
        timing.num_steps += 1
        timing.host_s += t1 - t0
        timing.device_s += t2 - t1
        timing.output_s += t3 - t2
        return output

    def _seed(self, req_id: str, params: SamplingParams) -> int:
        if params.seed is not None:
            return params.seed
        seed = self._seeds.get(req_id)
        if seed is None:  # drawn once per request, kept across preemptions
            seed = self._seeds[req_id] = int(self._rng.integers(0, 2**63))
        return seed

    def _sampling_metadata(self, batch: StepBatch) -> SamplingMetadata:
        """The step's SamplingMetadata (``SamplingMetadata.from_params`` over the rows).

        Steady decode reuses the previous step's metadata: when the same requests run in the
        same order and bucket, and none uses penalties or is still under ``min_tokens`` (the
        only row fields that follow the output), only ``step_index`` changes.
        """
        ib = self.input_batch
        n = batch.num_reqs
        step_index = np.zeros(batch.seq_bucket, np.int32)
        step_index[:n] = ib.num_tokens[batch.rows] - ib.num_prompt_tokens[batch.rows]
        key = (tuple(batch.req_ids), batch.seq_bucket)
        if self._md_cache is not None and self._md_cache[0] == key:
            return dataclasses.replace(self._md_cache[1], step_index=step_index)
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
        md = SamplingMetadata.from_params(rows, pad_to=batch.seq_bucket, eos_token_id=eos)
        self._md_cache = (key, md) if stable else None
        return md

    def _make_output(self, batch: StepBatch, sampled, plp) -> ModelRunnerOutput:
        ib = self.input_batch
        n = batch.num_reqs
        tokens = sampled.token_ids[:n].tolist()
        mask = batch.sample_mask.tolist()
        sampled_ids = [[t] if m else [] for t, m in zip(tokens, mask)]
        logprobs = None
        if sampled.logprobs is not None:
            lp = sampled.logprobs
            logprobs = []
            for i, row in enumerate(batch.rows.tolist()):
                k = ib.params[row].logprobs
                if k is None or not mask[i]:
                    logprobs.append([])
                    continue
                logprobs.append(
                    [
                        TokenLogprobs(
                            token_ids=[tokens[i]] + lp.top_ids[i, :k].tolist(),
                            logprobs=[float(lp.token_logprobs[i])]
                            + lp.top_logprobs[i, :k].tolist(),
                            rank=int(lp.token_ranks[i]),
                        )
                    ]
                )
        prompt_lps: dict[str, list[TokenLogprobs]] = {}
        if plp is not None:
            targets = batch.prompt_logprob_targets
            starts = np.concatenate([[0], np.cumsum(batch.num_scheduled)[:-1]])
            for i, row in enumerate(batch.rows.tolist()):
                k = ib.params[row].prompt_logprobs
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
            req_id_to_index={r: i for i, r in enumerate(batch.req_ids)},
            sampled_token_ids=sampled_ids,
            logprobs=logprobs,
            prompt_logprobs_dict=prompt_lps,
        )
