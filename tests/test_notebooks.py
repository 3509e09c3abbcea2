"""Every notebook in demos/ runs top to bottom (nbclient, the venv's python3 kernel, cwd demos/),
and is committed without outputs."""

from __future__ import annotations

import glob
import os

import nbformat
import pytest

DEMOS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demos")
NOTEBOOKS = sorted(glob.glob(os.path.join(DEMOS, "*.ipynb")))
CELL_TIMEOUT_S = 300


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 4, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"clear the outputs of {path}"
            )


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, monkeypatch):
    from nbclient import NotebookClient

    # The kernel inherits the environment: no install (jaxserve is importable here), CPU jax.
    monkeypatch.setenv("JAXSERVE_SKIP_INSTALL", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": DEMOS}}
    )
    client.execute()  # raises CellExecutionError (with the cell and traceback) on an error
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert not errors
