"""How jaxserve's commands log: one place, shared by the console script and the commands it
runs (``run-batch`` calls it again when started from Python; a second call is a no-op)."""

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
