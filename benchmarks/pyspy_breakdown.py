"""Shares of a py-spy profile of ``jaxserve serve`` by serving-path part (#21).

Reads py-spy's collapsed-stack output (``py-spy record --format raw``: one ``frame;frame;... N``
line per distinct stack, outermost frame first, each frame ``function (file:line)``) and prints,
for each part below, the share of the sampled (non-idle) samples whose stack passes through it.
A stack counts for the first part it matches, in the order listed, so the shares add up to 100%.

Usage: ``python benchmarks/pyspy_breakdown.py PROFILE.txt [RATE TOKENS]``; with the sampling
rate (Hz) and the tokens generated while sampling, it also prints the sampled milliseconds per
1,000 tokens (with ``py-spy --gil``: Python time holding the GIL per 1,000 tokens).
"""

from __future__ import annotations

import sys
from collections import Counter

PARTS: list[tuple[str, tuple[str, ...]]] = [
    # (label, substrings of a frame: the stack belongs to the part when any frame contains one)
    ("engine thread: LLMEngine.step", ("step (jaxserve/engine/llm_engine.py",)),
    ("engine thread: metrics", ("_record (jaxserve/engine/async_llm.py",)),
    ("engine thread: hand-over to the loop", ("_dispatch (jaxserve/engine/async_llm.py",)),
    ("engine thread: other", ("_run (jaxserve/engine/async_llm.py",)),
    (
        "SSE chunk building (serving/{completion,chat}._chunks)",
        ("_chunks (jaxserve/serving/completion.py", "_chunks (jaxserve/serving/chat.py"),
    ),
    ("SSE write (socket writes, aiohttp writer)", ("_write_sse (jaxserve/entrypoints/http/",)),
    (
        "request preparation (parse, tokenize, checks)",
        ("prepare (jaxserve/serving/", "_read_json (jaxserve/entrypoints/http/"),
    ),
    ("engine hand-in (add_request)", ("add_request (jaxserve/engine/async_llm.py",)),
    (
        "hand-over on the loop (self-pipe reads, outputs into streams)",
        (
            "_run_batch (jaxserve/engine/",
            "_put (jaxserve/engine/",
            "put_nowait (asyncio/queues.py",
            "_read_from_self (asyncio/selector_events.py",
        ),
    ),
    ("aiohttp request handling (other)", ("aiohttp/web_protocol.py", "aiohttp/http_parser.py")),
    (
        "event loop (select, other callbacks)",
        ("asyncio/base_events.py", "asyncio/selector_events.py"),
    ),
]


def breakdown(lines: list[str]) -> tuple[int, Counter]:
    """``(total samples, Counter label -> samples)`` of collapsed-stack lines."""
    total = 0
    shares: Counter = Counter()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        for label, keys in PARTS:
            if any(k in stack for k in keys):
                shares[label] += n
                break
        else:
            shares["other"] += n
    return total, shares


def main() -> None:
    with open(sys.argv[1]) as f:
        total, shares = breakdown(f.readlines())
    print(f"{total} samples")
    if len(sys.argv) == 4 and int(sys.argv[3]) > 0:
        ms = total * 1000 / float(sys.argv[2])
        print(f"{ms / int(sys.argv[3]) * 1000:.0f} ms sampled per 1,000 generated tokens")
    for label, _ in [*PARTS, ("other", ())]:
        if shares[label]:
            print(f"{100 * shares[label] / max(total, 1):5.1f}%  {label}")


if __name__ == "__main__":
    main()
