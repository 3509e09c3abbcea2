"""How jaxserve's commands log and show progress: one place, shared by the console script and
the commands it runs (``run-batch`` calls it again when started from Python; a second call is a
no-op)."""

from __future__ import annotations

import logging
import sys


def configure_logging() -> None:
    """Our own INFO lines (KV pool, warm-up, engine ready) on stderr; other libraries (jax's
    backend probing, orbax's absl INFO chatter) only from WARNING up."""
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("jaxserve").setLevel(logging.INFO)


def progress_bar_class() -> type:
    """The tqdm class for progress bars: tqdm's notebook widget where Jupyter can draw it (in a
    notebook kernel with ``ipywidgets``), else the plain text bar. ``tqdm.auto`` alone picks the
    widget in any kernel and, without ``ipywidgets``, warns "IProgress not found" into the
    notebook's output (#39)."""
    try:
        import ipywidgets  # noqa: F401 - only whether it is there
        from tqdm.auto import tqdm
    except ImportError:
        from tqdm import tqdm
    return tqdm
