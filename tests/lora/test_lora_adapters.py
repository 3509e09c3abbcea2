"""PEFT adapter reading and checking, the host tier and slot table, the delta backends, the
adapter's prefix-cache key and the flags (#33): no engine, fast."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxserve.config import EngineArgs, LoRAConfig
from jaxserve.core.kv_cache_utils import hash_token_blocks
from jaxserve.lora.manager import LoRAManager
from jaxserve.lora.peft import LoRAAdapterError, load_peft_adapter
from jaxserve.model.layers.lora import LoraBatch, lora_delta

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "lora")
# the llama golden fixture's projections: hidden 64, 4 query heads and 2 KV heads of 16, MLP 64
TARGETS = {
    f"layers.{i}.{m}": shape
    for i in range(2)
    for m, shape in {
        "self_attn.q_proj": (64, 64),
        "self_attn.k_proj": (64, 32),
        "self_attn.v_proj": (64, 32),
        "self_attn.o_proj": (64, 64),
        "mlp.gate_proj": (64, 64),
        "mlp.up_proj": (64, 64),
        "mlp.down_proj": (64, 64),
    }.items()
}


def test_reads_peft_layout_and_scaling():
    a1 = load_peft_adapter("a1", os.path.join(FIXTURES, "a1"), max_rank=16, targets=TARGETS)
    assert a1.rank == 8 and a1.scaling == 2.0 and len(a1.weights) == 14
    a, b = a1.weights["layers.0.self_attn.k_proj"]
    assert a.shape == (64, 8) and b.shape == (8, 32)
    a2 = load_peft_adapter("a2", os.path.join(FIXTURES, "a2"), max_rank=16, targets=TARGETS)
    assert a2.scaling == pytest.approx(8 / 2.0)  # rsLoRA: alpha / sqrt(r)
    assert sorted(a2.weights) == sorted(
        f"layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")
    )


def _copy(tmp_path, src="a2", **config):
    dst = tmp_path / "bad"
    shutil.copytree(os.path.join(FIXTURES, src), dst)
    if config:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        cfg.update(config)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(r=32), "rank 32 is over --max-lora-rank 16"),
        (dict(target_modules=["q_proj", "lm_head"]), "target_modules ['lm_head']"),
        (dict(use_dora=True), "use_dora=true is not supported"),
        (dict(bias="all"), "bias='all'"),
        (dict(r=2), "do not match the model's"),  # the file's matrices have rank 4
    ],
)
def test_bad_adapter_is_refused_in_one_line(tmp_path, change, message):
    path = _copy(tmp_path, **change)
    with pytest.raises(
        LoRAAdapterError, match=message.replace("[", r"\[").replace("]", r"\]")
    ) as e:
        load_peft_adapter("bad", str(path), max_rank=16, targets=TARGETS)
    assert "\n" not in str(e.value) and "'bad'" in str(e.value)


def test_missing_files_and_foreign_shapes(tmp_path):
    with pytest.raises(LoRAAdapterError, match="no directory"):
        load_peft_adapter("x", str(tmp_path / "nope"), max_rank=16, targets=TARGETS)
    path = _copy(tmp_path)
    os.remove(path / "adapter_model.safetensors")
    with pytest.raises(LoRAAdapterError, match="missing .*adapter_model.safetensors"):
        load_peft_adapter("x", str(path), max_rank=16, targets=TARGETS)
    save_file(
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros(
                (4, 65), "f4"
            ),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": np.zeros(
                (64, 4), "f4"
            ),
        },
        str(path / "adapter_model.safetensors"),
    )
    with pytest.raises(LoRAAdapterError, match=r"q_proj lora_A \[4, 65\]"):
        load_peft_adapter("x", str(path), max_rank=16, targets=TARGETS)
    save_file(
        {"base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": np.zeros((4, 64), "f4")},
        str(path / "adapter_model.safetensors"),
    )
    with pytest.raises(LoRAAdapterError, match="layers.7.self_attn.q_proj' is not in this model"):
        load_peft_adapter("x", str(path), max_rank=16, targets=TARGETS)


def test_manager_host_tier_and_slots_lru():
    writes = []
    m = LoRAManager(2, 2, 16, TARGETS, lambda slot, ad: writes.append((slot, ad and ad.name)))
    for name in ("a", "b", "c"):
        m.register(name, os.path.join(FIXTURES, "a1"))
    assert list(m.host) == ["b", "c"] and m.stats.disk_loads == 3  # host tier of 2: LRU
    with pytest.raises(LoRAAdapterError, match="already loaded"):
        m.register("a", os.path.join(FIXTURES, "a1"))
    assert m.activate({"a", "b"}) == {"a": 0, "b": 1}
    assert m.stats.disk_loads == 5  # "a", then "b" evicted from the host tier: read again
    assert m.activate({"b", "c"}) == {"b": 1, "c": 0}  # "a" was least recently used
    assert writes == [(0, "a"), (1, "b"), (0, "c")]
    with pytest.raises(ValueError, match="over max_loras 2"):
        m.activate({"a", "b", "c"})
    m.unregister("c")
    assert writes[-1] == (0, None) and m.slots == [None, "b"]
    with pytest.raises(LoRAAdapterError, match="not loaded"):
        m.unregister("c")


def test_delta_backends_agree_with_a_dense_reference():
    rng = np.random.default_rng(0)
    t, slots, rank = 11, 3, 4
    x = rng.standard_normal((t, 2, 5)).astype(np.float32)  # two input axes, as o_proj's
    a = rng.standard_normal((slots, 2, 5, rank)).astype(np.float32)
    b = rng.standard_normal((slots, rank, 6)).astype(np.float32)
    token_slots = np.array([2, -1, 0, 2, 1, -1, 0, 0, 2, -1, -1])
    want = np.stack(
        [
            np.zeros(6) if s < 0 else x[i].reshape(-1) @ a[s].reshape(10, rank) @ b[s]
            for i, s in enumerate(token_slots)
        ]
    )
    for backend in ("sgmv", "gather", "ragged"):
        batch = LoraBatch.from_slots(token_slots, slots, backend)
        got = jax.jit(lora_delta)(x, a, b, batch)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="slots must lie in"):
        LoraBatch.from_slots(np.array([3]), slots)


def test_adapter_joins_the_prefix_cache_key():
    tokens = list(range(64))
    base = hash_token_blocks(tokens, 16)
    a = hash_token_blocks(tokens, 16, lora_name="a")
    assert hash_token_blocks(tokens, 16, lora_name="a") == a
    assert not set(base) & set(a) and not set(a) & set(hash_token_blocks(tokens, 16, lora_name="b"))


def test_flags():
    assert LoRAConfig.parse_modules(
        ["x=/p", '{"name": "y", "path": "/q", "base_model_name": "m"}']
    ) == (("x", "/p", None), ("y", "/q", "m"))
    for bad, msg in [("x", "name=path"), ('{"name": "y"}', "needs string name and path")]:
        with pytest.raises(ValueError, match=msg):
            LoRAConfig.parse_modules([bad])
    args = EngineArgs(enable_lora=True, max_loras=2, lora_modules=["x=/p"])
    assert args.lora_config() == LoRAConfig(2, 2, 16, (("x", "/p", None),))
    with pytest.raises(ValueError, match="needs --enable-lora"):
        EngineArgs(lora_modules=["x=/p"]).lora_config()
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineArgs(enable_lora=True, max_loras=4, max_cpu_loras=2).lora_config()


def test_kv_events_and_ledger_name_the_adapter():
    from jaxserve.config import CacheConfig
    from jaxserve.core.kv_cache_manager import KVCacheManager
    from jaxserve.core.kv_cache_utils import BlockStored, update_block_hashes
    from jaxserve.core.request import Request
    from jaxserve.kv_events import event_to_wire
    from jaxserve.sampling_params import SamplingParams

    kv = KVCacheManager(CacheConfig(block_size=16), 8)
    kv.block_pool.kv_events = []
    prompt = list(range(40))
    for name in (None, "a1"):
        r = Request(name or "base", prompt, SamplingParams(max_tokens=4), lora_name=name)
        hits, num_hit = kv.get_computed_blocks(r)
        assert num_hit == 0  # the base model's blocks do not serve the adapter
        assert kv.allocate_slots(r, r.num_tokens, 0, hits, new_request=True) is not None
        (event,) = kv.block_pool.take_kv_events()
        assert event == BlockStored(update_block_hashes(r, 16), None, prompt[:32], None, name)
        assert event_to_wire(event, 16)["lora_name"] == name
        r.close_ledger()
        assert r.ledger.to_dict()["lora_name"] == name


def test_delta_composes_with_a_quantized_base_weight():
    """The seam's contract with #31: the delta is added to whatever ``project`` computes."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.model.layers.linear import Linear
    from jaxserve.model.layers.quant import ChannelQuant
    from jaxserve.model.quant_config import INT8_ON_LOAD

    lin = Linear(
        8,
        (2, 4),
        in_axes=("embed",),
        out_axes=("q_heads", "head_dim"),
        bias=True,
        dtype=jnp.float32,
        rngs=nnx.Rngs(0),
    )
    method = ChannelQuant(INT8_ON_LOAD)
    lin.set_quantization(method, method.quantize(lin.weight[...], 1))
    lin.enable_lora(3, 4, jnp.float32)
    rng = np.random.default_rng(1)
    lin.lora_a.set_value(jnp.asarray(rng.standard_normal((3, 8, 4)), jnp.float32))
    lin.lora_b.set_value(jnp.asarray(rng.standard_normal((3, 4, 2, 4)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((5, 8)), jnp.float32)
    batch = LoraBatch.from_slots(np.array([1, -1, 0, 2, 1]), 3)
    want = lin.project(x) + lora_delta(x, lin.lora_a[...], lin.lora_b[...], batch) + lin.bias[...]
    np.testing.assert_allclose(np.asarray(lin(x, batch)), np.asarray(want), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(lin(x)), np.asarray(lin.project(x) + lin.bias[...]))
    assert lin.quant is method
