"""Model tests compare float32 logits at 1e-4: ask for full-precision float32 matmuls (GPUs
otherwise default to TF32-like passes; CPUs are exact either way). ``kernel``: skips a test
where our CPU kernels cannot build."""

import jax
import pytest

from jaxserve.model import cpu_kernels


@pytest.fixture(autouse=True)
def _highest_matmul_precision():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="session")
def kernel():
    """Our C++ CPU kernels (``jaxserve.model.cpu_kernels``), built; the test skips without them."""
    if not cpu_kernels.available():
        pytest.skip(f"kernel unavailable: {cpu_kernels._load()}")
