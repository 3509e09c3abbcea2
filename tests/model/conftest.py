"""Model tests compare float32 logits at 1e-4: ask for full-precision float32 matmuls (GPUs
otherwise default to TF32-like passes; CPUs are exact either way)."""

import jax
import pytest


@pytest.fixture(autouse=True)
def _highest_matmul_precision():
    with jax.default_matmul_precision("highest"):
        yield
