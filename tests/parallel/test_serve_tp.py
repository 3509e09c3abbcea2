"""``jaxserve serve --tensor-parallel-size 2`` on a host with 2 simulated CPU devices serves the
official openai client, with the greedy text of one device."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
from tp_harness import ENGINE_KWARGS, MAX_TOKENS, PROMPTS, subprocess_env

from jaxserve.model import default_model_path
from jaxserve.tokenizer import get_tokenizer

# The shared harness (one session fixture) takes minutes on a loaded 2-core box.
pytestmark = pytest.mark.timeout(1800)


def _flags() -> list[str]:
    flags = []
    for name, value in ENGINE_KWARGS.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


@pytest.mark.slow
def test_serve_tensor_parallel_2_with_openai_client(tp_results):
    from openai import OpenAI

    env = subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=2")
    server = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.cli", "serve", "--tensor-parallel-size", "2"]
        + _flags()
        + ["--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        lines = []
        while True:
            line = server.stdout.readline()
            assert line, "server ended early:\n" + "".join(lines[-40:])
            lines.append(line)
            m = re.search(r"serving \S+ on (http://\S+)", line)
            if m:
                break
        report = "".join(lines)
        assert "'tensor_parallel_size': 2" in report  # the resolved-config report
        client = OpenAI(base_url=m.group(1) + "/v1", api_key="unused")
        done = client.completions.create(
            model="tiny-llama",
            prompt=PROMPTS[0],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        want = tp_results[("bundled", 1, "xla")]["tokens"][0]
        text = get_tokenizer(os.fspath(default_model_path())).decode(want)
        assert done.choices[0].text == text
        stream = client.chat.completions.create(
            model="tiny-llama",
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=8,
            stream=True,
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
