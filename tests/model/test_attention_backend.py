"""Choosing the attention backend per platform, and the TPU kernel's shape rules as the engine
sees them (KV head dim, token buckets)."""

from __future__ import annotations

import pytest

from jaxserve.config import EngineArgs, RunnerConfig
from jaxserve.model.attention import cache_head_dim, token_bucket_multiple
from jaxserve.model.attention_backends import (
    ATTENTION_BACKEND_CHOICES,
    ATTENTION_BACKENDS,
    resolve_attention_backend,
)
from jaxserve.worker.batch_builder import resolve_token_buckets


@pytest.mark.parametrize(
    "name,platform,expected",
    [
        ("auto", "tpu", "pallas-tpu"),
        ("auto", "gpu", "pallas-gpu"),
        ("auto", "cpu", "xla"),
        ("pallas", "tpu", "pallas-tpu"),
        ("pallas", "gpu", "pallas-gpu"),
        ("pallas-tpu", "tpu", "pallas-tpu"),
        ("pallas-gpu", "gpu", "pallas-gpu"),
        ("xla", "tpu", "xla"),
        ("xla", "cpu", "xla"),
        ("reference", "cpu", "xla"),  # the deprecated name
    ],
)
def test_backend_per_platform(name, platform, expected):
    assert resolve_attention_backend(name, platform) == expected
    assert expected in ATTENTION_BACKENDS


@pytest.mark.parametrize(
    "name,platform",
    [("pallas-tpu", "cpu"), ("pallas-tpu", "gpu"), ("pallas-gpu", "tpu"), ("pallas-gpu", "cpu")],
)
def test_wrong_platform_kernel_is_refused_unless_interpreted(name, platform):
    with pytest.raises(ValueError, match=f"only for platform .* runs on '{platform}'"):
        resolve_attention_backend(name, platform)
    assert resolve_attention_backend(name, platform, interpret=True) == name


def test_pallas_alias_on_cpu_and_unknown_names():
    with pytest.raises(ValueError, match="no kernel for platform 'cpu'.*--pallas-interpret"):
        resolve_attention_backend("pallas", "cpu")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        resolve_attention_backend("flash", "gpu")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        RunnerConfig(attention_backend="triton")
    assert set(ATTENTION_BACKEND_CHOICES) == {"auto", "pallas", "reference", *ATTENTION_BACKENDS}


def test_reference_is_a_deprecated_name_of_xla():
    """An old flag keeps working: the engine config stores "xla" (and logs that the name
    changed, once per process)."""
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--attention-backend", "reference"])
    config = EngineArgs.from_cli_args(args).create_engine_config(1024).runner
    assert config.attention_backend == "xla"
    assert RunnerConfig(attention_backend="reference") == RunnerConfig(attention_backend="xla")


def test_cli_flags():
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--attention-backend", "pallas-tpu", "--pallas-interpret"])
    config = EngineArgs.from_cli_args(args).create_engine_config(1024).runner
    assert (config.attention_backend, config.pallas_interpret) == ("pallas-tpu", True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-backend", "mosaic"])


def test_tpu_shapes_reach_the_engine():
    """The TPU kernel's KV pool is lane-aligned and its token buckets are whole query tiles;
    other backends keep the model's head dim and any bucket."""
    assert cache_head_dim("pallas-tpu", 64) == 128
    assert cache_head_dim("pallas-tpu", 256) == 256
    assert cache_head_dim("pallas-gpu", 64) == cache_head_dim("xla", 64) == 64
    assert token_bucket_multiple("xla") == token_bucket_multiple("pallas-gpu") == 1
    eight = token_bucket_multiple("pallas-tpu")
    assert eight == 8
    assert resolve_token_buckets((), 100, multiple=eight) == (16, 32, 64, 104)
    assert resolve_token_buckets((), 100) == (16, 32, 64, 100)
    assert resolve_token_buckets((24, 100), 100) == (24, 100)
    with pytest.raises(ValueError, match=r"token_buckets must be multiples of 8 .*\(24, 100\)"):
        resolve_token_buckets((24, 100), 100, multiple=eight)
