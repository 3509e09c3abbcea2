"""Checkpoint readers: names, stored shapes and dtypes from the header, whole and sliced reads,
for safetensors and our orbax layout (GGUF's reader: tests/model/test_gguf.py)."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from model_testing import golden_path
from safetensors.numpy import load_file

from jaxserve.model import default_model_path
from jaxserve.model.arch_config import ModelLoadError
from jaxserve.model.loader import load_model
from jaxserve.model.readers.base import TensorSpec
from jaxserve.model.readers.orbax_reader import OrbaxReader
from jaxserve.model.readers.safetensors_reader import SafetensorsReader

TINY = default_model_path()


def test_safetensors_reader_names_specs_and_slices():
    tensors = load_file(os.path.join(golden_path("qwen2"), "model.safetensors"))
    with SafetensorsReader(golden_path("qwen2")) as reader:
        assert set(reader.names()) == set(tensors) and reader.naming == "hf"
        name = "model.layers.1.self_attn.q_proj.weight"
        assert name in reader and "model.nope" not in reader
        stored = tensors[name]
        assert reader.spec(name) == TensorSpec(stored.shape, stored.dtype.name)
        np.testing.assert_array_equal(reader.read(name), stored)
        np.testing.assert_array_equal(reader.read(name, (slice(8, 24), slice(None))), stored[8:24])


def test_orbax_reader_names_specs_casts_and_slices():
    """The bundled checkpoint: our orbax layout from before ``Linear`` layers (``q_proj`` held
    the weight)."""
    with OrbaxReader(TINY) as reader:
        assert reader.naming == "jaxserve" and "embed_tokens" in reader
        assert {"layers.5.self_attn.q_proj", "layers.5.mlp.down_proj", "norm.weight"} < set(
            reader.names()
        )
        assert reader.spec("layers.0.self_attn.k_proj") == TensorSpec((256, 2, 64), "float32")
        k = reader.read("layers.0.self_attn.k_proj")
        assert k.shape == (256, 2, 64) and k.dtype == jnp.float32
        np.testing.assert_array_equal(
            reader.read("layers.0.self_attn.k_proj", (slice(1, 3),)), k[1:3]
        )
    with OrbaxReader(TINY, jnp.bfloat16) as reader:  # cast on restore
        assert reader.spec("embed_tokens").dtype == "float32"  # as stored
        assert reader.read("embed_tokens").dtype == jnp.bfloat16


def test_orbax_errors_name_the_checkpoint(tmp_path):
    with pytest.raises(ModelLoadError, match="orbax params directory not found"):
        OrbaxReader(str(tmp_path))
    bad = tmp_path / "other-arch"
    bad.mkdir()
    os.symlink(os.path.join(TINY, "params"), bad / "params")
    hf = json.loads(open(os.path.join(TINY, "config.json")).read())
    # Qwen3's q/k norms are not in a Llama checkpoint.
    (bad / "config.json").write_text(json.dumps(dict(hf, architectures=["Qwen3ForCausalLM"])))
    with pytest.raises(
        ModelLoadError,
        match=r"cannot restore: tensor layers\.0\.self_attn\.[qk]_norm\.weight not found in ",
    ):
        load_model(str(bad), dtype="float32")
