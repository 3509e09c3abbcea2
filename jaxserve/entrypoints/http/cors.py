"""CORS for browsers calling the server from another origin (``--allowed-origins`` and vLLM's
other three flags; the rules of Starlette's ``CORSMiddleware``, which vLLM uses).

A preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) is answered
here, before authentication (a browser sends no API key with it): 200 with the allowed origin,
methods, headers and credentials, or a 400 naming what is not allowed. Every other response to
a request from an allowed origin gets ``Access-Control-Allow-Origin`` (and
``Access-Control-Allow-Credentials``) as its headers are sent, streamed responses included.
With no allowed origin (our default; vLLM's is ``*``) nothing is added: a web page from another
origin cannot read the answers, and a server on localhost stays unreadable from every page.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from aiohttp import web

from jaxserve.serving.errors import bad_request

ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
SAFELISTED_HEADERS = frozenset({"accept", "accept-language", "content-language", "content-type"})
PREFLIGHT_MAX_AGE_S = 600


@dataclasses.dataclass(frozen=True)
class CORSPolicy:
    """Who may call the server from a browser page of another origin.

    Attributes:
      allowed_origins: origins (``scheme://host[:port]``) allowed, or ``*`` for any; empty:
        CORS off.
      allowed_methods: methods a preflight may ask for, or ``*`` for any.
      allowed_headers: request headers a preflight may ask for, or ``*`` for any (the
        CORS-safelisted ones are always allowed).
      allow_credentials: browsers may send cookies / HTTP auth and read the answer (the
        origin is then echoed, never ``*``).
    """

    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    @property
    def enabled(self) -> bool:
        """True when some origin is allowed."""
        return bool(self.allowed_origins)

    def allows_origin(self, origin: str) -> bool:
        """True when ``origin`` is allowed."""
        return "*" in self.allowed_origins or origin in self.allowed_origins

    def origin_header(self, origin: str) -> dict[str, str]:
        """The headers that let a page of ``origin`` read a response."""
        if "*" in self.allowed_origins and not self.allow_credentials:
            return {"Access-Control-Allow-Origin": "*"}
        headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if self.allow_credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        return headers

    def preflight(self, origin: str, method: str, requested: str) -> dict[str, str]:
        """The headers of the 200 answering a preflight.

        Args:
          origin, method, requested: the request's ``Origin``, ``Access-Control-Request-
            Method`` and ``Access-Control-Request-Headers``.

        Raises:
          APIError: 400 naming what is not allowed (origin, method or header).
        """
        if not self.allows_origin(origin):
            raise bad_request(f"CORS: origin {origin!r} is not allowed (--allowed-origins)")
        methods = ALL_METHODS if "*" in self.allowed_methods else self.allowed_methods
        if method.upper() not in methods:
            raise bad_request(f"CORS: method {method!r} is not allowed (--allowed-methods)")
        asked = [h.strip().lower() for h in requested.split(",") if h.strip()]
        allowed = {h.lower() for h in self.allowed_headers} | SAFELISTED_HEADERS
        if "*" not in self.allowed_headers:
            refused = [h for h in asked if h not in allowed]
            if refused:
                raise bad_request(f"CORS: headers {refused} are not allowed (--allowed-headers)")
        headers = self.origin_header(origin)
        headers.update(
            {
                "Access-Control-Allow-Methods": ", ".join(methods),
                "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
            }
        )
        if asked:
            headers["Access-Control-Allow-Headers"] = (
                requested if "*" in self.allowed_headers else ", ".join(self.allowed_headers)
            )
        return headers


def cors_middleware(policy: CORSPolicy) -> Any:
    """Answers CORS preflights (place it before authentication)."""

    @web.middleware
    async def cors(request: web.Request, handler: Any) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        method = request.headers.get("Access-Control-Request-Method")
        if request.method == "OPTIONS" and origin and method:
            requested = request.headers.get("Access-Control-Request-Headers", "")
            return web.Response(status=200, headers=policy.preflight(origin, method, requested))
        return await handler(request)

    return cors


def install_cors(app: web.Application, policy: CORSPolicy) -> None:
    """Adds the allowed-origin headers to every response of ``app`` as it is sent (the
    preflights are ``cors_middleware``'s)."""

    async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin and policy.allows_origin(origin):
            response.headers.update(policy.origin_header(origin))

    app.on_response_prepare.append(add_headers)
