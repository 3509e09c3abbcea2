"""The ``jaxserve`` console script: one subcommand per entry point, imported only when chosen.

Each subcommand lives in its owner's module as ``add_<name>_parser(subparsers)``, which adds
its parser and sets ``func`` (the function run with the parsed namespace). Only the chosen
subcommand's module is imported, so ``jaxserve --help`` and each command start fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

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


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The top-level parser, with the full parser of the subcommand named in ``argv`` (if any)."""
    parser = argparse.ArgumentParser(
        prog="jaxserve", description="LLM inference server on JAX/XLA."
    )
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
