"""jaxserve.core stays pure Python: importing it must not pull in jax (or numpy)."""

import subprocess
import sys


def test_core_imports_without_jax():
    code = (
        "import sys\n"
        "import jaxserve.core.scheduler, jaxserve.core.kv_cache_manager, jaxserve.core.runner_output\n"
        "import jaxserve.core.engine_core_output\n"
        "bad = sorted(m for m in ('jax', 'jaxlib', 'numpy', 'flax') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
