"""The ``jaxserve`` console script: one subcommand per entry point, imported only when chosen.

Each subcommand lives in its owner's module as ``add_<name>_parser(subparsers)``, which adds
its parser and sets ``func`` (the function run with the parsed namespace). Only the chosen
subcommand's module is imported, so ``jaxserve --help`` and each command start fast.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import signal
import sys
from typing import Any

from jaxserve.logging_config import configure_logging

# name -> (module, parser-adding function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": (
        "jaxserve.entrypoints.serve",
        "add_serve_parser",
        "run the OpenAI-compatible HTTP server",
    ),
    "run-batch": (
        "jaxserve.entrypoints.run_batch",
        "add_run_batch_parser",
        "offline inference over a JSONL file in the OpenAI batch format",
    ),
    "bench": (
        "jaxserve.bench.commands",
        "add_bench_parser",
        "benchmark a server (bench serve) or the offline engine (bench throughput)",
    ),
    "tune": (
        "jaxserve.tune.grid",
        "add_tune_parser",
        "predict latency / throughput per scheduler setting for a workload and recommend one",
    ),
    "doctor": (
        "jaxserve.doctor",
        "add_doctor_parser",
        "run the five pre-production checks (load, dashboard, preemptions, prefix caching, "
        "long prompts) against a live server",
    ),
    "plan": (
        "jaxserve.plan",
        "add_plan_parser",
        "will a model fit: weights, activations, KV blocks and concurrent sequences per device, "
        "from its config alone",
    ),
    "generate": (
        "jaxserve.generate",
        "add_generate_parser",
        "text continuation of one prompt through the engine (as LLM.generate)",
    ),
    "convert": (
        "jaxserve.model.checkpoint",
        "add_convert_parser",
        "convert a Hugging Face model directory or a .gguf file to our orbax layout",
    ),
}


class Parser(argparse.ArgumentParser):
    """argparse with two changes for every ``jaxserve`` parser (subcommands build theirs with
    ``subparsers.add_parser``, which makes this class again):

    - no abbreviations (``allow_abbrev=False``): ``--max-num-seq 4`` is not silently taken as
      ``--max-num-seqs``;
    - a command without subcommands of its own reports what it does not recognise itself, with
      its own usage and the closest flag it has ("did you mean --max-num-seqs?"), where argparse
      would print the top-level usage and suggest nothing.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(
        self, args: Any = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and not self._subparsers:
            self.error(self.unrecognized_message(extras))
        return namespace, extras

    def unrecognized_message(self, extras: list[str]) -> str:
        """argparse's "unrecognized arguments" line plus the closest flag to the first unknown
        one (``difflib``), when there is one."""
        message = f"unrecognized arguments: {' '.join(extras)}"
        unknown = next((a.split("=", 1)[0] for a in extras if a.startswith("--")), None)
        if unknown is not None:
            flags = [f for f in self._option_string_actions if f.startswith("--")]
            close = difflib.get_close_matches(unknown, flags, n=1, cutoff=0.75)
            if close:
                message += f" (did you mean {close[0]}?)"
        return message


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The top-level parser, with the full parser of the subcommand named in ``argv`` (if any)."""
    parser = Parser(prog="jaxserve", description="LLM inference server on JAX/XLA.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, adder, help_text) in COMMANDS.items():
        if name == chosen:
            getattr(importlib.import_module(module), adder)(subparsers)
        else:
            subparsers.add_parser(name, help=help_text)
    return parser


def _exit_on_ctrl_c(command: str) -> None:
    """Ctrl-C (SIGINT) exits at once with one line and code 130. A KeyboardInterrupt would
    not do: raised inside a garbage-collector callback of jax it is printed and swallowed, and
    loading or warm-up goes on. ``serve`` installs its own handler once it serves."""

    def interrupted(signum, frame) -> None:
        print(f"jaxserve {command}: interrupted", file=sys.stderr, flush=True)
        os._exit(130)

    signal.signal(signal.SIGINT, interrupted)


def main(argv: list[str] | None = None) -> None:
    """Parses ``argv`` (default: the process arguments) and runs the chosen subcommand.

    Bad user input that a command reports as ``ValueError`` (a missing model directory, an
    out-of-range flag; the message names the field) becomes a one-line message on standard
    error and exit code 2, argparse's code for usage errors, instead of a traceback; Ctrl-C
    before serving (loading, warm-up) exits 130 with one line.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    configure_logging()
    if args.command != "run-batch":  # run-batch unwinds (KeyboardInterrupt): its output closes
        _exit_on_ctrl_c(args.command)
    try:
        code = args.func(args)  # a command returns its exit code (None: 0)
    except ValueError as e:
        print(f"jaxserve {args.command}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # run-batch's Ctrl-C
        print(f"jaxserve {args.command}: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code)


if __name__ == "__main__":
    main()
