"""Every notebook in demos/ runs top to bottom (nbclient, the venv's python3 kernel, cwd demos/),
and is committed with the outputs of a run (``scripts/run_notebooks.py`` writes them), so a code
host shows them; CI executes each again and ignores how its outputs differ from the committed
ones (timings, the machine). Neither run may show an error or a progress-widget warning."""

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


WARNINGS = ("IProgress not found", "Traceback")
"""Output text no run may show (#39: notebook 01 warned "IProgress not found")."""


def _output_text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            parts.append(out.get("text", ""))
            parts.extend(str(v) for k, v in out.get("data", {}).items() if k.startswith("text/"))
    return "\n".join(parts)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_committed_with_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in code), (
        f"commit {path} executed: .venv/bin/python scripts/run_notebooks.py {path}"
    )
    assert any(cell.outputs for cell in code)
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path} was committed with an error output"
    text = _output_text(nb)
    assert not [w for w in WARNINGS if w in text], f"{path}'s outputs show {WARNINGS}"


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
    text = _output_text(nb)  # the outputs may differ from the committed ones; not the warnings
    assert not [w for w in WARNINGS if w in text], text[-2000:]
