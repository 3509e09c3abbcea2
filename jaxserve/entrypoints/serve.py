"""``jaxserve serve``: its flags, the start-up report, and the choice between one engine in this
process and replicas on Ray.

    jaxserve serve MODEL [engine flags] [--host H] [--port P] [--api-key K] [--data-parallel-size N]

Bad flags are one-line errors before any weight loads (``EngineArgs.check``, a busy port). The
HTTP server itself is ``jaxserve.entrypoints.http.api_server``; the Ray deployment
``jaxserve.entrypoints.ray_serve``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import socket
import time
from typing import Any

from jaxserve.config import EngineArgs
from jaxserve.engine.async_llm import DEFAULT_STEP_TIMEOUT_S, AsyncLLM
from jaxserve.entrypoints.http.api_server import (
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    Timeouts,
    api_keys,
    app_options,
    exit_now,
    make_ssl_context,
    serve_until_signal,
)
from jaxserve.entrypoints.ray_serve import add_ray_args, start_replicas, uses_ray


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds ``serve``: every EngineArgs flag (vLLM's names) plus --host, --port and --api-key."""
    parser = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/responses).",
    )
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument(
        "--port", type=int, default=8000, help="port to listen on (0: any free port)"
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer <key>' on the API routes; repeat the flag or give "
        "a comma list for several keys (a request's ledger and a stored /v1/responses response "
        "are then readable only with the key that created them) (default: $JAXSERVE_API_KEY, "
        "also a comma list, else open)",
    )
    parser.add_argument(
        "--ledger-route",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve GET /v1/requests/{id}/ledger (request ids are its capabilities: whoever "
        "holds one, and a valid key, can read it); --no-ledger-route removes the route",
    )
    parser.add_argument(
        "--request-header-timeout-s",
        type=float,
        default=Timeouts.header_s,
        help="close a connection whose request head has not fully arrived this many seconds "
        "after connecting or after the previous response (slow clients)",
    )
    parser.add_argument(
        "--request-body-timeout-s",
        type=float,
        default=Timeouts.body_s,
        help="answer 408 when a request body takes longer than this to arrive",
    )
    parser.add_argument(
        "--step-timeout-s",
        type=float,
        default=DEFAULT_STEP_TIMEOUT_S,
        help="liveness and watchdog: a turn of the engine loop (a model step, or host-side work "
        "such as adding requests) running longer than this makes /health 503 engine_stalled, "
        "then marks the engine dead (pending requests get an error, exit 1); 0 disables it",
    )
    parser.add_argument(
        "--shutdown-timeout-s",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="on SIGTERM/SIGINT stop accepting and let in-flight requests finish for up to "
        "this long, then cut them with a 503 (streams: an error event and [DONE]) and exit 0 "
        "within this window + 1 s",
    )
    add_transport_args(parser)
    add_ray_args(parser)  # Ray itself is imported only if used
    parser.set_defaults(func=run_serve)
    return parser


def _string_list(value: str) -> list[str]:
    """A flag's list: a JSON list of strings (vLLM's form, ``'["http://a", "http://b"]'``) or
    comma-separated names."""
    if value.lstrip().startswith("["):
        try:
            items = json.loads(value)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return items
    return [item.strip() for item in value.split(",") if item.strip()]


def add_transport_args(parser: argparse.ArgumentParser) -> None:
    """TLS, CORS and root-path flags (vLLM's names)."""
    parser.add_argument("--ssl-keyfile", default=None, help="TLS: the server's private key (PEM)")
    parser.add_argument(
        "--ssl-certfile", default=None, help="TLS: the server's certificate chain (PEM)"
    )
    parser.add_argument(
        "--allowed-origins",
        type=_string_list,
        default=[],
        help="CORS: browser origins allowed to call the API, a JSON list or comma-separated "
        "('*': any); default none (vLLM's default is '*')",
    )
    parser.add_argument(
        "--allowed-methods",
        type=_string_list,
        default=["*"],
        help="CORS: methods a preflight may ask for (default '*')",
    )
    parser.add_argument(
        "--allowed-headers",
        type=_string_list,
        default=["*"],
        help="CORS: request headers a preflight may ask for (default '*')",
    )
    parser.add_argument(
        "--allow-credentials",
        action="store_true",
        help="CORS: let allowed origins send credentials (the origin is echoed, never '*')",
    )
    parser.add_argument(
        "--root-path",
        default="",
        help="path prefix the server sits under behind a proxy (e.g. /llm): routes are served "
        "with and without it, and /openapi.json names it",
    )


_SERVER_FLAGS = (
    "host",
    "port",
    "ssl_certfile",
    "ssl_keyfile",
    "allowed_origins",
    "allowed_methods",
    "allowed_headers",
    "allow_credentials",
    "root_path",
    "request_header_timeout_s",
    "request_body_timeout_s",
    "step_timeout_s",
    "shutdown_timeout_s",
    "ledger_route",
    "data_parallel_size",
    "distributed_executor_backend",
    "ray_address",
    "routing",
)


def config_report(cfg: Any, args: argparse.Namespace | None = None) -> list[str]:
    """The resolved-config log lines: one per part of an EngineConfig, then the server flags."""
    lines = ["resolved config:"]
    for part in dataclasses.fields(cfg):
        value = getattr(cfg, part.name)  # a config section, or a plain knob (ledger_history)
        shown = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        lines.append(f"  {part.name}: {shown}")
    if args is not None:
        server = {name: getattr(args, name) for name in _SERVER_FLAGS if hasattr(args, name)}
        keys = api_keys(getattr(args, "api_key", None))
        server["api_key"] = f"{len(keys)} keys" if len(keys) > 1 else ("set" if keys else None)
        lines.append(f"  server: {server}")
    return lines


def startup_report(llm: AsyncLLM, startup_s: float, args: argparse.Namespace | None = None) -> str:
    """The start-up log: the resolved config, step buckets, KV pool, offloading, compile time."""
    cfg = llm.engine_config
    lines = config_report(cfg, args)
    runner = getattr(llm.engine, "runner", None)
    if runner is not None and hasattr(runner, "token_buckets"):
        lines.append(
            f"  step token buckets: {list(runner.token_buckets)} "
            f"(sequence buckets {list(runner.seq_buckets)})"
        )
    blocks, size = cfg.cache.num_gpu_blocks, cfg.cache.block_size
    weight_bytes = getattr(cfg.cache, "weight_bytes", 0)
    if weight_bytes:
        lines.append(
            f"weights: {weight_bytes} bytes ({weight_bytes / 2**30:.3f} GiB), quantization "
            f"{getattr(cfg.model, 'quantization', 'auto')}"
        )
    kv_spec = getattr(runner, "kv_spec", None)
    kv = (
        f", {kv_spec.bytes_per_token} bytes/token, {kv_spec.total_bytes / 2**30:.3f} GiB, "
        f"dtype {kv_spec.dtype}"
        if kv_spec is not None
        else ""
    )
    groups = cfg.cache.kv_cache_groups
    if any(w is not None for w in groups):  # sliding-window groups: blocks are per group
        layout = getattr(runner, "kv_layout", None)
        kinds = ", ".join("full" if w is None else f"window {w}" for w in groups)
        lines.append(
            f"KV pool: {blocks} blocks x {size} tokens, shared by {len(groups)} KV-cache groups "
            f"({kinds}"
            + ("" if layout is None else f"; a block holds {layout.num_tensors} layers' K/V")
            + f"); block 0 is the null block{kv}"
        )
    else:
        lines.append(
            f"KV pool: {blocks} blocks x {size} tokens ({max(blocks - 1, 0) * size} usable "
            f"tokens; block 0 is the null block){kv}"
        )
    num_host = getattr(cfg.cache, "num_host_blocks", 0)
    if num_host:
        lines.append(
            f"KV offloading: {num_host} host blocks ({num_host * size} tokens, "
            f"{cfg.cache.kv_offloading_size} GiB, backend {cfg.cache.kv_offloading_backend}); "
            f"resume cost probe: load {cfg.cache.offload_load_s_per_call * 1e6:.1f} us per call "
            f"+ {cfg.cache.offload_load_s_per_block * 1e6:.1f} us per block, recompute "
            f"{cfg.cache.offload_recompute_s_per_token * 1e6:.2f} us per token"
        )
    compile_s = getattr(runner, "compile_seconds", None)
    if compile_s is not None:
        lines.append(f"compile time: {compile_s:.1f} s (startup {startup_s:.1f} s)")
    else:
        lines.append(f"startup (load + KV sizing + compile): {startup_s:.1f} s")
    return "\n".join(lines)


def check_port_free(host: str, port: int) -> None:
    """Raises ValueError (saying what to do) when ``host:port`` cannot be listened on now."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp's listener
            s.bind(infos[0][4])
    except OSError as e:
        raise ValueError(
            f"port: cannot listen on {host}:{port} ({e.strerror or e}); stop the process using "
            "it or pass --port N (--port 0 picks a free one)"
        ) from None


def check_server_flags(args: argparse.Namespace) -> None:
    """The server's own flags, before anything heavy: TLS files, root path, a busy port.

    Raises:
      ValueError: naming the flag and what to do.
    """
    make_ssl_context(args.ssl_certfile, args.ssl_keyfile)
    root = args.root_path
    if root and (not root.startswith("/") or root.endswith("/")):
        raise ValueError(f"root_path must start with '/' and not end with it, got {root!r}")
    check_port_free(args.host, args.port)


def run_serve(args: argparse.Namespace) -> None:
    """The ``serve`` command: builds the engine, prints the config, serves until SIGINT/SIGTERM.

    Exits 0 after a signal (in-flight requests drained), 1 if the engine died (an error, or the
    step watchdog).
    """
    if args.api_key is None and os.environ.get("JAXSERVE_API_KEY"):
        args.api_key = [os.environ["JAXSERVE_API_KEY"]]
    if uses_ray(args):
        run_ray_serve(args)
        return
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.check(need_tokenizer=True)  # before loading and compiling: one-line errors
    check_server_flags(args)
    start = time.perf_counter()
    llm = AsyncLLM.from_engine_args(engine_args, step_timeout_s=args.step_timeout_s)
    print(startup_report(llm, time.perf_counter() - start, args), flush=True)
    exit_now(serve_until_signal(llm, args))


def run_ray_serve(args: argparse.Namespace) -> None:
    """``jaxserve serve`` with replicas on Ray: starts them, serves the ingress until
    SIGINT/SIGTERM, then stops them. Exits 0 on a signal."""
    import ray

    from jaxserve.entrypoints.http.ray_ingress import make_ingress

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.check(need_tokenizer=True)  # before starting Ray: one-line errors
    check_server_flags(args)
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
        f"  replicas: {args.data_parallel_size} on Ray "
        f"({args.ray_address or 'local cluster on 127.0.0.1'}), "
        f"routing {args.routing}, ready in {time.perf_counter() - start:.1f} s"
    )
    print("\n".join(lines), flush=True)
    app = ingress.build_app(**app_options(args))
    code = serve_until_signal(  # stops the replicas (ReplicaSet.shutdown) once the server stopped
        ingress.frontend,
        args,
        app=app,
        what=f"{ingress.info.model_name} ({args.data_parallel_size} replicas)",
    )
    ray.shutdown()
    exit_now(code)
