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

Watchdog: a step that never returns (a hung device) raises nothing, so a second thread watches
the step in flight; one that has run longer than ``step_timeout_s`` kills the engine the same
way (:class:`StepTimeoutError`). The engine thread, if it ever comes back, delivers nothing more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

from jaxserve.engine.protocol import EngineCore, EngineDeadError, EngineHealth
from jaxserve.metrics import EngineMetrics

if TYPE_CHECKING:
    from jaxserve.config import EngineArgs, EngineConfig
    from jaxserve.request_output import RequestOutput
    from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class StepTimeoutError(RuntimeError):
    """A step ran longer than ``step_timeout_s`` (the watchdog's verdict: the device hung)."""


DEFAULT_STEP_TIMEOUT_S = 300.0
"""Generous on purpose: a first-use compile of a sampler variant can take tens of seconds."""


def merge_outputs(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One output standing for two consecutive outputs of a request that no consumer read in
    between (vLLM V1's ``RequestOutputCollector``): ``newer``'s cumulative fields, and each
    sample's ``delta_*`` fields joined (``older``'s first), so the consumer sees the same
    text, tokens and logprobs as if it had read both. ``newer`` is updated in place and
    returned; a sample only ``older`` lists is kept as it was.
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
      finished: True once the final output was received (or the engine failed).
    """

    def __init__(
        self, request_id: str, num_samples: int, llm: AsyncLLM, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.request_id = request_id
        self.num_samples = num_samples
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
            self._pending = merge_outputs(self._pending, item)
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
      prompt, params, priority, cache_salt: as ``LLMEngine.add_request`` takes them.
      arrival_time: ``time.monotonic()`` when the request reached ``add_request``.
    """

    stream: RequestStream
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    arrival_time: float


@dataclasses.dataclass(slots=True)
class AbortRequest:
    """Inbox message: abort a request (all its samples) before the engine's next step."""

    request_id: str


InboxMessage = AddRequest | AbortRequest
"""What the event loop hands the engine thread; it handles them in order between steps."""


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
        self._cond = threading.Condition()
        self._inbox: list[InboxMessage] = []
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
        self._kv_cache_usage = 0.0
        self._handoff = _Handoff()  # engine thread only
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
    ) -> RequestStream:
        """Hands a request to the engine and returns its output stream once the engine accepted it.

        Args:
          request_id: unique among unfinished requests.
          prompt: text, or token ids (``int`` in ``[0, vocab)``).
          params: its SamplingParams.
          priority: smaller is more urgent (with the "priority" policy).
          cache_salt: tenant salt for prefix caching.

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
        stream = RequestStream(request_id, params.n, self, loop)
        message = AddRequest(stream, prompt, params, priority, cache_salt, time.monotonic())
        with self._cond:
            if self.dead_error is not None:
                raise EngineDeadError(f"engine is dead: {self.dead_error!r}")
            if self._stopping:
                raise EngineDeadError("engine is shutting down")
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

    def check_health(self) -> None:
        """Raises EngineDeadError if the engine thread died."""
        if self.dead_error is not None:
            raise EngineDeadError(f"engine is dead: {self.dead_error!r}")

    def health(self) -> EngineHealth:
        """Healthy while the engine thread lives; else the error it died of."""
        return EngineHealth(self.dead_error is None, self.dead_error)

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
                        self._cond.wait()
                    if self._stopping:
                        break
                    inbox, self._inbox = self._inbox, []
                self._process_inbox(inbox)
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
                has_work = self.engine.has_unfinished_requests()
            self._fail_pending(EngineDeadError("engine was shut down"))
            self.engine.close()  # the KV-event publisher, if any
        except BaseException as exc:  # noqa: BLE001 - any failure kills the engine, loudly
            logger.exception("engine loop died")
            self._die(exc)

    def _watch(self) -> None:
        """The watchdog thread: kills the engine when one step outlives ``step_timeout_s``."""
        period = min(1.0, self.step_timeout_s / 4)
        while self.dead_error is None and self._thread.is_alive():
            time.sleep(period)
            started = self._step_started
            if started is not None and time.monotonic() - started > self.step_timeout_s:
                error = StepTimeoutError(
                    f"a step has run for more than step_timeout_s={self.step_timeout_s:g} s "
                    f"(the device did not return)"
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
        try:
            self.metrics.record_step(stats, outputs)
        except Exception:  # noqa: BLE001 - a metrics bug must not take the engine down
            logger.exception("recording metrics failed")

    def _fail_pending(self, error: BaseException) -> None:
        with self._cond:
            inbox, self._inbox = self._inbox, []
            self._pending_ids.clear()
            self._num_inbox_adds = 0
        for message in inbox:
            if type(message) is AddRequest:
                message.stream._resolve_accept(error)
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
