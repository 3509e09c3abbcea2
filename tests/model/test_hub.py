"""Hugging Face Hub model ids resolve through ``huggingface_hub`` against a pre-populated cache
(a fake Hub cache layout built in a tmp dir from the tiny fixtures; no network): the default
branch, ``--revision``, ``--download-dir`` or ``HF_HUB_CACHE``, the served name; offline and not
cached, a one-line error (#39 deliverable 4: ``jaxserve serve org/name`` said "model directory
not found")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from model_testing import golden_path

from jaxserve.config import EngineArgs
from jaxserve.model import default_model_path
from jaxserve.model.hub import is_hub_id
from jaxserve.model.loader import load_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN = "a" * 40
TAGGED = "b" * 40


def _snapshot(cache: str, repo_id: str, commit: str, refs: list[str]) -> str:
    """A model snapshot in the Hub cache's layout: blobs, snapshots/<commit>/ linking to them,
    refs/<name> holding the commit."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snap = os.path.join(repo, "snapshots", commit)
    os.makedirs(snap)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    files = [
        os.path.join(golden_path("llama"), name)
        for name in ("config.json", "generation_config.json", "model.safetensors")
    ] + [os.path.join(default_model_path(), "tokenizer.model")]
    for src in files:
        blob = os.path.join(repo, "blobs", f"{commit[:8]}-{os.path.basename(src)}")
        shutil.copy(src, blob)
        os.symlink(os.path.relpath(blob, snap), os.path.join(snap, os.path.basename(src)))
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    for ref in refs:
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(commit)
    return snap


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("hub"))
    _snapshot(cache, "tiny-org/tiny-llama", MAIN, ["main"])
    _snapshot(cache, "tiny-org/tiny-llama", TAGGED, ["v1"])
    return cache


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_hub_ids_are_told_from_paths(tmp_path, monkeypatch):
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not is_hub_id("smollm2") and not is_hub_id("./a/b") and not is_hub_id("/a/b")
    local = tmp_path / "org"
    (local / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("org/name")  # a local directory wins


def test_a_cached_hub_id_resolves_offline_and_loads(hub_cache, offline):
    args = EngineArgs(model="tiny-org/tiny-llama", download_dir=hub_cache)
    path = args.resolved_model_path()
    assert path == os.path.join(hub_cache, "models--tiny-org--tiny-llama", "snapshots", MAIN)
    cfg = args.check(need_tokenizer=True)  # the preflight sees a plain model directory
    assert cfg.model.served_model_name == "tiny-org/tiny-llama"  # vLLM's default name
    assert cfg.model.model == path
    _, arch, _ = load_model(path, dtype="float32")
    with open(os.path.join(golden_path("llama"), "config.json")) as f:
        assert arch.hidden_size == json.load(f)["hidden_size"]


def test_revision_picks_the_tag_and_the_commit(hub_cache, offline):
    for revision in ("v1", TAGGED):
        path = EngineArgs(
            model="tiny-org/tiny-llama", revision=revision, download_dir=hub_cache
        ).resolved_model_path()
        assert path.endswith(os.path.join("snapshots", TAGGED)), path


@pytest.mark.parametrize(
    "model, revision, says",
    [
        ("tiny-org/missing", None, "'tiny-org/missing' is not in --download-dir"),
        ("tiny-org/tiny-llama", "v2", "at revision 'v2' is not in --download-dir"),
    ],
)
def test_offline_and_not_cached_is_one_line(hub_cache, offline, model, revision, says):
    with pytest.raises(ValueError) as exc_info:
        EngineArgs(model=model, revision=revision, download_dir=hub_cache).check()
    message = str(exc_info.value)
    assert says in message and "HF_HUB_OFFLINE=1" in message and "\n" not in message


def test_serve_with_a_hub_id_uses_the_hub_cache_env_and_fails_in_one_line(hub_cache):
    """Through the CLI in a fresh process: ``HF_HUB_CACHE`` is the cache (no --download-dir);
    an id that is not cached is one line on stderr and exit 2, before anything loads."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", HF_HUB_CACHE=hub_cache)
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "serve", "tiny-org/not-cached", "--port", "0"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "not in the Hugging Face cache" in lines[0], out.stderr
