"""The dense reference generator: the oracle the paged engine is checked against token for token.

Greedy decoding by full recomputation: every step runs ``model.forward_dense`` over the whole
sequence (prompt + tokens so far), with no KV cache and no batching, and takes the argmax of the
logits at the last real position. The sequence is right-padded to a power-of-two bucket so that
XLA compiles once per bucket rather than once per length; causal attention makes the padding
invisible to the real positions.
"""

from __future__ import annotations

import argparse
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
      model: a ``LlamaForCausalLM``.
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


def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    """``jaxserve generate PROMPT [MODEL] [--max-tokens N] [--dtype ...]`` (``--model`` is an
    alias of MODEL)."""
    p = subparsers.add_parser(
        "generate",
        help="greedy text continuation with the dense reference generator",
        description="Prints the greedy continuation of PROMPT computed by full recompute (no KV "
        "cache): the oracle the engine is tested against. Greedy only: there are no "
        "sampling options (temperature, top-p, ...); use `serve` or the LLM API for those.",
    )
    p.add_argument("prompt", help="prompt text (tokenized with the model's tokenizer, BOS added)")
    p.add_argument(
        "--max-tokens", type=int, default=32, help="tokens to generate at most (default 32)"
    )
    model_help = (
        "model directory (HF or our orbax layout), .gguf file, or 'smollm2' (the demo-model "
        "extra); default: the bundled checkpoint"
    )
    p.add_argument("model", nargs="?", default=None, help=model_help)
    p.add_argument("--model", dest="model_option", default=None, help="same as MODEL")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="weights and activations dtype (default: the config's torch_dtype)",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "orbax", "gguf", "dummy"],
        help="weights format (default: detected)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    p.add_argument(
        "--show-token-ids",
        action="store_true",
        help="also print the prompt and generated token ids",
    )
    p.set_defaults(func=run_generate)
    return p


def run_generate(args: argparse.Namespace) -> int:
    """Runs ``generate`` from parsed CLI args: loads model + tokenizer, prints the continuation."""
    from jaxserve.config import EngineArgs
    from jaxserve.model.loader import eos_token_ids, load_model
    from jaxserve.model.preflight import check_model_path
    from jaxserve.tokenizer import get_tokenizer

    if args.max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {args.max_tokens}")
    model_path = EngineArgs(model=args.model_option or args.model).resolved_model_path()
    check_model_path(model_path, args.load_format, need_tokenizer=True)
    model, cfg, gen_config = load_model(model_path, dtype=args.dtype, load_format=args.load_format)
    tokenizer = get_tokenizer(model_path)
    prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=True)
    eos = set(eos_token_ids(gen_config, cfg)) | set(tokenizer.eos_token_ids)
    out = generate_dense(model, prompt_ids, args.max_tokens, sorted(eos), args.ignore_eos)
    print(tokenizer.decode(out, skip_special_tokens=True))
    if args.show_token_ids:
        print(f"prompt_token_ids: {prompt_ids}\ngenerated_token_ids: {out}")
    return 0
