"""The draft-model proposer of speculative decoding: a small model with the target's vocabulary,
its own paged KV cache on the target's block tables, run greedily for K tokens per request.

Its KV cache has the target pool's blocks (``num_blocks``, ``block_size``; its own layers, heads
and head dim), so a request's block table and slot mapping serve both models: every step the
target runs, ``prefill`` runs the draft over the same step tokens (same positions, slots and
attention metadata), so the draft's cache holds what the target's holds, prefix-cache hits,
recomputes after preemption and rejected drafts (overwritten later) included. The draft's
layers are few, so this costs a fraction of the target's step.

After the step's sampler, ``propose`` continues each proposing request from its last kept token
(the target's own token after its accepted drafts, found on the device by
``spec_decode.accept_on_device``) for K greedy steps of one token each, writing the draft's K/V
for positions ``p .. p + K - 1`` (p: the position of that token). Those lie at most K past the
step's last token: the scheduler allocates them (``num_lookahead_tokens``) and they are never
registered in the prefix cache; the next step's ``prefill`` overwrites them with the real
tokens'. A slot on the null block (a lookahead the pool could not give) is not written. Both are
dispatched right after the target's step, with no host round trip, so the drafts reach the host
with the step's tokens.

KV-cache groups (a target with sliding-window layers, ``jaxserve/core/kv_cache_groups.py``): the
step carries one block table and slot mapping per group (``[G, S, P]``, ``[G, T]``), and a
sliding-window group's table frees (nulls) the blocks its window left behind. The draft has one
group of its own (every layer, full attention or its own windows), so it uses one of the
target's groups whose table keeps every block of the sequence: the first full-attention group
(``kv_group``, group 0: full groups come first). Its layers all read that group's table and
slots (``PagedAttentionMetadata.for_layer`` through the draft graph's ``kv_layout``) and write
the draft pool's pair of their own index. A block id that group holds belongs to the request
until it ends, so the draft's K/V there is never another request's; the other groups' block ids
are never written in the draft's pool. A target whose layers all slide (no full group) cannot
hold a draft's cache this way: ``ModelRunner.draft_kv_group`` refuses it at start-up.

A reduced LM head (``draft_vocab_size`` in the draft's config.json, EAGLE-3's convention; the
frequency-ranked vocabulary of FR-Spec): the head scores only the draft's most frequent tokens,
which makes each draft token much cheaper where the head is a large part of a small draft (a
135M target's tied head is 28M of its parameters). The checkpoint's int ``d2t`` tensor
``[draft_vocab_size]`` maps a draft id to the target's, ``target = draft + d2t[draft]``; the
proposer argmaxes over the reduced head and maps on the device. Verification is unchanged:
tokens outside the head are never drafted, not wrongly accepted.

Shapes: ``prefill`` compiles per token bucket (as the target's forward); ``propose`` per row
bucket R (the proposing requests padded to a power of two, at least the attention backend's
token multiple), with K unrolled.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxserve.model.attention import PagedAttentionMetadata, cache_head_dim
from jaxserve.model.sharding import gather_logits, place_model
from jaxserve.worker.compilation import StepGraph, merge_model, step_input_ids, step_metadata
from jaxserve.worker.kv_cache_alloc import KVCacheSpec, allocate_kv_caches, kv_cache_shapes
from pallas_kernels.bucketing import next_power_of_2

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from jaxserve.model.arch_config import ModelArchConfig
    from jaxserve.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)


@functools.partial(jax.jit, static_argnames="graph", donate_argnames="kv_caches")
def draft_prefill_step(graph: StepGraph, params: list, kv_caches: list, inputs: StepInputs):
    """The draft model over a target step's tokens: writes its K/V, returns its caches."""
    graph.traces["draft_prefill"] += 1
    model = merge_model(graph, params)
    _, kv_caches = model(
        step_input_ids(inputs), inputs.positions, kv_caches, step_metadata(graph, inputs)
    )
    return kv_caches  # the hidden states are unused: XLA drops the work only they need


@functools.partial(jax.jit, static_argnames=("graph", "k"), donate_argnames="kv_caches")
def draft_propose_step(
    graph: StepGraph,
    params: list,
    kv_caches: list,
    tables: jax.Array,
    context_lens: jax.Array,
    last_tokens: jax.Array,
    num_accepted: jax.Array | None,
    seqs: jax.Array,
    num_spec: jax.Array,
    num_real: jax.Array,
    d2t: jax.Array | None,
    k: int,
):
    """K greedy draft tokens for each of R proposing sequences of a step.

    Args:
      tables: int32 ``[R, P]``, their block tables (the draft's group's); context_lens: int32
        ``[R]``, their context lengths in the step (after its drafts).
      last_tokens: int32 ``[S_max]``, each sequence's last kept token.
      num_accepted: int32 ``[S_max]``, drafts accepted per sequence this step; None when no
        sequence carried drafts.
      seqs: int32 ``[R]``, the proposing sequences (real ones first; padding repeats one).
      num_spec: int32 ``[R]``, drafts each of them carried this step.
      num_real: int32 ``[]``, real entries of ``seqs``.
      d2t: int32 ``[draft_vocab_size]`` offsets from a reduced head's ids to the target's, or
        None (the head covers the vocabulary).
      k: K (static).

    Returns:
      ``(drafts int32 [R, K], kv_caches)``.
    """
    graph.traces["draft_propose"] += 1
    model = merge_model(graph, params)
    r = seqs.shape[0]
    max_pos = tables.shape[1] * kv_caches[0][0].shape[1]
    bs = kv_caches[0][0].shape[1]
    real = jnp.arange(r) < num_real
    # The position of the last kept token: the step's context ends after its drafts.
    pos = context_lens - num_spec
    if num_accepted is not None:
        pos = pos + num_accepted[seqs]
    query_start_loc = jnp.minimum(jnp.arange(r + 1, dtype=jnp.int32), num_real)
    block_index = jnp.arange(tables.shape[1], dtype=jnp.int32)

    def one(j, carry):
        """Draft step j: the token at position pos + j in, its K/V written, the next out. A
        loop rather than K unrolled steps: each iteration updates the pool in place (unrolled,
        XLA on CPU copied it around the attention's key loop at every step)."""
        tok, drafts, kv_caches = carry
        p = pos + j
        inside = real & (p < max_pos)
        at = jnp.minimum(p // bs, tables.shape[1] - 1)
        block = jnp.sum(jnp.where(block_index[None, :] == at[:, None], tables, 0), axis=1)
        slot = jnp.where(inside & (block > 0), block * bs + p % bs, -1)
        metadata = PagedAttentionMetadata(  # one group: the draft's table (kv_layout None)
            slot_mapping=slot[None],
            block_tables=tables[None],
            context_lens=jnp.where(inside, p + 1, 0),
            query_start_loc=query_start_loc,
            num_seqs=num_real,
            backend=graph.backend,
            interpret=graph.interpret,
            mesh=graph.mesh,
        )
        hidden, kv_caches = model(tok, jnp.minimum(p, max_pos - 1), kv_caches, metadata)
        logits = gather_logits(model.compute_logits(hidden), graph.mesh)  # [R, V]
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        if d2t is not None:  # a reduced head's id -> the target's
            tok = tok + d2t[tok]
        drafts = lax.dynamic_update_slice_in_dim(drafts, tok[:, None], j, axis=1)
        return tok, drafts, kv_caches

    drafts = jnp.zeros((r, k), jnp.int32)
    _, drafts, kv_caches = lax.fori_loop(0, k, one, (last_tokens[seqs], drafts, kv_caches))
    return drafts, kv_caches


def read_d2t(model_dir: str) -> np.ndarray | None:
    """The ``d2t`` tensor of a draft checkpoint directory's safetensors (a reduced head's id
    offsets, EAGLE-3's name), or None when it has none (or is not a safetensors directory)."""
    from jaxserve.model.readers.safetensors_reader import SafetensorsReader

    if not os.path.isdir(model_dir):
        return None
    try:
        reader = SafetensorsReader(model_dir)
    except (OSError, ValueError):
        return None
    with reader:
        return np.asarray(reader.read("d2t")) if "d2t" in reader else None


class DraftModel:
    """A draft model placed beside the target, with its K/V pool and jitted steps.

    Args:
      model: the draft's Flax NNX model (``jaxserve.model.load_model``).
      arch: its ModelArchConfig.
      mesh: the target's mesh (the draft is split the same way).
      step_mesh: the mesh the step functions shard over, or None (one device).
      backend: the resolved attention backend; interpret: Pallas interpret mode.
      num_speculative_tokens: K.
      token_multiple: the backend's token bucket multiple (R is at least this).
      kv_group: the target's KV-cache group whose block tables and slots hold the draft's cache
        (a full-attention group; ``ModelRunner.draft_kv_group``).
      d2t: int ``[draft_vocab_size]``, a reduced head's id offsets (:func:`read_d2t`), or None.

    Raises:
      ValueError: the draft's heads cannot be split over the mesh; ``d2t`` does not fit its
        head or maps outside the vocabulary.
    """

    def __init__(
        self,
        model: nnx.Module,
        arch: ModelArchConfig,
        *,
        mesh: Mesh,
        step_mesh: Mesh | None,
        backend: str,
        interpret: bool,
        num_speculative_tokens: int,
        token_multiple: int = 1,
        kv_group: int = 0,
        d2t: np.ndarray | None = None,
    ) -> None:
        self.d2t = None
        head_rows = arch.draft_vocab_size or arch.vocab_size
        if d2t is not None or arch.draft_vocab_size is not None:
            if d2t is None:
                raise ValueError(
                    f"config.json sets draft_vocab_size {arch.draft_vocab_size} but the "
                    "checkpoint has no d2t tensor (draft id -> target id offsets)"
                )
            d2t = np.asarray(d2t).astype(np.int64).reshape(-1)
            targets = np.arange(len(d2t)) + d2t
            if len(d2t) != head_rows:
                raise ValueError(
                    f"d2t: {len(d2t)} offsets, expected {head_rows} (draft_vocab_size)"
                )
            if targets.min() < 0 or targets.max() >= arch.vocab_size:
                raise ValueError(
                    f"d2t: offsets mapping into [{targets.min()}, {targets.max()}]; expected "
                    f"[0, {arch.vocab_size})"
                )
            head = getattr(model, "lm_head", None)
            if head is None or head.vocab_size != head_rows:
                raise ValueError(
                    f"draft_vocab_size {head_rows}: the {arch.architecture} family does not "
                    "build a reduced LM head (Llama, Mistral, Qwen2 and Qwen3 do)"
                )
            self.d2t = jnp.asarray(d2t.astype(np.int32))
        model, self.arch = place_model(model, arch, mesh)
        self.dtype = jnp.dtype(getattr(model, "dtype", jnp.float32))
        graphdef, state = nnx.split(model)
        self.params, state_def = jax.tree.flatten(state)
        self.kv_group = kv_group
        # Every draft layer reads group kv_group's table and slots and its own pool pair.
        layout = (
            None if kv_group == 0 else tuple((kv_group, i) for i in range(self.arch.num_layers))
        )
        self.graph = StepGraph(
            graphdef, backend, 0, interpret, step_mesh, state_def=state_def, kv_layout=layout
        )
        self.k = num_speculative_tokens
        self.head_dim = cache_head_dim(backend, self.arch.head_dim)
        self.token_multiple = token_multiple
        self.kv_spec: KVCacheSpec | None = None
        self.kv_caches: list | None = None

    @property
    def bytes_per_token(self) -> int:
        """The draft's K/V bytes per token, all its layers (what its pool adds per block slot)."""
        a = self.arch
        return 2 * a.num_layers * a.num_kv_heads * self.head_dim * self.dtype.itemsize

    def spec(self, num_blocks: int, block_size: int, num_shards: int) -> KVCacheSpec:
        """The draft pool's KVCacheSpec for a target pool of ``num_blocks`` blocks."""
        a = self.arch
        return KVCacheSpec(
            num_blocks=num_blocks,
            block_size=block_size,
            num_layers=a.num_layers,
            num_kv_heads=a.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype.name,
            bytes_per_token=self.bytes_per_token,
            source="draft",
            num_shards=num_shards,
        )

    def allocate(self, spec: KVCacheSpec, sharding) -> None:
        """Allocates the draft's pool (``spec`` from :meth:`spec`), placed with ``sharding``."""
        self.kv_spec = spec
        self.kv_caches = allocate_kv_caches(spec, sharding)
        logger.info(
            "draft model KV cache: %d layers x %d blocks, %d bytes/token, %.3f GiB",
            spec.num_layers,
            spec.num_blocks,
            spec.bytes_per_token,
            spec.total_bytes / 2**30,
        )

    def cache_shapes(self, sharding) -> list:
        """Stand-ins of the draft pool for lowering (after :meth:`allocate`)."""
        return kv_cache_shapes(self.kv_spec, sharding)

    def num_rows(self, n: int) -> int:
        """R for ``n`` proposing sequences: a power of two, at least the token multiple."""
        return max(next_power_of_2(max(n, 1)), self.token_multiple)

    def compile_prefill(self, inputs: StepInputs, sharding):
        """``prefill``'s executable for the token bucket of ``inputs``, compiled ahead of time
        (warm-up; ``sharding``: the pool's)."""
        return draft_prefill_step.lower(
            self.graph, self.params, self.cache_shapes(sharding), inputs
        ).compile()

    def prefill(self, inputs: StepInputs, aot=None) -> None:
        """Runs the draft over a target step's tokens (dispatched, not waited for); ``aot``: the
        token bucket's executable compiled ahead of time, if any."""
        if aot is not None:
            self.kv_caches = aot(self.params, self.kv_caches, inputs)
        else:
            self.kv_caches = draft_prefill_step(self.graph, self.params, self.kv_caches, inputs)

    def propose(
        self,
        block_tables: np.ndarray,
        context_lens: np.ndarray,
        last_tokens: jax.Array,
        num_accepted: jax.Array | None,
        seqs: np.ndarray,
        num_spec: np.ndarray,
        num_rows: int | None = None,
    ) -> jax.Array:
        """Dispatches K greedy draft tokens for the step's proposing sequences ``seqs`` (int
        ``[n]``, each with ``num_spec`` drafts this step); returns int32 ``[R, K]`` on the
        device (rows past n are padding).

        Args:
          block_tables: int32 ``[G, S, P]`` (the step's per-group tables; the draft reads group
            ``kv_group``'s), context_lens: int32 ``[S]``: the step's (host).
          last_tokens, num_accepted: int32 ``[S_max]`` (``accept_on_device``); num_accepted
            None when no sequence carried drafts.
          num_rows: R (default ``num_rows(n)``).
        """
        n = len(seqs)
        r = self.num_rows(n) if num_rows is None else num_rows
        pad_seqs = np.zeros(r, np.int32)
        pad_seqs[:n] = seqs
        pad_seqs[n:] = seqs[0] if n else 0
        pad_spec = np.zeros(r, np.int32)
        pad_spec[:n] = num_spec
        drafts, self.kv_caches = draft_propose_step(
            self.graph,
            self.params,
            self.kv_caches,
            block_tables[self.kv_group][pad_seqs],
            context_lens[pad_seqs],
            last_tokens,
            num_accepted,
            pad_seqs,
            pad_spec,
            np.asarray(n, np.int32),
            self.d2t,
            k=self.k,
        )
        return drafts
