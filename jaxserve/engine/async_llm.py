"""AsyncLLM: the synchronous LLMEngine driven by its own thread, with one asyncio queue per request.

The life of a request through this module (the server's view; vLLM V1's ``AsyncLLM`` with the
engine core in a thread instead of a process, JetStream's orchestrator threads):

1. ``await add_request(...)`` (or ``generate(...)``) runs on the event loop. It puts an
   :class:`AddRequest` in the inbox, a list guarded by a ``threading.Condition``, notifies the
   engine thread,
   and awaits an acknowledgement: ``LLMEngine.add_request`` may refuse the request
   (``ValueError`` naming the field), which is raised here so the server can answer 400 before
   it starts a response.
2. The engine thread sleeps on the condition while it has neither inbox items nor unfinished
   requests (no busy loop). Between steps it drains the inbox in order (adds, then any aborts
   sent after them), runs ``LLMEngine.step()``, and hands the step's ``RequestOutput``s to their
   request streams in one ``loop.call_soon_threadsafe`` (one wake-up of the loop per step, not
   per request; no polling). The event loop never waits on the engine: a step runs while the
   loop serves other clients.
3. The consumer iterates the :class:`RequestStream`; the last output has ``finished=True``. A
   consumer that lags gets the outputs it missed merged into one (``merge_outputs``).
   If the consumer goes away first (client disconnect: the handler is cancelled or closes the
   stream), the stream sends an :class:`AbortRequest`; the engine thread aborts the request
   (all ``n`` samples) before its next step, which frees its KV blocks.
4. After each step the thread folds ``LLMEngine.get_stats()`` and the step's outputs into
   :class:`~jaxserve.metrics.EngineMetrics`.

If ``step()`` (or anything else in the engine thread) raises, the engine is dead: every pending
request's stream raises :class:`EngineDeadError`, later calls raise it at once, ``errored``
turns true (the server's ``/health`` answers 503) and the ``on_dead`` callbacks run, which the
server uses to exit non-zero instead of hanging.

Liveness: the engine thread heartbeats. Each turn of its loop that has work (inbox messages or
unfinished requests: adding requests, one step, handing the outputs over) records when it
started; going idle clears it. ``health()`` is unhealthy while a turn has run longer than
``step_timeout_s`` (``engine_stalled``: the thread is stuck, in a model step or in host-side
work such as building a request's token masks), once the engine died (``engine_dead``), and
once it is shutting down (``shutting_down``). A second thread, the watchdog, kills the engine
the same way as an exception would when a turn outlives ``step_timeout_s``
(:class:`StepTimeoutError`, its message says whether a model step or host-side work hung); the
engine thread, if it ever comes back, delivers nothing more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

from jaxserve.engine.protocol import (
    SLEEP_MODES,
    EngineCore,
    EngineDeadError,
    EngineHealth,
    EngineSleepingError,
)
from jaxserve.metrics import EngineMetrics
from jaxserve.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from jaxserve.config import EngineArgs, EngineConfig
    from jaxserve.request_output import RequestOutput
    from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class StepTimeoutError(RuntimeError):
    """A turn of the engine loop ran longer than ``step_timeout_s`` (the watchdog's verdict: the
    device hung, or host-side work did)."""


DEFAULT_STEP_TIMEOUT_S = 300.0
"""Generous on purpose: a first-use compile of a sampler variant can take tens of seconds."""


def merge_outputs(
    older: RequestOutput, newer: RequestOutput, *, delta: bool = False
) -> RequestOutput:
    """One output standing for two consecutive outputs of a request that no consumer read in
    between (vLLM V1's ``RequestOutputCollector``): each sample's ``delta_*`` fields joined
    (``older``'s first), so the consumer sees the same text, tokens and logprobs as if it had
    read both, and ``newer``'s cumulative fields, or with ``delta`` (the request's outputs are
    ``RequestOutputKind.DELTA``) its text, token ids and logprobs joined as well. ``newer`` is
    updated in place and returned; a sample only ``older`` lists is kept as it was.
    """
    old_by_index = {c.index: c for c in older.outputs}
    for completion in newer.outputs:
        old = old_by_index.pop(completion.index, None)
        if old is None:
            continue
        if old.delta_text:
            completion.delta_text = old.delta_text + completion.delta_text
        if old.delta_token_ids:
            completion.delta_token_ids = old.delta_token_ids + completion.delta_token_ids
        if old.delta_logprobs is not None:
            completion.delta_logprobs = old.delta_logprobs + (completion.delta_logprobs or [])
        if delta:
            completion.text = completion.delta_text
            completion.token_ids = completion.delta_token_ids
            if completion.logprobs is not None:
                completion.logprobs = completion.delta_logprobs or []
    if old_by_index:  # a sample the newer output left out (not the engine's case, see outputs)
        newer.outputs = sorted([*newer.outputs, *old_by_index.values()], key=lambda c: c.index)
    if newer.prompt_logprobs is None:
        newer.prompt_logprobs = older.prompt_logprobs
    return newer


class RequestStream:
    """The outputs of one request, delivered from the engine thread to the consumer's loop.

    Iterate it with ``async for``; it ends after the output with ``finished=True`` and raises
    :class:`EngineDeadError` if the engine dies meanwhile. ``abort()`` (idempotent) asks the
    engine to drop the request; leaving an ``async for`` early does not abort by itself, so
    consumers wrap iteration in ``try/finally: stream.abort()`` (as ``AsyncLLM.generate`` does).

    At most one output waits to be read: when the consumer lags behind the engine, a new output
    is merged into the waiting one (:func:`merge_outputs`: the latest cumulative state, the
    deltas joined), so a slow consumer does one read, one SSE chunk and one socket write per
    turn of the event loop instead of one per engine step.

    Attributes:
      request_id: the engine request id.
      num_samples: the request's ``n``.
      delta: its outputs are ``RequestOutputKind.DELTA`` (unread ones merge by joining).
      finished: True once the final output was received (or the engine failed).
    """

    def __init__(
        self,
        request_id: str,
        num_samples: int,
        llm: AsyncLLM,
        loop: asyncio.AbstractEventLoop,
        *,
        delta: bool = False,
    ) -> None:
        self.request_id = request_id
        self.num_samples = num_samples
        self.delta = delta
        self.finished = False
        self._llm = llm
        self._loop = loop
        self._pending: RequestOutput | None = None  # not yet read (merged while unread)
        self._error: BaseException | None = None  # raised after the pending output is read
        self._waiter: asyncio.Future[None] | None = None
        self._accepted: asyncio.Future[None] = loop.create_future()
        self._aborted = False

    # Consumer's loop side (called there by the engine thread's batched deliveries) --------------

    def _put(self, item: RequestOutput | BaseException) -> None:
        """Stores an output (merged into an unread one) or the engine's error; wakes the reader."""
        if isinstance(item, BaseException):
            self._error = item
        elif self._pending is None:
            self._pending = item
        else:
            self._pending = merge_outputs(self._pending, item, delta=self.delta)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _deliver(self, item: Any) -> bool:
        """Schedules ``item`` (a RequestOutput or an exception) onto the consumer's loop."""
        try:
            self._loop.call_soon_threadsafe(self._put, item)
            return True
        except RuntimeError:  # the consumer's loop is closed: nobody will read this
            return False

    def _resolve_accept_now(self, error: BaseException | None) -> None:
        if self._accepted.done():
            return
        if error is None:
            self._accepted.set_result(None)
        else:
            self._accepted.set_exception(error)

    def _resolve_accept(self, error: BaseException | None) -> bool:
        try:
            self._loop.call_soon_threadsafe(self._resolve_accept_now, error)
            return True
        except RuntimeError:
            return False

    # Consumer side -------------------------------------------------------------------------

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while self._pending is None and self._error is None:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        output = self._pending
        if output is None:
            self.finished = True
            raise self._error  # type: ignore[misc]
        self._pending = None
        if output.finished:
            self.finished = True
        return output

    def abort(self) -> None:
        """Asks the engine to abort this request unless it already finished (thread-safe)."""
        if self.finished or self._aborted:
            return
        self._aborted = True
        self._llm.abort(self.request_id)


@dataclasses.dataclass(slots=True)
class AddRequest:
    """Inbox message: hand a request to the engine (:meth:`AsyncLLM.add_request`).

    Attributes:
      stream: where its outputs go; the engine thread resolves its acceptance.
      prompt, params, priority, cache_salt, lora_name: as ``LLMEngine.add_request`` takes them.
      arrival_time: ``time.monotonic()`` when the request reached ``add_request``.
    """

    stream: RequestStream
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    arrival_time: float
    lora_name: str | None = None


@dataclasses.dataclass(slots=True)
class AbortRequest:
    """Inbox message: abort a request (all its samples) before the engine's next step."""

    request_id: str


@dataclasses.dataclass(slots=True)
class SleepRequest:
    """Inbox message: put the engine to sleep (:meth:`AsyncLLM.sleep`); ``done`` resolves on
    ``loop`` once it sleeps (mode "wait": once the unfinished requests finished)."""

    level: int
    mode: str
    done: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


@dataclasses.dataclass(slots=True)
class WakeRequest:
    """Inbox message: wake the engine up (:meth:`AsyncLLM.wake_up`); ``done`` resolves to
    whether it is fully awake."""

    tags: list[str] | None
    done: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


@dataclasses.dataclass(slots=True)
class LoRARequest:
    """Inbox message: load (``path`` given) or unload a LoRA adapter between steps
    (:meth:`AsyncLLM.load_lora_adapter`); ``done`` resolves to None or the engine's error."""

    name: str
    path: str | None
    done: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


InboxMessage = AddRequest | AbortRequest | SleepRequest | WakeRequest | LoRARequest
"""What the event loop hands the engine thread; it handles them in order between steps."""


def _resolve(
    message: SleepRequest | WakeRequest | LoRARequest, result: Any = None, error: Any = None
) -> None:
    """Resolves a sleep / wake message's future on its loop (from the engine thread)."""

    def settle() -> None:
        if not message.done.done():
            if error is None:
                message.done.set_result(result)
            else:
                message.done.set_exception(error)

    try:
        message.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the caller's loop is closed: nobody waits
        pass


class _Handoff:
    """Calls for the consumers' event loops gathered on the engine thread during one turn of its
    loop, then handed over with one ``call_soon_threadsafe`` per loop (one wake-up of the server's
    loop per step, not one per request: each wake-up is a self-pipe write and a loop turn)."""

    def __init__(self) -> None:
        self._calls: dict[asyncio.AbstractEventLoop, list[tuple[Any, ...]]] = {}

    def add(self, stream: RequestStream, fn: Callable[..., None], arg: Any) -> None:
        """Queues ``fn(arg)`` for ``stream``'s loop."""
        calls = self._calls.get(stream._loop)
        if calls is None:
            calls = self._calls[stream._loop] = []
        calls.append((fn, arg, stream))

    def flush(self) -> list[RequestStream]:
        """Hands the queued calls over; returns the streams whose loop is closed (nobody will
        read them)."""
        calls, self._calls = self._calls, {}
        lost: list[RequestStream] = []
        for loop, batch in calls.items():
            try:
                loop.call_soon_threadsafe(_run_batch, batch)
            except RuntimeError:  # the consumer's loop is closed
                lost.extend(stream for _, _, stream in batch)
        return lost


def _run_batch(batch: list[tuple[Any, ...]]) -> None:
    """Runs a batch of calls handed over from the engine thread (on the consumer's loop)."""
    for fn, arg, _ in batch:
        fn(arg)


class AsyncLLM:
    """An :class:`~jaxserve.engine.llm_engine.LLMEngine` in a background thread, for asyncio
    callers: the in-process :class:`~jaxserve.engine.protocol.EngineClient`.

    Args:
      engine: a built LLMEngine, or any :class:`~jaxserve.engine.protocol.EngineCore` (the
        server tests' scripted FakeEngine). From now on only the engine thread touches it.
      metrics: where the engine thread records metrics; default a new
        :class:`~jaxserve.metrics.EngineMetrics` for the served model name.
      step_timeout_s: a step running longer than this, seconds, marks the engine dead (see the
        module docstring); 0 turns the watchdog off.

    The thread starts in the constructor; ``shutdown()`` stops it.
    """

    def __init__(
        self,
        engine: EngineCore,
        *,
        metrics: EngineMetrics | None = None,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.engine_config: EngineConfig = engine.engine_config
        self.model_name: str = self.engine_config.model.served_model_name
        # Token ids must be known to both the model and the tokenizer (the detokenizer decodes them).
        self.vocab_size: int = min(v for v in (self.tokenizer.vocab_size, engine.vocab_size) if v)
        self.metrics = metrics or EngineMetrics(
            self.model_name,
            self.engine_config.cache,
            namespace=self.engine_config.observability.metrics_namespace,
            max_model_len=self.engine_config.scheduler.max_model_len,
        )
        # --expert-load-metrics on a MoE model: the runner's recorder, read at each scrape.
        expert_load = getattr(getattr(engine, "runner", None), "expert_load", None)
        if expert_load is not None and metrics is None:
            self.metrics.add_expert_load(expert_load)
        self._cond = threading.Condition()
        self._inbox: list[InboxMessage] = []
        # the loaded LoRA adapters (#33), name -> parent; rewritten by the engine thread
        list_loras = getattr(engine, "list_loras", None)
        self._lora_adapters: dict[str, str | None] = list_loras() if list_loras else {}
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._pending_ids: set[str] = set()  # ids added and not finished (under _cond)
        self._num_inbox_adds = 0  # adds not yet handed to the engine
        self._stopping = False
        self.dead_error: BaseException | None = None
        self._dead_callbacks: list[Callable[[BaseException], None]] = []
        self._num_waiting = 0
        self._num_running = 0
        self.step_timeout_s = step_timeout_s
        self._step_started: float | None = None  # monotonic start of the step in flight
        # Heartbeat: monotonic start of the loop turn in progress; None while idle (see the
        # module docstring, "Liveness").
        self._turn_started: float | None = None
        # The inbox messages the engine thread is handing to the engine now: if it dies (or the
        # watchdog gives up) meanwhile, their callers still get an answer.
        self._processing: list[InboxMessage] = []
        self._kv_cache_usage = 0.0
        self._handoff = _Handoff()  # engine thread only
        # Sleep mode: requests are refused from sleep() until wake_up() is fully done
        # (under _cond); the engine thread's sleep waiting for requests to finish (mode "wait").
        self._paused = False
        self._pending_sleep: SleepRequest | None = None  # engine thread only
        self._sleep_lock: asyncio.Lock | None = None  # sleeps and wakes one at a time
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()
        if step_timeout_s > 0:
            threading.Thread(target=self._watch, name="jaxserve-watchdog", daemon=True).start()

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, *, step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S
    ) -> AsyncLLM:
        """Builds the LLMEngine (loads weights, sizes the KV pool, compiles) and starts the thread."""
        from jaxserve.engine.llm_engine import LLMEngine  # local: keeps importing this module cheap

        return cls(LLMEngine.from_engine_args(engine_args), step_timeout_s=step_timeout_s)

    # Public API (event loop side) ----------------------------------------------------------

    @property
    def errored(self) -> bool:
        """True once the engine thread died."""
        return self.dead_error is not None

    @property
    def num_waiting_requests(self) -> int:
        """Requests not yet running: the scheduler's waiting queue after the last step plus adds
        still in the inbox (what ``--max-waiting-requests`` caps)."""
        with self._cond:
            return self._num_waiting + self._num_inbox_adds

    @property
    def num_running_requests(self) -> int:
        """Requests in the running batch after the last step."""
        return self._num_running

    @property
    def num_pending_requests(self) -> int:
        """Requests added and not yet finished or aborted (what a drain waits for)."""
        with self._cond:
            return len(self._pending_ids)

    @property
    def kv_cache_usage(self) -> float:
        """Used KV blocks / usable blocks after the last step, in [0, 1]."""
        return self._kv_cache_usage

    def add_dead_callback(self, callback: Callable[[BaseException], None]) -> None:
        """Runs ``callback(error)`` from the engine thread when it dies (at once if it is dead)."""
        with self._cond:
            if self.dead_error is None:
                self._dead_callbacks.append(callback)
                return
        callback(self.dead_error)

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> RequestStream:
        """Hands a request to the engine and returns its output stream once the engine accepted it.

        Args:
          request_id: unique among unfinished requests.
          prompt: text, or token ids (``int`` in ``[0, vocab)``).
          params: its SamplingParams.
          priority: smaller is more urgent (with the "priority" policy).
          cache_salt: tenant salt for prefix caching.
          lora_name: a loaded LoRA adapter to run it on (None: the base model).

        Raises:
          ValueError: the engine refused the request (bad prompt or params; names the field), or
            the id is already in use, or ``params.token_mask_plan``'s compile refused its
            constraint (awaited here, before the request reaches the engine).
          EngineDeadError: the engine thread died.
        """
        plan = params.token_mask_plan
        if plan is not None:  # its grammar compiles in a compile thread: wait without a thread
            await plan.ready()
        loop = asyncio.get_running_loop()
        delta = params.output_kind == RequestOutputKind.DELTA
        stream = RequestStream(request_id, params.n, self, loop, delta=delta)
        message = AddRequest(
            stream, prompt, params, priority, cache_salt, time.monotonic(), lora_name
        )
        with self._cond:
            if self.dead_error is not None:
                raise EngineDeadError(f"engine is dead: {self.dead_error!r}")
            if self._stopping:
                raise EngineDeadError("engine is shutting down")
            if self._paused:
                raise EngineSleepingError("the engine is asleep (POST /wake_up wakes it)")
            if request_id in self._pending_ids:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._pending_ids.add(request_id)
            self._num_inbox_adds += 1
            self._inbox.append(message)
            self._cond.notify()
        try:
            await stream._accepted
        except asyncio.CancelledError:
            stream.abort()
            raise
        return stream

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yields the request's RequestOutputs (cumulative fields plus ``delta_*``) until finished.

        Closing the generator early (client gone) aborts the request. Raises like
        :meth:`add_request`, and :class:`EngineDeadError` mid-way if the engine dies.
        """
        stream = await self.add_request(
            request_id, prompt, params, priority=priority, cache_salt=cache_salt
        )
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    async def get_ledger(self, request_id: str) -> dict[str, Any] | None:
        """A finished request's ledger as JSON-ready data (see LedgerHistory.get), or None."""
        return self.engine.get_ledger(request_id)

    async def render_metrics(self) -> tuple[bytes, str]:
        """This engine's Prometheus exposition and its content type."""
        return self.metrics.render(), self.metrics.content_type

    def abort(self, request_id: str) -> None:
        """Aborts a request (all its samples) before the engine's next step; thread-safe, idempotent."""
        with self._cond:
            if self.dead_error is not None or request_id not in self._pending_ids:
                return
            self._inbox.append(AbortRequest(request_id))
            self._cond.notify()

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive (it may be hung in a step the watchdog gave
        up on)."""
        return self._thread.is_alive()

    @property
    def is_sleeping(self) -> bool:
        """True from ``sleep`` until ``wake_up`` returned True (requests are refused)."""
        return self._paused

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Puts the engine to sleep (``EngineClient.sleep``): from now on ``add_request``
        raises EngineSleepingError; mode "abort" ends the unfinished requests with it, mode
        "wait" lets them finish; then, for level 1 or 2, the engine frees its device memory
        (``LLMEngine.sleep``). Returns once it sleeps.

        Raises:
          ValueError: sleep mode is off, or a bad level or mode (naming it).
          EngineDeadError: the engine died.
        """
        self._check_sleep_mode()
        if level not in (0, 1, 2):
            raise ValueError(f"level must be 0, 1 or 2, got {level!r}")
        if mode not in SLEEP_MODES:
            raise ValueError(f"mode must be one of {list(SLEEP_MODES)}, got {mode!r}")
        async with self._lock_for_sleep():
            await self._send_and_wait(lambda done, loop: SleepRequest(level, mode, done, loop))

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Wakes the engine up (``EngineClient.wake_up``); True once fully awake.

        Raises:
          ValueError: sleep mode is off, or an unknown tag.
          EngineDeadError: the engine died.
        """
        self._check_sleep_mode()
        async with self._lock_for_sleep():
            return await self._send_and_wait(lambda done, loop: WakeRequest(tags, done, loop))

    def _check_sleep_mode(self) -> None:
        if not self.engine_config.model.enable_sleep_mode:
            raise ValueError("sleep mode is off: start the server with --enable-sleep-mode")

    def _lock_for_sleep(self) -> asyncio.Lock:
        if self._sleep_lock is None:
            self._sleep_lock = asyncio.Lock()
        return self._sleep_lock

    async def _send_and_wait(self, make: Callable[..., SleepRequest | WakeRequest]) -> Any:
        """Hands a sleep / wake message to the engine thread and awaits its answer."""
        loop = asyncio.get_running_loop()
        message = make(loop.create_future(), loop)
        with self._cond:
            if self.dead_error is not None or self._stopping:
                raise EngineDeadError(f"engine is dead: {self.dead_error!r}")
            if type(message) is SleepRequest:
                self._paused = True  # refuse adds from now on, before the thread sees it
            self._inbox.append(message)
            self._cond.notify()
        return await message.done

    def lora_adapters(self) -> dict[str, str | None]:
        """The loaded LoRA adapters, name -> ``base_model_name`` (None: the served model)."""
        return dict(self._lora_adapters)

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Reads, checks and registers a PEFT adapter between two steps.

        Raises:
          ValueError: LoRA is off, the name is in use, or a bad adapter (one line).
          EngineDeadError: the engine died.
        """
        await self._send_lora(lora_name, lora_path)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Unregisters a LoRA adapter between two steps.

        Raises:
          ValueError: LoRA is off, no such adapter, or unfinished requests use it.
          EngineDeadError: the engine died.
        """
        await self._send_lora(lora_name, None)

    async def _send_lora(self, name: str, path: str | None) -> None:
        if self.engine_config.lora is None:
            raise ValueError("lora_name: the server runs without --enable-lora")
        loop = asyncio.get_running_loop()
        message = LoRARequest(name, path, loop.create_future(), loop)
        with self._cond:
            if self.dead_error is not None or self._stopping:
                raise EngineDeadError(f"engine is dead: {self.dead_error!r}")
            self._inbox.append(message)
            self._cond.notify()
        await message.done

    def check_health(self) -> None:
        """Raises EngineDeadError if the engine thread died."""
        if self.dead_error is not None:
            raise EngineDeadError(f"engine is dead: {self.dead_error!r}")

    def stalled_s(self) -> float:
        """Seconds the loop turn in progress has run (0 while idle): past ``step_timeout_s``
        the engine is stalled."""
        started = self._turn_started
        return 0.0 if started is None else time.monotonic() - started

    def health(self) -> EngineHealth:
        """Healthy while the engine thread lives, is not shutting down and its loop turn in
        progress (if any) is younger than ``step_timeout_s``; else why not (``code``:
        ``engine_dead``, ``shutting_down`` or ``engine_stalled``)."""
        if self.dead_error is not None:
            return EngineHealth(False, self.dead_error)
        if self._stopping:
            return EngineHealth(
                False, EngineDeadError("engine is shutting down"), code="shutting_down"
            )
        stalled = self.stalled_s()
        if self.step_timeout_s > 0 and stalled > self.step_timeout_s:
            where = "a model step" if self._step_started is not None else "host-side work"
            error = StepTimeoutError(
                f"the engine loop has not completed a turn for {stalled:.1f} s (more than "
                f"step_timeout_s={self.step_timeout_s:g} s) with work queued: stuck in {where}"
            )
            return EngineHealth(False, error, code="engine_stalled")
        return EngineHealth(True)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine thread after its current step; pending requests get EngineDeadError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # Engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            has_work = False
            while True:
                with self._cond:
                    while not self._inbox and not has_work and not self._stopping:
                        self._turn_started = None  # idle: nothing is late
                        self._cond.wait()
                    if self._stopping:
                        break
                    inbox, self._inbox = self._inbox, []
                    self._turn_started = time.monotonic()
                    self._processing = inbox
                self._process_inbox(inbox)
                self._processing = []
                outputs: list[RequestOutput] = []
                if self.engine.has_unfinished_requests():
                    self._step_started = time.monotonic()
                    try:
                        outputs = self.engine.step()
                    finally:
                        self._step_started = None
                    if self.dead_error is not None:  # the watchdog gave up on this step
                        return
                wanted = [
                    o for o in outputs if o.request_id in self._streams
                ]  # not aborted meanwhile
                self._record(
                    wanted
                )  # before delivery, so a client that got its answer sees its metrics
                self._dispatch(wanted)
                if self._pending_sleep is not None:
                    self._maybe_sleep()
                has_work = self.engine.has_unfinished_requests()
            self._fail_pending(EngineDeadError("engine was shut down"))
            self.engine.close()  # the KV-event publisher, if any
        except BaseException as exc:  # noqa: BLE001 - any failure kills the engine, loudly
            logger.exception("engine loop died")
            self._die(exc)

    def _watch(self) -> None:
        """The watchdog thread: kills the engine when one turn of its loop (a model step, or
        host-side work: adding requests, scheduling, output processing) outlives
        ``step_timeout_s``."""
        period = min(1.0, self.step_timeout_s / 4)
        while self.dead_error is None and self._thread.is_alive():
            time.sleep(period)
            if self.stalled_s() > self.step_timeout_s:
                if self._step_started is not None:
                    what = "a step has run"
                    why = "the device did not return"
                else:
                    what = "the engine loop's host-side work has run"
                    why = "adding requests, scheduling or output processing did not return"
                error = StepTimeoutError(
                    f"{what} for more than step_timeout_s={self.step_timeout_s:g} s ({why})"
                )
                logger.error("engine watchdog: %s; marking the engine dead", error)
                self._die(error)
                return

    def _process_inbox(self, inbox: list[InboxMessage]) -> None:
        num_adds = 0
        for message in inbox:
            if type(message) is AbortRequest:
                self._abort_in_engine(message.request_id)
                continue
            if type(message) is SleepRequest:
                self._start_sleep(message)
                continue
            if type(message) is WakeRequest:
                self._wake(message)
                continue
            if type(message) is LoRARequest:
                try:
                    if message.path is None:
                        self.engine.remove_lora(message.name)
                    else:
                        self.engine.add_lora(message.name, message.path)
                except ValueError as exc:
                    _resolve(message, error=exc)
                else:
                    self._lora_adapters = self.engine.list_loras()
                    _resolve(message)
                continue
            num_adds += 1
            stream = message.stream
            if stream._aborted:  # the client left before the engine saw the request
                self._forget(stream.request_id)
                continue
            try:
                self.engine.add_request(
                    stream.request_id,
                    message.prompt,
                    message.params,
                    priority=message.priority,
                    cache_salt=message.cache_salt,
                    arrival_time=message.arrival_time,
                    **({"lora_name": message.lora_name} if message.lora_name else {}),
                )
            except Exception as exc:  # noqa: BLE001 - a refused request is the client's problem
                self._forget(stream.request_id)
                if not isinstance(exc, ValueError):
                    logger.exception("engine refused request %s", stream.request_id)
                stream._resolve_accept(exc)
                continue
            self._streams[stream.request_id] = stream
            self._handoff.add(stream, stream._resolve_accept_now, None)
        for stream in self._handoff.flush():  # before the step: the handlers start meanwhile
            self._abort_in_engine(stream.request_id)
        if num_adds:
            # The adds leave the inbox count and enter the scheduler's waiting count at once, so
            # ``num_waiting_requests`` (the 503 check) never misses them during the next step.
            waiting = self.engine.get_stats().num_waiting_reqs
            with self._cond:
                self._num_waiting = waiting
                self._num_inbox_adds -= num_adds

    def _start_sleep(self, message: SleepRequest) -> None:
        """Mode "abort": ends every unfinished request with EngineSleepingError now; the sleep
        itself happens once none is left (:meth:`_maybe_sleep`, after each step)."""
        if message.mode == "abort":
            error = EngineSleepingError("the engine was put to sleep (POST /sleep); retry later")
            for request_id, stream in list(self._streams.items()):
                self._abort_in_engine(request_id)
                self._handoff.add(stream, stream._put, error)
            self._handoff.flush()
        self._pending_sleep = message

    def _maybe_sleep(self) -> None:
        """Sleeps as the pending message asks once no request is unfinished; its future gets
        the result (or the engine's ValueError)."""
        message = self._pending_sleep
        if message is None or self.engine.has_unfinished_requests():
            return
        self._pending_sleep = None
        try:
            if message.level > 0:
                self.engine.sleep(message.level)
        except ValueError as exc:
            with self._cond:
                self._paused = self.engine.is_sleeping
            _resolve(message, error=exc)
            return
        except BaseException as exc:  # the engine dies of it (_run); its caller hears first
            _resolve(message, error=EngineDeadError(f"sleep failed: {exc!r}"))
            raise
        _resolve(message)

    def _wake(self, message: WakeRequest) -> None:
        """Wakes the engine up as the message asks; requests are taken again once fully awake.
        vLLM's "scheduling" tag (un-pausing only) needs nothing of the engine."""
        tags = message.tags
        engine_tags = None if tags is None else [t for t in tags if t != "scheduling"]
        try:
            if engine_tags is None or engine_tags:
                self.engine.wake_up(engine_tags)
        except ValueError as exc:
            _resolve(message, error=exc)
            return
        except BaseException as exc:  # the engine dies of it (_run); its caller hears first
            _resolve(message, error=EngineDeadError(f"wake-up failed: {exc!r}"))
            raise
        awake = not self.engine.is_sleeping
        if awake:
            with self._cond:
                self._paused = False
        _resolve(message, awake)

    def _abort_in_engine(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self.engine.abort_request([request_id])
        self._forget(request_id)
        self.metrics.record_abort(request_id, stream.num_samples)

    def _forget(self, request_id: str) -> None:
        with self._cond:
            self._pending_ids.discard(request_id)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hands the step's outputs to their streams: one hand-over per consumer loop."""
        streams = self._streams
        handoff = self._handoff
        for output in outputs:
            stream = streams[output.request_id]
            if output.finished:
                del streams[output.request_id]
                self._forget(output.request_id)
            handoff.add(stream, stream._put, output)
        for stream in handoff.flush():  # the consumer's loop is gone (no-op once finished)
            self._abort_in_engine(stream.request_id)

    def _record(self, outputs: list[RequestOutput]) -> None:
        stats = self.engine.get_stats()
        if stats is not None:
            with self._cond:
                self._num_waiting = stats.num_waiting_reqs
            self._num_running = stats.num_running_reqs
            self._kv_cache_usage = stats.kv_cache_usage
        lora_info = getattr(self.engine, "lora_requests_info", None)
        try:
            self.metrics.record_step(stats, outputs)
            if lora_info is not None and (info := lora_info()) is not None:
                self.metrics.record_lora_info(*info)
        except Exception:  # noqa: BLE001 - a metrics bug must not take the engine down
            logger.exception("recording metrics failed")

    def _fail_pending(self, error: BaseException) -> None:
        with self._cond:
            inbox, self._inbox = [*self._processing, *self._inbox], []
            self._pending_ids.clear()
            self._num_inbox_adds = 0
        for message in inbox:  # not yet accepted (resolving an accepted one is a no-op)
            if type(message) is AddRequest:
                message.stream._resolve_accept(error)
            elif type(message) in (SleepRequest, WakeRequest):
                _resolve(message, error=error)
        if self._pending_sleep is not None:
            _resolve(self._pending_sleep, error=error)
            self._pending_sleep = None
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._deliver(error)

    def _die(self, exc: BaseException) -> None:
        error = EngineDeadError(f"engine loop died: {exc!r}")
        error.__cause__ = exc
        with self._cond:
            if self.dead_error is not None:  # the watchdog and the engine thread both saw it
                return
            self.dead_error = exc
            callbacks, self._dead_callbacks = self._dead_callbacks, []
        for callback in callbacks:  # first, so a client that sees the error also sees their effect
            try:
                callback(exc)
            except Exception:  # noqa: BLE001
                logger.exception("engine-dead callback failed")
        self._fail_pending(error)
