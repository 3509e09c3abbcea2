"""``serve --speculative-config`` end to end: the official ``openai`` client gets the same greedy
text from a server speculating with the bundled model's draft as the dense oracle gives, streamed
or not, completions and chat; ``/metrics`` counts the drafts under vLLM's names; a bad
speculative config is a one-line error naming the field before anything loads."""

from __future__ import annotations

import json
import os

import httpx2 as httpx
import openai
import pytest
from server_harness import MODEL_DIR, metric_values, running_server, small_engine_args

DRAFT = os.path.join(os.path.dirname(MODEL_DIR), "tiny-llama-draft")
PROMPTS = ("Once upon a time", "And the king said unto them, Go")
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server():
    if not os.path.isfile(os.path.join(DRAFT, "config.json")):
        pytest.skip("the bundled draft model is missing")
    spec = {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4}
    args = small_engine_args(speculative_config=json.dumps(spec), metrics_namespace="vllm")
    with running_server(args) as srv:
        yield srv


@pytest.fixture(scope="module")
def oracle():
    """Greedy text of the dense reference generator (no KV cache) for each prompt."""
    from jaxserve.model.dense_oracle import generate_dense
    from jaxserve.model.loader import load_model
    from jaxserve.tokenizer import get_tokenizer

    model, _, _ = load_model(MODEL_DIR, "float32")
    tok = get_tokenizer(MODEL_DIR)
    return {
        p: tok.decode(generate_dense(model, tok.encode(p), MAX_TOKENS), skip_special_tokens=True)
        for p in PROMPTS
    }


@pytest.mark.slow
def test_openai_client_gets_the_oracle_text(server, oracle):
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    for prompt in PROMPTS:
        body = dict(model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        done = oai.completions.create(**body, extra_body={"ignore_eos": True})
        assert done.choices[0].text == oracle[prompt]
        streamed = oai.completions.create(**body, stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in streamed if c.choices) == oracle[prompt]
    with httpx.Client(base_url=server.url, timeout=60) as client:
        m = metric_values(client)
    assert m["vllm:spec_decode_num_drafts_total"] > 0
    drafted = m["vllm:spec_decode_num_draft_tokens_total"]
    accepted = m["vllm:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= drafted
    per_pos = [m[f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{i}]"] for i in range(4)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)


def test_bad_speculative_config_is_a_one_line_error(capsys):
    from jaxserve.cli import main

    for spec, field in (
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "medusa", "num_speculative_tokens": 2}', "method"),
        (
            '{"method": "draft_model", "model": "/nonexistent", "num_speculative_tokens": 2}',
            "model",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}', "k"),
        ("not json", None),
    ):
        with pytest.raises(SystemExit) as e:
            main(["serve", MODEL_DIR, "--speculative-config", spec])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "speculative_config" in err, err
        if field is not None:
            assert f"speculative_config.{field}:" in err, err
