"""Quantized serving (#31) through the official openai client: the FP8 W8A8 static
compressed-tensors fixture (its own k/v scales) with an FP8 KV cache, the golden token-id prompt
(the fixture has no tokenizer, so the test links the bundled tiny-llama tokenizer beside it; ids stay
below the fixture's 256-token vocabulary): the first greedy token's logprob is within 0.1 of the
golden top-1 logprob (compressed-tensors' fake quantization, wide KV; the top-1 leads by 0.47
logits, so this is the golden argmax); ``cache_config_info`` carries the weight bytes and the cache
dtype."""

from __future__ import annotations

import os
import urllib.request

import numpy as np
import pytest
from server_harness import running_server, small_engine_args

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "..", "fixtures", "quant", "fp8")
TOKENIZER_DIR = os.path.join(HERE, "..", "..", "checkpoints", "tiny-llama")


def test_fp8_checkpoint_and_fp8_kv_serve_through_openai_client(tmp_path):
    from openai import OpenAI

    for name in os.listdir(FIXTURE):
        os.symlink(os.path.join(FIXTURE, name), tmp_path / name)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        os.symlink(os.path.join(TOKENIZER_DIR, name), tmp_path / name)
    args = small_engine_args(
        model=str(tmp_path), served_model_name="fp8", max_model_len=128, kv_cache_dtype="fp8"
    )
    with running_server(args) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused")
        golden = np.load(os.path.join(FIXTURE, "golden.npz"))
        prompt = golden["prompt_0"].tolist()
        last = golden["logits_0"][-1].astype(np.float64)
        want_logprobs = last - last.max() - np.log(np.exp(last - last.max()).sum())
        out = client.completions.create(
            model="fp8", prompt=prompt, max_tokens=6, temperature=0.0, logprobs=1
        )
        assert out.usage.completion_tokens == 6
        assert out.choices[0].finish_reason == "length"
        lp = out.choices[0].logprobs
        # The golden top-1 leads its runner-up by 0.47 logits, so a chosen logprob within 0.1 of
        # the golden top-1 logprob is that token (measured: 0.036 apart, FP8 KV rounding).
        assert abs(lp.token_logprobs[0] - want_logprobs.max()) < 0.1
        with urllib.request.urlopen(srv.url + "/metrics") as r:
            metrics = r.read().decode()
        info = next(line for line in metrics.splitlines() if "cache_config_info{" in line)
        assert 'cache_dtype="fp8"' in info
        weight_bytes = int(info.split('weight_bytes="')[1].split('"')[0])
        assert 0 < weight_bytes < 300_000  # FP8 projections, float32 embedding and LM head
