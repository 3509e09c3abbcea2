"""The small CPU engine the notebooks and the benchmark-client test share.

One set of knobs everywhere means one set of compiled step shapes, so after the first engine the
persistent XLA compilation cache serves every later one (notebooks and tests start in seconds,
not a minute). The values match the server tests' engine (``tests/entrypoints``) for the same
reason: float32, xla attention, token buckets 16 and 64, 8 sequences, a 64-block KV pool
(1,008 usable tokens), 256-token sequences.
"""

from __future__ import annotations

DEMO_ENGINE_ARGS: dict[str, object] = {
    "dtype": "float32",
    "attention_backend": "xla",
    "token_buckets": "16,64",
    "max_num_batched_tokens": 64,
    "max_num_seqs": 8,
    "long_prefill_token_threshold": 0,
    "max_model_len": 256,
    "num_gpu_blocks_override": 64,
    "block_size": 16,
    "served_model_name": "tiny-llama",
}
"""``LLM(**DEMO_ENGINE_ARGS)`` / ``EngineArgs(**DEMO_ENGINE_ARGS)``: the bundled model, small and fast on CPU."""
