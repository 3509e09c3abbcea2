"""GGUF loading: the bundled tiny-llama written as GGUF files the way llama.cpp's converter
writes them (q/k rows permuted, quantised matrices, a sentencepiece vocabulary with scores),
then loaded back through ``load_model`` / ``get_tokenizer``: dequantised on load
(``quantization="none"``, what ``auto`` does on CPU) and with its blocks kept quantized
(``quantization="gguf"``, ``auto`` on an accelerator)."""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.model import ModelLoadError, default_model_path, sharded_loader
from jaxserve.model.loader import load_model
from jaxserve.model.readers.base import TensorSpec
from jaxserve.model.readers.gguf_reader import GGUFFileReader
from jaxserve.model.sharding import LOGICAL_AXIS_RULES
from jaxserve.model.weight_mapping import Layout, permute_qk, unpermute_qk
from jaxserve.tokenizer import get_tokenizer

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
TINY = default_model_path()
TEXTS = [
    "Once upon a time there was a little king.",
    "Hello world!  How are you?\nI am fine, thank you.",
    "héllo wörld, 世界 🙂 and 12345",
    " leading space and trailing ",
]
# Per quantisation type: the largest error relative to the tensor's max |value|.
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q4_1: 0.1, Q.Q4_0: 0.15}


def _torch_layout(x: np.ndarray, layout: Layout) -> np.ndarray:
    """Inverse of the loader's layout, without llama.cpp's q/k permutation (``write_gguf``
    applies it, as llama.cpp's converter does)."""
    return dataclasses.replace(layout, permuted_heads=0).to_stored(x)


@pytest.fixture(scope="module")
def tiny():
    model, cfg, _ = load_model(TINY)
    tensors = {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        source = model.weight_source(path, cfg, "gguf")
        x = _torch_layout(np.asarray(var.get_value()), source.layout)
        tensors[source.name] = np.ascontiguousarray(x, dtype=np.float32)
    return model, cfg, tensors


def write_gguf(path, cfg, tensors, qtype_of=lambda name, x: Q.F32, raw=None):
    """Writes ``tensors`` (torch layout, float32) as llama.cpp does: q/k permuted, plus the
    tiny-llama's sentencepiece vocabulary. ``raw`` maps a name to (quantised bytes, type)
    written instead."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    with open(os.path.join(TINY, "tokenizer.model"), "rb") as f:
        proto.ParseFromString(f.read())
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_tokenizer_model("llama")
    w.add_token_list([p.piece for p in proto.pieces])
    w.add_token_scores([p.score for p in proto.pieces])
    w.add_token_types([int(p.type) for p in proto.pieces])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template(
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    )
    for name, x in tensors.items():
        if raw and name in raw:
            w.add_tensor(name, raw[name][0], raw_dtype=raw[name][1])
            continue
        if ".attn_q." in name or ".attn_k." in name:
            x = permute_qk(x, cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads)
        qtype = qtype_of(name, x)
        if qtype == Q.F32:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_permutation_roundtrip():
    x = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)
    assert not np.array_equal(permute_qk(x, 2), x)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(x, 2), 2), x)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(x[:, 0], 2), 2), x[:, 0])


def test_f32_gguf_gives_the_same_model_and_tokenizer(tiny, tmp_path):
    model, cfg, tensors = tiny
    path = tmp_path / "tiny.gguf"
    write_gguf(path, cfg, tensors)
    loaded, lcfg, gen = load_model(str(path))
    assert lcfg == cfg.__class__(**{**cfg.__dict__, "torch_dtype": "float32"})
    assert gen == {"eos_token_id": [2], "bos_token_id": 1}
    ids = jnp.asarray([[1, 57, 300, 12, 900, 4000, 5, 77]], jnp.int32)
    np.testing.assert_allclose(
        np.asarray(loaded.forward_dense(ids)), np.asarray(model.forward_dense(ids)), atol=1e-5
    )
    ref, tok = get_tokenizer(TINY), get_tokenizer(str(path))
    assert tok.vocab_size == ref.vocab_size
    assert (tok.bos_token, tok.eos_token, tok.eos_token_ids) == ("<s>", "</s>", {2})
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text), text
        assert tok.decode(ref.encode(text)) == ref.decode(ref.encode(text)), text
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|user|>\nhi\n"


def test_quantised_tensors_dequantise_within_their_error(tiny, tmp_path):
    _, cfg, tensors = tiny
    kinds = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.F16, Q.BF16]
    chosen = {}

    def qtype_of(name, x):
        chosen[name] = Q.F32 if x.ndim == 1 else kinds[len(chosen) % len(kinds)]
        return chosen[name]

    path = tmp_path / "tiny-mixed.gguf"
    write_gguf(path, cfg, tensors, qtype_of)
    assert {k for k in chosen.values()} == {Q.F32, *kinds}
    loaded, _, _ = load_model(str(path), dtype="float32", quantization="none")
    for p, var in nnx.to_flat_state(nnx.state(loaded)):
        source = loaded.weight_source(p, cfg, "gguf")
        gname = source.name
        got = _torch_layout(np.asarray(var.get_value()), source.layout)
        err = np.abs(got - tensors[gname]).max() / np.abs(tensors[gname]).max()
        assert err <= TOLERANCE[chosen[gname]] + 1e-7, (gname, chosen[gname].name, err)
    assert loaded.embed_tokens.weight.get_value().dtype == jnp.float32
    with GGUFFileReader(str(path)) as reader:  # the header's GGML types, torch-layout shapes
        assert reader.naming == "gguf" and set(reader.names()) == set(tensors)
        for name, x in tensors.items():
            assert reader.spec(name) == TensorSpec(x.shape, chosen[name].name), name
        name = "blk.1.ffn_down.weight"
        np.testing.assert_array_equal(reader.read(name, (slice(2, 5),)), reader.read(name)[2:5])
        for name, x in tensors.items():  # rows and columns: only the rows are dequantised
            if x.ndim == 2:
                index = (slice(1, 3), slice(x.shape[1] // 2, x.shape[1]))
                np.testing.assert_array_equal(reader.read(name, index), reader.read(name)[index])
        # the sharded loader's parts (second half of each split axis, q/k permutation undone
        # per head) are those of the whole load
        for p, var in nnx.to_flat_state(nnx.state(loaded)):
            axes = var.get_metadata().get("out_sharding") or ()
            split = [i for i, a in enumerate(axes) if LOGICAL_AXIS_RULES.get(a) is not None]
            index = tuple(
                slice(n // 2, n) if i in split else slice(0, n) for i, n in enumerate(var.shape)
            )
            source = loaded.weight_source(p, cfg, "gguf")
            part = sharded_loader.tensor_part(reader, source, tuple(var.shape))
            got = sharded_loader.read_part(reader, part, index)
            np.testing.assert_array_equal(got, np.asarray(var.get_value())[index], str(p))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_k_quants_load_as_the_gguf_package_dequantises_them(tiny, tmp_path, qtype):
    """K-quant blocks (256 values) have no Python quantiser: write raw blocks with sane f16
    scales and check the loaded v_proj equals gguf's own dequantisation."""
    _, cfg, tensors = tiny
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = tensors["blk.0.attn_v.weight"].shape
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if qtype == Q.Q4_K:  # d, dmin first
        raw[..., 0:2], raw[..., 2:4] = scale, scale
    else:  # Q6_K: d last
        raw[..., size - 2 :] = scale
    raw = raw.reshape(rows, -1)
    expected = gguf.quants.dequantize(raw, qtype)

    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(path, cfg, tensors, raw={"blk.0.attn_v.weight": (raw, qtype)})
    loaded, _, _ = load_model(str(path), dtype="float32", quantization="none")
    v_proj = loaded.layers[0].self_attn.v_proj.weight.get_value()
    got = _torch_layout(np.asarray(v_proj), Layout("linear", 1))
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_bad_gguf_paths_raise_model_load_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load_model(str(tmp_path / "missing.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_model(str(bad))


def _mixed_blocks_gguf(tiny, path):
    """tiny-llama with every matrix in one of the five block types kept on the device: Q4_K /
    Q6_K (our encoders) where rows are whole 256-blocks, Q8_0 / Q4_0 / Q4_1 elsewhere."""
    from jaxserve.model.readers.gguf_blocks import encode_q4_k, encode_q6_k

    _, cfg, tensors = tiny
    chosen, raw = {}, {}
    kinds = [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.Q4_1]
    for i, (name, x) in enumerate(sorted((n, x) for n, x in tensors.items() if x.ndim == 2)):
        qtype = kinds[i % 5] if x.shape[1] % 256 == 0 else kinds[2 + i % 3]
        if qtype in (Q.Q4_K, Q.Q6_K):
            if ".attn_q." in name or ".attn_k." in name:
                x = permute_qk(x, cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads)
            encode = encode_q4_k if qtype == Q.Q4_K else encode_q6_k
            raw[name] = (encode(x), qtype)
        chosen[name] = qtype
    write_gguf(path, cfg, tensors, lambda n, x: chosen.get(n, Q.F32), raw=raw)
    return chosen


def test_blocks_kept_quantized_give_the_dequantised_logits(tiny, tmp_path):
    """Q8_0, Q4_0, Q4_1, Q4_K and Q6_K stay blocks on the device; the step widens them and
    the logits equal the dequantise-on-load path's within 1e-3."""
    from model_testing import dense_logits

    from jaxserve.model.layers.quant import BlockQuant
    from jaxserve.model.quant_loading import weight_bytes

    path = tmp_path / "tiny-blocks.gguf"
    chosen = _mixed_blocks_gguf(tiny, path)
    assert set(chosen.values()) == {Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K}
    wide, _, _ = load_model(str(path), dtype="float32", quantization="none")
    blocks, _, _ = load_model(str(path), dtype="float32", quantization="gguf")
    kept = {type(layer.quant) for _, layer in nnx.iter_graph(blocks) if hasattr(layer, "quant")}
    assert kept == {BlockQuant}
    assert blocks.layers[0].self_attn.q_proj.weight.get_value().dtype in (jnp.uint8, jnp.int8)
    assert weight_bytes(blocks) < 0.25 * weight_bytes(wide)  # float32 wide: < half of bf16
    seq = [1, 57, 300, 12, 900, 4000, 5, 77, 31, 2048, 9, 10]
    want = dense_logits(wide, seq)
    np.testing.assert_allclose(dense_logits(blocks, seq), want, atol=1e-3)
