"""Helpers for the model tests: fixture paths, a tiny config, and a paged-step driver that feeds
a token sequence through the paged forward in chunks (its own small batch builder)."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.arch_config import ModelArchConfig
from jaxserve.model.attention import PagedAttentionMetadata, cache_head_dim

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "..", "fixtures", "golden")
GOLDEN_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_mm")
MOE_GOLDEN_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


def golden_path(name: str) -> str:
    return os.path.join(GOLDEN_DIR, name)


def tiny_hf_config(**overrides) -> dict:
    """A HF config.json dict of a tiny Llama (GQA 4/2 heads, head_dim 16)."""
    hf = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        eos_token_id=2,
        bos_token_id=1,
    )
    hf.update(overrides)
    return hf


def tiny_config(**overrides) -> ModelArchConfig:
    return ModelArchConfig.from_hf_config(tiny_hf_config(**overrides))


@functools.partial(jax.jit, static_argnums=(0,))
def _dense_step(graphdef, state, input_ids):
    return nnx.merge(graphdef, state).forward_dense(input_ids)


def dense_logits(model, seq) -> np.ndarray:
    """Jitted ``forward_dense`` of one sequence: float32 ``[len(seq), vocab]``."""
    graphdef, state = nnx.split(model)
    return np.asarray(_dense_step(graphdef, state, jnp.asarray([seq], jnp.int32)))[0]


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(4,))
def _paged_step(graphdef, state, input_ids, positions, kv_caches, metadata):
    model = nnx.merge(graphdef, state)
    hidden, kv_caches = model(input_ids, positions, kv_caches, metadata)
    return model.compute_logits(hidden), kv_caches  # [T, vocab] float32 (all rows)


class PagedRunner:
    """Runs sequences through the paged forward step by step, like the engine would.

    Each sequence owns a block table of shuffled (non-contiguous) block ids; block 0 is the null
    block. ``step({seq: n_new})`` schedules the next ``n_new`` tokens of each named sequence in
    one ragged batch padded to ``t_bucket`` tokens and ``s_bucket`` sequences, and returns
    ``{seq: logits [n_new, vocab]}``.
    """

    def __init__(
        self,
        model,
        sequences: dict[str, list[int]],
        *,
        block_size=4,
        num_blocks=32,
        max_blocks_per_seq=8,
        t_bucket=16,
        s_bucket=4,
        backend="xla",
        interpret=False,
        seed=0,
        kv_dtype=None,
    ):
        cfg = model.config
        self.graphdef, self.state = nnx.split(model)
        self.seqs = sequences
        self.block_size, self.t_bucket, self.s_bucket = block_size, t_bucket, s_bucket
        self.max_blocks = max_blocks_per_seq
        self.backend, self.interpret = backend, interpret
        ids = np.random.default_rng(seed).permutation(np.arange(1, num_blocks))
        self.block_tables = {
            name: ids[i * max_blocks_per_seq : (i + 1) * max_blocks_per_seq]
            for i, name in enumerate(sequences)
        }
        assert len(sequences) * max_blocks_per_seq < num_blocks
        shape = (num_blocks, block_size, cfg.num_kv_heads, cache_head_dim(backend, cfg.head_dim))
        kv_dtype = model.dtype if kv_dtype is None else kv_dtype  # FP8: a quantized cache
        self.kv_caches = [
            (jnp.zeros(shape, kv_dtype), jnp.zeros(shape, kv_dtype)) for _ in range(cfg.num_layers)
        ]
        self.num_computed = {name: 0 for name in sequences}

    def step(self, schedule: dict[str, int]) -> dict[str, np.ndarray]:
        T, S = self.t_bucket, self.s_bucket
        input_ids = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        slot_mapping = np.full(T, -1, np.int32)
        block_tables = np.zeros((S, self.max_blocks), np.int32)
        context_lens = np.zeros(S, np.int32)
        query_start_loc = np.zeros(S + 1, np.int32)
        t = 0
        spans = {}
        for i, (name, n_new) in enumerate(schedule.items()):
            start = self.num_computed[name]
            pos = np.arange(start, start + n_new)
            table = self.block_tables[name]
            input_ids[t : t + n_new] = self.seqs[name][start : start + n_new]
            positions[t : t + n_new] = pos
            slot_mapping[t : t + n_new] = (
                table[pos // self.block_size] * self.block_size + pos % self.block_size
            )
            block_tables[i] = table
            context_lens[i] = start + n_new
            spans[name] = (t, t + n_new)
            t += n_new
            query_start_loc[i + 1 :] = t
            self.num_computed[name] += n_new
        assert t <= T
        metadata = PagedAttentionMetadata(  # one KV-cache group: [1, T] slots, [1, S, P] tables
            slot_mapping=jnp.asarray(slot_mapping)[None],
            block_tables=jnp.asarray(block_tables)[None],
            context_lens=jnp.asarray(context_lens),
            query_start_loc=jnp.asarray(query_start_loc),
            num_seqs=jnp.asarray(len(schedule), jnp.int32),
            backend=self.backend,
            interpret=self.interpret,
        )
        logits, self.kv_caches = _paged_step(
            self.graphdef,
            self.state,
            jnp.asarray(input_ids),
            jnp.asarray(positions),
            self.kv_caches,
            metadata,
        )
        logits = np.asarray(logits)
        return {name: logits[a:b] for name, (a, b) in spans.items()}
