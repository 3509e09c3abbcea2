"""The engine oracle through the TPU kernel: ``LLM(attention_backend="pallas-tpu",
pallas_interpret=True)`` on CPU gives the dense reference generator's greedy tokens.

Reduced configuration (interpreting the kernel costs seconds per layer call on the 2-core CI
box): one 16-token bucket, at most 4 sequences, 4 prompts of 1-65 tokens, so steps mix
prefill chunks (prompts longer than the budget are chunked) with decodes. The bundled model's
head dim 64 runs padded to the kernel's 128 (the KV pool is sized for it). On a TPU the same
test runs the kernel compiled.
"""

from __future__ import annotations

import jax
import pytest
from conftest import MAX_TOKENS, XLA_CACHE_DIR

from jaxserve.sampling_params import SamplingParams

ON_TPU = jax.default_backend() == "tpu"
SUBSET = [0, 5, 7, 10]  # prompt lengths 1, 17, 33, 65


@pytest.mark.slow
def test_greedy_equals_oracle_through_pallas_tpu(model_dir, prompts, oracle):
    from jaxserve import LLM

    llm = LLM(
        model_dir,
        dtype="float32",
        attention_backend="pallas-tpu",
        pallas_interpret=not ON_TPU,
        token_buckets="16",
        max_num_batched_tokens=16,
        long_prefill_token_threshold=16,
        max_num_seqs=4,
        max_model_len=128,
        num_gpu_blocks_override=64,
        compilation_cache_dir=XLA_CACHE_DIR,
        warmup=False,
    )
    runner = llm.llm_engine.runner
    assert runner.backend == "pallas-tpu" and runner.interpret == (not ON_TPU)
    assert runner.kv_caches[0][0].shape[-1] == 128  # head dim 64 padded for the kernel
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.generate([prompts[i] for i in SUBSET], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [oracle[i] for i in SUBSET]


def test_wrong_platform_kernel_fails_at_start_up():
    """A Pallas kernel for another platform is refused before any weights load (the model path
    does not even exist), naming the platform; interpret mode is the way to run it here."""
    from jaxserve import LLM

    platform = jax.local_devices()[0].platform
    other = "pallas-gpu" if platform == "tpu" else "pallas-tpu"
    with pytest.raises(ValueError, match=f"runs on '{platform}'"):
        LLM("/nonexistent/model", attention_backend=other)
