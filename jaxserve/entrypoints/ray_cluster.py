"""Keeping the data-parallel replicas' Ray cluster private (``serve --data-parallel-size N``).

**A local cluster** (no ``--ray-address``) is one machine's: nothing outside it needs to reach
it. By default Ray makes a node's address the machine's external IP and its servers (GCS,
raylets, core workers, the autoscaler monitor's metrics port) listen on every interface.
:func:`use_loopback_for_local_cluster` sets ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, Ray's own
switch for a single-machine cluster (what it does on macOS and Windows): the node's address is
then 127.0.0.1 and every one of those servers binds it (checked with Ray 2.60 by listing the
cluster's listening sockets; tests/entrypoints/test_ray_serve.py keeps checking it). Ray reads
the variable when it is first imported, so the function also sets the constant Ray derived from
it when Ray was imported earlier. With Ray 2.60 (what ``pip install 'jaxserve[ray]'`` installs
here) a local cluster also requires a token (``~/.ray/auth_token``) unless
``RAY_AUTH_MODE=disabled``.

**An existing cluster** (``--ray-address``) is someone else's; :func:`gcs_auth_status` asks its
GCS, the cluster's control plane, whether it answers a client that sends no token (a
``ray status`` subprocess with ``RAY_AUTH_MODE=disabled``: one read of its key-value store,
about 2 s), and :func:`warn_if_unauthenticated` logs a warning when it does. What this can tell:
that the GCS at that address serves anyone who reaches it (whoever reaches it can run code on
the cluster), and whether the address is loopback. What it cannot: whether a firewall keeps
other hosts away from that address; whether the cluster's other servers (raylets, object
managers, workers, the dashboard's HTTP API) check tokens as the GCS does; who else holds the
token; and, for a ``ray://`` (Ray Client) address, the GCS behind it when this process cannot
reach that GCS directly (then the status is "unknown", also logged).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import subprocess
import sys

logger = logging.getLogger(__name__)

LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch: "0" makes a node's address the loopback address."""

REQUIRED, NONE, UNKNOWN = "required", "none", "unknown"


def use_loopback_for_local_cluster() -> None:
    """Makes the Ray cluster that ``ray.init()`` starts next in this process (and its child
    processes) listen on 127.0.0.1 only. Call it before ``ray.init`` without an address."""
    os.environ[LOCAL_ONLY_ENV] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # imported before: it read the variable already
        constants.ENABLE_RAY_CLUSTER = False


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address, ``[v6]`` or a name) is a loopback address."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1, as dual-stack sockets show it
    return (mapped or ip).is_loopback


def gcs_auth_status(gcs_address: str, timeout_s: float = 30.0) -> tuple[str, str]:
    """Whether the GCS at ``HOST:PORT`` serves a client that sends no token.

    Returns:
      (``REQUIRED``: it refused the call for want of a token; ``NONE``: it answered;
      ``UNKNOWN``: the probe failed otherwise, e.g. unreachable or another Ray version,
      its last error line, or "" for the other two).
    """
    env = dict(os.environ, RAY_AUTH_MODE="disabled", **{LOCAL_ONLY_ENV: "0"})
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "status", "--address", gcs_address]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return UNKNOWN, f"no answer within {timeout_s:.0f} s"
    return classify_probe(done.returncode, done.stderr)


def classify_probe(returncode: int, stderr: str) -> tuple[str, str]:
    """:func:`gcs_auth_status`'s verdict from the ``ray status`` probe's exit code and stderr."""
    if returncode == 0:
        return NONE, ""
    if "AuthenticationError" in stderr or "InvalidAuthToken" in stderr:
        return REQUIRED, ""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return UNKNOWN, lines[-1][:300] if lines else f"exit code {returncode}"


def connected_gcs_address(ray_address: str) -> str:
    """The GCS address of the cluster this process connected to (``ray.init(address=...)``
    first); ``ray_address`` when Ray cannot say (a Ray Client connection may not)."""
    import ray

    try:
        return ray.get_runtime_context().gcs_address or ray_address
    except Exception:  # noqa: BLE001 - any failure: probe what the user gave
        return ray_address


def warn_if_unauthenticated(gcs_address: str) -> str:
    """Logs what :func:`gcs_auth_status` found about the cluster at ``gcs_address``: a warning
    when its GCS needs no token (or could not be asked), an info line when it does.

    Returns:
      The status (``REQUIRED``, ``NONE`` or ``UNKNOWN``).
    """
    status, detail = gcs_auth_status(gcs_address)
    host = gcs_address.rpartition(":")[0]
    where = "this machine" if is_loopback(host) else f"any host that reaches {host}"
    if status == NONE:
        logger.warning(
            "the Ray cluster at %s answers without authentication: %s can run code on it and "
            "read the replicas' requests. Start it with token authentication (RAY_AUTH_MODE=token "
            "on every node) or keep its ports on a private network",
            gcs_address,
            where,
        )
    elif status == REQUIRED:
        logger.info("the Ray cluster at %s requires token authentication", gcs_address)
    else:
        logger.warning(
            "could not tell whether the Ray cluster at %s requires authentication (%s); if it "
            "does not, %s can run code on it",
            gcs_address,
            detail,
            where,
        )
    return status
