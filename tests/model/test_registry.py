"""The model registry: every built-in architecture resolves to a family class that has the
family contract, and a plugin registered at run time serves checkpoints of its name."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from model_testing import dense_logits, golden_path

from jaxserve.model import registry
from jaxserve.model.loader import load_model
from jaxserve.model.models.llama import LlamaForCausalLM

PROMPT = [1, 17, 42, 99, 3]


@pytest.mark.parametrize("architecture", registry.supported_architectures())
def test_each_architecture_resolves_to_a_family_class(architecture):
    cls = registry.resolve_model_class(architecture)
    for name in ("__call__", "compute_logits", "forward_dense", "weight_source"):
        assert callable(getattr(cls, name, None)), (architecture, name)


class PluginLlama(LlamaForCausalLM):
    """A plugin family: the Llama model under its own architecture name."""


@pytest.fixture
def plugins(monkeypatch):
    monkeypatch.setattr(registry, "_PLUGINS", {})  # registrations end with the test


def test_a_registered_plugin_serves_its_architecture(plugins, tmp_path):
    registry.register_model("PluginLlamaForCausalLM", PluginLlama)
    registry.register_model("ByNameForCausalLM", "jaxserve.model.models.llama:LlamaForCausalLM")
    assert registry.supported_architectures()[-2:] == (
        "PluginLlamaForCausalLM",
        "ByNameForCausalLM",
    )
    assert registry.resolve_model_class("ByNameForCausalLM") is LlamaForCausalLM

    d = tmp_path / "plugin"
    shutil.copytree(golden_path("llama"), d)
    hf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(hf, architectures=["PluginLlamaForCausalLM"])))
    plugin, cfg, _ = load_model(str(d), dtype="float32")
    llama, _, _ = load_model(golden_path("llama"), dtype="float32")
    assert type(plugin) is PluginLlama and cfg.architecture == "PluginLlamaForCausalLM"
    np.testing.assert_array_equal(dense_logits(plugin, PROMPT), dense_logits(llama, PROMPT))


def test_register_model_checks_its_arguments(plugins):
    with pytest.raises(ValueError, match="non-empty"):
        registry.register_model("", PluginLlama)
    with pytest.raises(ValueError, match="package.module:Class"):
        registry.register_model("X", "jaxserve.model.models.llama.LlamaForCausalLM")
