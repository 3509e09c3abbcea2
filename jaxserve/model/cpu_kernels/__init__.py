"""Our C++ kernels for CPUs (XLA FFI custom calls), built at first use: paged attention, and
the matmul of float32 weights packed in column panels.

**Paged attention** (``paged_attention.cc``, ``paged_attention_rows``).

The jnp path (``jaxserve.model.chunked_attention``) must gather a copy of every key chunk it
reads out of the paged cache before XLA can multiply it, and on CPU that copy, not the
arithmetic, is what a decode row costs (benchmarks/RESULTS.md, #34: ~5-6 GB/s). This kernel
reads the keys and values where they lie, block by block through the block table, with an
online softmax per query row: for the rows of short queries (decode rows and speculative
verification's 1 + K), whose work is reading the cache, and for prefill chunks in query tiles
whose scores and weighted values are register-blocked products over panels of 32 keys.

**Panel matmul** (``panel_matmul.cc``, ``panel_matmul``; ``Linear.pack_panels`` packs a
layer for it). XLA CPU's dot reads a weight at ~17 GB/s for one row of x and slows as rows are
added (it packs the weight first, every call): a speculative verification's 1 + K rows cost
~1.7x a decode row's (benchmarks/RESULTS.md, #32). Packed once, on load, into panels of 32
output columns ``[P, K, 32]``, the weight is read in contiguous runs at the memory's pace for
up to 8 rows at a time; ``place_model`` packs every float32 ``Linear`` of a one-device CPU
model (``pack_cpu_linears``).

Built like PyTorch's inductor builds its CPU kernels: the sources ship in the package
(``*.cc``, ``*.h``), and the first process that needs them compiles them with the system's
C++ compiler (``$CXX``, else ``g++``, else ``c++``) against jaxlib's FFI headers, into a cache
directory (``$JAXSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/jaxserve``, else
``~/.cache/jaxserve``) keyed by the source, jaxlib's version, the compiler and the CPU, so
later processes load it in milliseconds (builds unused for ``STALE_DAYS`` days are deleted
when a new one is built). ``available()`` says whether it loaded; when it cannot be built (no
compiler), the "xla" attention backend keeps the jnp path, weights stay unpacked (XLA's dot),
and the log says why once. ``JAXSERVE_CPU_KERNEL=0`` turns both off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

_HERE = pathlib.Path(__file__).parent
_SOURCES = (_HERE / "paged_attention.cc", _HERE / "panel_matmul.cc")
_HEADERS = (_HERE / "parallel_for.h",)
_TARGET = "jaxserve_paged_attention_cpu"
_MATMUL_TARGET = "jaxserve_panel_matmul_cpu"
_SYMBOLS = {_TARGET: "JaxservePagedAttentionCpu", _MATMUL_TARGET: "JaxservePanelMatmulCpu"}
PANEL = 32
"""Output columns per panel of a packed weight (``panel_matmul.cc``'s ``kPanel``)."""
# -ffast-math at compile time only (vectorized expf from glibc's libmvec, reassociated sums):
# linking with it would add crtfastmath.o, whose constructor turns on flush-to-zero for the
# whole process when the library loads (subnormal floats would vanish everywhere).
_COMPILE = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-fPIC")
_LINK = ("-shared", *(("-lmvec",) if platform.machine() in ("x86_64", "AMD64") else ()))
KERNEL_DTYPES = (jnp.float32, jnp.bfloat16)
"""Cache dtypes the kernel reads (others, FP8 and float16, keep the jnp path)."""
PREFILL_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
"""Head sizes its prefill tiles are compiled for (others keep the jnp prefill path)."""


def cache_dir() -> pathlib.Path:
    """Where built kernels are kept (see the module docstring)."""
    root = os.environ.get("JAXSERVE_CACHE_DIR")
    if root:
        return pathlib.Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return pathlib.Path(xdg or pathlib.Path.home() / ".cache") / "jaxserve"


def _cpu_name() -> str:
    """The CPU's model and feature flags (the build uses ``-march=native``)."""
    lines = []
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features", "CPU part")):
                lines.append(line)
            elif not line.strip() and lines:
                break  # the first processor's block is enough
    except OSError:
        pass
    return "\n".join(lines) or platform.processor()


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        path = shutil.which(name) if name else None
        if path:
            return path
    return None


def _build(cxx: str) -> pathlib.Path:
    """The kernels' shared library, compiled now unless the cache holds it (atomic rename, so
    processes building at once do not see half a file)."""
    import jaxlib

    key = hashlib.sha256()
    for src in (*_SOURCES, *_HEADERS):
        key.update(src.read_bytes())
    for part in (jaxlib.__version__, cxx, *_COMPILE, *_LINK, _cpu_name()):
        key.update(part.encode())
    lib = cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if lib.exists():
        _touch(lib)
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    _prune(lib.parent)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        objs = [str(pathlib.Path(tmp) / f"{src.stem}.o") for src in _SOURCES]
        out = pathlib.Path(tmp) / lib.name
        include = f"-I{jax.ffi.include_dir()}"
        cmds = [
            [cxx, *_COMPILE, include, f"-I{_HERE}", "-c", str(src), "-o", obj]
            for src, obj in zip(_SOURCES, objs, strict=True)
        ]
        for cmd in (*cmds, [cxx, *objs, *_LINK, "-o", str(out)]):
            run = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if run.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{run.stderr[-2000:]}")
        os.replace(out, lib)
    return lib


STALE_DAYS = 30
"""A build no process has loaded for this many days is deleted when another is built (other
jaxserve versions, compilers or venvs sharing the cache keep theirs while they use them)."""


def _touch(lib: pathlib.Path) -> None:
    """Marks ``lib`` as used now (its mtime), so that ``_prune`` keeps it."""
    try:
        os.utime(lib)
    except OSError:
        pass  # a read-only cache: the build stays, unpruned


def _prune(root: pathlib.Path) -> None:
    """Deletes the kernel builds in ``root`` unused for ``STALE_DAYS`` days (and those of the
    attention-only library before it, ``paged_attention_cpu-*.so``)."""
    cutoff = time.time() - STALE_DAYS * 86400
    builds = [*root.glob("cpu_kernels-*.so"), *root.glob("paged_attention_cpu-*.so")]
    for old in builds:
        try:
            if old.stat().st_mtime < cutoff:
                old.unlink()
        except OSError:
            pass  # another process pruned it first, or it is not ours to delete


@functools.cache
def _load() -> str | None:
    """Builds (or finds) and registers the kernel; None when it is ready, else why not."""
    if os.environ.get("JAXSERVE_CPU_KERNEL", "1") == "0":
        return "JAXSERVE_CPU_KERNEL=0"
    cxx = _compiler()
    if cxx is None:
        return "no C++ compiler (set CXX, or install g++)"
    try:
        lib = ctypes.CDLL(str(_build(cxx)))
        for target, symbol in _SYMBOLS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), "cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        return f"it did not build or load: {e}"
    return None


@functools.cache
def available() -> bool:
    """Whether the kernels are built and registered (builds them on the first call; logs why
    not once)."""
    why = _load()
    if why is not None:
        logger.warning(
            "CPU kernels unavailable (%s); attention runs in jnp, matmuls in XLA's dot", why
        )
    else:
        logger.info("CPU kernels loaded (paged attention, panel matmul)")
    return why is None


def _require() -> None:
    """Raises RuntimeError, saying why, unless the kernels are ``available()``."""
    if not available():
        raise RuntimeError(f"the CPU kernels are unavailable: {_load()}")


def paged_attention_rows(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    min_q_len: int = 1,
    max_q_len: int = 1,
    split_keys: int = 512,
    prefill: bool = False,
) -> jax.Array:
    """Paged attention of the sequences with ``min_q_len <= q_len <= max_q_len`` query tokens,
    and with ``prefill`` those with more too (prefill chunks, in query tiles).

    Args:
      q: float32 ``[T, Hkv, G, D]`` queries, grouped by KV head.
      k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, a dtype of ``KERNEL_DTYPES``.
      block_tables: int32 ``[S, P]``; context_lens: int32 ``[S]``; query_start_loc: int32
        ``[S + 1]``; num_seqs: int32 ``[]`` (as ``chunked_paged_attention``).
      sm_scale, soft_cap, sliding_window: as ``paged_attention``.
      min_q_len, max_q_len: which sequences (by query tokens in this step) it attends.
      split_keys: keys per work item of the short rows (a long context is split so every
        thread has work).
      prefill: also attend the sequences with more than ``max_q_len`` query tokens; needs a
        head size in ``PREFILL_HEAD_DIMS``.

    Returns:
      float32 ``[T, Hkv, G, D]``: the attended sequences' rows; every other row zero.

    Raises:
      RuntimeError: the kernel is not ``available()``.
      ValueError: ``prefill`` with a head size outside ``PREFILL_HEAD_DIMS``.
    """
    _require()
    if prefill and q.shape[-1] not in PREFILL_HEAD_DIMS:
        raise ValueError(
            f"prefill tiles need a head size in {PREFILL_HEAD_DIMS}, got {q.shape[-1]}"
        )
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q.astype(jnp.float32),
        k_cache,
        v_cache,
        block_tables.astype(jnp.int32),
        context_lens.astype(jnp.int32),
        query_start_loc.astype(jnp.int32),
        jnp.asarray(num_seqs, jnp.int32),
        sm_scale=np.float32(sm_scale),
        soft_cap=np.float32(soft_cap or 0.0),
        sliding_window=int(sliding_window or 0),
        min_q_len=int(min_q_len),
        max_q_len=int(max_q_len),
        split_keys=int(split_keys),
        prefill=bool(prefill),
    )


def pack_panels(w: np.ndarray | jax.Array) -> np.ndarray:
    """A weight ``[K, N]`` (input rows, output columns) packed for ``panel_matmul``: float32
    ``[ceil(N / PANEL), K, PANEL]``, panel p holding columns ``[PANEL p, PANEL p + PANEL)`` row
    after row, the last panel's missing columns zero. On the host (numpy): done once on load.

    Raises:
      ValueError: ``w`` is not 2-D.
    """
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ValueError(f"pack_panels: expected a [K, N] weight, got shape {w.shape}")
    k, n = w.shape
    p = -(-n // PANEL)
    if n != p * PANEL:
        w = np.pad(w, ((0, 0), (0, p * PANEL - n)))
    return np.ascontiguousarray(w.reshape(k, p, PANEL).transpose(1, 0, 2))


def panel_matmul(x: jax.Array, w: jax.Array, n: int) -> jax.Array:
    """``x · W`` for a weight packed by ``pack_panels``, inside a jitted step on CPU.

    Args:
      x: ``[M, K]``, any float dtype (multiplied in float32).
      w: float32 ``[P, K, PANEL]``, ``pack_panels`` of ``W [K, n]``.
      n: W's output columns (``P == ceil(n / PANEL)``).

    Returns:
      float32 ``[M, n]``; the products accumulate over K in order, in float32 (XLA's dot sums in
      another order: results agree to float32 rounding, not bit for bit).

    Raises:
      RuntimeError: the kernels are not ``available()``.
      ValueError: shapes that do not match, or ``w`` not float32.
    """
    _require()
    if (
        x.ndim != 2
        or w.ndim != 3
        or w.shape[1:] != (x.shape[1], PANEL)
        or w.dtype != jnp.float32
        or n < 0
        or -(-n // PANEL) != w.shape[0]
    ):
        raise ValueError(
            f"panel_matmul: x {x.shape} and packed w {w.dtype}{list(w.shape)} (n={n}) do not "
            f"match (x [M, K], w float32 [P, K, {PANEL}], P = ceil(n / {PANEL}))"
        )
    call = jax.ffi.ffi_call(
        _MATMUL_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[0] * PANEL), jnp.float32)
    )
    y = call(x.astype(jnp.float32), w)
    return y if y.shape[1] == n else y[:, :n]
