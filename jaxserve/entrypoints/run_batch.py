"""``jaxserve run-batch``: offline inference over a file of requests in the OpenAI batch format.

    jaxserve run-batch -i requests.jsonl -o results.jsonl [MODEL] [engine flags]

Every input line is validated and served by the HTTP server's own code
(``jaxserve.serving.endpoints.OpenAIServing.serve_request``: the same validation, engine calls
and response bodies), without HTTP. All requests are handed to one engine at once, so continuous batching keeps the device
full; each record is written and flushed as its request finishes (completion order). The file
format, the rule for failed lines and how a rerun resumes are in
:mod:`jaxserve.entrypoints.batch_io` (vLLM's ``run_batch`` and the OpenAI Batch API).

Exit codes:
  0  every input line has a successful record (status 200) in the output
  1  the engine died (records of unfinished requests are not written; rerun to resume them)
  2  usage error: a bad flag, a missing input file, an output file that is locked or is not
     a batch output file, a bad engine argument (argparse's code)
  3  the run completed but some lines failed (their records carry the error)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxserve.engine.protocol import EngineClient, EngineDeadError
from jaxserve.entrypoints.batch_io import (
    BatchLine,
    LineError,
    OutputFile,
    ResumeState,
    error_record,
    parse_input,
    response_record,
)
from jaxserve.serving.endpoints import OpenAIServing
from jaxserve.serving.errors import error_body

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ENGINE_DEAD = 1
EXIT_USAGE = 2
EXIT_SOME_FAILED = 3

_EPILOG = """exit codes: 0 all lines succeeded; 1 the engine died (rerun to resume); 2 usage error;
3 some lines failed (their records carry the error).
Rerunning with an existing output file skips the lines it already holds records for."""


@dataclasses.dataclass
class BatchStats:
    """Counts of one run.

    Attributes:
      num_ok: records written with status 200.
      num_failed: records written with an error (a 4xx/5xx response or a line that could not run).
      num_skipped: lines skipped because the output already held their records.
      num_skipped_failed: of those, records that had failed.
      num_prompt_tokens, num_output_tokens: over this run's successful requests.
      startup_s: seconds to build the engine (load, KV sizing, compile); 0 if none was built.
      run_s: seconds from queueing the first request to the last record.
    """

    num_ok: int = 0
    num_failed: int = 0
    num_skipped: int = 0
    num_skipped_failed: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    startup_s: float = 0.0
    run_s: float = 0.0

    @property
    def all_succeeded(self) -> bool:
        """True when no line, of this run or an earlier one, failed."""
        return self.num_failed == 0 and self.num_skipped_failed == 0

    def summary(self, output: str) -> str:
        """A one-paragraph report for stderr."""
        rate = self.num_output_tokens / self.run_s if self.run_s > 0 else 0.0
        text = (
            f"run-batch: {self.num_ok} succeeded, {self.num_failed} failed; "
            f"prompt tokens {self.num_prompt_tokens}, output tokens {self.num_output_tokens}; "
            f"{self.run_s:.1f} s ({rate:.1f} output tok/s)"
        )
        if self.startup_s:
            text += f" after {self.startup_s:.1f} s engine start-up"
        if self.num_skipped:
            text += (
                f"; {self.num_skipped} lines skipped, already in {output} "
                f"({self.num_skipped_failed} of them failed)"
            )
        return text


# ---- the async part: serve every line through the serving layer -------------------------------------


async def run_batch(
    llm: EngineClient,
    lines: Sequence[BatchLine],
    write: Callable[[dict[str, Any]], None],
    *,
    stats: BatchStats | None = None,
    progress: bool = True,
    include_ledger: bool = False,
) -> BatchStats:
    """Serves ``lines`` on ``llm`` concurrently and writes one record per line as each finishes.

    Args:
      llm: a running AsyncLLM.
      lines: the requests to run (all are queued at once, in this order).
      write: called with each output record (``batch_io.response_record``), in completion order.
      stats: counts to add to (default: new ones).
      progress: show a tqdm bar on stderr (requests done, output tokens/s, ETA).
      include_ledger: put each request's ledger in its response body (``"ledger"``), as if
        every line asked with ``"include_ledger": true`` (a line may also ask by itself).

    Returns:
      The updated counts (``run_s`` is this call's wall time).

    Raises:
      EngineDeadError: the engine died; the records of requests it had not finished are not
        written (a rerun resumes them).
    """
    from jaxserve.logging_config import progress_bar_class

    tqdm = progress_bar_class()

    stats = stats or BatchStats()
    serving = OpenAIServing(llm)
    start = time.perf_counter()

    async def serve(item: BatchLine) -> tuple[BatchLine, int, dict[str, Any]]:
        try:
            request_body = {**item.body, "include_ledger": True} if include_ledger else item.body
            status, body = await serving.serve_request(item.url, request_body)
        except Exception:  # noqa: BLE001 - a bug of ours; the server answers it with a 500 too
            logger.exception(
                "internal error serving line %d (custom_id %r)", item.line, item.custom_id
            )
            status, body = (
                500,
                error_body("internal server error", "server_error", code="internal_error"),
            )
        return item, status, body

    bar = tqdm(
        total=len(lines),
        desc="run-batch",
        unit="req",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    )
    tasks = [asyncio.ensure_future(serve(item)) for item in lines]
    try:
        for next_done in asyncio.as_completed(tasks):
            item, status, body = await next_done
            if status >= 500 and llm.errored:
                raise EngineDeadError(f"the engine died: {llm.dead_error!r}")
            write(response_record(item.custom_id, status, body))
            if status == 200:
                stats.num_ok += 1
                stats.num_prompt_tokens += body["usage"]["prompt_tokens"]
                stats.num_output_tokens += body["usage"].get("completion_tokens", 0)  # 0: pooling
            else:
                stats.num_failed += 1
            elapsed = time.perf_counter() - start
            bar.set_postfix_str(
                f"{stats.num_output_tokens / max(elapsed, 1e-9):.1f} out tok/s, "
                f"{stats.num_failed} failed",
                refresh=False,
            )
            bar.update(1)
    finally:
        for task in tasks:
            task.cancel()  # unfinished requests are aborted in the engine (engine_calls.collect_all)
        await asyncio.gather(*tasks, return_exceptions=True)
        bar.close()
        stats.run_s += time.perf_counter() - start
    return stats


# ---- the command ---------------------------------------------------------------------------------


def _input_path(value: str) -> str:
    if value != "-" and not os.path.exists(value):
        raise argparse.ArgumentTypeError(f"no such file: {value!r}")
    if os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"{value!r} is a directory")
    return value


def _output_path(value: str) -> str:
    if value == "-":
        return value
    if os.path.exists(value) and not os.path.isfile(value):
        # Resuming reads the file back and appends under a lock: a regular file only.
        raise argparse.ArgumentTypeError(f"{value!r} is not a regular file (use '-' for stdout)")
    parent = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"the directory of {value!r} does not exist")
    return value


def _non_negative(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return number


def add_run_batch_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds ``run-batch``: -i/-o, --fsync-interval-s, --progress, and every EngineArgs flag."""
    from jaxserve.config import EngineArgs

    parser = subparsers.add_parser(
        "run-batch",
        help="offline inference over a JSONL file in the OpenAI batch format",
        description="Run every request of a JSON Lines file in the OpenAI batch format\n"
        "(/v1/completions, /v1/chat/completions) through one engine and write one\n"
        "output record per line, in completion order.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-i",
        "--input-file",
        required=True,
        type=_input_path,
        help="requests, one JSON object per line ('-': stdin)",
    )
    parser.add_argument(
        "-o",
        "--output-file",
        required=True,
        type=_output_path,
        help="results, appended one record per line as requests finish; an existing file "
        "is resumed ('-': stdout, no resume)",
    )
    parser.add_argument(
        "--fsync-interval-s",
        type=_non_negative,
        default=1.0,
        help="fsync the output file at most this often, seconds (0: after every record)",
    )
    parser.add_argument(
        "--include-ledger",
        action="store_true",
        help="write each request's ledger (steps, prefix hits, preemptions) into its record",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="show a progress bar on stderr",
    )
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run_batch_main)
    return parser


def _usage_error(message: str) -> int:
    print(f"jaxserve run-batch: error: {message}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def _read_input(path: str) -> bytes:
    if path == "-":
        return sys.stdin.buffer.read()
    with open(path, "rb") as f:
        return f.read()


def run_batch_main(args: argparse.Namespace, llm: EngineClient | None = None) -> int:
    """The ``run-batch`` command.

    Args:
      args: the parsed ``run-batch`` namespace.
      llm: a running AsyncLLM to use instead of building one from the engine flags (it is left
        running); for tests and embedding.

    Returns:
      The exit code (see the module docstring): 0, 1, 2 or 3.
    """
    from jaxserve.config import EngineArgs
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.logging_config import configure_logging

    configure_logging()  # a no-op after `jaxserve`'s main did it; tests call run() directly
    if (
        "-" not in (args.input_file, args.output_file)
        and os.path.exists(args.output_file)
        and os.path.samefile(args.input_file, args.output_file)
    ):
        return _usage_error("the input and output files are the same file")
    try:
        items = parse_input(_read_input(args.input_file).split(b"\n"))
        output, resume = OutputFile.open(args.output_file, fsync_interval_s=args.fsync_interval_s)
    except (OSError, ValueError) as exc:
        return _usage_error(str(exc))
    stats = BatchStats()
    code = EXIT_OK
    with output:
        todo = _write_line_errors(items, resume, output, stats)
        if todo:
            own_engine = llm is None
            if own_engine:
                start = time.perf_counter()
                try:
                    engine_args = EngineArgs.from_cli_args(args)
                    engine_args.check(need_tokenizer=True)  # text prompts; fails in a second
                    llm = AsyncLLM.from_engine_args(engine_args)
                except ValueError as exc:
                    return _usage_error(str(exc))
                stats.startup_s = time.perf_counter() - start
            try:
                asyncio.run(
                    run_batch(
                        llm,
                        todo,
                        output.write,
                        stats=stats,
                        progress=args.progress,
                        include_ledger=args.include_ledger,
                    )
                )
            except EngineDeadError as exc:
                print(
                    f"jaxserve run-batch: {exc}; rerun with the same output file to resume the "
                    f"unfinished requests",
                    file=sys.stderr,
                    flush=True,
                )
                code = EXIT_ENGINE_DEAD
            finally:
                if own_engine:
                    llm.shutdown()
    print(stats.summary(args.output_file), file=sys.stderr, flush=True)
    if code == EXIT_OK and not stats.all_succeeded:
        code = EXIT_SOME_FAILED
    return code


def _write_line_errors(
    items: Sequence[BatchLine | LineError],
    resume: ResumeState,
    output: OutputFile,
    stats: BatchStats,
) -> list[BatchLine]:
    """Skips what ``resume`` holds, writes the records of lines that cannot run, returns the rest."""
    todo: list[BatchLine] = []
    for item in items:
        if resume.is_done(item):
            stats.num_skipped += 1
            stats.num_skipped_failed += not resume.succeeded(item)
        elif isinstance(item, LineError):
            output.write(error_record(item))
            stats.num_failed += 1
        else:
            todo.append(item)
    return todo
