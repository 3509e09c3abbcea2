"""The ``jaxserve`` console script: one subcommand per entry point, imported only when chosen.

Each subcommand lives in its owner's module as ``add_<name>_parser(subparsers)``, which adds
its parser and sets ``func`` (the function run with the parsed namespace). Only the chosen
subcommand's module is imported, so ``jaxserve --help`` and each command start fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, parser-adding function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": ("jaxserve.entrypoints.openai.api_server", "add_serve_parser",
              "run the OpenAI-compatible HTTP server"),
    "run-batch": ("jaxserve.entrypoints.run_batch", "add_run_batch_parser",
                  "offline inference over a JSONL file in the OpenAI batch format"),
    "bench": ("jaxserve.benchmarks.cli", "add_bench_parser",
              "benchmark a server (bench serve) or the offline engine (bench throughput)"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The top-level parser, with the full parser of the subcommand named in ``argv`` (if any)."""
    parser = argparse.ArgumentParser(prog="jaxserve", description="LLM inference server on JAX/XLA.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, adder, help_text) in COMMANDS.items():
        if name == chosen:
            getattr(importlib.import_module(module), adder)(subparsers)
        else:
            subparsers.add_parser(name, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parses ``argv`` (default: the process arguments) and runs the chosen subcommand."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    sys.exit(args.func(args))  # a command returns its exit code (None: 0)


if __name__ == "__main__":
    main()
