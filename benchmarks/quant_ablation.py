"""Which layers cost fp8 quantize-on-load its perplexity on SmolLM2-135M (#31): cheap, dense
logits (``forward_dense``, no engine) of the bench's fixed text, every variant quantized in
memory from one wide load (the demo Q4_1 GGUF dequantized, float32).

Usage: ``JAX_PLATFORMS=cpu nice .venv/bin/python benchmarks/quant_ablation.py [main|layers|emb
|loaded|loaded_ppl|scale|rounding]``: main: fp8 / int8 with and without the embedding (tied LM head) and activation
quantization; layers: one projection kind at a time, W8A8 and W8A16; emb: the tied matrix's
lookup and LM head apart (an untied copy); loaded: ``load_model(quantization="fp8")``;
loaded_ppl: ``load_model`` int8 and fp8; scale: fp8 per-channel scales by an MSE search over
clip ratios; rounding: the jitted quantize against numpy's one-rounding division.
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


def report(name, model, extra=""):
    """Scores ``model`` on the text and prints its perplexity and distances to the baseline."""
    lg, lp = score(model)
    ppl = math.exp(-lp.mean())
    print(
        f"{name:45s} ppl {ppl:8.3f} {100 * (ppl / base_ppl - 1):+6.2f}%  |dlogp| {np.abs(lp - base_lp).mean():.4f}  max|dlogit| {np.abs(lg - base_lg).max():.3f}{extra}",
        flush=True,
    )


def variant(name, pick):
    """pick(path, layer) -> WeightScheme or None."""
    m = nnx.clone(wide)
    for path, layer in quantizable_layers(m).items():
        s = pick(path, layer)
        if s is not None:
            quantize_layer(layer, ChannelQuant(s))
    report(name, m)
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
if which == "loaded_ppl":  # the load path as served: --quantization int8 / fp8
    for q in ("int8", "fp8"):
        m, _, _ = load_model(demo_model_path(), dtype="float32", quantization=q)
        report("load_model " + q, m)
        del m
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
        report(name, with_head(*args))
if which == "scale":
    # fp8 W8A16 linears (the default on CPU), embedding wide: the per-channel scale amax/448
    # against one chosen per output channel by a small MSE search over clip ratios.
    import jax

    def mse_scale(w, num_in, ratios):
        """Per output channel, the scale r * amax / 448 (r in ratios) whose fp8 round trip has
        the least squared error; w [*in, *out] float32."""
        axes = tuple(range(num_in))
        amax = jnp.maximum(jnp.max(jnp.abs(w), axis=axes), 1e-12)
        best_err, best = None, None
        for r in ratios:
            s = amax * r / 448.0
            q = jnp.clip(w / s, -448, 448).astype(jnp.float8_e4m3fn).astype(jnp.float32)
            err = jnp.sum((q * s - w) ** 2, axis=axes)
            if best is None:
                best_err, best = err, s
            else:
                take = err < best_err
                best_err, best = jnp.where(take, err, best_err), jnp.where(take, s, best)
        return best

    def searched(ratios):
        method = ChannelQuant(W8A16)
        fn = jax.jit(lambda w, n: mse_scale(w, n, ratios), static_argnums=1)
        picked = []

        def quant(layer):
            w = layer.weight[...].astype(jnp.float32)
            s = fn(w, layer.num_in_axes)
            picked.append(
                np.asarray(s / jnp.max(jnp.abs(w), axis=tuple(range(layer.num_in_axes))) * 448)
            )
            layer.set_quantization(method, {"weight": quantize_to(w, s, FP8), "weight_scale": s})

        return quant, picked

    from jaxserve.model.layers.quant import quantize_to

    variant("fp8 W8A16 linears, amax/448 (today)", lambda p, l: W8A16 if lin(p, l) else None)
    for label, ratios in [
        ("clip ratios 1.00..0.80 step 0.01", [1 - i / 100 for i in range(21)]),
        ("clip ratios 1.00..0.50 step 1/64", [1 - i / 64 for i in range(33)]),
    ]:
        t1 = time.time()
        quant, picked = searched(ratios)
        m = nnx.clone(wide)
        for _p, l in quantizable_layers(m).items():
            if isinstance(l, Linear):
                quant(l)
        r = np.concatenate([x.ravel() for x in picked])
        report(
            f"fp8 W8A16 MSE scale, {label}",
            m,
            f"  ratio<1 in {np.mean(r < 0.9999):.2f} of channels, mean {r.mean():.3f}  "
            f"{time.time() - t1:.0f}s",
        )
        del m
if which == "rounding":
    # fp8 W8A16 linears, embedding wide: today's jitted quantize (XLA multiplies by 1/448 and by
    # the scale's reciprocal: two roundings) against numpy's float32 division rounded once and
    # ml_dtypes' cast (round to nearest even): how many fp8 codes differ, and the perplexity.
    import ml_dtypes

    from jaxserve.model.layers.quant import quantize_to

    def exact(layer):
        w = np.asarray(layer.weight[...], np.float32)
        axes = tuple(range(layer.num_in_axes))
        s = np.maximum(np.abs(w).max(axis=axes), np.float32(1e-12)) / np.float32(448)
        q = np.clip(w / s, -448, 448).astype(ml_dtypes.float8_e4m3fn)
        today = np.asarray(quantize_to(jnp.asarray(w), jnp.asarray(s), FP8))
        ours = ChannelQuant(W8A16).quantize(jnp.asarray(w), layer.num_in_axes)
        counts[0] += int((today.view(np.uint8) != q.view(np.uint8)).sum())
        counts[1] += int((np.asarray(ours["weight"]).view(np.uint8) != q.view(np.uint8)).sum())
        counts[2] += int((np.asarray(ours["weight_scale"]) != s).sum())
        counts[3] += q.size
        counts[4] += s.size
        layer.set_quantization(
            ChannelQuant(W8A16), {"weight": jnp.asarray(q), "weight_scale": jnp.asarray(s)}
        )

    counts = [0, 0, 0, 0, 0]
    variant("fp8 W8A16 linears, jitted quantize (today)", lambda p, l: W8A16 if lin(p, l) else None)
    m = nnx.clone(wide)
    for _p, l in quantizable_layers(m).items():
        if isinstance(l, Linear):
            exact(l)
    report("fp8 W8A16 linears, numpy one-rounding + RNE", m)
    print(
        f"fp8 codes differing from numpy's: same scale {counts[0]}, jitted quantize {counts[1]} "
        f"of {counts[3]}; scales differing (1 ulp) {counts[2]} of {counts[4]}",
        flush=True,
    )
