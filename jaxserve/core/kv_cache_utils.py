"""Building blocks of the paged KV cache: blocks, the LRU free queue, prefix hashes, sizing.

Follows vLLM V1's ``v1/core/kv_cache_utils.py`` (PagedAttention, Kwon et al. SOSP 2023).

Device layout (docs/ARCHITECTURE.md). One pair of arrays per layer, a Python list over layers::

    kv_caches: list[tuple[k_cache, v_cache]]        # len = num_hidden_layers (L)
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], dtype = model dtype

Token ``t`` of a request lives at slot ``block_table[t // block_size] * block_size + t %
block_size`` of the flat view ``[num_blocks * block_size, num_kv_heads, head_dim]``. Block 0 is
the null block: never handed out, it pads block tables. Hence::

    bytes per token = 2 (K and V) * L * Hkv * D * itemsize
    bytes per block = 2 * L * Hkv * D * itemsize * block_size

e.g. Llama-3-8B in bfloat16 (L=32, Hkv=8, D=128, itemsize 2): 128 KiB per token, 2 MiB per
16-token block. The runner measures free device memory after loading weights and a peak-memory
profile step, then calls :func:`compute_num_gpu_blocks` with what is left.

Prefix caching: a full block's hash is ``sha256(parent_hash || token ids as packed int32 ||
extra keys)``; the chain starts from :data:`NONE_HASH`, random per process unless
``PYTHONHASHSEED`` is set (vLLM's rule; then every process with the same value computes the
same hashes, which a prefix-aware router and KV-event consumers need), and the first block
mixes in the request's ``cache_salt`` so tenants with different salts never share blocks
(vLLM's ``cache_salt``). Only full blocks are hashed and cached. :func:`hash_token_blocks`
hashes a bare token list the same way (the router's use).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.core.request import Request

BlockHash = bytes
"""32-byte sha256 digest identifying a full block's tokens and everything before them."""


def none_hash_from_seed(seed: str | None) -> BlockHash:
    """The chain's start for a seed string: ``sha256("jaxserve-none-hash:" + seed)``; 32 random
    bytes when ``seed`` is None or empty (or ``"random"``, Python's own spelling)."""
    if not seed or seed == "random":
        return os.urandom(32)
    return hashlib.sha256(b"jaxserve-none-hash:" + seed.encode()).digest()


NONE_HASH: BlockHash = none_hash_from_seed(os.environ.get("PYTHONHASHSEED"))
"""Parent hash of a request's first block: from ``PYTHONHASHSEED`` if set, else random per process."""

_SALT_TAG = b"\x01salt:"
_LORA_TAG = b"\x01lora:"


_PACKERS: dict[
    int, Callable[..., bytes]
] = {}  # number of ints -> compiled ``struct.Struct(f"{n}i").pack``


def _pack_tokens(token_ids: list[int]) -> bytes:
    """Token ids as packed native int32: one call of a compiled ``struct.Struct`` per length."""
    n = len(token_ids)
    pack = _PACKERS.get(n)
    if pack is None:
        pack = _PACKERS[n] = struct.Struct(f"{n}i").pack
    return pack(*token_ids)


def hash_block_tokens(
    parent_hash: BlockHash, token_ids: list[int], extra: bytes = b""
) -> BlockHash:
    """Prefix-cache hash of one full block.

    Args:
      parent_hash: hash of the previous block (``NONE_HASH`` for the first block).
      token_ids: the block's ``block_size`` token ids (ints in [0, 2**31)).
      extra: extra keys (already tagged bytes, e.g. the cache salt of the first block).

    Returns:
      32-byte sha256 digest of ``parent_hash || int32 tokens || extra``; unambiguous because
      the parent hash and every full block have fixed lengths.
    """
    return hashlib.sha256(parent_hash + _pack_tokens(token_ids) + extra).digest()


def salt_extra_keys(cache_salt: str | None, lora_name: str | None = None) -> bytes:
    """Extra keys of a request's first block: its tagged cache salt and its tagged LoRA
    adapter's name (#33: an adapter's K/V differ from the base model's), or nothing; the
    chain carries them into every later block."""
    salt = _SALT_TAG + cache_salt.encode() if cache_salt else b""
    return salt + (_LORA_TAG + lora_name.encode() if lora_name else b"")


def hash_token_blocks(
    token_ids: list[int],
    block_size: int,
    *,
    cache_salt: str | None = None,
    none_hash: BlockHash = NONE_HASH,
    max_blocks: int | None = None,
    lora_name: str | None = None,
) -> list[BlockHash]:
    """Chained hashes of the full blocks of a token list, exactly as the KV-cache manager
    computes them for a request with these tokens and ``cache_salt``.

    Args:
      token_ids: the prompt's token ids.
      block_size: tokens per block.
      cache_salt: the request's salt (mixed into block 0), or None.
      none_hash: the chain's start (the engine's :data:`NONE_HASH`; a router in another
        process passes :func:`none_hash_from_seed` of the engines' ``PYTHONHASHSEED``).
      max_blocks: hash at most this many leading blocks (None: all full blocks).
      lora_name: the request's LoRA adapter (mixed into block 0), or None.

    Returns:
      One 32-byte hash per full block (``len(token_ids) // block_size``, capped), in order.
    """
    num_full = len(token_ids) // block_size
    if max_blocks is not None:
        num_full = min(num_full, max_blocks)
    hashes: list[BlockHash] = []
    parent = none_hash
    for i in range(num_full):
        extra = salt_extra_keys(cache_salt, lora_name) if i == 0 else b""
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes


def update_block_hashes(
    request: Request, block_size: int, none_hash: BlockHash = NONE_HASH
) -> list[BlockHash]:
    """Hashes the request's full blocks that are not hashed yet; returns ``request.block_hashes``.

    Each block is hashed once over the request's life (prompt blocks, then blocks filled by
    generated tokens), equal to :func:`hash_block_tokens` chained from ``none_hash`` with the
    salt as extra keys of block 0. Cost: one pack of the new tokens and one sha256 per new full
    block; O(1) when no block filled up since the last call.
    """
    hashes = request.block_hashes
    tokens = request.all_token_ids
    num_full = len(tokens) // block_size
    first = len(hashes)
    if first >= num_full:
        return hashes
    packed = _pack_tokens(tokens[first * block_size : num_full * block_size])
    parent = hashes[-1] if hashes else none_hash
    sha256 = hashlib.sha256
    if num_full - first == 1 and first:  # one block filled up by decoding: the usual case
        hashes.append(sha256(parent + packed).digest())
        return hashes
    width = 4 * block_size
    offset = 0
    for i in range(first, num_full):
        data = parent + packed[offset : offset + width]
        if i == 0 and (request.cache_salt or request.lora_name):
            data += salt_extra_keys(request.cache_salt, request.lora_name)
        parent = sha256(data).digest()
        hashes.append(parent)
        offset += width
    return hashes


def group_block_key(block_hash: BlockHash, group: int) -> bytes:
    """A block hash made unique across KV-cache groups (the host tier's key: one tier holds
    every group's blocks): the hash itself for group 0, else the hash and the group as 2 bytes.
    """
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


class KVCacheBlock:
    """Metadata of one KV block (the device memory is in the runner's arrays).

    Attributes:
      block_id: index into the ``num_blocks`` axis of every layer's k/v cache.
      ref_cnt: number of requests whose block table holds this block.
      block_hash: prefix-cache hash while the block is cached (also while it sits, free, in
        the free queue: lazy eviction); None otherwise.
      group: the KV-cache group whose prefix cache holds it (read while ``block_hash`` is set).
      prev_free_block, next_free_block: links of the free queue (None when not in it).
      is_null: True only for block 0.
    """

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "group",
        "prev_free_block",
        "next_free_block",
        "is_null",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.group = 0
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: a doubly linked list with O(1) popleft, append and
    remove-from-the-middle (a prefix-cache hit on a free block takes it out).

    The front is evicted first. Freed blocks are appended at the tail, so the least recently
    freed block is reused first (LRU); a request frees its blocks in reverse order so its
    last blocks are evicted before its prefix (vLLM's ``FreeKVCacheBlockQueue``).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        # Sentinels keep every link operation branch-free.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        """Removes and returns the front block. Raises ValueError when empty."""
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("no free blocks")
        self._head.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = self._head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Removes and returns the first ``n`` blocks. Raises ValueError if fewer are free."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        block = self._head.next_free_block
        for _ in range(n):
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        self._head.next_free_block = block
        block.prev_free_block = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlinks ``block`` from anywhere in the queue (O(1)).

        Raises:
          ValueError: if ``block`` is not linked into the queue (naming its block id).
        """
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Puts ``block`` at the tail (evicted last)."""
        last = self._tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Puts ``blocks`` at the tail in order (the last one is evicted last)."""
        if not blocks:
            return
        last = self._tail.prev_free_block
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
        last.next_free_block = self._tail
        self._tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The queue front to back (O(n); for tests and debugging)."""
        out = []
        block = self._head.next_free_block
        while block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


def kv_cache_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int
) -> int:
    """Bytes of K and V one token occupies across all layers: ``2 * L * Hkv * D * itemsize``.

    Args:
      num_layers: hidden layers ``L``.
      num_kv_heads: KV heads ``Hkv`` per layer.
      head_dim: ``D``.
      itemsize: bytes per element of the cache dtype (2 for bfloat16).

    Returns:
      Bytes per token (e.g. 131072 for Llama-3-8B in bfloat16).

    Raises:
      ValueError: if any argument is < 1 (naming it).
    """
    for name, value in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("itemsize", itemsize),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return 2 * num_layers * num_kv_heads * head_dim * itemsize


def compute_num_gpu_blocks(available_bytes: int, bytes_per_token: int, block_size: int) -> int:
    """Number of KV blocks that fit in a byte budget, the null block included.

    Args:
      available_bytes: device bytes left for the KV cache (after weights and the profiled
        activation peak, times gpu_memory_utilization).
      bytes_per_token: from :func:`kv_cache_bytes_per_token`.
      block_size: tokens per block.

    Returns:
      ``available_bytes // (bytes_per_token * block_size)``.

    Raises:
      ValueError: if fewer than 2 blocks fit (the null block plus one usable block); the
        message gives the bytes available and needed.
    """
    if bytes_per_token < 1 or block_size < 1:
        raise ValueError(
            f"bytes_per_token and block_size must be >= 1, got {bytes_per_token}, {block_size}"
        )
    per_block = bytes_per_token * block_size
    num_blocks = max(int(available_bytes), 0) // per_block
    if num_blocks < 2:
        raise ValueError(
            f"KV cache budget of {int(available_bytes)} bytes holds {num_blocks} blocks of "
            f"{per_block} bytes; at least 2 are needed (raise gpu_memory_utilization or lower max_model_len)"
        )
    return num_blocks


@dataclasses.dataclass
class PrefixCacheStats:
    """Prefix-cache counters over an interval (tokens, not blocks).

    Only a request's first admission counts: the recompute after a preemption is neither a
    query nor a hit (vLLM counts the same way).
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0  # device and host hits together
    host_hits: int = 0  # of ``hits``, tokens found in the host tier (KV offloading)


def load_beats_recompute(
    num_blocks: int,
    block_size: int,
    per_call: float,
    per_block: float,
    per_token: float,
    num_tokens: int | None = None,
) -> bool:
    """The resume cost model of KV offloading: True when loading ``num_blocks`` host blocks
    (``per_call + num_blocks * per_block`` seconds) costs no more than recomputing the
    ``num_tokens`` tokens they would spare (``per_token`` seconds each; default ``num_blocks *
    block_size``: one KV-cache group, whose blocks are the tokens'). All 0: True."""
    if num_tokens is None:
        num_tokens = num_blocks * block_size
    return per_call + num_blocks * per_block <= num_tokens * per_token


@dataclasses.dataclass
class KVTransfers:
    """One step's KV copies between the device pool and the host tier (KV offloading).

    The runner executes every save (device block ``save_src[i]`` -> host slot ``save_dst[i]``),
    then every load (host slot ``load_src[i]`` -> device block ``load_dst[i]``), before the
    step's forward. Within one step no host slot is written twice, no device block is loaded
    twice, and a slot is never evicted after it was read or written; a slot saved this step
    may be loaded this step (hence saves first).
    """

    save_src: list[int] = dataclasses.field(default_factory=list)
    save_dst: list[int] = dataclasses.field(default_factory=list)
    load_src: list[int] = dataclasses.field(default_factory=list)
    load_dst: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class KVCacheStats:
    """What the KV-cache manager reports each step.

    Attributes:
      usage: used blocks / (total - 1) (gauge; evictable cached blocks count as free).
      prefix_cache: queries and hits since the last ``make_stats`` (interval).
      num_evictions: cached blocks evicted since the last ``make_stats`` (interval).
      host_usage: host-tier slots in use / all slots (gauge; 0.0 without offloading).
      offload_stored_tokens, offload_loaded_tokens: tokens copied device -> host and host ->
        device since the last ``make_stats`` (interval; whole blocks).
      resumed_loaded_tokens, resumed_recomputed_tokens: host-hit tokens of resumed (preempted)
        requests that the cost model chose to load / to recompute (interval).
    """

    usage: float
    prefix_cache: PrefixCacheStats
    num_evictions: int
    host_usage: float = 0.0
    offload_stored_tokens: int = 0
    offload_loaded_tokens: int = 0
    resumed_loaded_tokens: int = 0
    resumed_recomputed_tokens: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class BlockStored:
    """KV event: consecutive full blocks entered the prefix cache (vLLM's ``BlockStored``).

    Attributes:
      block_hashes: the blocks' chained hashes, in order.
      parent_block_hash: hash of the block before the first one; None for a prompt's first block.
      token_ids: the blocks' tokens, ``len(block_hashes) * block_size`` of them.
      group_idx: the KV-cache group whose blocks these are, when the cache has several groups
        (the same hashes are then stored once per group; vLLM's ``group_idx``); else None.
      lora_name: the LoRA adapter whose K/V these are (#33; part of the hashes), else None.
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    group_idx: int | None = None
    lora_name: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRemoved:
    """KV event: cached blocks were evicted (their hashes no longer hit); ``group_idx`` as in
    ``BlockStored``."""

    block_hashes: list[BlockHash]
    group_idx: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """KV event: the whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
