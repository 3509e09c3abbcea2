"""Tile and split choices for the ragged paged-attention kernel.

The kernel (``pallas_kernels/ragged_paged_attention.py``) is compiled once per
static shape bucket, so its tile sizes are chosen from static shapes only:
the padded token count ``T``, the padded sequence count ``S``, the head layout,
the KV block size and the block-table width. The heuristics follow the usual
GPU attention practice:

* GQA packing (vLLM's Triton ``unified_attention``): one program handles all
  query heads of one KV head for ``block_q`` consecutive tokens, so the rows of
  its query tile are ``block_q * group_pad`` (token, head) pairs and each KV
  tile is read once per group.
* Flash-decoding (Dao et al., 2023): when there are few query tiles (few
  sequences, or few KV heads), the context of each query tile is split across
  ``num_splits`` programs whose partial results are merged with a
  log-sum-exp reduction afterwards.
* KV tiles of 16 KiB per operand, double-buffered (three pipeline stages),
  take 64 KiB of shared memory, so two or three programs fit on an H100/H200
  SM (228 KiB) with 128 KiB or more of K/V loads in flight (the Triton
  compiler's register and shared-memory figures: benchmarks/RESULTS.md).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pallas_kernels.bucketing import is_power_of_2, next_power_of_2

# Programs we aim to launch; an H200 has 132 SMs and a memory-bound decode
# kernel wants several resident programs per SM to keep enough loads in flight.
TARGET_PROGRAMS = 1024
MAX_SPLITS = 64
# Bytes of one K (or V) tile; two operands x (num_stages - 1) of these sit in
# shared memory while Triton pipelines the loads (the block ids of a chunk of
# steps are loaded ahead, so the K/V loads pipeline NUM_STAGES - 1 deep).
KV_TILE_BYTES = 16 * 1024
NUM_STAGES = 3
MIN_DOT_ROWS = 16  # tensor-core dots need at least 16 rows (M) in Triton
# Shared memory we let one program plan for; sm_90 allows 227 KiB per block.
SMEM_BUDGET = 200 * 1024


def shared_memory_estimate(block_m, block_k, head_dim, itemsize, num_stages) -> int:
    """Upper estimate of the kernel's shared memory, in bytes: the query tile,
    ``num_stages`` K and V tiles and the probabilities tile, x1.5 for float32
    (Triton's FMA dot path stages more). Checked against the Triton compiler's
    figures for sm_90, which it exceeds for the tilings choose_config makes."""
    q_tile = block_m * head_dim * itemsize
    kv = num_stages * 2 * block_k * head_dim * itemsize
    probs = block_m * block_k * 4
    total = q_tile + kv + probs
    return int(total * 1.5) if itemsize >= 4 else total


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static tiling of one ragged paged-attention call.

    Attributes:
      block_q: query tokens per program (power of two). The query tile has
        ``block_q * group_pad`` rows, ``group_pad`` being the query heads per KV
        head rounded up to a power of two.
      block_k: KV tokens per inner-loop step (power of two >= 16): several
        cache blocks when the block size is smaller, part of one when larger.
      num_splits: programs sharing the context of one query tile
        (flash-decoding); 1 writes the output directly, > 1 writes float32
        partials that are merged by a log-sum-exp reduction.
      num_warps: Triton warps per program.
      num_stages: Triton software-pipelining stages of the KV loop.

    Raises:
      ValueError: if ``block_q``, ``block_k``, ``num_splits`` or ``num_warps``
        is not a power of two, or ``num_stages < 1`` (naming the field).
    """

    block_q: int
    block_k: int
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k", "num_splits", "num_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or not is_power_of_2(value):
                raise ValueError(f"KernelConfig.{name} must be a power of two, got {value!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"KernelConfig.num_stages must be >= 1, got {self.num_stages!r}")


def choose_config(
    *,
    num_tokens: int,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    pages_per_seq: int,
    dtype,
) -> KernelConfig:
    """Picks tile sizes and the KV split count from static shapes.

    Args:
      num_tokens: padded query-token bucket ``T``.
      num_seqs: padded sequence bucket ``S``.
      num_q_heads, num_kv_heads, head_dim: the attention head layout.
      block_size: tokens per KV-cache block.
      pages_per_seq: width ``P`` of the block table (max blocks per sequence).
      dtype: dtype of queries and KV cache.

    Returns:
      A ``KernelConfig``. A batch with at most two query tokens per sequence on
      average is treated as decode-heavy: 16-row query tiles (the tensor-core
      minimum) and a context split until about ``TARGET_PROGRAMS`` programs run.
      Otherwise prefill tiles of 128 rows (64 for rows over 256 bytes) are used
      and the context is split only when the query tiles alone cannot fill the
      GPU.
    """
    itemsize = np.dtype(dtype).itemsize
    group_pad = next_power_of_2(num_q_heads // num_kv_heads)
    decode_heavy = num_tokens <= 2 * num_seqs
    row_bytes = head_dim * itemsize

    if decode_heavy:
        # Memory bound: the smallest tensor-core tile.
        block_m = max(MIN_DOT_ROWS, group_pad)
    else:
        # Compute bound: 128-row tiles (64 for rows over 256 bytes) keep the
        # float32 accumulator and logits in registers without spilling.
        block_m = max(MIN_DOT_ROWS, group_pad, 128 if row_bytes <= 256 else 64)
    block_q = max(1, block_m // group_pad)
    block_k = min(256, max(MIN_DOT_ROWS, KV_TILE_BYTES // row_bytes))
    block_k = min(block_k, max(MIN_DOT_ROWS, next_power_of_2(pages_per_seq * block_size)))
    max_iters = -(-(pages_per_seq * block_size) // block_k)

    if decode_heavy:
        query_tiles = num_seqs
        max_splits = MAX_SPLITS
    else:
        query_tiles = -(-num_tokens // block_q)
        max_splits = 8
    programs = max(1, query_tiles * num_kv_heads)
    num_splits = 1
    while programs * num_splits * 2 <= TARGET_PROGRAMS and num_splits * 2 <= min(
        max_iters, max_splits
    ):
        num_splits *= 2

    num_warps = 8 if block_m * max(head_dim, 128) >= 128 * 128 else 4
    num_stages = NUM_STAGES
    # Fit shared memory: fewer stages first, then (prefill) fewer query rows.
    while shared_memory_estimate(block_m, block_k, head_dim, itemsize, num_stages) > SMEM_BUDGET:
        if num_stages > 1:
            num_stages -= 1
        elif block_m // 2 >= max(MIN_DOT_ROWS, group_pad):
            block_m //= 2
            block_q = max(1, block_m // group_pad)
            num_stages = NUM_STAGES
        else:
            break
    return KernelConfig(
        block_q=block_q,
        block_k=block_k,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
    )
