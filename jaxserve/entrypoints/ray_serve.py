"""Data-parallel replicas on Ray: N engine actors behind one OpenAI-compatible ingress.

``jaxserve serve --data-parallel-size N`` (or ``--distributed-executor-backend ray``) starts,
on a local Ray cluster it starts itself or on an existing one (``--ray-address``):

* N :class:`EngineReplica` actors, each a process owning its devices with its own
  ``AsyncLLM`` (engine thread, KV pool, metrics). Ray restarts one that dies
  (``max_restarts``). Every replica gets the same ``PYTHONHASHSEED``, so all compute the same
  block hashes as each other and as the router;
* in this process, the ingress: the same aiohttp app as a single server (validation, auth,
  ``/v1/models``, ``/tokenize``), whose generation routes validate and tokenize the request
  here, ask the :class:`~jaxserve.entrypoints.router.Router` for a replica
  (``--routing prefix-aware|least-loaded|round-robin``) and relay its answer. The replica runs
  the server's own serving functions, so responses are the single server's, byte for byte.

Failures. A replica first yields ``("accepted", None)`` once its engine holds the request.
If the replica dies before that (or does not accept within ``ACCEPT_TIMEOUT_S``: a restarting
actor queues calls), the request had not started: the ingress marks the replica down and sends
the request to another one. If it dies after, the client gets
a 503 ``replica_died`` (a stream: an error event, then ``data: [DONE]``); nothing hangs.
A poll every ``HEALTH_INTERVAL_S`` marks replicas up or down (and empties the router's prefix
index of one that restarted); ``GET /health`` answers
``{"replicas": N, "replicas_up": k}``, 200 while k >= 1, else 503. ``GET /metrics`` merges the
replicas' expositions with an ``engine="<rank>"`` label.

Why Ray core actors and not Ray Serve's proxy and controller: the router needs each request's
token ids and the replicas' live load, which our own ingress has at hand, and Ray Serve's HTTP
proxy, controller and FastAPI stack would add three processes and tens of seconds of start-up
on the CPU boxes this runs on; the actors are what Ray Serve would run underneath.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from jaxserve.config import EngineArgs
from jaxserve.entrypoints.openai.api_server import (
    _read_json,
    build_app,
    check_port_free,
    config_report,
    json_response,
    ledger_response,
    prepare,
    serve_until_signal,
)
from jaxserve.entrypoints.openai.sse import DONE_EVENT, SSEEncoder
from jaxserve.entrypoints.router import POLICIES, NoReplicaError, Router
from jaxserve.serving.errors import APIError
from jaxserve.serving.validation import ServingInfo

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

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def _replica_died(message: str) -> APIError:
    return APIError(message, status=503, type="server_error", code="replica_died")


# ---- the replica (runs in a Ray actor process) ------------------------------------------------


class _AcceptProbe:
    """An AsyncLLM seen through a proxy that notes when the engine accepted a request."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        self.accepted = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    async def add_request(self, *args: Any, **kwargs: Any) -> Any:
        stream = await self._llm.add_request(*args, **kwargs)
        self.accepted.set()
        return stream


class EngineReplica:
    """One engine replica (used as a Ray actor: ``ray.remote(EngineReplica)``).

    Args:
      engine_args: the engine's flags (``data_parallel_rank`` is set from ``rank``).
      rank: the replica's index in ``[0, data_parallel_size)``.
      step_timeout_s: the engine's step watchdog (``--step-timeout-s``; None: its default).
    """

    def __init__(
        self, engine_args: EngineArgs, rank: int, step_timeout_s: float | None = None
    ) -> None:
        from jaxserve.engine.async_llm import AsyncLLM

        logging.basicConfig(
            level=logging.INFO, format=f"%(asctime)s %(levelname)s replica{rank} %(message)s"
        )
        self.rank = rank
        self.started_at = time.time()
        kwargs = {} if step_timeout_s is None else {"step_timeout_s": step_timeout_s}
        self.llm = AsyncLLM.from_engine_args(
            dataclasses.replace(engine_args, data_parallel_rank=rank), **kwargs
        )
        self.info = ServingInfo.from_engine(self.llm)

    async def describe(self) -> dict[str, Any]:
        """What the ingress needs once: serving facts, KV geometry, the hash seed in use."""
        from jaxserve.core.kv_cache_utils import NONE_HASH

        cfg = self.llm.engine_config
        return {
            "info": self.info,
            "block_size": cfg.cache.block_size,
            "num_gpu_blocks": cfg.cache.num_gpu_blocks,
            "hash_seed": os.environ.get("PYTHONHASHSEED"),
            "none_hash": NONE_HASH,  # the chain start this process's KV manager uses
            "engine_config": cfg,
        }

    async def stats(self) -> dict[str, Any]:
        """Health and load (the ingress polls it): ``errored`` is True once the engine died."""
        return {
            "errored": self.llm.errored,
            "num_waiting": self.llm.num_waiting_requests,
            "num_running": self.llm.num_running_requests,
            "kv_cache_usage": self.llm.kv_cache_usage,
            "started_at": self.started_at,
            "pid": os.getpid(),
        }

    async def ledger(self, request_id: str) -> Any:
        """A finished request's ledger if this replica served it, else None."""
        return await self.llm.get_ledger(request_id)

    async def metrics(self) -> str:
        """This replica's Prometheus exposition."""
        return self.llm.metrics.render().decode()

    async def generate(self, url: str, body: dict[str, Any]) -> AsyncIterator[tuple[str, Any]]:
        """Serves one completions or chat request (a Ray streaming generator).

        Yields ``("accepted", None)`` once the engine holds the request, then ``("chunk",
        dict)`` per SSE event of a stream, or ``("response", (status, body, headers))``: the
        final answer, or an error before acceptance (then without ``accepted``).
        """
        from jaxserve.engine.async_llm import EngineDeadError
        from jaxserve.serving.chat import create_chat, stream_chat
        from jaxserve.serving.completion import (
            create_completion,
            stream_completion,
        )
        from jaxserve.serving.engine_calls import abort_all, engine_error
        from jaxserve.serving.validation import check_queue

        probe = _AcceptProbe(self.llm)
        try:
            request, job = await asyncio.to_thread(prepare, probe, self.info, url, body)
            try:
                self.llm.check_health()
            except EngineDeadError as exc:
                raise engine_error(exc) from None
            check_queue(self.llm, self.info)
            if request.stream:
                start = stream_completion if url == COMPLETIONS else stream_chat
                streams, chunks = await start(probe, job)
                try:
                    yield ("accepted", None)
                    async for chunk in chunks:
                        yield ("chunk", chunk)
                finally:
                    abort_all(streams)
                    await chunks.aclose()
                return
            create = create_completion if url == COMPLETIONS else create_chat
            task = asyncio.ensure_future(create(probe, job))
            waiter = asyncio.ensure_future(probe.accepted.wait())
            try:
                await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                if probe.accepted.is_set():
                    yield ("accepted", None)
                result = await task
            finally:
                waiter.cancel()
                task.cancel()  # no-op once done; else aborts its requests
            yield ("response", (200, result, None))
        except APIError as exc:
            yield ("response", (exc.status, exc.body(), exc.headers))


# ---- the ingress (this process) ----------------------------------------------------------------


class _Frontend:
    """What the single server's code reads off an engine, for the ingress: the tokenizer
    (``/tokenize``), the model name, requests in flight (the drain's log line), and no engine of
    its own to die or stop (``run_server``, ``serve_until_signal``)."""

    errored = False
    dead_error = None
    is_running = False

    def __init__(self, tokenizer: Any, model_name: str, router: Any) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._ingress_router = router

    @property
    def num_pending_requests(self) -> int:
        return sum(r.in_flight for r in self._ingress_router().replicas)

    def add_dead_callback(self, callback: Any) -> None:
        pass

    def shutdown(self, timeout: float = 0.0) -> None:
        pass


def _actor_errors() -> tuple[type[BaseException], ...]:
    import ray.exceptions as rex

    errors: list[type[BaseException]] = [rex.RayActorError]
    for name in ("ActorUnavailableError", "ActorDiedError"):
        if hasattr(rex, name):
            errors.append(getattr(rex, name))
    return tuple(errors)


class RayIngress:
    """Routes OpenAI requests over replica actors and relays their answers.

    Args:
      actors: the replica actor handles, by rank.
      router: the routing policy's state.
      info: the served model's facts (from replica 0).
      tokenizer: the model's tokenizer (prompts are tokenized here for routing and checks).
    """

    def __init__(self, actors: list[Any], router: Router, info: ServingInfo, tokenizer: Any):
        self.actors = actors
        self.router = router
        self.info = info
        self.frontend = _Frontend(tokenizer, info.model_name, lambda: self.router)
        self._started_at: list[float | None] = [None] * len(actors)
        self._missed = [0] * len(actors)
        self._actor_errors = _actor_errors()
        self._poller: asyncio.Task | None = None
        self.num_rerouted = 0  # requests moved off a replica that failed before starting them

    def build_app(self, api_key: str | None = None, **kwargs: Any) -> web.Application:
        """The aiohttp app: the single server's routes (``kwargs`` go to its ``build_app``), with
        generation, ledgers, /health and /metrics answered by the replicas."""
        app = build_app(
            self.frontend,
            api_key=api_key,
            info=self.info,
            **kwargs,
            routes={
                COMPLETIONS: self._generation_handler(COMPLETIONS),
                CHAT: self._generation_handler(CHAT),
                "/health": self._health,
                "/metrics": self._metrics,
                "/v1/requests/{request_id}/ledger": self._ledger,
            },
        )

        async def poll_ctx(app: web.Application) -> AsyncIterator[None]:
            await self.poll_once()
            self._poller = asyncio.ensure_future(self._poll_forever())
            yield
            self._poller.cancel()

        app.cleanup_ctx.append(poll_ctx)
        return app

    # -- health -----------------------------------------------------------------------------

    async def poll_once(self) -> None:
        """Asks every replica for its stats (concurrently) and updates the router."""

        async def poll(i: int) -> None:
            try:
                stats = await asyncio.wait_for(
                    _await_ref(self.actors[i].stats.remote()), HEALTH_TIMEOUT_S
                )
            except TimeoutError:
                self._missed[i] += 1
                if self._missed[i] >= MAX_MISSED_POLLS:
                    self._set_down(i)
                return
            except self._actor_errors:
                self._set_down(i)
                return
            self._missed[i] = 0
            restarted = (
                self._started_at[i] is not None and stats["started_at"] != (self._started_at[i])
            )
            self._started_at[i] = stats["started_at"]
            self.router.update(
                i,
                up=not stats["errored"],
                num_waiting=stats["num_waiting"],
                kv_cache_usage=stats["kv_cache_usage"],
                restarted=restarted,
            )

        await asyncio.gather(*(poll(i) for i in range(len(self.actors))))

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            try:
                await self.poll_once()
            except Exception:  # noqa: BLE001 - keep polling
                logger.exception("health poll failed")

    def _set_down(self, i: int) -> None:
        if self.router.replicas[i].up:
            logger.warning("replica %d is down", i)
        self.router.update(i, up=False)

    async def _health(self, request: web.Request) -> web.Response:
        up, total = self.router.num_up, len(self.actors)
        body = {"replicas": total, "replicas_up": up}
        return json_response(body, status=200 if up else 503)

    async def _ledger(self, request: web.Request) -> web.Response:
        """A finished request's ledger from whichever replica served it."""
        request_id = request.match_info["request_id"]

        async def ask(actor: Any) -> Any:
            try:
                return await asyncio.wait_for(
                    _await_ref(actor.ledger.remote(request_id)), HEALTH_TIMEOUT_S
                )
            except (TimeoutError, *self._actor_errors):
                return None

        found = [x for x in await asyncio.gather(*map(ask, self.actors)) if x is not None]
        return ledger_response(request_id, found[0] if found else None)

    async def _metrics(self, request: web.Request) -> web.Response:
        from jaxserve.metrics import CONTENT_TYPE_LATEST, merge_expositions

        async def fetch(i: int) -> tuple[str, str] | None:
            try:
                text = await asyncio.wait_for(
                    _await_ref(self.actors[i].metrics.remote()), HEALTH_TIMEOUT_S
                )
            except (TimeoutError, *self._actor_errors):
                return None
            return str(i), text

        texts = [t for t in await asyncio.gather(*map(fetch, range(len(self.actors)))) if t]
        return web.Response(
            body=merge_expositions(dict(texts), "engine").encode(),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    # -- generation -------------------------------------------------------------------------

    def _generation_handler(self, url: str) -> Any:
        async def handler(request: web.Request) -> web.StreamResponse:
            body = await _read_json(request)
            parsed, job = await asyncio.to_thread(prepare, self.frontend, self.info, url, body)
            prompt = job.prompt_ids[0] if url == COMPLETIONS else job.prompt_ids
            return await self._relay(request, url, body, prompt, parsed.cache_salt)

        return handler

    async def _relay(
        self,
        request: web.Request,
        url: str,
        body: dict[str, Any],
        prompt: list[int],
        cache_salt: str | None,
    ) -> web.StreamResponse:
        """Sends the request to a replica, re-routing while none has accepted it."""
        tried: set[int] = set()
        while True:
            try:
                index, hashes = self.router.choose(prompt, cache_salt, frozenset(tried))
            except NoReplicaError as exc:
                raise APIError(
                    f"no engine replica can take the request: {exc}",
                    status=503,
                    type="server_error",
                    code="no_replica",
                    headers={"Retry-After": "1"},
                ) from None
            self.router.started(index, hashes)
            gen = self.actors[index].generate.options(num_returns="streaming").remote(url, body)
            try:
                try:
                    kind, payload = await asyncio.wait_for(_next_item(gen), ACCEPT_TIMEOUT_S)
                except (TimeoutError, *self._actor_errors):
                    tried.add(index)
                    self._set_down(index)
                    self.num_rerouted += 1
                    continue  # not started there: try another replica
                if kind == "response":  # refused before starting (400, 503 ...)
                    status, answer, headers = payload
                    if status == 503 and answer.get("error", {}).get("code") == "engine_dead":
                        tried.add(index)
                        self._set_down(index)
                        self.num_rerouted += 1
                        continue
                    return json_response(answer, status=status, headers=headers)
                header = {"x-jaxserve-replica": str(index)}
                if body.get("stream"):
                    return await self._relay_stream(request, gen, index, header)
                try:
                    kind, (status, answer, headers) = await _next_item(gen)
                except self._actor_errors:
                    self._set_down(index)
                    raise _replica_died(
                        f"engine replica {index} died while serving this request; retry it"
                    ) from None
                return json_response(answer, status=status, headers={**(headers or {}), **header})
            finally:
                self.router.finished(index)
                _cancel(gen)

    async def _relay_stream(
        self, request: web.Request, gen: Any, index: int, header: dict[str, str]
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                **header,
            }
        )
        encoder = SSEEncoder()
        try:
            await response.prepare(request)
            while True:
                try:
                    kind, chunk = await _next_item(gen)
                except StopAsyncIteration:
                    break
                except self._actor_errors:
                    self._set_down(index)
                    error = _replica_died(
                        f"engine replica {index} died while serving this request; retry it"
                    )
                    await response.write(encoder.event(error.body()))
                    break
                await response.write(encoder.event(chunk))
            await response.write_eof(DONE_EVENT)
        except ConnectionResetError:  # the client left; the generator is cancelled by the caller
            pass
        return response


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


# ---- start-up ---------------------------------------------------------------------------------


def add_ray_args(parser: argparse.ArgumentParser) -> None:
    """Adds --data-parallel-size, --distributed-executor-backend, --ray-address, --routing."""
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas behind one ingress; > 1 runs them as Ray actors (pip install 'jaxserve[ray]')",
    )
    parser.add_argument(
        "--distributed-executor-backend",
        choices=["uni", "ray"],
        default=None,
        help="uni: one engine in this process; ray: replicas as Ray actors "
        "(default: ray when --data-parallel-size > 1)",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        help="an existing Ray cluster (ray://HOST:PORT or HOST:PORT); default: start a local one",
    )
    parser.add_argument(
        "--routing",
        choices=list(POLICIES),
        default="prefix-aware",
        help="how the ingress picks a replica: prefix-aware (the replica likely holding the "
        "prompt's prefix blocks, unless overloaded), least-loaded, round-robin",
    )


def uses_ray(args: argparse.Namespace) -> bool:
    """Whether ``serve`` runs replicas on Ray.

    Raises:
      ValueError: data_parallel_size < 1, or > 1 with ``--distributed-executor-backend uni``.
    """
    size = args.data_parallel_size
    if size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {size}")
    backend = args.distributed_executor_backend or ("ray" if size > 1 else "uni")
    if size > 1 and backend != "ray":
        raise ValueError(
            "data_parallel_size > 1 needs --distributed-executor-backend ray (the only one)"
        )
    return backend == "ray"


def start_replicas(
    engine_args: EngineArgs,
    num_replicas: int,
    *,
    ray_address: str | None = None,
    max_restarts: int = 4,
    step_timeout_s: float | None = None,
) -> tuple[list[Any], list[dict[str, Any]]]:
    """Starts Ray (or connects) and ``num_replicas`` replica actors; waits until all are ready.

    A local cluster is kept small: ``num_replicas`` logical CPUs, no dashboard, a 128 MiB object
    store, and without Ray's node-wide memory monitor (``RAY_memory_monitor_refresh_ms=0``
    unless set), which on a shared machine kills replicas for other processes' memory. When the cluster has a GPU (or TPU) per replica, each replica gets one. Every replica gets this process's ``PYTHONHASHSEED`` (a random one is chosen when
    unset) so block hashes agree across replicas and with the router.

    Returns:
      (actor handles by rank, each replica's ``describe()``).

    Raises:
      ValueError: Ray is not installed (``pip install 'jaxserve[ray]'``).
      RuntimeError: a replica failed to start (its error in the message).
    """
    try:
        import ray
    except ImportError:
        raise ValueError("data_parallel_size > 1 needs Ray: pip install 'jaxserve[ray]'") from None
    seed = os.environ.get("PYTHONHASHSEED") or str(secrets.randbits(31))
    env = {"PYTHONHASHSEED": seed}
    for name in ("JAX_PLATFORMS", "XLA_FLAGS"):
        if name in os.environ:
            env[name] = os.environ[name]
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"runtime_env": {"env_vars": env}, "log_to_driver": True}
        if ray_address:
            ray.init(address=ray_address, **kwargs)
        else:
            # Ray's memory monitor kills workers when the whole node passes 95% of its memory,
            # whoever uses it; on a shared box that takes the replicas down for others' jobs.
            # The kernel's OOM killer still guards the node.
            os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
            ray.init(
                num_cpus=num_replicas,
                include_dashboard=False,
                object_store_memory=128 * 2**20,
                **kwargs,
            )
    # On an accelerator cluster each replica owns one device (Ray sets CUDA_VISIBLE_DEVICES /
    # TPU_VISIBLE_CHIPS for the actor, and JAX sees only that one); on CPU, one logical CPU.
    resources = ray.cluster_resources()
    devices: dict[str, Any] = {}
    if resources.get("GPU", 0) >= num_replicas:
        devices["num_gpus"] = 1
    elif resources.get("TPU", 0) >= num_replicas:
        devices["resources"] = {"TPU": 1}
    actor_cls = ray.remote(EngineReplica).options(
        num_cpus=1,
        **devices,
        max_restarts=max_restarts,
        max_task_retries=0,
        max_concurrency=1000,
        runtime_env={"env_vars": env},
    )
    actors = [actor_cls.remote(engine_args, rank, step_timeout_s) for rank in range(num_replicas)]
    try:
        described = ray.get([a.describe.remote() for a in actors])
    except Exception as exc:
        for a in actors:
            ray.kill(a, no_restart=True)
        raise RuntimeError(f"an engine replica failed to start: {exc}") from exc
    return actors, described


def make_ingress(actors: list[Any], described: list[dict[str, Any]], routing: str) -> RayIngress:
    """The ingress over started replicas (tokenizer loaded here, router hashing like them).

    Raises:
      RuntimeError: the replicas' hash chains differ (an existing cluster whose workers
        override ``PYTHONHASHSEED``): prefix-aware routing could not match their caches.
    """
    from jaxserve.tokenizer import get_tokenizer

    first = described[0]
    info: ServingInfo = first["info"]
    if len({d["none_hash"] for d in described}) != 1:
        raise RuntimeError("the replicas hash KV blocks differently (PYTHONHASHSEED differs)")
    router = Router(len(actors), routing, first["block_size"], first["none_hash"])
    for i, d in enumerate(described):
        router.update(i, up=True, capacity_blocks=d["num_gpu_blocks"] - 1)
    return RayIngress(actors, router, info, get_tokenizer(info.model_path))


def run_ray_serve(args: argparse.Namespace) -> None:
    """``jaxserve serve`` with replicas on Ray: starts them, serves the ingress until
    SIGINT/SIGTERM, then stops them. Exits 0 on a signal."""
    import ray

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.check(need_tokenizer=True)  # before starting Ray: one-line errors
    check_port_free(args.host, args.port)
    start = time.perf_counter()
    actors, described = start_replicas(
        engine_args,
        args.data_parallel_size,
        ray_address=args.ray_address,
        step_timeout_s=args.step_timeout_s,
    )
    ingress = make_ingress(actors, described, args.routing)
    lines = config_report(described[0]["engine_config"], args)
    lines.append(
        f"  replicas: {args.data_parallel_size} on Ray ({args.ray_address or 'local cluster'}), "
        f"routing {args.routing}, ready in {time.perf_counter() - start:.1f} s"
    )
    print("\n".join(lines), flush=True)
    app = ingress.build_app(
        args.api_key,
        header_timeout_s=args.request_header_timeout_s,
        body_timeout_s=args.request_body_timeout_s,
    )
    code = serve_until_signal(
        ingress.frontend,
        args,
        app=app,
        what=f"{ingress.info.model_name} ({args.data_parallel_size} replicas)",
    )
    for actor in actors:
        ray.kill(actor, no_restart=True)
    ray.shutdown()
    sys.exit(code)
