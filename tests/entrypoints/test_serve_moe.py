"""A tiny Mixtral (the golden fixture, with the bundled model's tokenizer beside it) served over
HTTP answers the official openai client: the greedy token's logprob equals transformers' within
1e-4, a streamed completion produces text, and ``--expert-load-metrics`` puts the expert load on
/metrics."""

from __future__ import annotations

import os
import shutil

import httpx2 as httpx
import numpy as np
import openai
import pytest
from server_harness import MODEL_DIR, metric_values, running_server, small_engine_args

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "fixtures", "golden", "mixtral")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    """The Mixtral fixture plus the bundled tokenizer (its ids past the fixture's 256-token
    vocabulary never come up: prompts are token ids, outputs are ids < 256)."""
    out = tmp_path_factory.mktemp("tiny-mixtral")
    for name in os.listdir(GOLDEN):
        if name != "golden.npz":
            shutil.copy(os.path.join(GOLDEN, name), out)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(os.path.join(MODEL_DIR, name), out)
    return str(out)


@pytest.mark.slow
def test_serve_tiny_mixtral_with_openai_client(moe_dir):
    golden = np.load(os.path.join(GOLDEN, "golden.npz"))
    prompt, logits = golden["prompt_0"].tolist(), golden["logits_0"][-1].astype(np.float64)
    want = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())  # log_softmax
    args = small_engine_args(
        model=moe_dir,
        served_model_name="tiny-mixtral",
        expert_load_metrics=True,
        token_buckets="32",
        max_num_batched_tokens=32,
        attention_backend="xla",
    )
    with running_server(args) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        done = client.completions.create(
            model="tiny-mixtral", prompt=prompt, max_tokens=4, temperature=0, logprobs=1
        )
        first = done.choices[0].logprobs.token_logprobs[0]
        assert abs(first - want.max()) < 1e-4, (first, want.max())
        assert done.usage.completion_tokens == 4
        stream = client.completions.create(
            model="tiny-mixtral", prompt=prompt[:5], max_tokens=8, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in stream if c.choices)
        with httpx.Client(base_url=srv.url) as http:
            values = metric_values(http)
    tokens = {k: v for k, v in values.items() if k.startswith("jaxserve:moe_expert_tokens_total")}
    assert len(tokens) == 2 * 8  # two MoE layers, eight experts
    # Each real token reaches top-2 experts in each layer: prompt + decodes of both requests.
    # Keys: name[expert][layer].
    per_layer = [sum(v for k, v in tokens.items() if k.endswith(f"][{i}]")) for i in (0, 1)]
    assert per_layer[0] == per_layer[1] >= 2 * (len(prompt) + 3 + 5 + 7) and per_layer[0] % 2 == 0
    ratio = values["jaxserve:moe_expert_load_max_over_mean[0]"]
    assert 1.0 <= ratio <= 4.0  # E / k = 4 when every token goes to the same two experts
