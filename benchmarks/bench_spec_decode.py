"""Speculative decoding, on vs off in one interleaved run: output tok/s and acceptance.

Three workloads, each run ``--rounds`` times alternating speculation off / on (fresh engines on
one runner: the same compiled executables and KV pool, an empty prefix cache each run), greedy,
``ignore_eos``:

* ``ngram-copy``, batch 1 (one request at a time): input-copying requests, the n-gram proposer
  (``--ngram-k`` drafts, lookup 1..``--ngram-max``). With a chat model (``--model smollm2``, the
  demo model) they are chat turns whose answer repeats much of the prompt ("copy this
  paragraph", "rename this function and output the whole code", "repeat this list");
  ``--copy-prompts text`` sends plain text instead (for a base model such as the bundled one,
  which does not follow instructions: its greedy text falls into loops the proposer finds);
* ``draft``, batch 1: held-out corpus text (``--corpus``'s ``valid.txt``, documents' first
  sentences) or, without it, fixed text prompts, the draft model (``--draft``) with K =
  ``--draft-k``;
* ``concurrent``, ``--concurrent`` requests at once (the draft workload's prompts, cycled),
  each method with its ``disable_by_batch_size`` (``--disable-by-batch-size``): above it
  speculation is off and costs nothing.

Per workload it prints each run, the median output tok/s of each mode, their ratio (on / off),
the mean acceptance length (1 + accepted / drafts: tokens a speculating request gains per step)
and the acceptance rate; the last line is a JSON summary (``--json-out`` too).

CPU, the bundled model and its draft:
  .venv/bin/python benchmarks/bench_spec_decode.py --rounds 3

GPU at Llama-3.1-8B shapes with a Llama-3.2-1B-shaped draft (dummy weights: the drafts are
rejected, so this measures what a step with K drafts costs, not a speed-up; with real weights
pass the directories):
  python benchmarks/bench_spec_decode.py --model llama-3.1-8b --draft llama-3.2-1b \\
      --load-format dummy --dtype bfloat16 --rounds 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxserve.config import EngineArgs, SpeculativeConfig  # noqa: E402

COPY_TASKS = (
    "Copy this sentence word for word: The quick brown fox jumps over the lazy dog while the "
    "cat watches from the old wooden fence near the river bank, and the farmer walks slowly "
    "home with his two tired horses.",
    "Copy this paragraph exactly:\nThe train left the station at seven in the morning. It was "
    "full of people going to work in the city. Some of them read newspapers, some of them "
    "slept, and a few of them looked out of the window at the green fields and the small "
    "villages that passed by.",
    "Output this code exactly as it is:\n```python\ndef area(width, height):\n    return "
    "width * height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n```",
    "Rename the function `area` to `rect_area` in this code and output the whole code:\n"
    "```python\ndef area(width, height):\n    return width * height\n\n\nprint(area(3, 4))\n"
    "print(area(5, 6))\n```",
    "Repeat this list: red, orange, yellow, green, blue, indigo, violet, black, white, grey, "
    "brown, pink.",
    "Copy this text exactly: In the beginning God created the heaven and the earth. And the "
    "earth was without form, and void; and darkness was upon the face of the deep.",
)
"""Chat turns whose answer repeats much of the prompt (the ``ngram-copy`` workload)."""

COPY_PROMPTS = (
    "apples, pears, plums, figs, dates, limes, grapes, lemons, melons, cherries, peaches, "
    "oranges.\napples, pears, plums, figs, dates, limes, grapes, lemons, melons, cherries, "
    "peaches, oranges.\napples, pears,",
    "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n\n\n"
    "def area(w, h):\n    return w * h\n\n\ndef",
    "And God said, Let there be light: and there was light. And God saw the light, that it "
    "was good.\nAnd God said, Let there be light: and there was",
    "one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve.\none, two, "
    "three, four, five, six, seven, eight, nine, ten,",
    "The old man went to the market and bought bread, cheese and wine. The old man went to "
    "the market and bought",
    "for i in range(10):\n    total = total + values[i]\n    count = count + 1\nfor i in "
    "range(10):\n    total =",
)
TEXT_PROMPTS = (
    "Once upon a time",
    "The king said unto them",
    "It was a dark and stormy night",
    "My father gave me",
    "In the beginning",
    "He who knows",
    "The master of the school",
    "A wise man",
)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    EngineArgs.add_cli_args(ap, positional_model=False)
    ap.add_argument(
        "--draft", default=None, help="draft model (default: the bundled model's draft)"
    )
    ap.add_argument("--draft-k", type=int, default=4)
    ap.add_argument(
        "--copy-prompts",
        choices=["chat", "text"],
        default=None,
        help="ngram-copy requests: chat copy tasks (default unless the model is the bundled "
        "one) or plain text prompts",
    )
    ap.add_argument("--ngram-k", type=int, default=4)
    ap.add_argument("--ngram-max", type=int, default=3)
    ap.add_argument("--corpus", default="data/corpus", help="held-out text for the draft prompts")
    ap.add_argument(
        "--draft-prompts",
        default=None,
        help="a JSON list of chat turns for the draft and concurrent workloads instead of the "
        "corpus text (chat-templated with the target's tokenizer; answers end at their end of "
        "turn), e.g. the held-out prompts of a draft distilled with scripts/train_draft.py",
    )
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=6, help="batch-1 requests per run")
    ap.add_argument("--concurrent", type=int, default=64)
    ap.add_argument("--disable-by-batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="off/on pairs per workload")
    ap.add_argument(
        "--workloads", default="ngram-copy,draft,concurrent", help="comma-separated subset"
    )
    ap.add_argument("--json-out", default="")
    ap.add_argument(
        "--serial-baseline",
        action="store_true",
        help="batch-1 workloads: a third run per round, speculation on without the early "
        "update of the step in flight (as before it), and the on / serial ratios",
    )
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="print each run's time per output token (engine steps, scheduler, runner host, "
        "device wait, output) and the load average",
    )
    args = ap.parse_args(argv)
    from jaxserve.model import default_model_path

    bundled = args.model is None or os.path.abspath(args.model) == str(default_model_path())
    if args.draft is None and bundled:
        args.draft = str(default_model_path()) + "-draft"
    if args.copy_prompts is None:
        args.copy_prompts = "text" if bundled else "chat"
    return args


def corpus_prompts(path: str, n: int) -> list[str]:
    """The first sentence (up to 120 characters) of the first ``n`` held-out documents."""
    file = os.path.join(path, "valid.txt")
    if not os.path.isfile(file):
        return list(TEXT_PROMPTS[:n])
    with open(file, encoding="utf-8") as f:
        docs = [d.strip() for d in f.read().split("\n\n") if len(d.strip()) > 40]
    out = []
    for doc in docs[:n]:
        cut = min((doc.find(c) for c in ".;:\n" if 0 < doc.find(c) < 120), default=80)
        out.append(doc[: max(cut, 20)])
    return out


class Bench:
    """One runner (with the draft attached) and fresh engines on it, per mode."""

    def __init__(self, args: argparse.Namespace, with_draft: bool) -> None:
        from jaxserve.engine.llm_engine import LLMEngine

        self.args = args
        if with_draft:
            spec = {
                "method": "draft_model",
                "model": args.draft,
                "num_speculative_tokens": args.draft_k,
            }
        else:  # the runner compiles the speculative step functions for K
            spec = {"method": "ngram", "num_speculative_tokens": args.ngram_k}
        t0 = time.perf_counter()
        base = LLMEngine.from_engine_args(
            dataclasses.replace(EngineArgs.from_cli_args(args), speculative_config=json.dumps(spec))
        )
        self.startup_s = time.perf_counter() - t0
        self.base = base
        self.runner = base.runner
        self.draft = self.runner.draft

    def engine(self, spec: SpeculativeConfig | None, serial: bool = False):
        """A fresh engine (empty prefix cache) with ``spec`` on the shared runner; ``serial``:
        without the early update of the step in flight (``LLMEngine.step``), as before it: a
        speculating request's next step is dispatched one engine step after an empty one."""
        from jaxserve.engine.llm_engine import LLMEngine

        b, runner = self.base, self.runner
        runner.reset_requests()
        runner.set_speculative_config(spec)
        runner.draft = self.draft if spec is not None and spec.method == "draft_model" else None
        config = dataclasses.replace(b.config, speculative=spec)
        engine = LLMEngine(config, runner, b.arch, b.tokenizer, b.generation_config)
        if serial:
            engine.scheduler.waits_for_in_flight = lambda: False
        return engine

    def run(
        self,
        spec: SpeculativeConfig | None,
        prompts: list,
        concurrent: int,
        ignore_eos: bool,
        serial: bool = False,
    ) -> dict:
        """Generates ``output_len`` tokens for each prompt, ``concurrent`` at a time; returns
        output tok/s and the speculative decoding counters."""
        from jaxserve.sampling_params import SamplingParams

        engine = self.engine(spec, serial)
        params = SamplingParams(
            temperature=0.0, max_tokens=self.args.output_len, ignore_eos=ignore_eos
        )
        queue = list(enumerate(prompts))
        outputs = {}
        device_steps0 = self.runner.timing.num_steps
        idle0 = (self.runner.timing.idle_s, self.runner.timing.num_idle_gaps)
        t0 = time.perf_counter()
        running = 0
        while queue or engine.has_unfinished_requests():
            while queue and running < concurrent:
                i, prompt = queue.pop(0)
                engine.add_request(str(i), prompt, params, final_only=True)
                running += 1
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
                    running -= 1
        seconds = time.perf_counter() - t0
        st = engine.get_stats()
        tokens = sum(len(t) for t in outputs.values())
        steps = st.num_steps_total
        timing = self.runner.timing
        device_steps = timing.num_steps - device_steps0
        idle_s, gaps = timing.idle_s - idle0[0], timing.num_idle_gaps - idle0[1]
        drafts = st.spec_decode_num_drafts_total
        accepted = st.spec_decode_num_accepted_tokens_total
        return {
            "tok_s": tokens / seconds,
            "steps": steps,
            "seconds": seconds,
            "tokens": tokens,
            "drafts": drafts,
            "draft_tokens": st.spec_decode_num_draft_tokens_total,
            "accepted": accepted,
            "acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_rate": accepted / st.spec_decode_num_draft_tokens_total if drafts else None,
            # drafts whose every position was accepted (the last position's count / drafts)
            "all_accepted": (
                st.spec_decode_num_accepted_tokens_per_pos_total[-1] / drafts if drafts else None
            ),
            "outputs": outputs,
            # where the time went (engine stats): engine steps and dispatched (device) steps
            # per output token; seconds in the scheduler, the runner's host work, waiting for
            # the device, and the output path (update, detokenize)
            "device_steps": device_steps,
            "schedule_s": st.schedule_s,
            "runner_host_s": st.runner_host_s,
            "runner_device_s": st.runner_device_s,
            "output_s": st.output_s,
            "idle_s": idle_s,  # device without a step (StepTiming.idle_s)
            "idle_gaps": gaps,
        }


def copy_prompts(bench: Bench, args: argparse.Namespace) -> list:
    """The ``ngram-copy`` requests, ``--num-prompts`` of them (cycled): ``COPY_TASKS`` as chat
    turns (token ids, chat-templated with the target's tokenizer) or ``COPY_PROMPTS`` as text,
    by ``--copy-prompts``."""
    if args.copy_prompts == "chat":
        tok = bench.base.tokenizer
        tasks = [tok.encode_chat([{"role": "user", "content": t}]) for t in COPY_TASKS]
    else:
        tasks = list(COPY_PROMPTS)
    return [tasks[i % len(tasks)] for i in range(args.num_prompts)]


def breakdown(res: dict) -> str:
    """One run's time per output token: engine steps, device steps, and ms in the scheduler,
    the runner's host work, the wait for the device and the output path."""
    n = max(res["tokens"], 1)
    ms = {k: 1e3 * res[k] / n for k in ("schedule_s", "runner_host_s", "runner_device_s")}
    return (
        f"per output token: {res['steps'] / n:.2f} engine steps, "
        f"{res['device_steps'] / n:.2f} device steps; ms schedule {ms['schedule_s']:.2f}, "
        f"runner host {ms['runner_host_s']:.2f}, device wait {ms['runner_device_s']:.2f}, "
        f"output {1e3 * res['output_s'] / n:.2f}, wall {1e3 * res['seconds'] / n:.2f}; "
        f"device idle {1e3 * res['idle_s'] / max(res['device_steps'], 1):.2f} ms per device step "
        f"({res['idle_gaps']} gaps); load {os.getloadavg()[0]:.1f}"
    )


def compare(
    bench: Bench, name: str, spec, prompts: list, concurrent: int, ignore_eos: bool = True
) -> dict:
    """``--rounds`` interleaved off/on runs of one workload; prints and returns the figures."""
    # the serial baseline at batch 1 only (above disable_by_batch_size nothing speculates)
    serial_too = bench.args.serial_baseline and concurrent == 1
    modes = ("off", "on", "serial") if serial_too else ("off", "on")
    runs = {mode: [] for mode in modes}
    for r in range(bench.args.rounds):
        for mode in modes:
            res = bench.run(
                None if mode == "off" else spec, prompts, concurrent, ignore_eos, mode == "serial"
            )
            runs[mode].append(res)
            extra = ""
            if mode != "off" and res["drafts"]:
                extra = (
                    f", acceptance length {res['acceptance_length']:.2f}, "
                    f"rate {100 * res['acceptance_rate']:.0f}%, all {spec.num_speculative_tokens} "
                    f"accepted in {100 * res['all_accepted']:.0f}% of drafts"
                )
            print(
                f"{name} round {r + 1} {mode:3s}: {res['tok_s']:8.1f} tok/s "
                f"({res['tokens']} tokens in {res['seconds']:.2f} s){extra}",
                flush=True,
            )
            if bench.args.breakdown:
                print("    " + breakdown(res), flush=True)
    off = statistics.median(x["tok_s"] for x in runs["off"])
    on = statistics.median(x["tok_s"] for x in runs["on"])
    serial = None

    def idle(res: dict) -> float:
        return res["idle_s"] / max(res["device_steps"], 1)

    if "serial" in runs:  # per round, as ratios: robust to the box's load drifting
        ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(runs["on"], runs["serial"])]
        serial = statistics.median(x["tok_s"] for x in runs["serial"])
        print(
            f"{name}: on / serial per round "
            + ", ".join(f"{x:.2f}" for x in ratios)
            + f"; median {statistics.median(ratios):.2f}x; serial / off per round "
            + ", ".join(
                f"{a['tok_s'] / b['tok_s']:.2f}" for a, b in zip(runs["serial"], runs["off"])
            )
            + "; device idle per device step, on / serial per round "
            + ", ".join(
                f"{idle(a) / max(idle(b), 1e-9):.2f}" for a, b in zip(runs["on"], runs["serial"])
            ),
            flush=True,
        )
    same = all(a["outputs"] == b["outputs"] for a, b in zip(runs["off"], runs["on"]))
    on_runs = [x for x in runs["on"] if x["drafts"]]
    length = statistics.median(x["acceptance_length"] for x in on_runs) if on_runs else None
    rate = statistics.median(x["acceptance_rate"] for x in on_runs) if on_runs else None
    summary = {
        "workload": name,
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "disable_by_batch_size": spec.disable_by_batch_size,
        "concurrent": concurrent,
        "prompts": len(prompts),
        "off_tok_s": round(off, 2),
        "on_tok_s": round(on, 2),
        "speedup": round(on / off, 3),
        "serial_tok_s": None if serial is None else round(serial, 2),
        "acceptance_length": None if length is None else round(length, 3),
        "acceptance_rate": None if rate is None else round(rate, 3),
        "identical_outputs": same,
    }
    print(
        f"{name}: off {off:.1f} tok/s, on {on:.1f} tok/s, speed-up {on / off:.2f}x, "
        f"mean acceptance length {'n/a' if length is None else f'{length:.2f}'}, "
        f"outputs identical: {same}",
        flush=True,
    )
    return summary


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import jax

    chosen = set(args.workloads.split(","))
    with_draft = bool(chosen & {"draft", "concurrent"})
    if with_draft and args.draft is None:
        raise SystemExit("--draft: the draft and concurrent workloads need a draft model")
    bench = Bench(args, with_draft)
    runner = bench.runner
    print(
        f"device: {jax.devices()[0].device_kind}, model {bench.base.config.model.model}, "
        f"attention {runner.backend}, dtype {runner.dtype.name}, start-up "
        f"{bench.startup_s:.1f} s"
        + (f", draft {args.draft} ({runner.draft.arch.num_layers} layers)" if with_draft else ""),
        flush=True,
    )
    ngram = SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=args.ngram_k,
        prompt_lookup_max=args.ngram_max,
        prompt_lookup_min=1,
    )
    draft = (  # None: no draft model for this target (n-gram workloads only)
        SpeculativeConfig(
            method="draft_model", model=args.draft, num_speculative_tokens=args.draft_k
        )
        if args.draft
        else None
    )
    text = corpus_prompts(args.corpus, max(args.num_prompts, 8))
    if bench.base.tokenizer is None:  # dummy weights of a preset: token-id prompts
        import numpy as np

        rng = np.random.default_rng(0)
        vocab = bench.base.vocab_size
        text = [rng.integers(3, vocab, size=24).tolist() for _ in text]

    def chat(turns) -> list[list[int]]:  # one user turn each, chat-templated
        return [bench.base.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in turns]

    draft_eos = False
    if args.draft_prompts:
        with open(args.draft_prompts, encoding="utf-8") as f:
            text = chat(json.load(f))
        draft_eos = True
    copy = copy_prompts(bench, args)
    results = []
    if "ngram-copy" in chosen:
        # a chat answer ends at its end of turn
        results.append(
            compare(bench, "ngram-copy", ngram, copy, 1, ignore_eos=args.copy_prompts == "text")
        )
    if "draft" in chosen:
        prompts = text[: args.num_prompts]
        results.append(compare(bench, "draft", draft, prompts, 1, ignore_eos=not draft_eos))
    if "concurrent" in chosen:
        many = [text[i % len(text)] for i in range(args.concurrent)]
        for spec in (ngram, draft) if draft is not None else (ngram,):
            spec = dataclasses.replace(spec, disable_by_batch_size=args.disable_by_batch_size)
            results.append(
                compare(
                    bench,
                    f"concurrent-{spec.method}",
                    spec,
                    many,
                    args.concurrent,
                    ignore_eos=not draft_eos,
                )
            )
    print(json.dumps(results))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
