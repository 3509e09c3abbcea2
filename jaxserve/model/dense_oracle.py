"""The dense oracle: greedy generation that the paged engine is tested against token for token.

Greedy decoding by full recomputation: every step runs ``model.forward_dense`` over the whole
sequence (prompt + tokens so far), with no KV cache and no batching, and takes the argmax of the
logits at the last real position. The sequence is right-padded to a power-of-two bucket so that
XLA compiles once per bucket rather than once per length; causal attention makes the padding
invisible to the real positions. It shares the model's layers with the engine but none of the
engine's machinery (scheduler, paged KV cache, batching, sampler), which is what makes it the
oracle; ``jaxserve generate`` runs the engine.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.bucketing import next_power_of_2

MIN_BUCKET = 16


def bucket_len(n: int) -> int:
    """Smallest power of two >= n (at least ``MIN_BUCKET``)."""
    return max(MIN_BUCKET, next_power_of_2(n))


@functools.partial(jax.jit, static_argnums=0)
def _greedy_next(graphdef, state, input_ids, last):
    """argmax of the logits at position ``last`` of ``input_ids [1, L]`` -> int32 []."""
    logits = nnx.merge(graphdef, state).forward_dense(input_ids)  # [1, L, vocab] float32
    return jnp.argmax(logits[0, last])


def generate_dense(
    model,
    prompt_token_ids: Sequence[int],
    max_tokens: int,
    eos_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
) -> list[int]:
    """Greedy continuation of ``prompt_token_ids`` by full recompute.

    Args:
      model: a family model (``jaxserve.model.registry``), e.g. ``LlamaForCausalLM``.
      prompt_token_ids: the prompt, a non-empty list of ids in ``[0, vocab_size)``.
      max_tokens: how many tokens to generate at most (>= 0).
      eos_token_ids: ids that end generation; the EOS token itself is included in the output
        (as vLLM's ``token_ids``).
      ignore_eos: keep going past EOS until ``max_tokens`` (vLLM's ``ignore_eos``).

    Returns:
      The generated token ids (not including the prompt).

    Raises:
      ValueError: empty or out-of-range ``prompt_token_ids``, negative ``max_tokens``, or
        prompt + max_tokens longer than the model's ``max_position_embeddings``.
    """
    cfg = model.config
    tokens = [int(t) for t in prompt_token_ids]
    if not tokens:
        raise ValueError("prompt_token_ids must not be empty")
    if min(tokens) < 0 or max(tokens) >= cfg.vocab_size:
        raise ValueError(
            f"prompt_token_ids must be in [0, {cfg.vocab_size}), got {min(tokens)}..{max(tokens)}"
        )
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if len(tokens) + max_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"max_position_embeddings ({cfg.max_position_embeddings})"
        )
    eos = set() if ignore_eos else {int(e) for e in eos_token_ids}
    graphdef, state = nnx.split(model)
    generated: list[int] = []
    for _ in range(max_tokens):
        n = len(tokens)
        input_ids = np.zeros((1, bucket_len(n)), np.int32)  # right-padded with id 0
        input_ids[0, :n] = tokens
        next_id = int(_greedy_next(graphdef, state, input_ids, n - 1))
        generated.append(next_id)
        tokens.append(next_id)
        if next_id in eos:
            break
    return generated
