#!/usr/bin/env python
"""Distil a small draft model for speculative decoding from a target's own greedy answers.

The draft shares the target's tokenizer and embedding; it has ``--num-layers`` decoder layers
(initialised from the target's first layers: the target truncated, as in self-speculative
decoding, Zhang et al. 2023), the target's final norm, and a reduced LM head over the
``--draft-vocab-size`` tokens most frequent in the target's answers (FR-Spec, Zhao et al. 2025;
EAGLE-3's ``draft_vocab_size`` / ``d2t``), initialised from the target's head rows. On a CPU a
draft token costs about what reading its weights costs, and a small model's tied head is most
of them (SmolLM2-135M: 28M of 135M parameters), so the reduced head is what makes a 1-layer
draft cheap.

Data: ``--data`` JSON lines ``{"prompt": [ids], "output": [ids]}``, the target's greedy
answers to chat prompts (``--generate PROMPTS.json`` makes them with jaxserve first, resuming
a partial file; ``--make-prompts DIR`` writes training and held-out prompts built from the
standard library's docstrings and source, so nothing is downloaded). The loss is next-token
cross-entropy on the answer tokens (the target's greedy choices: what greedy verification
accepts), over the reduced head, computed at the answer positions only; answer tokens outside
the head are not counted. The embedding stays frozen (it is the target's); layers, norm and
head train with AdamW (``scripts/train_tiny.py``'s). Two layers, not one: copying from the
prompt (much of a chat answer) needs an induction circuit, which takes two.

Writes into ``--out``: ``model.safetensors`` (HF Llama names, float32, plus ``d2t``: int64
offsets, target id = draft id + d2t[draft id]), ``config.json`` (the target's with
``num_hidden_layers``, ``tie_word_embeddings`` false, ``draft_vocab_size``) and
``train_log.json`` (losses, held-out greedy agreement, data sizes, wall time).

The SmolLM2 draft of benchmarks/RESULTS.md (#32), on the 2-core CPU box: prompts, the
target's answers to the training ones (956 answers, 111,188 tokens, ~20 min at ~90 tok/s),
then ~35 min of training (the last ``--valid-lines`` 56 answers held out for the agreement;
the benchmark's prompts are the held-out modules' ``valid_prompts.json``):

    python scripts/train_draft.py --make-prompts /tmp/draft
    python scripts/train_draft.py --target smollm2 --generate /tmp/draft/train_prompts.json \
        --data /tmp/draft/answers.jsonl --time-budget-s 2100 --out /tmp/smollm2-draft
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_tiny import adamw_init, adamw_update, export_hf, lr_at  # noqa: E402

from jaxserve.model.layers.causal_lm import run_layers  # noqa: E402
from jaxserve.model.models.llama import LlamaForCausalLM  # noqa: E402

DOC_TASKS = (
    "Summarize this documentation in a few sentences:\n\n{x}",
    "Explain this to a beginner:\n\n{x}",
    "Rewrite this text in simpler words:\n\n{x}",
    "What is this about? Answer briefly.\n\n{x}",
    "Copy this paragraph exactly:\n\n{x}",
    "Turn this into a bulleted list of key points:\n\n{x}",
)
CODE_TASKS = (
    "Explain what this Python function does:\n```python\n{x}```",
    "Add comments to this code and output the whole code:\n```python\n{x}```",
    "Find possible bugs in this function:\n```python\n{x}```",
    "Rename the variables in this code to clearer names and output the whole code:\n"
    "```python\n{x}```",
)


def stdlib_prompts(out_dir: str, seed: int = 0) -> tuple[int, int]:
    """Chat prompts built from this Python's standard library (docstrings of 200-1,200
    characters, functions' source of 150-1,400), each with a random task; writes
    ``train_prompts.json`` and ``valid_prompts.json`` (held out: every prompt of the modules
    whose name's CRC32 is 0 mod 10) into ``out_dir``; returns their counts. Nothing is
    downloaded: any chat model's answers to these make a draft's training data."""
    import importlib
    import inspect
    import pkgutil
    import random
    import textwrap
    import zlib

    rng = random.Random(seed)
    stdlib = os.path.dirname(os.__file__)
    skip = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "ensurepip"}
    items = []
    for info in sorted(pkgutil.iter_modules([stdlib]), key=lambda m: m.name):
        if info.name.startswith("_") or info.name in skip:
            continue
        try:
            module = importlib.import_module(info.name)
        except BaseException:  # noqa: BLE001 - platform-specific modules
            continue
        for attr, obj in list(vars(module).items())[:400]:
            if attr.startswith("_") or getattr(obj, "__module__", None) != info.name:
                continue
            doc = inspect.getdoc(obj)
            if doc and 200 < len(doc) < 1200:
                items.append((info.name, rng.choice(DOC_TASKS).format(x=doc)))
            if inspect.isfunction(obj):
                try:
                    src = textwrap.dedent(inspect.getsource(obj))
                except (OSError, TypeError):
                    continue
                if 150 < len(src) < 1400:
                    items.append((info.name, rng.choice(CODE_TASKS).format(x=src)))
    rng.shuffle(items)
    held_out = [p for name, p in items if zlib.crc32(name.encode()) % 10 == 0]
    train = [p for name, p in items if zlib.crc32(name.encode()) % 10 != 0]
    os.makedirs(out_dir, exist_ok=True)
    for name, prompts in (("train_prompts.json", train), ("valid_prompts.json", held_out)):
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(prompts, f)
    return len(train), len(held_out)


def generate(target: str, prompts_path: str, data_path: str, max_tokens: int, batch: int) -> None:
    """The target's greedy answers to the chat prompts of ``prompts_path`` (a JSON list of
    strings), appended to ``data_path`` as JSON lines (resumes after the lines already there)."""
    from jaxserve.engine.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    prompts = json.load(open(prompts_path))
    done = sum(1 for _ in open(data_path)) if os.path.exists(data_path) else 0
    if done >= len(prompts):
        return
    llm = LLM(target, max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=1024)
    tok = llm.get_tokenizer()
    t0, ntok = time.time(), 0
    with open(data_path, "a") as out:
        for i in range(done, len(prompts), batch):
            chunk = [
                tok.encode_chat([{"role": "user", "content": p}])[-700:]
                for p in prompts[i : i + batch]
            ]
            res = llm.generate(
                chunk, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False
            )
            for p, r in zip(chunk, res):
                o = list(r.outputs[0].token_ids)
                ntok += len(o)
                out.write(json.dumps({"prompt": p, "output": o}) + "\n")
            out.flush()
            print(
                f"generated {i + len(chunk)}/{len(prompts)}, {ntok / (time.time() - t0):.0f} tok/s",
                flush=True,
            )


def load_examples(path: str, seq_len: int, answer_len: int) -> list[tuple[np.ndarray, int]]:
    """(ids, index of the first answer token) per line: at most ``answer_len`` answer tokens
    after the prompt's tail, ``seq_len + 1`` tokens in all."""
    rows = []
    for line in open(path):
        r = json.loads(line)
        p, o = r["prompt"], r["output"][:answer_len]
        if not o:
            continue
        ids = (p + o)[-(seq_len + 1) :]
        rows.append((np.asarray(ids, np.int32), max(len(ids) - len(o), 1)))
    return rows


def batches(rows, draft_of: np.ndarray, batch: int, seq_len: int, answer_len: int, rng):
    """Shuffled batches: inputs int32 ``[B, L]``; at ``answer_len`` answer positions per row,
    their indices int32 ``[B, A]``, targets int32 ``[B, A]`` (reduced-head ids) and mask
    float32 ``[B, A]`` (1 on answer tokens the head covers). The head runs at those positions
    only (most of a chat sequence is its prompt)."""
    order = rng.permutation(len(rows))
    for s in range(0, len(order) - batch + 1, batch):
        x = np.zeros((batch, seq_len), np.int32)
        at = np.zeros((batch, answer_len), np.int32)
        y = np.zeros((batch, answer_len), np.int32)
        m = np.zeros((batch, answer_len), np.float32)
        for b, j in enumerate(order[s : s + batch]):
            ids, start = rows[j]
            n = len(ids) - 1
            x[b, :n] = ids[:-1]
            pos = np.arange(start - 1, min(n, start - 1 + answer_len))
            tgt = draft_of[ids[pos + 1]]
            at[b, : len(pos)] = pos
            y[b, : len(pos)] = np.maximum(tgt, 0)
            m[b, : len(pos)] = tgt >= 0
        yield x, at, y, m


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument(
        "--make-prompts",
        default=None,
        metavar="DIR",
        help="write chat prompts from the standard library (train_prompts.json, "
        "valid_prompts.json) into DIR and exit",
    )
    ap.add_argument("--target", help="the target model (directory, .gguf or 'smollm2')")
    ap.add_argument("--data", help="JSON lines of the target's greedy answers")
    ap.add_argument("--generate", default=None, help="a JSON list of chat prompts to answer first")
    ap.add_argument(
        "--valid-lines",
        type=int,
        default=56,
        help="the last N answers of --data are held out: the agreement is measured on them",
    )
    ap.add_argument("--gen-max-tokens", type=int, default=160)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--draft-vocab-size", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=384)
    ap.add_argument("--answer-len", type=int, default=160, help="answer tokens trained per row")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--epochs", type=float, default=12.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--time-budget-s", type=float, default=3600.0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.make_prompts:
        n_train, n_valid = stdlib_prompts(args.make_prompts)
        print(f"{n_train} training and {n_valid} held-out prompts in {args.make_prompts}")
        return
    if not (args.target and args.data and args.out):
        ap.error("--target, --data and --out are required (unless --make-prompts)")
    if args.generate:
        generate(args.target, args.generate, args.data, args.gen_max_tokens, 128)

    from jaxserve.model.loader import load_model
    from jaxserve.model.resolve import resolve_model_path

    t_start = time.time()
    target, arch, _ = load_model(resolve_model_path(args.target), "float32")
    rows = load_examples(args.data, args.seq_len, args.answer_len)
    n_valid = min(max(args.valid_lines, 0), len(rows) // 2)
    rows, valid = rows[: len(rows) - n_valid], rows[len(rows) - n_valid :]
    # The reduced vocabulary: the answers' most frequent tokens (and the target's EOS ids).
    counts = collections.Counter()
    for ids, start in rows:
        counts.update(ids[start:].tolist())
    keep = list(dict.fromkeys(arch.eos_token_ids))  # the EOS ids first, then by frequency
    keep += [t for t, _ in counts.most_common() if t not in keep]
    top = np.sort(np.asarray(keep[: args.draft_vocab_size], np.int64))
    if len(top) < args.draft_vocab_size:  # few distinct tokens: pad with the lowest unused ids
        unused = np.setdiff1d(np.arange(arch.vocab_size), top)[: args.draft_vocab_size - len(top)]
        top = np.sort(np.concatenate([top, unused]))
    draft_of = np.full(arch.vocab_size, -1, np.int32)
    draft_of[top] = np.arange(len(top), dtype=np.int32)
    covered = sum(c for t, c in counts.items() if draft_of[t] >= 0) / max(sum(counts.values()), 1)
    print(
        f"{len(rows)} answers, {sum(counts.values())} answer tokens, {len(counts)} distinct; "
        f"the {len(top)}-token head covers {covered:.1%} of them",
        flush=True,
    )

    cfg = dataclasses.replace(
        arch,
        num_layers=args.num_layers,
        tie_word_embeddings=False,
        draft_vocab_size=len(top),
        layer_sliding_windows=arch.layer_sliding_windows[: args.num_layers],
    )
    draft = LlamaForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    tgt = dict(nnx.to_flat_state(nnx.state(target)))
    embed = tgt[("embed_tokens", "weight")].get_value()
    head_src = tgt.get(("lm_head", "weight"))
    head_src = embed if head_src is None else head_src.get_value()
    for path, var in nnx.to_flat_state(nnx.state(draft)):
        if path == ("lm_head", "weight"):
            var.set_value(jnp.asarray(np.asarray(head_src)[top]))
        elif tuple(path) in tgt:
            var.set_value(tgt[tuple(path)].get_value())
    graphdef, state = nnx.split(draft)
    flat = dict(nnx.to_flat_state(state))
    frozen_keys = [k for k in flat if k[0] == "embed_tokens"]
    train_keys = [k for k in flat if k[0] != "embed_tokens"]
    frozen = {k: flat[k].get_value() for k in frozen_keys}
    params = {k: flat[k].get_value() for k in train_keys}
    print(
        f"draft: {cfg.num_layers} layers, {sum(np.size(v) for v in params.values()):,} trained "
        f"parameters, embedding {np.size(embed):,} frozen",
        flush=True,
    )

    def full_state(params):
        """The draft's state: the trained ``params`` and the frozen embedding."""
        values = {**params, **frozen}
        return nnx.from_flat_state({k: flat[k].replace(values[k]) for k in flat})

    def merged(params):
        return nnx.merge(graphdef, full_state(params))

    def loss_fn(params, x, at, y, m):
        model = merged(params)
        positions = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape)
        h, _ = run_layers(model.layers, model.embed_tokens(x), positions)  # [B, L, e]
        h = jnp.take_along_axis(h, at[..., None], axis=1)  # [B, A, e]: answer positions
        logits = model.compute_logits(model.norm(h))  # [B, A, Vd]
        logz = jax.nn.logsumexp(logits, axis=-1)
        gold = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
        right = (jnp.argmax(logits, -1) == y).astype(jnp.float32)
        n = jnp.maximum(m.sum(), 1.0)
        return ((logz - gold) * m).sum() / n, (right * m).sum() / n

    @jax.jit
    def train_step(params, opt, x, at, y, m, lr):
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, at, y, m)
        params, opt, gnorm = adamw_update(params, grads, opt, lr, weight_decay=0.0)
        return params, opt, loss, acc

    eval_fn = jax.jit(loss_fn)

    def evaluate(params):
        if not valid:
            return None
        tot = acc = 0.0
        for b in batches(
            valid,
            draft_of,
            args.batch_size,
            args.seq_len,
            args.answer_len,
            np.random.default_rng(0),
        ):
            _, a = eval_fn(params, *b)
            tot += 1
            acc += float(a)
        return acc / max(tot, 1)

    opt = adamw_init(params)
    steps_per_epoch = len(rows) // args.batch_size
    total = max(int(args.epochs * steps_per_epoch), 1)
    rng = np.random.default_rng(0)
    log = {"losses": [], "valid_agreement": []}
    a0 = evaluate(params)
    print(f"held-out greedy agreement before training: {a0}", flush=True)
    log["valid_agreement"].append((0, a0))
    step, t0 = 0, time.time()
    while step < total and time.time() - t0 < args.time_budget_s:
        for b in batches(rows, draft_of, args.batch_size, args.seq_len, args.answer_len, rng):
            progress = max(step / total, (time.time() - t0) / args.time_budget_s)
            lr = lr_at(step, progress, args.lr, args.warmup)
            params, opt, loss, acc = train_step(params, opt, *b, jnp.float32(lr))
            step += 1
            if step % 10 == 0:
                print(
                    f"step {step}/{total} loss {float(loss):.3f} agreement {float(acc):.3f} "
                    f"lr {lr:.2e} {time.time() - t0:.0f} s",
                    flush=True,
                )
                log["losses"].append((step, float(loss), float(acc)))
            if step >= total or time.time() - t0 >= args.time_budget_s:
                break
        a = evaluate(params)
        print(f"held-out greedy agreement after {step} steps: {a}", flush=True)
        log["valid_agreement"].append((step, a))

    os.makedirs(args.out, exist_ok=True)
    d2t = (top - np.arange(len(top))).astype(np.int64)
    export_hf(full_state(params), cfg, args.out, extra={"d2t": d2t})
    hf = dict(target_hf_config(args.target))
    hf.update(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        num_hidden_layers=cfg.num_layers,
        tie_word_embeddings=False,
        draft_vocab_size=len(top),
        torch_dtype="float32",
    )
    hf.pop("layer_types", None)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    log.update(
        target=args.target,
        answers=len(rows),
        answer_tokens=sum(counts.values()),
        head_coverage=covered,
        steps=step,
        wall_s=time.time() - t_start,
        args=vars(args),
    )
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    print(f"wrote {args.out}", flush=True)


def target_hf_config(target: str) -> dict:
    """The target's HF config dict (a GGUF file's, as the loader reads it)."""
    from jaxserve.model.arch_config import read_hf_config
    from jaxserve.model.readers.gguf_reader import gguf_hf_config, is_gguf_path, open_gguf
    from jaxserve.model.resolve import resolve_model_path

    path = resolve_model_path(target)
    if is_gguf_path(path):
        return gguf_hf_config(open_gguf(path), path)
    return read_hf_config(path)


if __name__ == "__main__":
    main()
