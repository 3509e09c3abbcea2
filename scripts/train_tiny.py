#!/usr/bin/env python
"""Train the bundled tiny-llama model (jaxserve's own Llama) on the packed corpus.

Model: ``LlamaForCausalLM`` from ``jaxserve.model.models.llama``, vocab 4096, hidden 256, 6 layers,
4 query / 2 KV heads of 64 (grouped-query attention), SwiGLU 704, RoPE theta 1e4, tied
embeddings (5,475,584 parameters). Data: ``<corpus>/train_ids.npy`` / ``valid_ids.npy`` (uint16
token streams from scripts/train_tokenizer.py); each step samples ``batch_size`` random
windows of ``seq_len + 1`` tokens on the device (standard packed next-token training).

Optimiser: AdamW (Loshchilov & Hutter 2019) written with ``jax.tree.map`` (no optax needed on
the GPU machine): betas (0.9, 0.95), weight decay 0.1 on matrices only, global-norm clipping
at 1.0, linear warm-up then cosine decay to 10% of the peak rate. Master parameters are
float32; with ``--compute-dtype bfloat16`` the forward/backward runs on a bfloat16 copy.
The schedule's horizon is the smallest of ``--steps``, ``--max-epochs`` worth of tokens and
``--time-budget-s`` (progress = the larger of the step and the time fraction). The held-out
loss is measured every ``--eval-every`` steps; the best parameters are kept, and training
stops early after ``--patience`` evaluations without improvement (the corpus is small, so
the model overfits if trained for long).

Writes into ``--out``: ``model.safetensors`` (Hugging Face tensor names and layouts, float32,
via the inverse of the family's ``weight_source(..., "hf")`` layouts), ``config.json`` (HF Llama),
the tokenizer files from ``--tokenizer-dir`` and ``train_log.json`` (loss curve, held-out
loss and perplexity, wall time, device, a greedy sample). The saved file is reloaded with
``jaxserve.model.loader.load_safetensors`` and its logits checked against the trained ones.

    PYTHONPATH=. python scripts/train_tiny.py --steps 20 --batch-size 4 --out /tmp/tiny  # CPU smoke

A draft model for speculative decoding (``--speculative-config '{"method": "draft_model",
...}'``): ``--num-layers 1`` keeps the bundled shapes with fewer layers, ``--init-from DIR``
starts from a trained model's embedding, final norm and first layers (the target truncated,
as in self-speculative decoding, Zhang et al. 2023), and ``--distill-from DIR`` trains it to
match that model's next-token distribution on the corpus (knowledge distillation, Hinton et al.
2015; for drafts, DistillSpec, Zhou et al. 2024) rather than the corpus tokens alone
(``--distill-weight``: the KL term's share of the loss). The draft shipped beside the bundled
model, ``checkpoints/tiny-llama-draft``, was trained on the 2-core CPU box (267 steps of 8 x 256
tokens in the ~93-minute budget, held-out loss 3.974 vs the target's 3.439) with:

    python scripts/train_tiny.py --num-layers 1 --init-from jaxserve/checkpoints/tiny-llama \
        --distill-from jaxserve/checkpoints/tiny-llama --corpus data/corpus \
        --batch-size 8 --lr 1e-3 --warmup 50 --steps 3000 --time-budget-s 5600 \
        --out jaxserve/checkpoints/tiny-llama-draft --tokenizer-dir jaxserve/checkpoints/tiny-llama
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxserve.model.arch_config import ModelArchConfig  # noqa: E402
from jaxserve.model.loader import load_safetensors  # noqa: E402
from jaxserve.model.models.llama import LlamaForCausalLM  # noqa: E402

TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
TOKENIZER_FILES = (
    "tokenizer.model",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
)


# ---------------------------------------------------------------- optimiser


def adamw_init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return {"m": zeros, "v": jax.tree.map(jnp.zeros_like, params), "t": jnp.zeros((), jnp.int32)}


def adamw_update(params, grads, opt, lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip=1.0):
    """One AdamW step with global-norm gradient clipping; decay only on >= 2-D parameters."""
    gnorm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    scale = jnp.minimum(1.0, clip / (gnorm + 1e-6))
    grads = jax.tree.map(lambda g: g * scale, grads)
    t = opt["t"] + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, opt["m"], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, opt["v"], grads)
    bc1 = 1 - b1 ** t.astype(jnp.float32)
    bc2 = 1 - b2 ** t.astype(jnp.float32)

    def step(p, m, v):
        upd = (m / bc1) / (jnp.sqrt(v / bc2) + eps)
        if p.ndim >= 2:
            upd = upd + weight_decay * p
        return p - lr * upd

    return jax.tree.map(step, params, m, v), {"m": m, "v": v, "t": t}, gnorm


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from ``peak`` to ``peak / 10``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(max(progress, 0.0), 1.0)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# ---------------------------------------------------------------- model plumbing


def cross_entropy(logits, targets):
    """Mean next-token loss; logits float32 ``[B, L, V]``, targets int32 ``[B, L]``."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    gold = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - gold)


def distillation_loss(logits, teacher_logits, targets, weight: float):
    """``weight * KL(teacher || student) + (1 - weight) * cross-entropy``, mean per token;
    logits float32 ``[B, L, V]``, targets int32 ``[B, L]``."""
    log_q = jax.nn.log_softmax(logits, axis=-1)
    log_p = jax.nn.log_softmax(jax.lax.stop_gradient(teacher_logits), axis=-1)
    kl = jnp.mean(jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1))
    if weight >= 1.0:
        return kl
    return weight * kl + (1.0 - weight) * cross_entropy(logits, targets)


def make_fns(
    graphdef,
    compute_dtype,
    batch_size: int,
    seq_len: int,
    steps_per_call: int,
    teacher_graphdef=None,
    distill_weight: float = 1.0,
):
    def forward(params, ids):
        p = jax.tree.map(lambda x: x.astype(compute_dtype), params)
        return nnx.merge(graphdef, p).forward_dense(ids)

    def loss_fn(params, window, teacher):
        if teacher is None:
            return cross_entropy(forward(params, window[:, :-1]), window[:, 1:])
        t = jax.tree.map(lambda x: x.astype(compute_dtype), teacher)
        teacher_logits = nnx.merge(teacher_graphdef, t).forward_dense(window[:, :-1])
        return distillation_loss(
            forward(params, window[:, :-1]), teacher_logits, window[:, 1:], distill_weight
        )

    def sample_windows(data, key):
        starts = jax.random.randint(key, (batch_size,), 0, data.shape[0] - seq_len - 1)
        return jax.vmap(lambda s: jax.lax.dynamic_slice(data, (s,), (seq_len + 1,)))(starts)

    @jax.jit
    def train_chunk(params, opt, data, key, lrs, teacher=None):
        """``steps_per_call`` optimiser steps; lrs float32 ``[steps_per_call]``; ``teacher``:
        the distillation teacher's parameters, or None (plain next-token training)."""

        def body(carry, lr):
            params, opt, key = carry
            key, sub = jax.random.split(key)
            loss, grads = jax.value_and_grad(loss_fn)(params, sample_windows(data, sub), teacher)
            params, opt, gnorm = adamw_update(params, grads, opt, lr)
            return (params, opt, key), (loss, gnorm)

        (params, opt, key), (losses, gnorms) = jax.lax.scan(body, (params, opt, key), lrs)
        return params, opt, key, losses, gnorms

    @jax.jit
    def eval_loss(params, windows):
        """Per-window summed token loss ``[b]`` of windows int32 ``[b, seq_len + 1]``."""
        logits = forward(params, windows[:, :-1])
        logz = jax.nn.logsumexp(logits, axis=-1)
        gold = jnp.take_along_axis(logits, windows[:, 1:, None], axis=-1)[..., 0]
        return jnp.sum(logz - gold, axis=-1)

    return train_chunk, eval_loss, forward


def evaluate(
    eval_loss, params, ids: np.ndarray, seq_len: int, batch_size: int, max_tokens: int | None
) -> float:
    """Mean loss over non-overlapping windows of the held-out stream (nats per token)."""
    n = (len(ids) - 1) // seq_len
    if max_tokens:
        n = max(1, min(n, max_tokens // seq_len))
    windows = np.stack([ids[i * seq_len : (i + 1) * seq_len + 1] for i in range(n)]).astype(
        np.int32
    )
    total, count = 0.0, 0
    for i in range(0, n, batch_size):
        chunk = windows[i : i + batch_size]
        real = len(chunk)
        if real < batch_size:  # pad to one shape (no recompile); padded rows are not counted
            chunk = np.concatenate([chunk, np.repeat(chunk[:1], batch_size - real, axis=0)])
        total += float(np.sum(np.asarray(eval_loss(params, chunk))[:real]))
        count += real * seq_len
    return total / count


def greedy_sample(forward, params, tokenizer, prompt: str, new_tokens: int, buf_len: int) -> str:
    """Greedy continuation by full recompute over a fixed ``[1, buf_len]`` buffer."""
    ids = tokenizer.encode(prompt)
    fwd = jax.jit(forward)
    buf = np.zeros((1, buf_len), np.int32)
    out = []
    for _ in range(new_tokens):
        n = len(ids) + len(out)
        if n >= buf_len:
            break
        buf[0, :n] = ids + out
        nxt = int(jnp.argmax(fwd(params, buf)[0, n - 1]))
        if nxt in tokenizer.eos_token_ids:
            break
        out.append(nxt)
    return prompt + tokenizer.decode(ids + out)[len(tokenizer.decode(ids)) :]


def export_hf(params_state, cfg: ModelArchConfig, out_dir: str, extra: dict | None = None) -> int:
    """Writes ``model.safetensors`` with HF names/layouts (inverse of the loader's mapping),
    plus the ``extra`` tensors by name (a draft's ``d2t``); returns the parameter count."""
    tensors = {}
    for path, var in nnx.to_flat_state(params_state):
        x = np.asarray(var[...], dtype=np.float32)
        source = LlamaForCausalLM.weight_source(path, cfg, "hf")
        y = source.layout.to_stored(x)
        assert y.shape == source.layout.stored_shape(x.shape), (source.name, y.shape)
        tensors[source.name] = np.ascontiguousarray(y)
    count = sum(t.size for t in tensors.values())
    tensors.update(extra or {})
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return count


def transformers_logit_diff(out_dir: str, probe: np.ndarray, ref: np.ndarray) -> float | str:
    """Max |logit difference| between our model and transformers' LlamaForCausalLM loading
    the exported directory (HF parity of the export), or why it could not be checked
    (transformers/torch are optional: present on the GPU machine, not in our venv)."""
    try:
        import torch
        from transformers import LlamaForCausalLM as HFLlama
    except ImportError as e:
        return f"skipped ({e.name} not installed)"
    try:
        hf = HFLlama.from_pretrained(out_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            got = hf(torch.tensor(probe, dtype=torch.long)).logits.float().numpy()
        return float(np.max(np.abs(got - ref)))
    except Exception as e:  # noqa: BLE001 - a diagnostic only; the weights are already saved
        return f"failed: {type(e).__name__}: {e}"


def init_from(params, model_dir: str):
    """``params`` with every tensor that ``model_dir``'s model has at the same path and shape
    (embedding, final norm, its first layers) copied from it; the others keep their draw."""
    from jaxserve.model.loader import load_model

    source, _, _ = load_model(model_dir, "float32")
    have = {tuple(path): var.get_value() for path, var in nnx.to_flat_state(nnx.state(source))}
    flat = dict(nnx.to_flat_state(params))
    copied = 0
    for path, var in flat.items():
        value = have.get(tuple(path))
        if value is not None and value.shape == var.get_value().shape:
            var.set_value(jnp.asarray(value))
            copied += value.size
    print(f"init from {model_dir}: {copied:,} parameters copied", flush=True)
    return nnx.from_flat_state(flat)


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", default="data/corpus", help="dir with train_ids.npy, valid_ids.npy")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer-dir", default="checkpoints/tiny-llama")
    ap.add_argument("--steps", type=int, default=100_000, help="upper bound on optimiser steps")
    ap.add_argument(
        "--max-epochs", type=float, default=40.0, help="upper bound, in passes over train"
    )
    ap.add_argument(
        "--time-budget-s", type=float, default=None, help="wall-clock limit for training"
    )
    ap.add_argument("--batch-size", type=int, default=None, help="default 128 on GPU/TPU, 8 on CPU")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--steps-per-call", type=int, default=None, help="default 20 on GPU, 1 on CPU")
    ap.add_argument(
        "--compute-dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="default bfloat16 on GPU/TPU, float32 on CPU",
    )
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument(
        "--eval-tokens", type=int, default=None, help="cap on held-out tokens (smoke runs)"
    )
    ap.add_argument("--patience", type=int, default=4)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--sample-tokens", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--num-layers", type=int, default=None, help="decoder layers (default: the bundled 6)"
    )
    ap.add_argument(
        "--init-from",
        default=None,
        help="model dir whose embedding, final norm and first layers start the training",
    )
    ap.add_argument(
        "--distill-from", default=None, help="teacher model dir: match its next-token distribution"
    )
    ap.add_argument(
        "--distill-weight",
        type=float,
        default=1.0,
        help="share of the KL-to-teacher term in the loss (the rest: cross-entropy)",
    )
    args = ap.parse_args(argv)

    t_start = time.time()
    device = jax.devices()[0]
    accel = device.platform != "cpu"
    batch = args.batch_size or (128 if accel else 8)
    per_call = args.steps_per_call or (20 if accel else 1)
    compute_dtype = jnp.dtype(args.compute_dtype or ("bfloat16" if accel else "float32"))
    L = args.seq_len
    print(
        f"device {device.device_kind} ({device.platform}), batch {batch} x {L}, "
        f"compute {compute_dtype.name}",
        flush=True,
    )

    train_ids = np.load(os.path.join(args.corpus, "train_ids.npy")).astype(np.int32)
    valid_ids = np.load(os.path.join(args.corpus, "valid_ids.npy")).astype(np.int32)
    hf_config = dict(TINY_LLAMA_CONFIG)
    if args.num_layers is not None:
        hf_config["num_hidden_layers"] = args.num_layers
    cfg = ModelArchConfig.from_hf_config(hf_config)
    if train_ids.max() >= cfg.vocab_size:
        raise SystemExit(f"token id {train_ids.max()} >= vocab_size {cfg.vocab_size}")
    model = LlamaForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model)
    if args.init_from:
        params = init_from(params, args.init_from)
    teacher_graphdef = teacher = None
    if args.distill_from:
        from jaxserve.model.loader import load_model

        teacher_model, _, _ = load_model(args.distill_from, "float32")
        teacher_graphdef, teacher = nnx.split(teacher_model)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    tokens_per_step = batch * L
    horizon = max(1, min(args.steps, int(args.max_epochs * len(train_ids) / tokens_per_step)))
    warmup = max(1, min(args.warmup, horizon // 10))
    print(
        f"params {n_params:,}; train tokens {len(train_ids):,}, valid {len(valid_ids):,}; "
        f"horizon {horizon} steps",
        flush=True,
    )

    train_chunk, eval_loss, forward = make_fns(
        graphdef, compute_dtype, batch, L, per_call, teacher_graphdef, args.distill_weight
    )
    data = jax.device_put(train_ids)
    opt = adamw_init(params)
    key = jax.random.key(args.seed)

    log = {
        "device": f"{device.device_kind} ({device.platform})",
        "jax": jax.__version__,
        "config": hf_config,
        "init_from": args.init_from,
        "distill_from": args.distill_from,
        "distill_weight": args.distill_weight if args.distill_from else None,
        "num_params": int(n_params),
        "batch_size": batch,
        "seq_len": L,
        "peak_lr": args.lr,
        "warmup": warmup,
        "horizon_steps": horizon,
        "compute_dtype": compute_dtype.name,
        "train_tokens_available": int(len(train_ids)),
        "loss_curve": [],
        "valid_curve": [],
    }
    best = (float("inf"), 0, params)
    bad_evals, step, t_train = 0, 0, time.time()
    t_compiled, first_chunk = t_train, 0
    stop_reason = "steps"
    recent = []
    while step < horizon:
        elapsed = time.time() - t_start
        if args.time_budget_s and elapsed >= args.time_budget_s:
            stop_reason = "time budget"
            break
        frac_time = elapsed / args.time_budget_s if args.time_budget_s else 0.0
        n = min(per_call, horizon - step)
        lrs = np.array(
            [
                lr_at(step + i, max((step + i) / horizon, frac_time), args.lr, warmup)
                for i in range(n)
            ],
            np.float32,
        )
        params, opt, key, losses, gnorms = train_chunk(params, opt, data, key, lrs, teacher)
        losses = np.asarray(losses)
        if step == 0:
            t_compiled, first_chunk = time.time(), n  # throughput excludes the compile
        if not np.all(np.isfinite(losses)):
            raise SystemExit(f"non-finite loss at step {step}: {losses}")
        recent.extend(losses.tolist())
        prev, step = step, step + n
        if step // args.log_every > prev // args.log_every or step >= horizon:
            entry = [
                step,
                round(float(np.mean(recent)), 4),
                float(lrs[-1]),
                round(float(np.asarray(gnorms)[-1]), 3),
                round(time.time() - t_start, 1),
            ]
            log["loss_curve"].append(entry)
            print(
                f"step {step:6d} loss {entry[1]:.4f} lr {entry[2]:.2e} gnorm {entry[3]:.2f} "
                f"t {entry[4]:.0f}s",
                flush=True,
            )
            recent = []
        if step // args.eval_every > prev // args.eval_every:
            vloss = evaluate(eval_loss, params, valid_ids, L, batch, args.eval_tokens)
            log["valid_curve"].append([step, round(vloss, 4)])
            print(f"step {step:6d} held-out loss {vloss:.4f} ppl {math.exp(vloss):.2f}", flush=True)
            if vloss < best[0]:
                best, bad_evals = (vloss, step, params), 0  # not donated: stays valid
            else:
                bad_evals += 1
                if bad_evals >= args.patience:
                    stop_reason = f"no held-out improvement in {args.patience} evaluations"
                    break
    train_wall = time.time() - t_train

    if not log["valid_curve"] or log["valid_curve"][-1][0] != step:
        final_vloss = evaluate(eval_loss, params, valid_ids, L, batch, args.eval_tokens)
        log["valid_curve"].append([step, round(final_vloss, 4)])
        if final_vloss < best[0]:
            best = (final_vloss, step, params)
    vloss, best_step, params = best
    tloss = evaluate(eval_loss, params, train_ids[: len(valid_ids)], L, batch, args.eval_tokens)
    print(
        f"stopped after {step} steps ({stop_reason}); best held-out loss {vloss:.4f} "
        f"(ppl {math.exp(vloss):.2f}) at step {best_step}; train-sample loss {tloss:.4f}",
        flush=True,
    )

    os.makedirs(args.out, exist_ok=True)
    count = export_hf(params, cfg, args.out)
    hf_cfg = dict(hf_config)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    if os.path.abspath(args.tokenizer_dir) != os.path.abspath(args.out):
        for name in TOKENIZER_FILES:
            src = os.path.join(args.tokenizer_dir, name)
            if os.path.isfile(src):
                shutil.copy2(src, os.path.join(args.out, name))

    # Reload through the serving loader and compare logits with the trained parameters.
    reloaded = load_safetensors(args.out, cfg, jnp.float32)
    probe = valid_ids[:L][None]
    ref = np.asarray(nnx.merge(graphdef, params).forward_dense(probe))
    got = np.asarray(reloaded.forward_dense(probe))
    reload_err = float(np.max(np.abs(ref - got)))
    if reload_err > 1e-4:
        raise SystemExit(f"reloaded model.safetensors differs from the trained model: {reload_err}")

    hf_err = transformers_logit_diff(args.out, probe, ref)
    print(
        f"reload check: max |logit diff| {reload_err:.2e} (our loader), {hf_err} (transformers)",
        flush=True,
    )

    sample = ""
    try:
        from jaxserve.tokenizer import get_tokenizer

        tok = get_tokenizer(args.tokenizer_dir)
        sample = greedy_sample(forward, params, tok, "Once upon a time", args.sample_tokens, 128)
        print("greedy sample:", repr(sample), flush=True)
    except (ImportError, ValueError) as e:  # tokenizer missing: still keep the weights
        print(f"no sample: {e}", flush=True)

    log.update(
        {
            "steps": step,
            "tokens_seen": int(step * tokens_per_step),
            "epochs": round(step * tokens_per_step / len(train_ids), 2),
            "stop_reason": stop_reason,
            "best_step": best_step,
            "valid_loss": round(vloss, 4),
            "valid_ppl": round(math.exp(vloss), 3),
            "train_sample_loss": round(tloss, 4),
            "train_wall_s": round(train_wall, 1),
            "wall_s": round(time.time() - t_start, 1),
            "tokens_per_s": round(
                (step - first_chunk)
                * tokens_per_step
                / max(t_train + train_wall - t_compiled, 1e-9)
            ),
            "exported_params": int(count),
            "reload_max_abs_logit_diff": reload_err,
            "transformers_max_abs_logit_diff": hf_err,
            "sample_prompt": "Once upon a time",
            "sample_greedy": sample,
        }
    )
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(log, f, indent=2)
    print(
        json.dumps(
            {
                k: log[k]
                for k in ("steps", "epochs", "valid_loss", "valid_ppl", "wall_s", "tokens_per_s")
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
