"""`jaxserve serve` on a Gemma checkpoint (the Gemma 2 golden fixture: soft caps, alternating
sliding-window layers), asked through the official openai client: greedy tokens and logprobs
are transformers', and chat requests use the chat template of the fixture's
tokenizer_config.json (Gemma's turn markup, the system prompt joined to the first user turn,
other roles refused with a 400)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from server_harness import serve_cli

pytestmark = pytest.mark.slow

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "golden", "gemma2")
NAME = "gemma2-tiny"


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    log = tmp_path_factory.mktemp("gemma2") / "serve.log"
    args = [FIXTURE, "--served-model-name", NAME, "--dtype", "float32", "--max-model-len", "128"]
    args += ["--block-size", "8", "--num-gpu-blocks-override", "64"]
    args += ["--max-num-batched-tokens", "64", "--max-num-seqs", "4", "--token-buckets", "16,64"]
    args += ["--attention-backend", "xla", "--no-warmup"]
    with serve_cli(args, str(log)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server_url):
    from openai import OpenAI

    return OpenAI(base_url=server_url + "/v1", api_key="unused")


def test_completion_tokens_and_logprobs_are_transformers(client):
    from jaxserve.tokenizer import get_tokenizer

    tok = get_tokenizer(FIXTURE)
    golden = np.load(os.path.join(FIXTURE, "golden.npz"))
    prompt, want = golden["prompt_0"].tolist(), golden["greedy_0"].tolist()
    assert [m.id for m in client.models.list().data] == [NAME]
    out = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=len(want), temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in want]
    np.testing.assert_allclose(
        lp.token_logprobs, golden["greedy_logprobs_0"][np.arange(len(want)), want], atol=1e-4
    )


def test_chat_uses_the_gemma_template_from_tokenizer_config(client, server_url):
    import httpx2 as httpx

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    ids = httpx.post(
        server_url + "/tokenize", json={"model": NAME, "messages": messages}, timeout=30
    ).json()["tokens"]
    from jaxserve.tokenizer import get_tokenizer

    assert get_tokenizer(FIXTURE).decode(ids, skip_special_tokens=False) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    )
    reply = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=6, temperature=0
    )
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens >= 1 and reply.choices[0].message.role == "assistant"


def test_chat_role_the_template_refuses_is_a_400(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="Gemma turns are user or assistant"):
        client.chat.completions.create(
            model=NAME,
            messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}],
            max_tokens=2,
        )
