"""KV-cache events over ZMQ PUB with msgpack payloads, in vLLM's event format.

An external KV-aware router (llm-d's KV-cache indexer, the Gateway API Inference Extension's
prefix scorer) subscribes to every replica's events to learn which replica holds which prefix.
The block pool records the events (``BlockPool.kv_events``, its one hook); the engine takes them
after each step and hands them to :class:`KVEventPublisher`, whose thread encodes and sends them,
so the engine thread never blocks on the network.

Wire format (vLLM's ``vllm/distributed/kv_events.py``; msgspec structs encoded as maps, the
event class name under ``"type"``). Each ZMQ message has three frames::

    [topic (bytes, "" by default), seq (8-byte big-endian unsigned, +1 per message from 0),
     payload (msgpack)]

    payload = {"ts": float (Unix seconds), "events": [event, ...], "data_parallel_rank": int}
    event   = {"type": "BlockStored", "block_hashes": [bytes32, ...],
               "parent_block_hash": bytes32 | None, "token_ids": [int, ...],
               "block_size": int, "lora_id": None, "medium": "GPU", "lora_name": str | None}
            | {"type": "BlockRemoved", "block_hashes": [bytes32, ...], "medium": "GPU"}
            | {"type": "AllBlocksCleared"}

With several KV-cache groups (a model with sliding-window layers: ``jaxserve/core/
kv_cache_groups.py``) the same tokens are stored once per group, and each ``BlockStored`` also
carries ``"group_idx": int, "kv_cache_spec_kind": "full_attention" | "sliding_window",
"kv_cache_spec_sliding_window": int | None`` and each ``BlockRemoved`` ``"group_idx"`` (vLLM's
fields of the same names). A router that predicts prefix hits should count a prefix as held
only when the full-attention group holds all of it (a sliding group keeps only the blocks of
its window; jaxserve/core/kv_cache_manager.py, "Prefix caching"). With one group these fields
are left out, as vLLM's encoder leaves out unset fields.

A gap in ``seq`` means the subscriber missed messages (PUB drops above its high-water mark
and before a subscriber connects); vLLM's replay socket is not implemented, so a subscriber
that sees a gap should treat that replica's index as stale. ``medium`` is always "GPU"
(the device pool; vLLM's name even on CPU or TPU).

Where our block hashes differ from vLLM's (docs/ARCHITECTURE.md, "KV-cache events"): ours are
``sha256(parent || token ids packed as native int32 || extra keys)`` with the salt's tagged
bytes as block 0's extra keys, chained from ``none_hash_from_seed(PYTHONHASHSEED)``; vLLM's
are sha256 (or xxhash) over a CBOR/pickle of ``(parent, token tuple, extra keys)`` from its own
seed. The two never match, so a router must not compute vLLM's hashes for us: either it indexes
by the hashes we send (and, to match a new prompt, computes ours with
``jaxserve.core.kv_cache_utils.hash_token_blocks`` given the engines' ``PYTHONHASHSEED``), or it
re-hashes the ``token_ids`` each ``BlockStored`` carries with its own function (llm-d does this).
Without ``PYTHONHASHSEED`` each engine's chain starts from random bytes and hashes are only
comparable within one replica.

Privacy (the events carry no authentication; docs/ARCHITECTURE.md, "KV-cache events"):

* where it listens: ``tcp://*:PORT`` binds 127.0.0.1 only (vLLM binds every interface for the
  same string), like ``--host``'s default; ``tcp://0.0.0.0:PORT`` (or ``tcp://[::]:PORT``) binds
  every interface and logs a warning at start-up, as ``*`` does (saying what it binds);
* what it says: the ``BlockStored`` of a request with a ``cache_salt`` carries its block hashes
  and an empty ``token_ids`` (token ids are the prompt's text, and a salt marks a tenant that
  does not share its prefixes), unless ``kv_events_include_token_ids`` is set. Unsalted
  requests' token ids are published as in vLLM.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from jaxserve.core.kv_cache_utils import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

logger = logging.getLogger(__name__)

MEDIUM = "GPU"
"""vLLM's name for the device KV pool (the only pool we have)."""


def event_to_wire(
    event: KVEvent, block_size: int, group_windows: Sequence[int | None] = ()
) -> dict[str, Any]:
    """One event as vLLM's msgspec struct encodes it (a map with its class name under "type").

    ``group_windows``: each KV-cache group's sliding window (None: full attention), for the
    ``kv_cache_spec_*`` fields of an event that names its group."""
    if isinstance(event, BlockStored):
        wire = {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": block_size,
            "lora_id": None,
            "medium": MEDIUM,
            "lora_name": event.lora_name,
        }
        group = event.group_idx
        if group is not None:
            window = group_windows[group] if group < len(group_windows) else None
            wire["group_idx"] = group
            wire["kv_cache_spec_kind"] = "full_attention" if window is None else "sliding_window"
            wire["kv_cache_spec_sliding_window"] = window
        return wire
    if isinstance(event, BlockRemoved):
        wire = {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": MEDIUM}
        if event.group_idx is not None:
            wire["group_idx"] = event.group_idx
        return wire
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(
    events: Sequence[KVEvent],
    block_size: int,
    data_parallel_rank: int,
    ts: float | None = None,
    group_windows: Sequence[int | None] = (),
) -> bytes:
    """msgpack bytes of one event batch (vLLM's ``KVEventBatch``).

    Args:
      events: the block pool's events, in order.
      block_size: tokens per block (``BlockStored.block_size``).
      data_parallel_rank: the replica's index.
      ts: Unix seconds (default: now).
      group_windows: each KV-cache group's sliding window (see :func:`event_to_wire`).
    """
    import msgpack

    return msgpack.packb(
        {
            "ts": time.time() if ts is None else ts,
            "events": [event_to_wire(e, block_size, group_windows) for e in events],
            "data_parallel_rank": data_parallel_rank,
        },
        use_bin_type=True,
    )


def offset_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """The endpoint replica ``data_parallel_rank`` uses. A bound endpoint gets a ``tcp://`` port
    + rank, an ipc or inproc name + ``_dp<rank>`` (vLLM's rule, so N replicas given one address
    do not collide); a connecting one is shared as given (one subscriber, many publishers;
    vLLM offsets it too, we do not need to).

    Raises:
      ValueError: a bound tcp endpoint without a numeric port (naming ``kv_events_endpoint``).
    """
    if data_parallel_rank == 0 or not binds(endpoint):
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"kv_events_endpoint {endpoint!r} has no numeric port")
        return f"{base}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


LOOPBACK = "127.0.0.1"
"""Where ``tcp://*:PORT`` binds (``--host``'s default)."""

EVERY_INTERFACE = ("0.0.0.0", "[::]", "::")
"""tcp hosts that bind every interface (each start-up logs a warning)."""


def _tcp_host(endpoint: str) -> str | None:
    """The host part of a ``tcp://HOST:PORT`` endpoint; None for ipc and inproc."""
    if not endpoint.startswith("tcp://"):
        return None
    host, sep, _ = endpoint[len("tcp://") :].rpartition(":")
    return host if sep else endpoint[len("tcp://") :]


def binds(endpoint: str) -> bool:
    """Whether the publisher binds (``*``, ``0.0.0.0``, an IPv6 address, ipc, inproc) or
    connects (a host name or IPv4 address: a subscriber that binds, vLLM's rule)."""
    host = _tcp_host(endpoint)
    return host is None or host == "*" or "::" in host or host in EVERY_INTERFACE


def bind_address(endpoint: str) -> str:
    """The address a binding publisher passes to ZMQ: ``tcp://*:PORT`` becomes
    ``tcp://127.0.0.1:PORT``; every other endpoint is taken as written."""
    if _tcp_host(endpoint) == "*":
        return f"tcp://{LOOPBACK}:{endpoint.rpartition(':')[2]}"
    return endpoint


def exposure_warning(endpoint: str) -> str | None:
    """The start-up warning for an endpoint written with ``*`` or an every-interface address,
    else None."""
    host = _tcp_host(endpoint)
    port = endpoint.rpartition(":")[2]
    if host == "*":
        return (
            f"kv_events_endpoint {endpoint}: '*' binds {LOOPBACK}:{port} only (loopback; vLLM "
            f"binds every interface for it); to publish to other hosts write "
            f"tcp://0.0.0.0:{port}, or have the engine connect to the subscriber "
            f"(tcp://SUBSCRIBER_HOST:PORT)"
        )
    if host in EVERY_INTERFACE:
        return (
            f"kv_events_endpoint {endpoint} binds every interface: anyone who can reach port "
            f"{port} reads the prefix cache's block hashes and the token ids (prompt text) of "
            f"unsalted requests, without authentication; keep the port on a private network"
        )
    return None


class KVEventPublisher:
    """Sends the engine's KV events from a daemon thread over a ZMQ PUB socket.

    Args:
      endpoint: ``tcp://*:PORT`` (binds 127.0.0.1), ``tcp://0.0.0.0:PORT`` (binds every
        interface, with a warning), ``tcp://HOST:PORT`` (connects), ipc or inproc (binds);
        already offset for the rank (:func:`offset_endpoint`).
      block_size: tokens per block.
      data_parallel_rank: the replica's index (in each payload).
      topic: first frame of every message.
      max_queue: batches kept while the socket is slow; beyond it new batches are dropped
        (counted in ``num_dropped``; the subscriber sees a ``seq`` gap only for sent ones).
      hwm: the socket's high-water mark (messages).
      group_windows: each KV-cache group's sliding window (``CacheConfig.kv_cache_groups``),
        for the group fields of the events (:func:`event_to_wire`).

    Attributes:
      address: where the socket listens (bound; the port resolved) or what it connected to.

    Raises:
      ValueError: pyzmq or msgpack missing (``pip install 'jaxserve[events]'``).
      zmq.ZMQError: the address cannot be bound or connected.
    """

    def __init__(
        self,
        endpoint: str,
        block_size: int,
        data_parallel_rank: int = 0,
        *,
        topic: str = "",
        max_queue: int = 10_000,
        hwm: int = 100_000,
        group_windows: Sequence[int | None] = (),
    ) -> None:
        try:
            import msgpack  # noqa: F401
            import zmq
        except ImportError:
            raise ValueError(
                "kv_events_endpoint needs pyzmq and msgpack: pip install 'jaxserve[events]'"
            ) from None
        self.endpoint = endpoint
        self.block_size = block_size
        self.data_parallel_rank = data_parallel_rank
        self.group_windows = tuple(group_windows)
        self.num_dropped = 0
        self._topic = topic.encode()
        self._queue: queue.Queue[list[KVEvent] | None] = queue.Queue(max_queue)
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.PUB)
        self._socket.set_hwm(hwm)
        warning = exposure_warning(endpoint)
        if warning:
            logger.warning(warning)
        if binds(endpoint):
            self._socket.ipv6 = "[" in endpoint or "::" in endpoint
            self._socket.bind(bind_address(endpoint))
            self.address = self._socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        else:
            self._socket.connect(endpoint)
            self.address = endpoint
        self._thread = threading.Thread(target=self._run, name="jaxserve-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Queues one step's events (engine thread; never blocks)."""
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.num_dropped += 1

    def close(self, timeout: float = 1.0) -> None:
        """Sends what is queued (up to ``timeout``), then closes the socket."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._socket.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        seq = 0
        while True:
            events = self._queue.get()
            if events is None:
                return
            try:
                payload = encode_batch(
                    events,
                    self.block_size,
                    self.data_parallel_rank,
                    group_windows=self.group_windows,
                )
                self._socket.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                seq += 1
            except Exception:  # noqa: BLE001 - events are best-effort; the engine goes on
                logger.exception("publishing KV events failed")
