"""Executes the notebooks in demos/ and writes them back with their outputs (what the repository
commits, so a code host shows them run): the venv's python3 kernel, cwd demos/, CPU jax, as
tests/test_notebooks.py runs them.

    .venv/bin/python scripts/run_notebooks.py [demos/NAME.ipynb ...]   # default: all of them
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

import nbformat
from nbclient import NotebookClient

DEMOS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demos")


def run(path: str, timeout_s: int = 600) -> nbformat.NotebookNode:
    """The notebook at ``path`` executed top to bottom (raises CellExecutionError on an error)."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": DEMOS}}
    )
    client.execute()
    return nb


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument(
        "paths", nargs="*", default=sorted(glob.glob(os.path.join(DEMOS, "*.ipynb")))
    )
    args = parser.parse_args()
    os.environ.update(
        JAXSERVE_SKIP_INSTALL="1",
        JAX_PLATFORMS="cpu",
        MPLBACKEND="module://matplotlib_inline.backend_inline",
    )
    for path in args.paths:
        print(f"running {path}", file=sys.stderr, flush=True)
        nbformat.write(run(path), path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
