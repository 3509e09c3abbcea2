"""``jaxserve serve``'s signal handling and exit codes over the FakeEngine, as a subprocess.

    python fake_serve.py [--hang-at-step N] [--step-s S] [serve flags ...]

Prints ``serving ... on http://host:port`` once listening (like ``jaxserve serve``), then runs
``api_server.serve_until_signal`` and exits with its code.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from fake_engine import FakeEngine  # noqa: E402
from server_harness import MODEL_DIR  # noqa: E402

from jaxserve.engine.async_llm import AsyncLLM  # noqa: E402
from jaxserve.entrypoints.http.api_server import serve_until_signal  # noqa: E402
from jaxserve.entrypoints.serve import add_serve_parser  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    serve = add_serve_parser(sub)
    serve.add_argument("--hang-at-step", type=int, default=None)
    serve.add_argument("--step-s", type=float, default=0.01)
    args = parser.parse_args(["serve", *sys.argv[1:]])
    engine = FakeEngine(MODEL_DIR, step_s=args.step_s, hang_at_step=args.hang_at_step)
    llm = AsyncLLM(engine, step_timeout_s=args.step_timeout_s)
    return serve_until_signal(llm, args)


if __name__ == "__main__":
    sys.exit(main())
