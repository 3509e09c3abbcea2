"""Our C++ paged-attention kernel for CPUs (``jaxserve.model.cpu_kernels``): it builds where
there is a compiler, attends exactly the rows it is asked for (decode and verification rows,
split keys merged, sliding window, soft cap, bfloat16) against the whole-row oracle, and the
engine falls back to jnp, saying why, where it cannot build."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_chunked_attention import make_args

from jaxserve.model import chunked_attention, cpu_kernels
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

# (query_len, context_len): decode rows at block edges and one key, verification rows (1 + K)
# fresh and after a prefix, a prefill chunk the kernel must leave alone.
SEQS = [(1, 33), (4, 40), (1, 1), (12, 30), (1, 150), (5, 5), (1, 64), (3, 97)]


def test_builds_where_there_is_a_compiler():
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler on this machine")
    assert cpu_kernels.available(), cpu_kernels._load()


def test_loading_leaves_the_processs_floats_alone(kernel):
    """Built with -ffast-math but not linked with it: a library linked so would set flush-to-zero
    for the whole process as it loads (hypothesis, numpy and every caller lose subnormals)."""
    tiny = np.float32(1e-39)  # subnormal
    assert tiny * np.float32(1.0) == tiny and tiny / np.float32(2.0) > 0


@pytest.mark.parametrize(
    "dtype,split_keys,soft_cap,sliding_window",
    [
        (jnp.float32, 512, None, None),
        (jnp.float32, 16, None, None),  # contexts split in 16-key items, merged
        (jnp.float32, 24, 20.0, None),  # splits not on block edges
        (jnp.float32, 8, None, 21),  # window inside the splits, and past a whole split
        (jnp.bfloat16, 32, None, 7),
    ],
)
def test_rows_match_the_oracle(kernel, dtype, split_keys, soft_cap, sliding_window):
    rng = np.random.default_rng(split_keys)
    args = make_args(
        rng,
        SEQS,
        num_tokens=40,  # 28 real tokens + padding
        num_seq_slots=10,  # padding sequences
        hkv=2,
        group=3,
        head_dim=24,
        block_size=8,
        pages=20,
    )
    args = tuple(a.astype(dtype) if a.dtype == jnp.float32 else a for a in args)
    kw = dict(sm_scale=0.3, soft_cap=soft_cap, sliding_window=sliding_window)
    ref = np.asarray(ragged_paged_attention_reference(*args, **kw), np.float32)
    q = args[0].astype(jnp.float32).reshape(40, 2, 3, 24)
    got = jax.jit(
        lambda q, *a: cpu_kernels.paged_attention_rows(
            q, *a, min_q_len=1, max_q_len=5, split_keys=split_keys, **kw
        )
    )(q, *args[1:])
    got = np.asarray(got).reshape(40, 6, 24)
    atol = 2e-5 if dtype == jnp.float32 else 2e-2
    start = 0
    for q_len, _ in SEQS:
        rows = slice(start, start + q_len)
        if q_len <= 5:  # attended
            np.testing.assert_allclose(got[rows], ref[rows], atol=atol, rtol=0)
        else:  # left to the prefill tiles
            np.testing.assert_array_equal(got[rows], 0.0)
        start += q_len
    np.testing.assert_array_equal(got[start:], 0.0)  # padding tokens


# Prefill chunks: several query tiles (a tile is ~128 rows of tokens x G), fresh and after a
# cached prefix, chunk ends inside and on key panels (32 keys), next to decode and short rows.
PREFILL_SEQS = [(70, 200), (1, 33), (5, 40), (40, 40), (9, 9), (100, 300), (1, 1), (33, 90)]


@pytest.mark.parametrize(
    "head_dim,group,block_size,dtype,soft_cap,sliding_window",
    [
        (16, 1, 8, jnp.float32, None, None),
        (32, 2, 32, jnp.float32, None, None),
        (32, 4, 16, jnp.float32, 20.0, None),
        (64, 3, 16, jnp.float32, None, 37),  # window inside a tile and across panels
        (128, 2, 16, jnp.bfloat16, None, None),
        (80, 8, 32, jnp.float32, 30.0, 70),
    ],
)
def test_prefill_tiles_match_the_oracle(
    kernel, head_dim, group, block_size, dtype, soft_cap, sliding_window
):
    rng = np.random.default_rng(head_dim + group)
    num_tokens = sum(q for q, _ in PREFILL_SEQS) + 11  # padding tokens
    args = make_args(
        rng,
        PREFILL_SEQS,
        num_tokens=num_tokens,
        num_seq_slots=10,
        hkv=2,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        pages=-(-300 // block_size) + 2,
    )
    args = tuple(a.astype(dtype) if a.dtype == jnp.float32 else a for a in args)
    kw = dict(sm_scale=head_dim**-0.5, soft_cap=soft_cap, sliding_window=sliding_window)
    ref = np.asarray(ragged_paged_attention_reference(*args, **kw), np.float32)
    q = args[0].astype(jnp.float32).reshape(num_tokens, 2, group, head_dim)
    attend = jax.jit(
        lambda q, *a: cpu_kernels.paged_attention_rows(
            q, *a, min_q_len=1, max_q_len=8, prefill=True, **kw
        )
    )
    got = np.asarray(attend(q, *args[1:])).reshape(num_tokens, 2 * group, head_dim)
    real = sum(q for q, _ in PREFILL_SEQS)
    atol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got[:real], ref[:real], atol=atol, rtol=0)
    np.testing.assert_array_equal(got[real:], 0.0)


def test_prefill_skips_block_ids_outside_the_cache(kernel):
    """A block table entry outside the cache (a bug upstream) is skipped, not read: its keys
    are masked, the other sequences' rows are exact."""
    seqs = [(40, 40), (33, 90)]
    args = make_args(
        np.random.default_rng(1),
        seqs,
        num_tokens=73,
        num_seq_slots=2,
        hkv=2,
        group=2,
        head_dim=32,
        block_size=16,
        pages=8,
    )
    ref = np.asarray(ragged_paged_attention_reference(*args, sm_scale=0.2), np.float32)
    tables = np.asarray(args[3]).copy()
    tables[0, 1] = 10**6  # keys 16..31 of sequence 0
    q = args[0].reshape(73, 2, 2, 32)
    got = cpu_kernels.paged_attention_rows(
        q, args[1], args[2], jnp.asarray(tables), *args[4:], sm_scale=0.2, prefill=True
    )
    got = np.asarray(got).reshape(73, 4, 32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[:16], ref[:16], atol=2e-5, rtol=0)  # before the bad block
    np.testing.assert_allclose(got[40:], ref[40:], atol=2e-5, rtol=0)


def test_prefill_needs_a_compiled_head_size(kernel):
    args = make_args(
        np.random.default_rng(0),
        [(4, 4)],
        num_tokens=4,
        num_seq_slots=1,
        hkv=1,
        group=1,
        head_dim=24,
        block_size=8,
        pages=1,
    )
    with pytest.raises(ValueError, match="head size"):
        cpu_kernels.paged_attention_rows(
            args[0].reshape(4, 1, 1, 24), *args[1:], sm_scale=1.0, prefill=True
        )


_NARROW = """
import jax, jax.numpy as jnp, numpy as np
from jaxserve.model import cpu_kernels
cpu_kernels._COMPILE = (*cpu_kernels._COMPILE, "-mno-avx512f")
assert cpu_kernels.available(), cpu_kernels._load()
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from test_chunked_attention import make_args
from test_cpu_attention import PREFILL_SEQS
for head_dim, group, window in ((32, 2, None), (64, 3, 37)):
    T = sum(q for q, _ in PREFILL_SEQS) + 5
    args = make_args(np.random.default_rng(head_dim), PREFILL_SEQS, num_tokens=T, num_seq_slots=10,
                     hkv=2, group=group, head_dim=head_dim, block_size=16, pages=21)
    kw = dict(sm_scale=head_dim**-0.5, sliding_window=window)
    ref = np.asarray(ragged_paged_attention_reference(*args, **kw))
    q = args[0].reshape(T, 2, group, head_dim)
    got = cpu_kernels.paged_attention_rows(q, *args[1:], max_q_len=8, prefill=True, **kw)
    got = np.asarray(got).reshape(T, 2 * group, head_dim)
    np.testing.assert_allclose(got[: T - 5], ref[: T - 5], atol=2e-5, rtol=0)
rng = np.random.default_rng(0)
for m in (9, 71):  # 2-row blocks; from 64 rows 6 x 16 blocks (and the rest)
    x, w = rng.standard_normal((m, 50), np.float32), rng.standard_normal((50, 70), np.float32)
    got = cpu_kernels.panel_matmul(jnp.asarray(x), cpu_kernels.pack_panels(w), 70)
    np.testing.assert_allclose(np.asarray(got), x.astype(np.float64) @ w, atol=1e-4, rtol=0)
print("NARROW OK")
"""


@pytest.mark.skipif(
    "avx512f" not in cpu_kernels._cpu_name(), reason="the default build is the narrow one here"
)
def test_builds_and_matches_without_avx512(kernel, tmp_path):
    """CPUs without AVX-512 (AVX2: 16 vector registers) get smaller register blocks: built
    here with -mno-avx512f (a subprocess, its own cache) and checked against the oracle (the
    panel matmul against numpy)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", JAXSERVE_CACHE_DIR=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(__file__).parent), *sys.path])
    run = subprocess.run(
        [sys.executable, "-c", _NARROW], env=env, capture_output=True, text=True, timeout=300
    )
    assert "NARROW OK" in run.stdout, run.stderr[-3000:]
    assert not any("zmm" in line for line in _disassemble(tmp_path))


def _disassemble(cache: pathlib.Path) -> list[str]:
    """objdump of the library built into ``cache`` (empty without objdump)."""
    objdump = shutil.which("objdump")
    libs = list(cache.glob("*.so"))
    assert len(libs) == 1, libs
    if objdump is None:
        return []
    out = subprocess.run([objdump, "-d", str(libs[0])], capture_output=True, text=True)
    return out.stdout.splitlines()


_SHARDED = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as Ps
from jaxserve.model.chunked_attention import chunked_paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from test_chunked_attention import make_args
from test_cpu_attention import SEQS
assert len(jax.devices()) == 2, jax.devices()
args = make_args(np.random.default_rng(0), SEQS, num_tokens=32, num_seq_slots=8, hkv=2, group=2,
                 head_dim=16, block_size=8, pages=20)
heads, cache, rep = Ps(None, "model", None), Ps(None, None, "model", None), Ps()
attend = jax.jit(jax.shard_map(
    lambda *a: chunked_paged_attention(*a, sm_scale=0.25, native=True),
    mesh=Mesh(np.array(jax.devices()), ("model",)),
    in_specs=(heads, cache, cache, rep, rep, rep, rep), out_specs=heads, check_vma=False))
ref = np.asarray(ragged_paged_attention_reference(*args, sm_scale=0.25))
np.testing.assert_allclose(np.asarray(attend(*args))[:28], ref[:28], atol=2e-5, rtol=0)
empty = (*args[:5], jnp.zeros_like(args[5]), jnp.int32(0))
np.testing.assert_array_equal(np.asarray(attend(*empty)), 0.0)
print("SHARDED OK")
"""


def test_tensor_parallel_shards_and_empty_batches(kernel):
    """Under shard_map over KV heads (2 host devices, a subprocess) each shard runs the kernel
    on its own heads; a step with no sequence is all zeros."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="2")
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(__file__).parent), *sys.path])
    run = subprocess.run(
        [sys.executable, "-c", _SHARDED], env=env, capture_output=True, text=True, timeout=300
    )
    assert "SHARDED OK" in run.stdout, run.stderr[-3000:]


def test_without_a_compiler_the_jnp_path_runs_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    cpu_kernels._load.cache_clear()
    cpu_kernels.available.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert not cpu_kernels.available()
        assert "no C++ compiler" in caplog.text
        assert not chunked_attention._native_ok(jnp.float32)
        with pytest.raises(RuntimeError, match="unavailable: no C\\+\\+ compiler"):
            cpu_kernels.paged_attention_rows(
                *make_args(
                    np.random.default_rng(0),
                    [(1, 4)],
                    num_tokens=1,
                    num_seq_slots=1,
                    hkv=1,
                    group=1,
                    head_dim=8,
                    block_size=8,
                    pages=1,
                ),
                sm_scale=1.0,
            )
        monkeypatch.setenv("JAXSERVE_CPU_KERNEL", "0")
        monkeypatch.setattr(cpu_kernels, "_compiler", lambda: "/usr/bin/g++")
        cpu_kernels._load.cache_clear()
        assert cpu_kernels._load() == "JAXSERVE_CPU_KERNEL=0"
    finally:
        cpu_kernels._load.cache_clear()
        cpu_kernels.available.cache_clear()


def test_a_failed_build_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: shutil.which("false") or "/bin/false")
    cpu_kernels._load.cache_clear()
    try:
        why = cpu_kernels._load()
        assert why is not None and why.startswith("it did not build or load")
        assert not list(tmp_path.glob("*.so"))  # nothing half-written left to load later
    finally:
        cpu_kernels._load.cache_clear()
        cpu_kernels.available.cache_clear()


def test_a_new_build_deletes_builds_unused_for_a_month(kernel, monkeypatch, tmp_path):
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path))
    stale, recent = tmp_path / "paged_attention_cpu-old.so", tmp_path / "paged_attention_cpu-new.so"
    other = tmp_path / "notes.txt"  # not a kernel build: never touched
    for f in (stale, recent, other):
        f.write_bytes(b"x")
    month = time.time() - (cpu_kernels.STALE_DAYS + 1) * 86400
    os.utime(stale, (month, month))
    os.utime(other, (month, month))
    lib = cpu_kernels._build(cpu_kernels._compiler())
    assert lib.exists() and recent.exists() and other.exists() and not stale.exists()
    os.utime(lib, (month, month))  # found again: marked as used, so kept
    assert cpu_kernels._build(cpu_kernels._compiler()) == lib
    assert lib.stat().st_mtime > month + 86400


def test_fp8_and_float16_caches_keep_the_jnp_path():
    assert not chunked_attention._native_ok(jnp.float8_e4m3fn)
    assert not chunked_attention._native_ok(jnp.float16)
