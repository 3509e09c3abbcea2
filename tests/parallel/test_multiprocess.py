"""Two processes x 2 simulated CPU devices form one TP-4 mesh (jax.distributed, gloo): greedy
tokens equal one process on one device; the worker exits 0 when process 0 ends; when the worker
dies, process 0 reports it and exits non-zero instead of hanging."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from tp_harness import HERE, subprocess_env

# The shared harness (one session fixture) takes minutes on a loaded 2-core box.
pytestmark = pytest.mark.timeout(1800)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _member(process_id: int, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, os.path.join(HERE, "mp_member.py"), str(process_id), str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )


@pytest.mark.slow
def test_two_processes_match_one_and_fail_loudly(tp_results):
    port = _free_port()
    leader, worker = _member(0, port), _member(1, port)
    try:
        line = ""
        while not line.startswith("RESULT"):
            line = leader.stdout.readline()
            assert line, f"process 0 ended early:\n{leader.stderr.read()[-4000:]}"
        tokens = json.loads(line.split(" ", 1)[1])
        assert tokens == tp_results[("llama", 1, "xla")]["tokens"]
        # The worker dies; process 0's next step must fail and exit non-zero, not hang.
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
        leader.stdin.write("go\n")
        leader.stdin.flush()
        out, err = leader.communicate(timeout=120)
        assert leader.returncode not in (0, None), out
        assert "SECOND RUN FINISHED" not in out
        assert "did another process die?" in err, err[-4000:]
    finally:
        for p in (leader, worker):
            if p.poll() is None:
                p.kill()


@pytest.mark.slow
def test_worker_exits_zero_when_process_zero_ends():
    port = _free_port()
    leader, worker = _member(0, port), _member(1, port)
    try:
        out, err = leader.communicate(input="", timeout=600)  # EOF: no second run
        assert leader.returncode == 0, err[-4000:]
        assert any(line.startswith("RESULT") for line in out.splitlines())  # gloo logs too
        assert worker.wait(timeout=60) == 0, worker.stderr.read()[-4000:]
    finally:
        for p in (leader, worker):
            if p.poll() is None:
                p.kill()
