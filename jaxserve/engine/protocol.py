"""What the serving layer asks of an engine, and what ``AsyncLLM``'s thread asks of the engine it
drives: two Protocols, the one place an engine capability is declared.

``EngineClient`` is the engine as the server sees it (asyncio side): facts about the model, the
load, adding and aborting requests, ledgers, health, metrics, lifecycle. It is implemented by
``AsyncLLM`` (an engine in this process), and over Ray by ``ReplicaClient`` (one replica) and
``ReplicaSet`` (every replica behind the ingress). ``EngineCore`` is a step-loop engine as
``AsyncLLM``'s thread drives it: ``LLMEngine``, and the scripted ``FakeEngine`` the server tests
run on. A new capability (sleep, embeddings, adapters) is a member of ``EngineClient`` (and of
``EngineCore`` when the engine thread carries it out); ``tests/engine/test_engine_protocol.py``
fails until every implementation has it with the same signature.

This module imports no jax (the serving layer and its tests import it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import EngineStats
    from jaxserve.request_output import RequestOutput
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.tokenizer import Tokenizer


class EngineDeadError(RuntimeError):
    """The engine stopped on an exception; no request can be served any more.

    Attributes:
      code: the OpenAI error ``code`` a client gets for it (503): "engine_dead", or a subclass's
        own ("replica_died": a Ray replica went away under the request).
    """

    code = "engine_dead"


class EngineSleepingError(EngineDeadError):
    """The engine sleeps (``POST /sleep``): a request added meanwhile, or one it aborted to go
    to sleep (mode "abort"), gets this. A subclass of :class:`EngineDeadError` so every
    consumer ends such a request as it would under a dead engine (a 503, an error event), but
    the engine is not dead: it serves again once woken up."""

    code = "engine_sleeping"


SLEEP_MODES = ("abort", "wait")
"""What ``EngineClient.sleep`` does with unfinished requests (vLLM's pause modes): abort them
(their streams raise :class:`EngineSleepingError`), or wait for them to finish. vLLM's third,
"keep", is not served."""


class EngineUnavailableError(RuntimeError):
    """The engine did not take the request and nothing of it started: another engine may (a Ray
    replica that is down or restarting); a single engine never raises it."""


@dataclasses.dataclass(frozen=True)
class EngineHealth:
    """What ``GET /health`` reports.

    Attributes:
      healthy: the engine takes requests (200) or not (503).
      error: why not, for the error body: the exception the engine died of, or None.
      detail: a JSON object to answer with instead of the default (an empty 200 body, or
        OpenAI's error object naming ``error``): a replica set's counts.
      code: the error body's ``code`` when unhealthy: "engine_dead", "engine_stalled" (the
        engine's loop has made no progress for longer than the step timeout with work
        queued), "shutting_down".
    """

    healthy: bool
    error: BaseException | None = None
    detail: dict[str, Any] | None = None
    code: str = "engine_dead"


class RequestOutputStream(Protocol):
    """The outputs of one engine request, read with ``async for``: cumulative fields plus
    ``delta_*``, the last with ``finished=True``; raises :class:`EngineDeadError` when the engine
    dies meanwhile. Leaving the loop early does not abort the request: call :meth:`abort`."""

    @property
    def request_id(self) -> str:
        """The engine request id."""
        ...

    @property
    def finished(self) -> bool:
        """True once the final output was read (or the engine failed)."""
        ...

    def abort(self) -> None:
        """Asks the engine to drop the request unless it finished (idempotent, thread-safe)."""
        ...

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def __anext__(self) -> RequestOutput: ...


class EngineClient(Protocol):
    """An engine as the serving layer sees it (called from the server's event loop)."""

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (prompts are tokenized and responses detokenized with it)."""
        ...

    @property
    def engine_config(self) -> EngineConfig:
        """The engine's resolved configuration."""
        ...

    @property
    def model_name(self) -> str:
        """The name clients send as ``model`` (``--served-model-name``)."""
        ...

    @property
    def vocab_size(self) -> int:
        """Prompt token ids must be in ``[0, vocab_size)``: the smaller of the model's and the
        tokenizer's vocabularies (the detokenizer decodes every id)."""
        ...

    @property
    def errored(self) -> bool:
        """True once the engine died."""
        ...

    @property
    def dead_error(self) -> BaseException | None:
        """The exception the engine died of, or None."""
        ...

    @property
    def is_running(self) -> bool:
        """True while the engine's thread (or process) is alive."""
        ...

    @property
    def num_waiting_requests(self) -> int:
        """Requests not yet running (what ``--max-waiting-requests`` caps)."""
        ...

    @property
    def num_running_requests(self) -> int:
        """Requests in the running batch."""
        ...

    @property
    def num_pending_requests(self) -> int:
        """Requests added and not yet finished or aborted (what a drain waits for)."""
        ...

    @property
    def kv_cache_usage(self) -> float:
        """Used KV blocks / usable blocks, in [0, 1]."""
        ...

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> RequestOutputStream:
        """Hands a request to the engine; returns its output stream once the engine holds it
        (``lora_name``: a loaded LoRA adapter to run it on, None: the base model).

        Raises:
          ValueError: the engine refused the request (names the field), or the id is in use.
          EngineDeadError: the engine died.
          EngineUnavailableError: this engine cannot take it now; nothing started.
        """
        ...

    def lora_adapters(self) -> dict[str, str | None]:
        """The loaded LoRA adapters (#33), name -> ``base_model_name`` (None: the served
        model); empty without ``--enable-lora``."""
        ...

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Reads, checks and registers a PEFT adapter.

        Raises:
          ValueError: LoRA is off, the name is in use or a bad adapter (one line); nothing
            changes then.
        """
        ...

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Unregisters a LoRA adapter.

        Raises:
          ValueError: LoRA is off, no such adapter, or unfinished requests use it.
        """
        ...

    def abort(self, request_id: str) -> None:
        """Aborts a request (all its samples) before the engine's next step; idempotent."""
        ...

    async def get_ledger(self, request_id: str) -> dict[str, Any] | None:
        """A finished request's ledger (engine request id or response id) as JSON-ready data,
        or None when unknown or past ``--ledger-history``."""
        ...

    def check_health(self) -> None:
        """Raises EngineDeadError if the engine died."""
        ...

    def health(self) -> EngineHealth:
        """The engine's health now, for ``GET /health``."""
        ...

    async def render_metrics(self) -> tuple[bytes, str]:
        """The Prometheus exposition and its content type."""
        ...

    @property
    def is_sleeping(self) -> bool:
        """True from ``sleep`` until ``wake_up`` returned True: requests are refused
        (:class:`EngineSleepingError`)."""
        ...

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Puts the engine to sleep (vLLM's sleep mode) and returns once it sleeps.

        Args:
          level: 0 refuses new requests only; 1 also moves the weights to host memory and frees
            the KV cache; 2 drops the weights instead (``wake_up`` reloads the checkpoint).
          mode: one of :data:`SLEEP_MODES`, what happens to unfinished requests first.

        Raises:
          ValueError: sleep mode is off (``--enable-sleep-mode``), or a bad level or mode
            (naming it).
          EngineDeadError: the engine died.
        """
        ...

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Puts back what ``tags`` name ("weights", "kv_cache"; None: everything) and returns
        True once the engine is fully awake (it then takes requests again).

        Raises:
          ValueError: sleep mode is off, or an unknown tag.
          EngineDeadError: the engine died.
        """
        ...

    def add_dead_callback(self, callback: Callable[[BaseException], None]) -> None:
        """Runs ``callback(error)`` when the engine dies (at once if it is dead)."""
        ...

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine; pending requests get EngineDeadError."""
        ...


class EngineCore(Protocol):
    """A step-loop engine as ``AsyncLLM``'s thread drives it. One thread calls it (not
    thread-safe), except :meth:`get_ledger`, which any thread may call."""

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        ...

    @property
    def engine_config(self) -> EngineConfig:
        """The engine's resolved configuration."""
        ...

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (token ids it can embed)."""
        ...

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validates and queues a request (its ``n`` samples).

        Raises:
          ValueError: the request is refused (names the field); nothing is queued.
        """
        ...

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Aborts requests wherever they are and frees their blocks; unknown ids are ignored."""
        ...

    def has_unfinished_requests(self) -> bool:
        """True while a request has not produced its final output."""
        ...

    def step(self) -> list[RequestOutput]:
        """Runs one step; returns a RequestOutput per request that progressed."""
        ...

    def get_stats(self) -> EngineStats:
        """The engine's figures after the latest step (the metrics read them)."""
        ...

    def get_ledger(self, request_id: str) -> dict[str, Any] | None:
        """A finished request's ledger as JSON-ready data, or None (any thread)."""
        ...

    @property
    def is_sleeping(self) -> bool:
        """True while the weights or the KV cache are off the device (``sleep``)."""
        ...

    def sleep(self, level: int = 1) -> None:
        """Frees device memory: level 1 moves the weights to host memory, level 2 drops them;
        both free the KV cache and clear the prefix cache. Only with no unfinished request.

        Raises:
          ValueError: sleep mode is off, a bad level, or an unfinished request.
        """
        ...

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Puts back "weights" and / or "kv_cache" (None: both); True once fully awake.

        Raises:
          ValueError: an unknown tag, or reloaded weights that differ from the compiled ones.
        """
        ...

    def close(self) -> None:
        """Releases what the engine holds besides memory (the KV-event publisher)."""
        ...
