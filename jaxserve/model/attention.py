"""Attention dispatch: the paged path (KV cache + ragged paged attention) and the dense path.

The paged path writes the step's new K/V into the per-layer cache through the slot mapping,
then attends every query token to its sequence's cached tokens through the block table
(vLLM's PagedAttention, Kwon et al. 2023, in its ragged form: prefill chunks and decodes mixed in
one flat token batch). The metadata describing the batch is an explicit pytree passed into the
jitted step (see docs/ARCHITECTURE.md, "Attention metadata").

Backends (``--attention-backend``): "xla" (pure jnp compiled by XLA, any platform; the key-chunked
``jaxserve.model.chunked_attention``, whose cost follows the contexts present), "pallas-gpu" (our
Pallas Triton kernel, ``pallas_kernels/ragged_paged_attention.py``), "pallas-tpu" (our Pallas
Mosaic-TPU kernel, ``pallas_kernels/ragged_paged_attention_tpu.py``); resolving the flag per
platform: ``jaxserve.model.attention_backends`` (jax-free). The TPU kernel's shape rules reach the rest of the engine through
``cache_head_dim`` (KV pool sized with the head dim padded to 128) and
``token_bucket_multiple`` (token buckets in whole query tiles).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxserve.model.attention_backends import ATTENTION_BACKENDS
from jaxserve.model.chunked_attention import chunked_paged_attention
from jaxserve.model.layers.lora import LoraBatch
from jaxserve.model.sharding import MODEL_AXIS
from pallas_kernels.kv_cache_write import write_kv_cache
from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
)
from pallas_kernels.ragged_paged_attention_tpu import (
    TPU_BLOCK_Q,
    ragged_paged_attention_tpu,
    tpu_head_dim,
)


def cache_head_dim(backend: str, head_dim: int) -> int:
    """Head dim of the KV cache for ``backend``: the model's, except the TPU kernel's
    lane-aligned one (a multiple of 128; ``paged_attention`` zero-pads q, k and v to it)."""
    return tpu_head_dim(head_dim) if backend == "pallas-tpu" else head_dim


def token_bucket_multiple(backend: str) -> int:
    """Every token bucket of ``backend`` must be a multiple of this (the TPU kernel's query
    tile; 1 otherwise)."""
    return TPU_BLOCK_Q if backend == "pallas-tpu" else 1


def min_token_bucket(backend: str) -> int:
    """The smallest default token bucket of ``backend``: 1 for the jnp backends ("xla",
    "reference": XLA CPU's cost follows the padded rows, and a one-sequence decode step padded
    to 16 rows spends most of its time on the padding: the LM head alone is ~3x at 16 rows),
    16 for the Pallas kernels (whose query tiles have not been measured below that on a GPU)."""
    return 1 if backend in ("xla", "reference") else 16


@dataclasses.dataclass(frozen=True)
class PagedAttentionMetadata:
    """Where this step's tokens go in the paged KV cache and what each one attends to.

    T is the padded token bucket, S the padded sequence bucket, G the KV-cache groups (layers
    that share a block table: ``jaxserve/core/kv_cache_groups.py``; 1 without sliding-window
    layers). The model hands each layer ``for_layer(i)``: its group's ``[T]`` slots and
    ``[S, P]`` block table, the shapes ``paged_attention`` and every kernel take.

    Attributes:
      slot_mapping: int32 ``[G, T]``, per group the flat cache slot of each step token
        (``block_table[pos // block_size] * block_size + pos % block_size``); -1 for padding,
        which writes nowhere. (``[T]`` in a layer's view.)
      block_tables: int32 ``[G, S, max_blocks_per_seq]``, per group the block ids of each
        sequence, padded with the null block 0; a sliding-window group's entries before the
        window may name blocks another request now holds (never read unmasked). (``[S, P]``
        in a layer's view.)
      context_lens: int32 ``[S]``, tokens of each sequence in the cache after this step's writes
        (cached + new); 0 for padding sequences.
      query_start_loc: int32 ``[S + 1]``, cumulative query lengths; sequence i's tokens are
        ``q[query_start_loc[i]:query_start_loc[i + 1]]``, the last tokens of the sequence.
      num_seqs: int32 ``[]``, real sequences (the rest of S is padding).
      backend: static; one of ``ATTENTION_BACKENDS`` ("xla", "pallas-gpu", "pallas-tpu").
      interpret: static; run the Pallas kernel in Pallas interpret mode (the TPU kernel in TPU
        interpret mode); ignored by "xla".
      mesh: static; the tensor-parallel mesh ``("model",)`` when it has more than one device,
        else None. With a mesh the cache write and the attention run per shard of heads
        (``shard_map``); the metadata arrays are replicated.
      kv_layout: static; per layer, ``(group, array pair)``: the block table it reads and the
        pool's ``(k_cache, v_cache)`` pair it uses (``KVCacheLayout.layer_kv``); None: one group,
        layer i uses pair i.
      lora: the step's adapter batch (``jaxserve.model.layers.lora.LoraBatch``) that every
        LoRA-enabled ``Linear`` adds its delta for; None: no adapter token in the step.
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array
    query_start_loc: jax.Array
    num_seqs: jax.Array
    backend: str = "xla"
    interpret: bool = False
    mesh: Mesh | None = None
    kv_layout: tuple[tuple[int, int], ...] | None = None
    lora: LoraBatch | None = None

    def __post_init__(self):
        if self.backend not in ATTENTION_BACKENDS:
            raise ValueError(f"backend must be one of {ATTENTION_BACKENDS}, got {self.backend!r}")

    def for_layer(self, layer: int) -> tuple[int, PagedAttentionMetadata]:
        """Layer ``layer``'s pool array pair and its view of the step: its group's ``[T]`` slot
        mapping and ``[S, P]`` block table (static indexing, free under jit), what
        ``paged_attention`` takes.

        FP8 KV cache: the k/v scales are not in the metadata nor per pool array pair, but per
        layer (the checkpoint's ``k_scale`` / ``v_scale`` of that layer, held by the layer and
        passed with this view to ``paged_attention``). Layers of different groups share an
        array pair but never a block (a block id belongs to one group at a time), so every FP8
        value in a pair is read back only by the layer that wrote it, with the scales it was
        written with; one scale per pair would have to be one layer's, wrong for the others."""
        group, pair = (0, layer) if self.kv_layout is None else self.kv_layout[layer]
        view = dataclasses.replace(
            self,
            slot_mapping=self.slot_mapping[group],
            block_tables=self.block_tables[group],
            kv_layout=None,
        )
        return pair, view


jax.tree_util.register_dataclass(
    PagedAttentionMetadata,
    data_fields=[
        "slot_mapping",
        "block_tables",
        "context_lens",
        "query_start_loc",
        "num_seqs",
        "lora",
    ],
    meta_fields=["backend", "interpret", "mesh", "kv_layout"],
)

KVCache = tuple[jax.Array, jax.Array]  # (k_cache, v_cache), each [num_blocks, block_size, Hkv, D]


def paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_cache: KVCache,
    metadata: PagedAttentionMetadata,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """Writes this step's K/V into the cache, then runs ragged paged attention.

    FP8 KV cache (a cache of float8_e4m3fn or float8_e5m2, ``--kv-cache-dtype``): the write
    stores ``k / k_scale`` and ``v / v_scale`` saturated to the FP8 range; every backend widens
    the FP8 keys and values inside its inner loop (as it reads each KV tile), and the per-tensor
    scales are applied outside the kernels, where they cost one multiply per query and output
    element instead of one per key: ``q · (k_scale k8) = (k_scale q) · k8`` and
    ``sum p (v_scale v8) = v_scale sum p v8``, exact up to rounding. So the kernels take an FP8
    cache with their signatures unchanged.

    Args:
      q: ``[T, Hq, D]`` queries (RoPE applied).
      k, v: ``[T, Hkv, D]`` new keys (RoPE applied) and values, cache dtype.
      kv_cache: ``(k_cache, v_cache)``, each ``[num_blocks, block_size, Hkv, Dc]``; donate them.
        ``Dc >= D`` (``cache_head_dim``): q, k and v are zero-padded to ``Dc``, which changes
        no score, and the output is cut back to ``D``.
      metadata: the layer's view of the step's ``PagedAttentionMetadata`` (``for_layer``:
        ``[T]`` slots, ``[S, P]`` block table).
      sm_scale: softmax scale, usually ``head_dim ** -0.5``.
      soft_cap: attention-logit soft cap (``cap * tanh(s / cap)``), or None.
      sliding_window: keys at positions ``> q_pos - sliding_window`` are visible, or None (all).
      k_scale, v_scale: float32 scalars, this layer's FP8 per-tensor scales (None: 1.0; per
        layer, not per pool array pair: see ``PagedAttentionMetadata.for_layer``); unused by a
        cache in the model dtype.

    Returns:
      ``(out [T, Hq, D] in q's dtype, (k_cache, v_cache))``; rows for padding tokens are
      unspecified (finite).

    Raises:
      ValueError: the step's metadata instead of a layer's view (a ``[G, S, P]`` block table).
    """
    if metadata.block_tables.ndim != 2:
        raise ValueError(
            f"block_tables must be a layer's [S, P] table, got shape "
            f"{tuple(metadata.block_tables.shape)}: pass metadata.for_layer(i)"
        )
    out_dtype = q.dtype
    fp8 = is_fp8(kv_cache[0].dtype)
    if fp8:
        one = jnp.ones((), jnp.float32)
        k_scale = one if k_scale is None else k_scale.astype(jnp.float32)
        v_scale = one if v_scale is None else v_scale.astype(jnp.float32)
        q = (q.astype(jnp.float32) * k_scale).astype(out_dtype)
        k = quantize_kv(k, k_scale, kv_cache[0].dtype)
        v = quantize_kv(v, v_scale, kv_cache[0].dtype)
    kwargs = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    if metadata.mesh is None:
        out, kv_cache = _write_and_attend(q, k, v, kv_cache, metadata, kwargs)
    else:
        # Tensor parallel: each shard writes and reads its own KV heads with its own query
        # heads (GQA groups never straddle shards, see model/sharding.py), so no collective is
        # needed.
        heads = PartitionSpec(None, MODEL_AXIS, None)  # [T, H, D]
        cache = PartitionSpec(None, None, MODEL_AXIS, None)  # [N, bs, Hkv, Dc]
        md = dataclasses.replace(metadata, mesh=None)
        md_spec = jax.tree.map(lambda _: PartitionSpec(), md)
        per_shard = jax.shard_map(
            lambda q, k, v, kv, md: _write_and_attend(q, k, v, kv, md, kwargs),
            mesh=metadata.mesh,
            in_specs=(heads, heads, heads, (cache, cache), md_spec),
            out_specs=(heads, (cache, cache)),
            check_vma=False,
        )
        out, kv_cache = per_shard(q, k, v, kv_cache, md)
    if fp8:
        out = (out.astype(jnp.float32) * v_scale).astype(out_dtype)
    return out, kv_cache


FP8_KV_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)


def is_fp8(dtype) -> bool:
    """Whether ``dtype`` is an FP8 KV-cache dtype."""
    return any(jnp.dtype(dtype) == d for d in FP8_KV_DTYPES)


def quantize_kv(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """New keys or values ``[T, H, D]`` for an FP8 cache: ``x / scale`` saturated to the
    format's largest finite value (an overflowing cast would give NaN or inf), then cast."""
    big = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -big, big).astype(dtype)


def _write_and_attend(q, k, v, kv_cache, metadata, kwargs) -> tuple[jax.Array, KVCache]:
    """``paged_attention`` on one device (or one shard of heads)."""
    head_dim = q.shape[-1]
    pad = kv_cache[0].shape[-1] - head_dim
    if pad:
        widths = ((0, 0), (0, 0), (0, pad))
        q, k, v = jnp.pad(q, widths), jnp.pad(k, widths), jnp.pad(v, widths)
    k_cache, v_cache = write_kv_cache(kv_cache[0], kv_cache[1], k, v, metadata.slot_mapping)
    kwargs = dict(kwargs)
    if metadata.backend == "pallas-gpu":
        attend = ragged_paged_attention
        kwargs["interpret"] = metadata.interpret
    elif metadata.backend == "pallas-tpu":
        attend = ragged_paged_attention_tpu
        kwargs["interpret"] = metadata.interpret
    else:  # "xla": chunked over the keys present (the kernels' oracle gathers whole rows)
        attend = chunked_paged_attention
    out = attend(
        q,
        k_cache,
        v_cache,
        metadata.block_tables,
        metadata.context_lens,
        metadata.query_start_loc,
        metadata.num_seqs,
        **kwargs,
    )
    return out[..., :head_dim].astype(q.dtype), (k_cache, v_cache)


def dense_causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Causal grouped-query attention over whole sequences at positions 0..L-1, no cache.

    Args:
      q: ``[B, L, Hq, D]``; k, v: ``[B, L, Hkv, D]`` with ``Hq % Hkv == 0`` (query head h reads
        kv head ``h // (Hq // Hkv)``, as HF's ``repeat_kv``).
      sm_scale, soft_cap, sliding_window: as in ``paged_attention``.

    Returns:
      ``[B, L, Hq, D]`` in q's dtype; scores and softmax in float32. Right-padding after the
      real tokens cannot change them (causality).
    """
    b, l, hq, d = q.shape
    hkv = k.shape[2]
    q_blkgd = q.reshape(b, l, hkv, hq // hkv, d)
    s_bkgls = (
        jnp.einsum("blkgd,bskd->bkgls", q_blkgd, k, preferred_element_type=jnp.float32) * sm_scale
    )
    if soft_cap is not None:
        s_bkgls = soft_cap * jnp.tanh(s_bkgls / soft_cap)
    q_pos = jnp.arange(l)[:, None]
    k_pos = jnp.arange(l)[None, :]
    mask_ls = k_pos <= q_pos
    if sliding_window is not None:
        mask_ls &= k_pos > q_pos - sliding_window
    s_bkgls = jnp.where(mask_ls, s_bkgls, -jnp.inf)
    p_bkgls = jax.nn.softmax(s_bkgls, axis=-1).astype(v.dtype)
    out_blkgd = jnp.einsum("bkgls,bskd->blkgd", p_bkgls, v, preferred_element_type=jnp.float32)
    return out_blkgd.reshape(b, l, hq, d).astype(q.dtype)
