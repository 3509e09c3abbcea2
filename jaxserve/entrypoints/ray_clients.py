"""The serving process's view of Ray replicas: engine clients over their actors, and routing.

:class:`ReplicaClient` is one replica actor as an ``EngineClient``: a request is relayed to its
``EngineReplica.run_request`` and the ``RequestOutput``s stream back (:class:`RelayedStream`);
its load and health are what the last poll saw. :class:`ReplicaSet` is every replica as one
``EngineClient``, the one the HTTP server runs on: requests go where the router says, ledgers
come from whichever replica has them, metrics from all. :class:`RoutedServing` is
``OpenAIServing`` over the set: each request runs whole on one replica, so responses are the
single server's, byte for byte.

A request the replica had not accepted when it failed (gone, not accepted within
``ACCEPT_TIMEOUT_S``, its engine dead) raises ``EngineUnavailableError``: the replica is marked
down and the request goes to another. One that fails after raises :class:`ReplicaDiedError`
(a 503 ``replica_died``; a stream gets it as an error event, then ``data: [DONE]``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from jaxserve.engine.protocol import (
    EngineDeadError,
    EngineHealth,
    EngineUnavailableError,
    RequestOutputStream,
)
from jaxserve.entrypoints.router import NoReplicaError, Router
from jaxserve.serving.endpoints import Generation, Job, OpenAIServing, Reply, StreamReply
from jaxserve.serving.errors import APIError
from jaxserve.serving.validation import ServingInfo

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig
    from jaxserve.request_output import RequestOutput
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 1.0
"""Seconds between health polls of each replica."""

HEALTH_TIMEOUT_S = 2.0
"""A poll unanswered within this counts as missed (a busy replica on a loaded CPU can miss one)."""

MAX_MISSED_POLLS = 3
"""Consecutive missed polls after which a replica counts as down (restarting or wedged); one
whose actor is dead counts as down at once."""

ACCEPT_TIMEOUT_S = 10.0
"""A replica whose engine has not taken a request within this is treated as down and the
request goes elsewhere (a restarting actor queues calls until it is back, tens of seconds)."""

REPLICA_HEADER = "x-jaxserve-replica"
"""The response header naming the replica (its rank) that served a request."""

T = TypeVar("T")


class ReplicaDiedError(EngineDeadError):
    """A replica went away while serving a request (its process died or was killed)."""

    code = "replica_died"


def _actor_errors() -> tuple[type[BaseException], ...]:
    import ray.exceptions as rex

    errors: list[type[BaseException]] = [rex.RayActorError]
    for name in ("ActorUnavailableError", "ActorDiedError"):
        if hasattr(rex, name):
            errors.append(getattr(rex, name))
    return tuple(errors)


async def _await_ref(ref: Any) -> Any:
    return await ref


async def _next_item(gen: Any) -> Any:
    """The next value of a Ray streaming generator (StopAsyncIteration at its end)."""
    ref = await gen.__anext__()
    return await ref


def _cancel(gen: Any) -> None:
    import ray

    try:
        ray.cancel(gen)
    except Exception:  # noqa: BLE001 - finished already, or its actor is gone
        pass


class RelayedStream:
    """A request's outputs relayed from a replica's actor (a ``RequestOutputStream``).

    Raises :class:`ReplicaDiedError` when the replica goes away, and the replica's own
    ``EngineDeadError`` when its engine dies.
    """

    def __init__(self, client: ReplicaClient, request_id: str, gen: Any) -> None:
        self.request_id = request_id
        self.finished = False
        self.on_close: Callable[[], None] | None = None  # once, when it ends or is aborted
        self._client = client
        self._gen = gen
        self._closed = False

    def __aiter__(self) -> RelayedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        client = self._client
        try:
            kind, payload = await _next_item(self._gen)
        except (StopAsyncIteration, *client.actor_errors):
            self._end()
            client.set_down()
            raise ReplicaDiedError(
                f"engine replica {client.index} died while serving this request; retry it"
            ) from None
        if kind == "dead":
            self._end()
            raise payload
        if payload.finished:
            self._end()
        return payload

    def abort(self) -> None:
        """Cancels the actor's call (which aborts the request there) unless it ended."""
        if not self._closed:
            self._close()
            _cancel(self._gen)

    def _end(self) -> None:
        self.finished = True
        self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._client.streams.pop(self.request_id, None)
        if self.on_close is not None:
            self.on_close()


class NoLoRAAdapters:
    """The ``EngineClient`` LoRA members of the Ray clients: no adapters over Ray replicas
    (not built; #33 serves them in one process)."""

    def lora_adapters(self) -> dict[str, str | None]:
        """None: LoRA adapters are not served over Ray replicas."""
        return {}

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Refused: LoRA adapters are not served over Ray replicas.

        Raises:
          ValueError: always.
        """
        raise ValueError("lora_name: LoRA adapters are not served over Ray replicas")

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Refused, as ``load_lora_adapter``.

        Raises:
          ValueError: always.
        """
        raise ValueError("lora_name: LoRA adapters are not served over Ray replicas")


class ReplicaClient(NoLoRAAdapters):
    """One replica actor as an ``EngineClient``: requests relayed to it, outputs streamed back;
    its load and health are what the last poll (:meth:`ReplicaSet.poll_once`) saw.

    Args:
      actor: the replica's actor handle.
      index: its rank.
      described: its ``EngineReplica.describe()``.
      tokenizer: the model's tokenizer (loaded once in the serving process).
      on_down: called with ``index`` when a call finds the replica gone.
    """

    errored = False  # a replica never dies for good: Ray restarts it
    dead_error = None

    def __init__(
        self,
        actor: Any,
        index: int,
        described: dict[str, Any],
        tokenizer: Tokenizer,
        on_down: Callable[[int], None],
    ) -> None:
        self.actor = actor
        self.index = index
        self.info: ServingInfo = described["info"]
        self.tokenizer = tokenizer
        self.engine_config: EngineConfig = described["engine_config"]
        self.model_name = self.info.model_name
        self.vocab_size = self.info.vocab_size
        self.up = True
        self.stats: dict[str, Any] = {}  # the last poll's EngineReplica.stats()
        self.streams: dict[str, RelayedStream] = {}  # requests in flight, by id
        self.actor_errors = _actor_errors()
        self._on_down = on_down

    @property
    def is_running(self) -> bool:
        return self.up

    @property
    def num_waiting_requests(self) -> int:
        return self.stats.get("num_waiting", 0)

    @property
    def num_running_requests(self) -> int:
        return self.stats.get("num_running", 0)

    @property
    def num_pending_requests(self) -> int:
        return len(self.streams)

    @property
    def kv_cache_usage(self) -> float:
        return self.stats.get("kv_cache_usage", 0.0)

    def set_down(self) -> None:
        """Marks the replica down (a call found its actor gone)."""
        self.up = False
        self._on_down(self.index)

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> RelayedStream:
        """Starts the request on the replica; returns once its engine holds it.

        Raises:
          ValueError: the replica's engine refused it (names the field), or the id is in use.
          EngineUnavailableError: the replica is gone, did not accept in ``ACCEPT_TIMEOUT_S``,
            or its engine is dead (it is marked down; nothing started).
        """
        if lora_name is not None:
            raise ValueError("lora_name: LoRA adapters are not served over Ray replicas")
        if request_id in self.streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        gen = self.actor.run_request.options(num_returns="streaming").remote(
            request_id, prompt, params, priority, cache_salt
        )
        try:
            kind, payload = await asyncio.wait_for(_next_item(gen), ACCEPT_TIMEOUT_S)
        except (TimeoutError, *self.actor_errors):
            _cancel(gen)
            self.set_down()
            raise EngineUnavailableError(
                f"engine replica {self.index} did not take the request"
            ) from None
        except BaseException:
            _cancel(gen)
            raise
        if kind == "refused":
            if isinstance(payload, ValueError):
                raise payload
            self.set_down()
            raise EngineUnavailableError(f"engine replica {self.index}: {payload}") from payload
        stream = self.streams[request_id] = RelayedStream(self, request_id, gen)
        return stream

    def abort(self, request_id: str) -> None:
        stream = self.streams.get(request_id)
        if stream is not None:
            stream.abort()

    async def _call(self, method: Any, *args: Any) -> Any:
        """A short actor call; raises EngineUnavailableError when it is gone or slow."""
        try:
            return await asyncio.wait_for(_await_ref(method.remote(*args)), HEALTH_TIMEOUT_S)
        except (TimeoutError, *self.actor_errors):
            raise EngineUnavailableError(f"engine replica {self.index} did not answer") from None

    async def get_ledger(self, request_id: str) -> dict[str, Any] | None:
        try:
            return await self._call(self.actor.ledger, request_id)
        except EngineUnavailableError:
            return None

    @property
    def is_sleeping(self) -> bool:
        """What the replica said last: its answer to ``sleep`` / ``wake_up``, or a poll's."""
        return bool(self.stats.get("is_sleeping", False))

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Puts the replica's engine to sleep (``AsyncLLM.sleep`` there; no time limit: mode
        "wait" lasts as long as its requests).

        Raises:
          ValueError: as ``AsyncLLM.sleep``.
          EngineUnavailableError: the replica is gone.
        """
        await self._call_unbounded(self.actor.sleep, level, mode)
        self.stats = {**self.stats, "is_sleeping": True}

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Wakes the replica's engine up; True once fully awake (raises as :meth:`sleep`)."""
        awake = await self._call_unbounded(self.actor.wake_up, tags)
        self.stats = {**self.stats, "is_sleeping": not awake}
        return awake

    async def _call_unbounded(self, method: Any, *args: Any) -> Any:
        try:
            return await _await_ref(method.remote(*args))
        except self.actor_errors:
            raise EngineUnavailableError(f"engine replica {self.index} did not answer") from None

    def check_health(self) -> None:
        """Never raises: a request for a replica that is gone is refused by ``add_request``
        (EngineUnavailableError) and goes elsewhere."""

    def health(self) -> EngineHealth:
        return EngineHealth(self.up)

    async def render_metrics(self) -> tuple[bytes, str]:
        """Raises EngineUnavailableError when the replica does not answer."""
        from jaxserve.metrics import CONTENT_TYPE_LATEST

        return (await self._call(self.actor.metrics)).encode(), CONTENT_TYPE_LATEST

    def add_dead_callback(self, callback: Callable[[BaseException], None]) -> None:
        """A replica never dies for good (Ray restarts it): the callback never runs."""

    def shutdown(self, timeout: float = 10.0) -> None:
        """Kills the actor (no restart)."""
        import ray

        self.up = False
        ray.kill(self.actor, no_restart=True)


class ReplicaSet(NoLoRAAdapters):
    """Every replica as one ``EngineClient``: what the HTTP server runs on over Ray.

    Requests go to the replica the router picks (:meth:`route`: re-picked while none has
    accepted); ledgers come from whichever replica has them, metrics from all, merged.

    Args:
      actors: the replica actor handles, by rank.
      described: each replica's ``describe()``.
      router: the routing policy's state (:attr:`router` may be replaced later).
      tokenizer: the model's tokenizer.
    """

    errored = False  # the set never dies: its replicas restart
    dead_error = None

    def __init__(
        self,
        actors: list[Any],
        described: list[dict[str, Any]],
        router: Router,
        tokenizer: Tokenizer,
    ) -> None:
        self.actors = actors
        self.router = router
        self.info: ServingInfo = described[0]["info"]
        self.tokenizer = tokenizer
        self.engine_config: EngineConfig = described[0]["engine_config"]
        self.model_name = self.info.model_name
        self.vocab_size = self.info.vocab_size
        self.clients = [
            ReplicaClient(a, i, d, tokenizer, self._set_down)
            for i, (a, d) in enumerate(zip(actors, described, strict=True))
        ]
        self.num_rerouted = 0  # requests moved off a replica that failed before starting them
        self._started_at: list[float | None] = [None] * len(actors)
        self._missed = [0] * len(actors)
        self._running = True

    # -- load and lifecycle ----------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._running

    @property
    def num_waiting_requests(self) -> int:
        return sum(c.num_waiting_requests for c in self.clients)

    @property
    def num_running_requests(self) -> int:
        return sum(c.num_running_requests for c in self.clients)

    @property
    def num_pending_requests(self) -> int:
        return sum(c.num_pending_requests for c in self.clients)

    @property
    def kv_cache_usage(self) -> float:
        """The mean over the replicas that are up."""
        up = [c.kv_cache_usage for c in self.clients if c.up]
        return sum(up) / len(up) if up else 0.0

    @property
    def is_sleeping(self) -> bool:
        """True while a replica that is up sleeps (they sleep and wake together)."""
        return any(c.is_sleeping for c in self.clients if c.up)

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Puts every replica that is up to sleep (``ReplicaClient.sleep``), concurrently."""
        await asyncio.gather(*(c.sleep(level, mode) for c in self.clients if c.up))

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Wakes every replica that is up; True once all are fully awake."""
        woken = await asyncio.gather(*(c.wake_up(tags) for c in self.clients if c.up))
        return all(woken)

    def check_health(self) -> None:
        """Never raises: requests find a replica that is up, or a 503 ``no_replica``."""

    def health(self) -> EngineHealth:
        up, total = self.router.num_up, len(self.clients)
        return EngineHealth(up > 0, detail={"replicas": total, "replicas_up": up})

    def add_dead_callback(self, callback: Callable[[BaseException], None]) -> None:
        """The set never dies (its replicas restart): the callback never runs."""

    def shutdown(self, timeout: float = 10.0) -> None:
        """Kills every replica's actor (no restart)."""
        self._running = False
        for client in self.clients:
            client.shutdown(timeout)

    # -- requests ------------------------------------------------------------------------------

    async def route(
        self,
        prompt_ids: list[int],
        cache_salt: str | None,
        start: Callable[[ReplicaClient], Awaitable[T]],
    ) -> tuple[int, T]:
        """Runs ``start`` on the replica the router picks for ``prompt_ids``, and on another
        while it raises EngineUnavailableError (nothing started there). The router counts the
        request in flight on the returned replica: call ``router.finished(index)`` at its end.

        Raises:
          NoReplicaError: no replica (left) is up.
        """
        tried: set[int] = set()
        while True:
            index, hashes = self.router.choose(prompt_ids, cache_salt, frozenset(tried))
            self.router.started(index, hashes)
            try:
                return index, await start(self.clients[index])
            except EngineUnavailableError:
                self.router.finished(index)
                tried.add(index)
                self.num_rerouted += 1
            except BaseException:
                self.router.finished(index)
                raise

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
        """Starts the request on the replica the router picks (by its prompt's prefix).

        Raises:
          ValueError: the engine refused it (names the field).
          EngineUnavailableError: no replica is up.
        """
        if lora_name is not None:
            raise ValueError("lora_name: LoRA adapters are not served over Ray replicas")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt

        async def start(client: ReplicaClient) -> RelayedStream:
            return await client.add_request(
                request_id, prompt, params, priority=priority, cache_salt=cache_salt
            )

        try:
            index, stream = await self.route(ids, cache_salt, start)
        except NoReplicaError as exc:
            raise EngineUnavailableError(f"no engine replica can take the request: {exc}") from None
        stream.on_close = lambda: self.router.finished(index)
        return stream

    def abort(self, request_id: str) -> None:
        for client in self.clients:
            client.abort(request_id)

    async def get_ledger(self, request_id: str) -> dict[str, Any] | None:
        """A finished request's ledger from whichever replica served it."""
        found = await asyncio.gather(*(c.get_ledger(request_id) for c in self.clients))
        return next((ledger for ledger in found if ledger is not None), None)

    async def render_metrics(self) -> tuple[bytes, str]:
        """The replicas' expositions merged, each sample labelled ``engine="<rank>"``; a
        replica that does not answer is left out."""
        from jaxserve.metrics import CONTENT_TYPE_LATEST, merge_expositions

        async def fetch(client: ReplicaClient) -> tuple[str, str] | None:
            try:
                body, _ = await client.render_metrics()
            except EngineUnavailableError:
                return None
            return str(client.index), body.decode()

        texts = [t for t in await asyncio.gather(*map(fetch, self.clients)) if t]
        return merge_expositions(dict(texts), "engine").encode(), CONTENT_TYPE_LATEST

    # -- health polls --------------------------------------------------------------------------

    async def poll_once(self) -> None:
        """Asks every replica for its stats (concurrently) and updates the router."""

        async def poll(client: ReplicaClient) -> None:
            i = client.index
            try:
                stats = await asyncio.wait_for(
                    _await_ref(client.actor.stats.remote()), HEALTH_TIMEOUT_S
                )
            except TimeoutError:
                self._missed[i] += 1
                if self._missed[i] >= MAX_MISSED_POLLS:
                    self._set_down(i)
                return
            except client.actor_errors:
                self._set_down(i)
                return
            self._missed[i] = 0
            restarted = (
                self._started_at[i] is not None and stats["started_at"] != (self._started_at[i])
            )
            self._started_at[i] = stats["started_at"]
            client.stats = stats
            client.up = not stats["errored"]
            self.router.update(
                i,
                up=client.up,
                num_waiting=stats["num_waiting"],
                kv_cache_usage=stats["kv_cache_usage"],
                restarted=restarted,
            )

        await asyncio.gather(*(poll(c) for c in self.clients))

    async def poll_forever(self) -> None:
        """:meth:`poll_once` every ``HEALTH_INTERVAL_S`` until cancelled."""
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            try:
                await self.poll_once()
            except Exception:  # noqa: BLE001 - keep polling
                logger.exception("health poll failed")

    def _set_down(self, i: int) -> None:
        self.clients[i].up = False
        if self.router.replicas[i].up:
            logger.warning("replica %d is down", i)
        self.router.update(i, up=False)


class RoutedServing(OpenAIServing):
    """``OpenAIServing`` over a :class:`ReplicaSet`: each request runs whole on one replica,
    the one the router picks for its (first) prompt, re-picked while none has accepted it; the
    response names it in ``x-jaxserve-replica``."""

    engine: ReplicaSet

    async def start(self, endpoint: Generation, job: Job) -> Reply:
        """Starts the job on a replica.

        Raises:
          APIError: 503 ``no_replica`` (with ``Retry-After``) when no replica can take it;
            as :meth:`OpenAIServing.start_on` otherwise.
        """
        replicas = self.engine

        async def start(client: ReplicaClient) -> Reply:
            headers = {REPLICA_HEADER: str(client.index)}
            return await self.start_on(client, endpoint, job, headers)

        try:
            index, reply = await replicas.route(job.first_prompt, job.request.cache_salt, start)
        except NoReplicaError as exc:
            raise APIError(
                f"no engine replica can take the request: {exc}",
                status=503,
                type="server_error",
                code="no_replica",
                headers={"Retry-After": "1"},
            ) from None
        if isinstance(reply, StreamReply):
            reply.on_close.append(lambda: replicas.router.finished(index))
        else:
            replicas.router.finished(index)
        return reply


def make_replica_set(
    actors: list[Any], described: list[dict[str, Any]], routing: str
) -> ReplicaSet:
    """The engine client over started replicas (tokenizer loaded here, router hashing like them).

    Raises:
      RuntimeError: the replicas' hash chains differ (an existing cluster whose workers
        override ``PYTHONHASHSEED``): prefix-aware routing could not match their caches.
    """
    from jaxserve.tokenizer.loading import load_served_tokenizer

    first = described[0]
    if len({d["none_hash"] for d in described}) != 1:
        raise RuntimeError("the replicas hash KV blocks differently (PYTHONHASHSEED differs)")
    router = Router(len(actors), routing, first["block_size"], first["none_hash"])
    for i, d in enumerate(described):
        router.update(i, up=True, capacity_blocks=d["num_gpu_blocks"] - 1)
    cfg = first["engine_config"]  # --tokenizer, --chat-template as the replicas have them
    tokenizer = load_served_tokenizer(
        cfg.model.model, cfg.model.tokenizer, cfg.serving.chat_template
    )
    return ReplicaSet(actors, described, router, tokenizer)
