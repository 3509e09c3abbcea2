"""How a request's preprocessing shares the CPU and the GIL with the engine thread.

The engine thread takes the GIL back many times per step (around every device call); a thread
that runs Python meanwhile makes it wait up to the interpreter's switch interval (5 ms) each
time. Preprocessing loops over request-sized input therefore call :func:`yield_gil` every few
dozen items. Grammar compiles, which release the GIL but burn CPU, run in ``COMPILE_SLOTS``
threads at a lower priority (``COMPILE_NICE``), through :data:`compiler`.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading
import time

COMPILE_SLOTS = max(1, (os.cpu_count() or 2) // 2)
"""Threads that compile constraints (callers wait for theirs): compiles release the GIL, so
without a bound a burst of heavy grammars takes every core from the engine."""

COMPILE_NICE = 10
"""How much nicer than the server those threads run on Linux (capped at 19): a compile gets
the CPU the engine and its device threads leave (CFS weight 110 against 1024 at nice 0), so a
0.3 s compile of 128 tool schemas does not slow the requests being served; it only delays its
own request."""


def yield_gil() -> None:
    """Lets other threads take the GIL now: a request's preprocessing loops call it every few
    dozen items, so the engine thread, which takes the GIL back many times per step, waits for
    it a fraction of a millisecond instead of the 5 ms switch interval each time."""
    time.sleep(0)


def _lower_priority() -> None:
    """Runs in each compile thread as it starts: lowers its own scheduling priority."""
    if sys.platform == "linux":  # there a thread id names one thread to setpriority
        tid = threading.get_native_id()
        try:
            nice = min(19, os.getpriority(os.PRIO_PROCESS, tid) + COMPILE_NICE)
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            pass


compiler = concurrent.futures.ThreadPoolExecutor(
    COMPILE_SLOTS, thread_name_prefix="jaxserve-grammar", initializer=_lower_priority
)
"""The executor grammar compiles run in."""
