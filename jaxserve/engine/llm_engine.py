"""``LLMEngine``: the synchronous engine (tokenizer + scheduler/KV-cache manager + model runner).

The life of one request:

1. ``add_request(id, prompt, params)`` tokenizes the prompt and validates it (empty, too long,
   token ids outside the vocabulary, ``SamplingParams.check_vocab``: ``ValueError`` naming the
   field, nothing queued). ``n > 1`` fans out into ``n`` child requests ``{id}-{k}`` (seed
   ``seed + k`` when a seed is given) that share the prompt's KV blocks through prefix caching.
   The children enter the scheduler's waiting queue (``jaxserve.core.scheduler``).
2. ``step()``: the scheduler picks this step's tokens under the token budget (chunked prefill,
   prefix-cache hits, decode and recompute after preemption are the same arithmetic) and hands a
   ``SchedulerOutput`` to the ``ModelRunner``, which updates its persistent batch, runs the
   padded jitted forward + sampler once, and returns the sampled tokens
   (``ModelRunnerOutput``). The scheduler appends them, checks EOS / stop token ids /
   max_tokens and frees finished requests' blocks (``EngineCoreOutput`` per request).
3. The ``OutputProcessor`` detokenizes incrementally; a stop string ends the sample, and the
   engine then finishes it in the scheduler (``finish_requests``), freeing its blocks. Each
   parent that progressed yields a ``RequestOutput`` (cumulative text/tokens plus this step's
   deltas), ``finished`` once all its samples are.

Token masks (structured outputs, ``allowed_token_ids``, ``bad_words``): ``add_request`` starts a
request's mask state in ``TokenMaskManager`` from the plan the server prepared off this thread
(``SamplingParams.token_mask_plan``; without one it is prepared here, and a constraint refused
at admission is a ``ValueError``); after each step's update ``advance`` feeds the matchers the
new tokens and ends the requests whose grammar is complete ("stop", even with ``ignore_eos``)
or failed ("error"); right after scheduling, one ``step_mask`` call computes the next masks,
which the runner applies in the jitted sampler (``jaxserve.structured``).

Length policy (documented choice): ``prompt + max_tokens`` beyond ``max_model_len`` is not an
error; ``max_tokens`` is clamped to what max_model_len leaves and the sample ends with "length"
(the scheduler's rule; vLLM's engine behaves the same). A prompt longer than max_model_len, or
one whose ``prompt + max_tokens`` exceeds the whole KV pool, is rejected.

EOS: the tokenizer's EOS id ends a sample (unless ``ignore_eos``); further EOS ids of the
generation config / tokenizer (e.g. Llama 3's ``<|eot_id|>``) are added to the request's
``stop_token_ids`` (vLLM's ``update_from_generation_config``), so they end it too, with that id
as ``stop_reason``.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import sys
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from jaxserve.config import EngineArgs, EngineConfig
from jaxserve.core.ledger import LedgerHistory
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.request_output import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.stats_schema import COUNTER_TOTALS, SCHEDULER_TO_ENGINE, EngineStats, add_counts
from jaxserve.structured import TokenMaskManager

if TYPE_CHECKING:
    from jaxserve.core.runner_output import ModelRunnerOutput
    from jaxserve.model.arch_config import ModelArchConfig
    from jaxserve.tokenizer import Tokenizer
    from jaxserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class LLMEngine:
    """Synchronous LLM engine (vLLM V1's ``LLMEngine`` over one ``EngineCore``).

    Build it with :meth:`from_engine_args`. Not thread-safe: one caller drives ``add_request`` /
    ``step`` / ``abort_request`` (the async engine runs it on its own thread).

    Args:
      config: resolved configs (``cache.num_gpu_blocks`` set from the runner's KV pool;
        ``cache.kv_cache_groups`` is taken from the runner's ``kv_layout``).
      runner: a ModelRunner with its KV cache allocated (and warmed up, if configured).
      arch: the model's ModelArchConfig.
      tokenizer: the model's tokenizer, or None (then prompts must be token ids and outputs
        carry no text).
      generation_config: the model's ``generation_config.json`` dict (may be empty).
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        arch: ModelArchConfig,
        tokenizer: Tokenizer | None,
        generation_config: dict[str, Any],
    ) -> None:
        layout = getattr(runner, "kv_layout", None)
        if layout is not None and config.cache.kv_cache_groups != layout.sliding_windows:
            # The runner's KV-cache groups decide: the scheduler's tables mirror its pool.
            cache = dataclasses.replace(config.cache, kv_cache_groups=layout.sliding_windows)
            config = dataclasses.replace(config, cache=cache)
        self.config = self.engine_config = config
        self.runner = runner
        self.arch = arch
        self.tokenizer = tokenizer
        self.generation_config = generation_config
        self.vocab_size = arch.vocab_size
        self.max_model_len = config.scheduler.max_model_len
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            config.cache.num_gpu_blocks,
            speculative_config=config.speculative,
        )
        if config.lora is not None:
            self.scheduler.max_loras = config.lora.max_loras
        self.output_processor = OutputProcessor(tokenizer, config.scheduler.stream_interval)
        self.ledger_history = LedgerHistory(config.ledger_history)
        self.token_masks = TokenMaskManager(
            tokenizer,
            bounded_numbers=config.model.structured_outputs_bounded_numbers,
            vocab_size=arch.vocab_size,
        )
        self.eos_token_id, self.extra_eos_token_ids = _eos_ids(tokenizer, generation_config, arch)
        self._stats = EngineStats()
        self.async_scheduling = config.scheduler.async_scheduling
        # Async scheduling: the dispatched step not yet collected (SchedulerOutput, PendingStep).
        self._in_flight: tuple | None = None
        # Steps whose in-flight predecessor was collected and updated before scheduling them,
        # because nothing could run without its tokens (``Scheduler.waits_for_in_flight``).
        self.num_early_updates = 0
        self.kv_event_publisher = self._start_kv_events(config)

    def _start_kv_events(self, config: EngineConfig) -> Any:
        """With ``kv_events_endpoint`` set: the block pool records its events and a
        ``KVEventPublisher`` sends them after each step (jaxserve/kv_events.py); else None."""
        obs = config.observability
        if not obs.kv_events_endpoint:
            return None
        from jaxserve.kv_events import KVEventPublisher, offset_endpoint

        manager = self.scheduler.kv_cache_manager
        self._block_pool = manager.record_kv_events(obs.kv_events_include_token_ids)
        endpoint = offset_endpoint(obs.kv_events_endpoint, obs.data_parallel_rank)
        publisher = KVEventPublisher(
            endpoint,
            config.cache.block_size,
            obs.data_parallel_rank,
            group_windows=config.cache.kv_cache_groups,
        )
        logger.info("publishing KV-cache events on %s", publisher.address)
        return publisher

    def close(self) -> None:
        """Stops the KV-event publisher (if any) after it sent what is queued."""
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()
            self.kv_event_publisher = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        """Loads the model and tokenizer, sizes and allocates the KV pool, warms up, and builds
        the scheduler.

        Multi-process (``num_processes > 1``): starts the distributed runtime first. On process 0
        the engine's runner publishes every step to the others; on any other process this never
        returns: it runs the steps process 0 publishes and exits when process 0 stops
        (``jaxserve.distributed``).

        Raises:
          ValueError (ModelLoadError included): bad engine args or model directory, or a KV
            pool of fewer than 2 blocks.
        """
        import jax

        from jaxserve import distributed
        from jaxserve.model import quant_loading
        from jaxserve.model.attention_backends import resolve_attention_backend
        from jaxserve.model.loader import load_model
        from jaxserve.model.readers.gguf_reader import is_gguf_path
        from jaxserve.worker.draft_model import read_d2t
        from jaxserve.worker.model_runner import ModelRunner

        t0 = time.perf_counter()
        parallel = engine_args.parallel_config()
        distributed.initialize(parallel)  # before anything touches a device
        # A Pallas kernel on the wrong platform fails here, before any weights are loaded.
        resolve_attention_backend(
            engine_args.attention_backend,
            jax.local_devices()[0].platform,
            interpret=engine_args.pallas_interpret,
        )
        engine_args.check(need_tokenizer=False)  # a bad path or flag fails before loading
        path = engine_args.resolved_model_path()
        model, arch, generation_config = load_model(
            path,
            engine_args.dtype,
            engine_args.load_format,
            seed=engine_args.seed,
            quantization=engine_args.quantization,
            kv_cache_dtype=engine_args.kv_cache_dtype,
            # straight onto the mesh, each process reading only its devices' slices; with LoRA
            # read whole: the adapter pools are added before placement (worker/lora_slots.py)
            tensor_parallel_size=None if engine_args.enable_lora else parallel.tensor_parallel_size,
            enable_expert_parallel=parallel.enable_expert_parallel,
        )
        weight_bytes = quant_loading.weight_bytes(model)
        logger.info(
            "weights: %.3f GiB (quantization %s, KV cache dtype %s)",
            weight_bytes / 2**30,
            engine_args.quantization,
            engine_args.kv_cache_dtype,
        )
        config = engine_args.create_engine_config(arch.max_position_embeddings)
        logger.debug("engine config: %s", config)  # `serve` prints it once, resolved
        tokenizer = None
        if config.model.tokenizer or os.path.isdir(path) or is_gguf_path(path):
            from jaxserve.tokenizer.loading import load_served_tokenizer

            try:
                tokenizer = load_served_tokenizer(
                    path, config.model.tokenizer, config.serving.chat_template
                )
            except ValueError as e:  # no tokenizer files: token-id prompts only
                if config.model.tokenizer or config.serving.chat_template:
                    raise
                logger.warning("no tokenizer loaded (%s); prompts must be token ids", e)
        runner = ModelRunner(model, arch, config)
        spec_config = config.speculative
        if spec_config is not None and spec_config.method == "draft_model":
            runner.draft_kv_group()  # a target the draft's cache cannot follow: refused now
            draft, draft_arch, _ = load_model(
                spec_config.model,
                engine_args.dtype,
                engine_args.draft_load_format,
                seed=engine_args.seed,
            )
            if draft_arch.max_position_embeddings < config.scheduler.max_model_len:
                logger.warning(
                    "the draft model's max_position_embeddings (%d) is below max_model_len "
                    "(%d): its drafts past it are guesses (verification keeps outputs exact)",
                    draft_arch.max_position_embeddings,
                    config.scheduler.max_model_len,
                )
            runner.attach_draft_model(draft, draft_arch, read_d2t(spec_config.model))
        spec = runner.initialize_kv_cache()
        num_host = runner.initialize_host_kv_cache(config.cache.kv_offloading_size)
        if config.runner.warmup:
            runner.warmup()
        load_call, load_block, recompute_token = runner.measure_offload_costs()
        config = dataclasses.replace(
            config,
            cache=dataclasses.replace(
                config.cache,
                num_gpu_blocks=spec.num_blocks,
                num_host_blocks=num_host,
                weight_bytes=weight_bytes,
                offload_load_s_per_call=load_call,
                offload_load_s_per_block=load_block,
                offload_recompute_s_per_token=recompute_token,
            ),
        )
        if parallel.num_processes > 1:
            if parallel.process_id != 0:
                sys.exit(distributed.run_worker(runner))
            runner = distributed.lead(runner)
        engine = cls(config, runner, arch, tokenizer, generation_config)
        # Everything built so far (jax, the model, the block pool, the tokenizer) lives as long
        # as the engine: take it out of the cyclic GC's reach, or every full collection walks
        # it (vLLM does the same; figures in benchmarks/RESULTS.md).
        gc.collect()
        gc.freeze()
        logger.info("engine ready in %.1f s", time.perf_counter() - t0)
        return engine

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        final_only: bool = False,
        lora_name: str | None = None,
    ) -> None:
        """Validates and queues a request (its ``n`` samples).

        Args:
          request_id: unique among unfinished requests (children use ``{request_id}-{k}``).
          prompt: text (tokenized with the model's tokenizer, BOS added as its config says) or
            token ids.
          params: SamplingParams (validated on construction).
          priority: smaller is more urgent (scheduling_policy "priority").
          cache_salt: mixed into the prefix-cache hash of the first block (tenant isolation).
          lora_name: a registered LoRA adapter to run it on (#33); None: the base model.
          arrival_time: ``time.monotonic()`` seconds; defaults to now.
          final_only: only return this request's RequestOutput once, when it finished (the
            offline API uses this; it skips building per-step outputs), as
            ``params.output_kind`` FINAL_ONLY does; otherwise the outputs are of
            ``params.output_kind`` (CUMULATIVE or DELTA, see ``RequestOutputKind``).

        Raises:
          ValueError: request_id in use or not a string; prompt empty, of the wrong type, not
            tokenizable (no tokenizer), longer than max_model_len, or with token ids outside
            the vocabulary; params not a SamplingParams, or naming token ids outside the
            vocabulary; stop strings without a tokenizer; prompt + max_tokens larger than the
            KV pool; a ``structured_outputs`` constraint that does not compile (named).
            Nothing is queued when it raises.
        """
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        if self.config.model.runner == "pooling" and (params.max_tokens != 0 or params.n != 1):
            raise ValueError(
                "max_tokens: this engine runs --runner pooling (embeddings); its requests "
                "generate nothing (max_tokens=0, n=1)"
            )
        if lora_name is not None:
            lora = getattr(self.runner, "lora", None)
            if lora is None:
                raise ValueError(f"lora_name {lora_name!r}: this engine runs without --enable-lora")
            if lora_name not in lora.paths:
                raise ValueError(f"lora_name {lora_name!r}: no such LoRA adapter is loaded")
        n = params.n
        child_ids = [request_id] if n == 1 else [f"{request_id}-{k}" for k in range(n)]
        for rid in [request_id, *child_ids]:
            if self.output_processor.is_id_in_use(rid) or rid in self.scheduler.requests:
                raise ValueError(f"request_id {rid!r} is already in use")
        prompt_text, prompt_ids = self._tokenize(prompt)
        self._check_prompt(prompt_ids)
        params.check_vocab(self.vocab_size)
        params.check_max_logprobs(self.config.serving.max_logprobs)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer, and this model has none")
        arrival = time.monotonic() if arrival_time is None else float(arrival_time)
        children = []
        for k, rid in enumerate(child_ids):
            children.append(
                Request(
                    rid,
                    prompt_ids,
                    self._child_params(params, k, n),
                    self.eos_token_id,
                    arrival_time=arrival,
                    priority=priority,
                    cache_salt=cache_salt,
                    lora_name=lora_name,
                )
            )
        added = []
        try:
            for child in children:
                self.token_masks.add_request(child.request_id, child.sampling_params)
            for child in children:
                self.scheduler.add_request(child)
                added.append(child.request_id)
        except ValueError:
            self.token_masks.drop(child_ids)
            self.scheduler.abort_requests(added)
            raise
        self.output_processor.add_request(
            request_id,
            prompt_text,
            prompt_ids,
            params,
            children,
            final_only=final_only,
            arrival_time=arrival,
        )

    def _tokenize(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "prompt: this model has no tokenizer; pass the prompt as token ids"
                )
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return None, list(prompt)
        raise ValueError(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
        )

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError(
                "prompt: the prompt is empty (0 tokens); at least one token is required"
            )
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(
                f"prompt: the prompt has {len(prompt_ids)} tokens, more than max_model_len "
                f"({self.max_model_len})"
            )
        lo, hi = min(prompt_ids), max(prompt_ids)
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"prompt: token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )

    def _child_params(self, params: SamplingParams, k: int, n: int) -> SamplingParams:
        changes: dict[str, Any] = {}
        if n > 1:
            changes["n"] = 1
            if params.seed is not None:
                changes["seed"] = (params.seed + k) % 2**64
        if self.extra_eos_token_ids and not params.ignore_eos:
            extra = [t for t in self.extra_eos_token_ids if t not in params.stop_token_ids]
            if extra:
                changes["stop_token_ids"] = list(params.stop_token_ids) + extra
        return params.clone(**changes) if changes else params

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Aborts requests (parent ids) wherever they are; their blocks are freed now. Unknown
        or finished ids are ignored; no RequestOutput is produced for them."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for rid in request_ids:
            children = self.output_processor.abort_request(rid)
            if children:
                get = self.scheduler.requests.get
                ledgers = [r.ledger for r in map(get, children) if r is not None]
                self.scheduler.abort_requests(children)
                if ledgers:
                    self.ledger_history.add(rid, ledgers)
                self.token_masks.drop(children)

    def get_ledger(self, request_id: str) -> dict[str, Any] | None:
        """A finished request's ledger as JSON-ready data (``LedgerHistory.get``), or None; any
        thread may call it."""
        return self.ledger_history.get(request_id)

    # ------------------------------------------------------------------ LoRA adapters (#33)

    def list_loras(self) -> dict[str, str | None]:
        """The registered LoRA adapters, name -> their ``base_model_name`` (None: the served
        model), in registration order; empty without ``--enable-lora``."""
        lora = getattr(self.runner, "lora", None)
        if lora is None:
            return {}
        parents = {m[0]: m[2] for m in self.config.lora.lora_modules}
        return {name: parents.get(name) for name in lora.paths}

    def lora_requests_info(self) -> tuple[list[str], list[str], int] | None:
        """``(adapters of running requests, of waiting ones, max_loras)``, names sorted, for
        ``vllm:lora_requests_info``; None without ``--enable-lora``. Engine thread only."""
        if self.config.lora is None:
            return None
        sched = self.scheduler
        running = sorted({r.lora_name for r in sched.running if r.lora_name is not None})
        waiting = sorted({r.lora_name for r in sched.waiting if r.lora_name is not None})
        return running, waiting, self.config.lora.max_loras

    def add_lora(self, name: str, path: str) -> None:
        """Reads, checks and registers the PEFT adapter in directory ``path`` as ``name``.

        Raises:
          ValueError: LoRA is off; ``LoRAAdapterError`` (a ValueError) for a bad adapter or a
            name in use (one line). Nothing changes then.
        """
        lora = getattr(self.runner, "lora", None)
        if lora is None:
            raise ValueError("lora_name: this engine runs without --enable-lora")
        lora.register(name, path)

    def remove_lora(self, name: str) -> None:
        """Unregisters adapter ``name`` (its host copy and device slot are freed).

        Raises:
          ValueError: LoRA is off, ``name`` is not loaded, or unfinished requests use it.
        """
        lora = getattr(self.runner, "lora", None)
        if lora is None:
            raise ValueError("lora_name: this engine runs without --enable-lora")
        users = sum(r.lora_name == name for r in self.scheduler.requests.values())
        if users:
            raise ValueError(f"lora_name {name!r}: in use by {users} unfinished requests")
        lora.unregister(name)

    def has_unfinished_requests(self) -> bool:
        """True while any parent request (n > 1 counts once) has not produced its final output."""
        return len(self.output_processor) > 0

    def get_num_unfinished_requests(self) -> int:
        """Parent requests (n > 1 counts once) not yet finished or aborted."""
        return len(self.output_processor)

    # ------------------------------------------------------------------ sleep mode

    def sleep(self, level: int = 1) -> None:
        """Frees device memory (vLLM's sleep mode, ``--enable-sleep-mode``): level 1 moves the
        weights to host memory, level 2 drops them (``wake_up`` reloads the checkpoint); both
        free the KV pool. The step in flight (async scheduling) is collected first and the
        prefix cache (both tiers) is cleared, since the KV contents are gone.

        Raises:
          ValueError: sleep mode is off, level is not 1 or 2, a request is unfinished (abort
            or finish them first), or the engine already sleeps.
        """
        if not self.config.model.enable_sleep_mode:
            raise ValueError("sleep mode is off: start the engine with --enable-sleep-mode")
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level}")
        if self.has_unfinished_requests():
            raise ValueError(
                f"sleep: {self.get_num_unfinished_requests()} requests are unfinished; abort "
                "them or let them finish first"
            )
        if self._in_flight is not None:  # a step dispatched after the last request's end
            done_sched, pending = self._in_flight
            self._in_flight = None
            # Its tokens belong to requests that ended already: the scheduler drops them.
            self.scheduler.update_from_output(done_sched, self.runner.collect(pending))
        if not self.scheduler.kv_cache_manager.reset_prefix_cache():
            raise ValueError("sleep: KV blocks are still in use")
        if self.kv_event_publisher is not None:  # AllBlocksCleared, now rather than at wake-up
            events = self._block_pool.take_kv_events()
            if events:
                self.kv_event_publisher.publish(events)
        self.runner.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Puts back the weights and / or the KV pool (``tags``: "weights", "kv_cache"; None:
        both) without recompiling anything; True once the engine is fully awake.

        Raises:
          ValueError: an unknown tag, or a level-2 checkpoint that no longer matches the
            compiled model (naming the parameter).
        """
        model = self.config.model

        def load() -> tuple[Any, Any]:
            from jaxserve.model.loader import load_model

            # the weights as first loaded: quantized the same way, with the same FP8 KV scales
            loaded, arch, _ = load_model(
                model.model,
                model.dtype,
                model.load_format,
                seed=model.seed,
                quantization=model.quantization,
                kv_cache_dtype=self.config.cache.cache_dtype,
                tensor_parallel_size=(
                    None
                    if self.config.lora is not None
                    else self.config.parallel.tensor_parallel_size
                ),
                enable_expert_parallel=self.config.parallel.enable_expert_parallel,
            )
            return loaded, arch

        return self.runner.wake_up(tags, load)

    @property
    def is_sleeping(self) -> bool:
        """True while the weights or the KV pool are off the device."""
        return self.runner.is_sleeping

    # ------------------------------------------------------------------ one step

    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns a RequestOutput per parent request that progressed
        (only finished ones for ``final_only`` requests).

        Synchronous loop: schedule step N, run it, wait for its tokens, update. Async scheduling
        (``async_scheduling``, the default): schedule and dispatch step N+1 while step N runs on
        the device, then wait for step N's tokens and update: the outputs returned are step N's,
        one call behind the dispatch. A request that finishes on a token of step N (EOS, a stop
        token or string) may already be in step N+1; that step's token for it is dropped, and
        its KV blocks, freed at step N's update, are reused only by steps that run after step
        N+1 on the device (each step takes the KV pool its predecessor returned), so nothing in
        flight writes into a block after its new owner. Requests that reach ``max_tokens`` with
        step N's token are not scheduled in step N+1 at all.

        When no request could be scheduled before step N's tokens land (speculating requests,
        whose next drafts and position follow their verified tokens; penalties; see
        ``Scheduler.waits_for_in_flight``), the call collects and updates step N first, then
        schedules and dispatches step N+1, and makes step N's outputs (detokenization, stop
        strings) while step N+1 runs: one engine step per device step, no empty step between.
        """
        t0, c0 = time.perf_counter(), time.thread_time()
        timing = self.runner.timing
        host0, dev0, launch0, aside0 = (
            timing.host_s,
            timing.device_s,
            timing.launch_s,
            timing.aside_cpu_s,
        )
        core_outputs = None
        outputs: list[RequestOutput] | None = None
        if self._in_flight is not None and self.scheduler.waits_for_in_flight():
            # Nothing can run before step N's tokens (speculation: the verified tokens and the
            # next drafts): collect and update step N first, schedule and dispatch step N+1,
            # and make step N's outputs while N+1 runs (instead of an empty step N+1 and the
            # real one an engine step later). With constrained requests in the engine, step
            # N's outputs first: their grammars take step N's tokens before N+1's masks.
            (done_sched, pending), self._in_flight = self._in_flight, None
            runner_out = self.runner.collect(pending)
            tokens_time = time.monotonic()
            core_outputs = self.scheduler.update_from_output(done_sched, runner_out, batched=True)
            self.num_early_updates += 1
            if len(self.token_masks):
                outputs = self._process(core_outputs, runner_out, tokens_time)
                self.token_masks.drop(self.scheduler.finished_req_ids)
        t0s = time.perf_counter()
        sched_out = self.scheduler.schedule()
        t1 = time.perf_counter()
        token_mask = self.token_masks.step_mask(sched_out, self.scheduler.requests)
        if core_outputs is not None:  # dispatched at once: nothing else is in flight
            pending = self.runner.dispatch(sched_out, token_mask)
            self._in_flight = (sched_out, pending)
        elif self.async_scheduling:
            pending = self.runner.dispatch(sched_out, token_mask)
            done, self._in_flight = self._in_flight, (sched_out, pending)
            if done is None:
                runner_out, done_sched = None, None
            else:
                done_sched, runner_out = done[0], self.runner.collect(done[1])
        else:
            done_sched, runner_out = sched_out, self.runner.execute_model(sched_out, token_mask)
        t2 = time.perf_counter()
        if outputs is None:
            outputs = []
            if runner_out is not None:
                if core_outputs is None:
                    tokens_time = time.monotonic()  # the step's tokens are on the host
                    core_outputs = self.scheduler.update_from_output(
                        done_sched, runner_out, batched=True
                    )
                outputs = self._process(core_outputs, runner_out, tokens_time)
        if len(self.token_masks):  # finished this step: their matchers go now, not next step
            self.token_masks.drop(self.scheduler.finished_req_ids)
        t3, c3 = time.perf_counter(), time.thread_time()
        if self.kv_event_publisher is not None:
            events = self._block_pool.take_kv_events()
            if events:
                self.kv_event_publisher.publish(events)
        self._update_stats(outputs)
        st = self._stats
        st.schedule_s += t1 - t0s
        st.runner_host_s += timing.host_s - host0
        st.runner_launch_s += timing.launch_s - launch0
        st.host_cpu_s += (c3 - c0) - (timing.aside_cpu_s - aside0)
        st.runner_device_s += timing.device_s - dev0
        st.output_s += (
            (t0s - t0) + (t2 - t1) - (timing.host_s - host0) - (timing.device_s - dev0) + (t3 - t2)
        )
        return outputs

    def _process(
        self, core_outputs: Any, runner_out: ModelRunnerOutput, tokens_time: float
    ) -> list[RequestOutput]:
        """A collected step's outputs, after the scheduler's update: grammars advance (a
        complete one ends its request), detokenization and stop strings, pooled vectors; the
        requests they end are finished and their ledgers kept."""
        # Grammars see their tokens now: a complete one ends its request on this token.
        ended = self.token_masks.advance(core_outputs) if len(self.token_masks) else None
        outputs, stopped = self.output_processor.process_outputs(core_outputs, tokens_time)
        pooled = runner_out.pooler_output
        if pooled:  # pooling runner: the vectors of the prompts this step completed
            for out in outputs:
                if out.finished:
                    out.pooled = pooled.get(out.request_id)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        if ended:
            for status, req_ids in ended.items():
                self.scheduler.finish_requests(req_ids, status)
        for out in outputs:
            if out.finished:
                self.ledger_history.add(out.request_id, out.ledgers)
        return outputs

    def _update_stats(self, outputs: list[RequestOutput]) -> None:
        """The step's figures into ``self._stats`` (rows of ``jaxserve.stats_schema``): the
        scheduler's, then the engine's own counters, then every counter's running total."""
        s = self.scheduler.make_stats()
        st = self._stats
        for name in SCHEDULER_TO_ENGINE:
            setattr(st, name, getattr(s, name))
        st.num_prompt_tokens = self.output_processor.num_prompt_tokens_step
        st.num_generation_tokens = self.output_processor.num_generation_tokens_step
        st.num_finished_reqs = sum(1 for o in outputs if o.finished)
        for name, total in COUNTER_TOTALS:
            setattr(st, total, add_counts(getattr(st, total), getattr(st, name)))

    def get_stats(self) -> EngineStats:
        """A copy of the engine's figures after the latest step (see EngineStats), with the
        gauges read now (so aborts since that step show: the server's metrics rely on it)."""
        stats = dataclasses.replace(self._stats)
        stats.num_running_reqs, stats.num_waiting_reqs = self.scheduler.get_request_counts()
        stats.kv_cache_usage = self.scheduler.kv_cache_manager.usage
        return stats


def _eos_ids(
    tokenizer, generation_config: dict[str, Any], arch
) -> tuple[int | None, tuple[int, ...]]:
    """(the EOS id the scheduler checks, the other EOS ids to add to stop_token_ids)."""
    from_config = generation_config.get("eos_token_id", list(arch.eos_token_ids))
    ids = list(from_config) if isinstance(from_config, list) else [from_config]
    if tokenizer is not None:
        ids += sorted(tokenizer.eos_token_ids)
    primary = (
        tokenizer.eos_token_id
        if tokenizer is not None and tokenizer.eos_token_id is not None
        else (ids[0] if ids else None)
    )
    extra = tuple(dict.fromkeys(int(t) for t in ids if t is not None and t != primary))
    return primary, extra
