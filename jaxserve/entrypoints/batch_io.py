"""The batch file format (OpenAI Batch API): input lines, output records, and resuming a run.

Input (OpenAI "batch request input"): JSON Lines, one request per line,

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

Blank lines are ignored; line numbers count every physical line from 1. ``method`` may be left
out (it can only be "POST").

Output (OpenAI "batch request output"): one record per non-blank input line, in completion order,

    {"id": "batch_req_<hex>", "custom_id": "req-1",
     "response": {"status_code": 200, "request_id": "chatcmpl-<hex>", "body": {...}}, "error": null}

The rule for failures, OpenAI's: a request that reached the server's handling has an HTTP status,
so it gets a ``response`` whose ``body`` is exactly what the server sends, the
``{"error": {"message", "type", "param", "code"}}`` body for a 4xx (bad parameters, a prompt over
max_model_len, ``stream: true``, an unknown model). A line that could not be made into a request
at all (malformed JSON, no usable ``custom_id``, a duplicate ``custom_id``, a method other than
POST, a URL not in :data:`SUPPORTED_URLS`, a ``body`` that is not an
object) gets ``"response": null`` and ``"error": {"code", "message", "line"}``: OpenAI's
``BatchRequestOutputError`` plus the input ``line`` number, as in the Batch object's
``errors.data[]``. A malformed line's ``custom_id`` is null.

Resume: every record is written with one ``write()`` of its bytes and newline on a file opened
with ``O_APPEND``, so a killed run (even SIGKILL) leaves complete records plus at most one torn
last line. :meth:`OutputFile.open` takes an exclusive ``flock`` on the file (a second run on the
same file is refused), truncates a torn last line away and reads the records back: a
``response`` record marks its ``custom_id`` done, an ``error`` record marks its input line done.
Rerunning with the same input and output therefore runs each remaining line once; failed records
count as done too (delete them from the file to retry them). ``fsync`` runs at most every
``fsync_interval_s`` and on close: a SIGKILL loses nothing already written (the kernel has it),
an OS crash at most the last interval.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Iterable
from typing import Any, BinaryIO

from jaxserve.serving.errors import APIError
from jaxserve.serving.json_io import dumps, parse_json_body

logger = logging.getLogger(__name__)

SUPPORTED_URLS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/score")
"""What a line may ask for (vLLM's run-batch: also the embeddings and score endpoints, which a
``--runner pooling`` engine answers; a generate engine answers them with the 400 naming
``--runner pooling``, as the server does)."""


@dataclasses.dataclass(frozen=True)
class BatchLine:
    """One input line that became a request.

    Attributes:
      line: 1-based line number in the input.
      custom_id: the caller's id, unique within the input.
      url: "/v1/completions" or "/v1/chat/completions".
      body: the request body, passed as is to the server's validation.
    """

    line: int
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class LineError:
    """One input line that could not be made into a request.

    Attributes:
      line: 1-based line number in the input.
      custom_id: the line's ``custom_id`` if it had a usable one, else None.
      code: machine-readable reason: "invalid_json", "missing_custom_id", "duplicate_custom_id",
        "invalid_method", "invalid_url" or "invalid_body".
      message: human-readable reason, starting with ``line <n>``.
    """

    line: int
    custom_id: str | None
    code: str
    message: str


def parse_input(lines: Iterable[bytes]) -> list[BatchLine | LineError]:
    """Parses the input file's lines (with or without their newlines), in order.

    The first line with a given ``custom_id`` owns it; later ones are ``duplicate_custom_id``
    errors (whether or not the first one was valid otherwise). JSON is parsed as strictly as the
    server parses a body (no NaN or Infinity).

    Returns:
      One BatchLine or LineError per non-blank line.
    """
    out: list[BatchLine | LineError] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            obj = parse_json_body(raw)
        except APIError as exc:
            out.append(LineError(number, None, "invalid_json", f"line {number}: {exc.message}"))
            continue
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            out.append(
                LineError(
                    number,
                    None,
                    "missing_custom_id",
                    f"line {number}: custom_id must be a non-empty string, got {custom_id!r}",
                )
            )
            continue
        if custom_id in seen:
            out.append(
                LineError(
                    number,
                    custom_id,
                    "duplicate_custom_id",
                    f"line {number}: custom_id {custom_id!r} was already used on line "
                    f"{seen[custom_id]}",
                )
            )
            continue
        seen[custom_id] = number
        method = obj.get("method", "POST")
        url = obj.get("url")
        body = obj.get("body")
        if method != "POST":
            error = ("invalid_method", f"method must be 'POST', got {method!r}")
        elif url not in SUPPORTED_URLS:
            error = ("invalid_url", f"url must be one of {', '.join(SUPPORTED_URLS)}, got {url!r}")
        elif not isinstance(body, dict):
            error = ("invalid_body", f"body must be a JSON object, got {type(body).__name__}")
        else:
            out.append(BatchLine(number, custom_id, url, body))
            continue
        out.append(LineError(number, custom_id, error[0], f"line {number}: {error[1]}"))
    return out


def response_record(custom_id: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """The output record of a request the server handled: its HTTP ``status`` and response ``body``.

    ``request_id`` is the response's own id (``cmpl-...``/``chatcmpl-...``, the engine requests'
    prefix) when it has one, else a fresh ``req_<hex>``.
    """
    request_id = body.get("id") if isinstance(body.get("id"), str) else f"req_{uuid.uuid4().hex}"
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


def error_record(error: LineError) -> dict[str, Any]:
    """The output record of a line that could not be run (``response`` null)."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": error.custom_id,
        "response": None,
        "error": {"code": error.code, "message": error.message, "line": error.line},
    }


def record_succeeded(record: dict[str, Any]) -> bool:
    """True for a record with no ``error`` and a 200 response."""
    response = record.get("response")
    return (
        record.get("error") is None
        and isinstance(response, dict)
        and response.get("status_code") == 200
    )


@dataclasses.dataclass
class ResumeState:
    """What an existing output file already holds.

    Attributes:
      done_ids: custom_id -> whether its response record succeeded (status 200).
      done_lines: input line numbers that have an ``error`` record (never succeeded).
      num_records: complete records found.
      torn_bytes: bytes of a torn last line that were truncated away (0 if none).
    """

    done_ids: dict[str, bool] = dataclasses.field(default_factory=dict)
    done_lines: set[int] = dataclasses.field(default_factory=set)
    num_records: int = 0
    torn_bytes: int = 0

    def is_done(self, item: BatchLine | LineError) -> bool:
        """True if ``item`` already has its record."""
        if isinstance(item, LineError):
            return item.line in self.done_lines
        return item.custom_id in self.done_ids

    def succeeded(self, item: BatchLine | LineError) -> bool:
        """True if ``item``'s existing record succeeded."""
        return isinstance(item, BatchLine) and self.done_ids.get(item.custom_id, False)


def read_records(data: bytes, name: str = "output") -> ResumeState:
    """Reads the complete records of an output file's contents (a torn tail is ignored).

    Raises:
      ValueError: a complete line is not a batch output record (names the file and line).
    """
    state = ResumeState()
    end = data.rfind(b"\n") + 1
    state.torn_bytes = len(data) - end
    for number, raw in enumerate(data[:end].split(b"\n")[:-1], start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            record = None
        if not (
            isinstance(record, dict)
            and "custom_id" in record
            and "response" in record
            and "error" in record
        ):
            raise ValueError(
                f"{name} line {number} is not a batch output record; refusing to append to it"
            )
        state.num_records += 1
        error = record["error"]
        if error is not None:
            line = error.get("line") if isinstance(error, dict) else None
            if not isinstance(line, int):
                raise ValueError(
                    f"{name} line {number}: an error record without its input line number"
                )
            state.done_lines.add(line)
        elif isinstance(record["custom_id"], str):
            state.done_ids[record["custom_id"]] = record_succeeded(record)
        else:
            raise ValueError(f"{name} line {number}: a response record without a custom_id")
    return state


class OutputFile:
    """Where records go: an output file opened for appending and resuming, or stdout.

    Use :meth:`open`; write each record with :meth:`write`; :meth:`close` fsyncs and unlocks.

    Args:
      stream: the binary stream records are written to (stdout), or None for a file ``fd``.
      fd: the output file's descriptor (``O_APPEND``, locked), or None for ``stream``.
      fsync_interval_s: fsync the file at most this often (0: after every record).
    """

    def __init__(
        self,
        *,
        stream: BinaryIO | None = None,
        fd: int | None = None,
        fsync_interval_s: float = 1.0,
    ) -> None:
        self._stream = stream
        self._fd = fd
        self._fsync_interval_s = fsync_interval_s
        self._last_fsync = time.monotonic()
        self._dirty = False

    @classmethod
    def open(cls, path: str, *, fsync_interval_s: float = 1.0) -> tuple[OutputFile, ResumeState]:
        """Opens ``path`` ("-": stdout, no resume) and reads what it already holds.

        A torn last line (no newline: the previous run was killed inside a write) is truncated
        away, so its request runs again.

        Raises:
          ValueError: another process holds the file's lock, or it holds something other than
            batch output records.
          OSError: the file cannot be opened.
        """
        if path == "-":
            return cls(stream=sys.stdout.buffer), ResumeState()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise ValueError(
                        f"{path} is being written by another run-batch process"
                    ) from None
                raise
            with open(fd, "rb", closefd=False) as f:
                data = f.read()
            state = read_records(data, path)
            if state.torn_bytes:
                logger.warning(
                    "%s: truncating a torn last line of %d bytes (the previous run was killed "
                    "while writing it)",
                    path,
                    state.torn_bytes,
                )
                os.ftruncate(fd, len(data) - state.torn_bytes)
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd=fd, fsync_interval_s=fsync_interval_s), state

    def write(self, record: dict[str, Any]) -> None:
        """Appends one record as one line: a single ``write()`` of the whole line, then a flush."""
        data = dumps(record) + b"\n"
        if self._stream is not None:
            self._stream.write(data)
            self._stream.flush()
            return
        assert self._fd is not None, "write after close"
        view = memoryview(data)
        while view:  # a regular file takes it in one write unless the disk fills up
            view = view[os.write(self._fd, view) :]
        self._dirty = True
        now = time.monotonic()
        if now - self._last_fsync >= self._fsync_interval_s:
            os.fsync(self._fd)
            self._dirty = False
            self._last_fsync = now

    def close(self) -> None:
        """Fsyncs what is unsynced and releases the file (idempotent; stdout stays open)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if self._dirty:
                os.fsync(fd)
        finally:
            os.close(fd)  # also drops the flock

    def __enter__(self) -> OutputFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
