"""Data-parallel replicas on Ray: N engine actors, and starting them.

``jaxserve serve --data-parallel-size N`` (or ``--distributed-executor-backend ray``) starts,
on a local Ray cluster it starts itself (listening on 127.0.0.1 only) or on an existing one
(``--ray-address``; a warning when its GCS answers without authentication):

* N :class:`EngineReplica` actors, each a process owning its devices with its own
  ``AsyncLLM`` (engine thread, KV pool, metrics). Ray restarts one that dies
  (``max_restarts``). Every replica gets the same ``PYTHONHASHSEED``, so all compute the same
  block hashes as each other and as the router;
* in the serving process (``jaxserve.entrypoints.ray_clients``), one ``ReplicaClient`` per
  actor (an ``EngineClient``: requests are relayed to the actor, their ``RequestOutput``s
  streamed back) and a ``ReplicaSet`` over all of them, the ``EngineClient`` the HTTP server runs on: ledgers from whichever
  replica has them, ``/health`` as ``{"replicas": N, "replicas_up": k}`` (200 while k >= 1),
  ``/metrics`` merged with an ``engine="<rank>"`` label. ``RoutedServing`` validates and
  tokenizes each request in the serving process, as a single server does, asks the
  :class:`~jaxserve.entrypoints.router.Router` for a replica (``--routing
  prefix-aware|least-loaded|round-robin``) and runs the whole request there; responses are the
  single server's, byte for byte, with an ``x-jaxserve-replica`` header.

Failures. A replica's actor first yields ``("accepted", None)`` once its engine holds the
request. If the replica dies before that (or does not accept within ``ACCEPT_TIMEOUT_S``: a
restarting actor queues calls), or its engine is dead, the request had not started: the
replica is marked down and the request goes to another one. If it dies after, the client gets
a 503 ``replica_died`` (a stream: an error event, then ``data: [DONE]``); nothing hangs. A poll
every ``HEALTH_INTERVAL_S`` marks replicas up or down (and empties the router's prefix index of
one that restarted). The HTTP front (``jaxserve.entrypoints.http.ray_ingress``) is the single
server's app over the ``ReplicaSet``.

Why Ray core actors and not Ray Serve's proxy and controller: the router needs each request's
token ids and the replicas' live load, which our own ingress has at hand, and Ray Serve's HTTP
proxy, controller and FastAPI stack would add three processes and tens of seconds of start-up
on the CPU boxes this runs on; the actors are what Ray Serve would run underneath.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from jaxserve.config import EngineArgs
from jaxserve.engine.protocol import EngineDeadError
from jaxserve.entrypoints.ray_cluster import (
    connected_gcs_address,
    use_loopback_for_local_cluster,
    warn_if_unauthenticated,
)
from jaxserve.entrypoints.router import POLICIES
from jaxserve.serving.validation import ServingInfo

if TYPE_CHECKING:
    from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# ---- the replica (runs in a Ray actor process) ------------------------------------------------


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
        """What the serving process needs once: serving facts, KV geometry, the hash seed."""
        from jaxserve.core.kv_cache_utils import NONE_HASH

        cfg = self.llm.engine_config
        return {
            # the live adapter lookup is a bound method of this process's engine (not sent;
            # Ray replicas serve no LoRA adapters: ray_clients.NoLoRAAdapters)
            "info": dataclasses.replace(self.info, lora_adapters=dict),
            "block_size": cfg.cache.block_size,
            "num_gpu_blocks": cfg.cache.num_gpu_blocks,
            "hash_seed": os.environ.get("PYTHONHASHSEED"),
            "none_hash": NONE_HASH,  # the chain start this process's KV manager uses
            "engine_config": cfg,
        }

    async def stats(self) -> dict[str, Any]:
        """Health and load (polled): ``errored`` is True once the engine died, and while it
        is stalled or shutting down (``AsyncLLM.health``)."""
        return {
            "errored": not self.llm.health().healthy,
            "num_waiting": self.llm.num_waiting_requests,
            "num_running": self.llm.num_running_requests,
            "kv_cache_usage": self.llm.kv_cache_usage,
            "started_at": self.started_at,
            "pid": os.getpid(),
            "is_sleeping": self.llm.is_sleeping,
        }

    async def sleep(self, level: int, mode: str) -> None:
        """Puts this replica's engine to sleep (``AsyncLLM.sleep``)."""
        await self.llm.sleep(level, mode)

    async def wake_up(self, tags: list[str] | None) -> bool:
        """Wakes this replica's engine up; True once fully awake (``AsyncLLM.wake_up``)."""
        return await self.llm.wake_up(tags)

    async def ledger(self, request_id: str) -> Any:
        """A finished request's ledger if this replica served it, else None."""
        return await self.llm.get_ledger(request_id)

    async def metrics(self) -> str:
        """This replica's Prometheus exposition."""
        body, _ = await self.llm.render_metrics()
        return body.decode()

    async def run_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int,
        cache_salt: str | None,
    ) -> AsyncIterator[tuple[str, Any]]:
        """Runs one engine request (a Ray streaming generator).

        Yields ``("accepted", None)`` once the engine holds it, then ``("output",
        RequestOutput)`` per output until the finished one, or ``("dead", EngineDeadError)``
        if the engine dies meanwhile; ``("refused", error)`` instead of all that when the engine
        does not take it (a ValueError naming the field, or EngineDeadError). Cancelling the
        call aborts the request.
        """
        try:
            stream = await self.llm.add_request(
                request_id, prompt, params, priority=priority, cache_salt=cache_salt
            )
        except (ValueError, EngineDeadError) as exc:
            yield ("refused", exc)
            return
        try:
            yield ("accepted", None)
            async for output in stream:
                yield ("output", output)
        except EngineDeadError as exc:
            yield ("dead", exc)
        finally:
            stream.abort()


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
        help="an existing Ray cluster (ray://HOST:PORT or HOST:PORT; a warning when its GCS "
        "answers without a token); default: start a local one, listening on 127.0.0.1 only",
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

    A local cluster is kept small and private: ``num_replicas`` logical CPUs, every server on
    127.0.0.1 (jaxserve/entrypoints/ray_cluster.py), no dashboard, a 128 MiB object
    store, and without Ray's node-wide memory monitor (``RAY_memory_monitor_refresh_ms=0``
    unless set), which on a shared machine kills replicas for other processes' memory. When the cluster has a GPU (or TPU) per replica, each replica gets one. Every replica gets this process's ``PYTHONHASHSEED`` (a random one is chosen when
    unset) so block hashes agree across replicas and with the router. With ``ray_address``, a
    warning is logged when the cluster's GCS answers without authentication.

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
            warn_if_unauthenticated(connected_gcs_address(ray_address))
        else:
            # Ray's memory monitor kills workers when the whole node passes 95% of its memory,
            # whoever uses it; on a shared box that takes the replicas down for others' jobs.
            # The kernel's OOM killer still guards the node.
            os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
            use_loopback_for_local_cluster()  # GCS, raylets, workers on 127.0.0.1 only
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
