"""The HTTP front of data-parallel replicas on Ray: the single server's app over a
``ReplicaSet``, answering every route the way one server does (the replicas' engine clients
and the per-request routing are ``jaxserve.entrypoints.ray_clients``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from jaxserve.entrypoints.http.api_server import build_app
from jaxserve.entrypoints.ray_clients import ReplicaSet, RoutedServing, make_replica_set
from jaxserve.entrypoints.router import Router
from jaxserve.serving.validation import ServingInfo


class RayIngress:
    """The replicas behind one aiohttp app.

    Args:
      replicas: the engine client over the replica actors.

    Attributes:
      frontend: the ``EngineClient`` the server runs on (``replicas``).
      serving: what answers the routes (a replica per request).
    """

    def __init__(self, replicas: ReplicaSet) -> None:
        self.frontend = replicas
        self.serving = RoutedServing(replicas, replicas.info)

    @property
    def actors(self) -> list[Any]:
        """The replica actor handles, by rank."""
        return self.frontend.actors

    @property
    def info(self) -> ServingInfo:
        """The served model's facts (from replica 0)."""
        return self.serving.info

    @property
    def router(self) -> Router:
        """The routing policy's state (a new one may be set, keeping the replicas)."""
        return self.frontend.router

    @router.setter
    def router(self, router: Router) -> None:
        self.frontend.router = router

    @property
    def num_rerouted(self) -> int:
        """Requests moved off a replica that failed before starting them."""
        return self.frontend.num_rerouted

    def build_app(self, api_key: str | None = None, **kwargs: Any) -> web.Application:
        """The aiohttp app (``kwargs`` go to ``api_server.build_app``); while it runs, the
        replicas are polled every ``ray_clients.HEALTH_INTERVAL_S``."""
        app = build_app(self.frontend, api_key=api_key, serving=self.serving, **kwargs)

        async def poll_ctx(app: web.Application) -> AsyncIterator[None]:
            await self.frontend.poll_once()
            poller = asyncio.ensure_future(self.frontend.poll_forever())
            yield
            poller.cancel()

        app.cleanup_ctx.append(poll_ctx)
        return app


def make_ingress(actors: list[Any], described: list[dict[str, Any]], routing: str) -> RayIngress:
    """The ingress over started replicas (``ray_clients.make_replica_set``).

    Raises:
      RuntimeError: the replicas hash KV blocks differently (``PYTHONHASHSEED`` differs).
    """
    return RayIngress(make_replica_set(actors, described, routing))
