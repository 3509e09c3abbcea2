"""Which layers cost fp8 quantize-on-load its perplexity on SmolLM2-135M (#31): cheap, dense
logits (``forward_dense``, no engine) of the bench's fixed text, every variant quantized in
memory from one wide load (the demo Q4_1 GGUF dequantized, float32).

Usage: ``JAX_PLATFORMS=cpu nice .venv/bin/python benchmarks/quant_ablation.py [main|layers|emb
|loaded]``: main: fp8 / int8 with and without the embedding (tied LM head) and activation
quantization; layers: one projection kind at a time, W8A8 and W8A16; emb: the tied matrix's
lookup and LM head apart (an untied copy); loaded: ``load_model(quantization="fp8")``.
Results: benchmarks/RESULTS.md (#31).
"""

import math
import sys
import time

sys.path.insert(0, "tests/model")
sys.path.insert(0, "benchmarks")
import jax.numpy as jnp
import numpy as np
from bench_quant import PPL_TEXT
from flax import nnx
from model_testing import dense_logits

from jaxserve.model import demo_model_path
from jaxserve.model.layers.linear import Linear
from jaxserve.model.layers.quant import ChannelQuant
from jaxserve.model.loader import load_model
from jaxserve.model.quant_config import WeightScheme
from jaxserve.model.quant_loading import quantizable_layers, quantize_layer
from jaxserve.tokenizer.loading import get_tokenizer

t0 = time.time()
wide, cfg, _ = load_model(demo_model_path(), dtype="float32", quantization="none")
tok = get_tokenizer(demo_model_path())
print("loaded", time.time() - t0, flush=True)
ids = tok.encode(PPL_TEXT)
ids = list(ids)
print("tokens", len(ids), flush=True)


def score(model):
    lg = dense_logits(model, ids).astype(np.float64)
    lse = np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)) + lg.max(-1)
    lp = lg[np.arange(len(ids) - 1), ids[1:]] - lse[:-1]
    return lg, lp


base_lg, base_lp = score(wide)
base_ppl = math.exp(-base_lp.mean())
print(f"baseline ppl {base_ppl:.3f}", flush=True)

FP8 = "float8_e4m3fn"


def variant(name, pick):
    """pick(path, layer) -> WeightScheme or None."""
    m = nnx.clone(wide)
    for path, layer in quantizable_layers(m).items():
        s = pick(path, layer)
        if s is not None:
            quantize_layer(layer, ChannelQuant(s))
    lg, lp = score(m)
    ppl = math.exp(-lp.mean())
    print(
        f"{name:45s} ppl {ppl:8.3f} {100 * (ppl / base_ppl - 1):+6.2f}%  |dlogp| {np.abs(lp - base_lp).mean():.4f}  max|dlogit| {np.abs(lg - base_lg).max():.3f}",
        flush=True,
    )
    del m


lin = lambda p, l: isinstance(l, Linear)
emb = lambda p, l: not isinstance(l, Linear)
W8A8 = WeightScheme(FP8, "dynamic")
W8A16 = WeightScheme(FP8)
I8 = WeightScheme("int8")
which = sys.argv[1] if len(sys.argv) > 1 else "main"
if which == "main":
    variant("fp8 current (W8A8 linears + fp8 emb)", lambda p, l: W8A8 if lin(p, l) else W8A16)
    variant("fp8 emb/lm-head only", lambda p, l: W8A16 if emb(p, l) else None)
    variant("fp8 W8A8 linears, emb wide", lambda p, l: W8A8 if lin(p, l) else None)
    variant("fp8 W8A16 linears, emb wide", lambda p, l: W8A16 if lin(p, l) else None)
    variant("int8 current (linears + emb)", lambda p, l: I8)
    variant("int8 emb only", lambda p, l: I8 if emb(p, l) else None)
elif which == "layers":
    for key in ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]:
        variant(f"fp8 W8A8 {key} only", lambda p, l, k=key: W8A8 if k in p else None)
        variant(f"fp8 W8A16 {key} only", lambda p, l, k=key: W8A16 if k in p else None)
if which == "loaded":
    m, _, _ = load_model(demo_model_path(), dtype="float32", quantization="fp8")
    lg, lp = score(m)
    ppl = math.exp(-lp.mean())
    print(f"load_model fp8: ppl {ppl:.3f} {100 * (ppl / base_ppl - 1):+.2f}%", flush=True)
    mm = nnx.clone(wide)
    for path, layer in quantizable_layers(mm).items():
        quantize_layer(layer, ChannelQuant(W8A8 if lin(path, layer) else W8A16))
    for path, layer in quantizable_layers(m).items():
        a = {k: np.asarray(getattr(layer, k)[...]).astype(np.float32) for k in layer.quant_params}
        b = {
            k: np.asarray(getattr(quantizable_layers(mm)[path], k)[...]).astype(np.float32)
            for k in layer.quant_params
        }
        d = {k: float(np.abs(a[k] - b[k]).max()) for k in a}
        if any(v > 0 for v in d.values()):
            print("differs", path, d)
    print("compare done", flush=True)
if which == "emb":
    from jaxserve.model.layers.embedding import Embedding

    def with_head(quant_lookup, quant_head, lin_scheme=None):
        m = nnx.clone(wide)
        head = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=jnp.float32, rngs=nnx.Rngs(0))
        head.weight.set_value(wide.embed_tokens.weight[...])
        m.lm_head = nnx.data(head)
        if quant_lookup:
            quantize_layer(m.embed_tokens, ChannelQuant(W8A16))
        if quant_head:
            quantize_layer(m.lm_head, ChannelQuant(W8A16))
        if lin_scheme:
            for _p, l in quantizable_layers(m).items():
                if isinstance(l, Linear):
                    quantize_layer(l, ChannelQuant(lin_scheme))
        return m

    for name, args in [
        ("fp8 lookup only (head wide)", (True, False)),
        ("fp8 head only (lookup wide)", (False, True)),
        ("fp8 W8A16 linears + fp8 lookup, head wide", (True, False, W8A16)),
    ]:
        m = with_head(*args)
        lg, lp = score(m)
        ppl = math.exp(-lp.mean())
        print(
            f"{name:45s} ppl {ppl:8.3f} {100 * (ppl / base_ppl - 1):+6.2f}%  |dlogp| {np.abs(lp - base_lp).mean():.4f}  max|dlogit| {np.abs(lg - base_lg).max():.3f}",
            flush=True,
        )
