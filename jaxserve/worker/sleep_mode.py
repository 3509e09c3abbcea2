"""Sleep mode (vLLM's): the model runner gives its device memory back and takes it again.

    sleep(runner, 1)   the weights are copied to host memory (numpy), the device buffers of the
                       weights and of the KV pool are deleted
    sleep(runner, 2)   the same, but the weights are dropped: ``wake_up`` reloads them with the
                       engine's ``load`` (the checkpoint, read again)
    wake_up(runner, tags)  puts back "weights" and / or "kv_cache" (None: both); True once both are

What stays on the device: the compiled step executables (ahead-of-time, ``runner.aot_*``) and
the few small arrays of the last step's batch. Nothing recompiles on wake: the weights come back
with the shapes, dtypes and shardings they had (checked: a reloaded checkpoint whose tensors no
longer match is an error), and the KV pool is re-made by the same zero-fill executable
(``kv_cache_alloc.allocate_kv_caches`` keeps one per shape). Its contents are gone: the engine
clears the prefix cache before the runner sleeps.

Costs: level 1 holds a host copy of the weights (their bytes, in host RAM) while asleep and
copies them both ways (device -> host at sleep, host -> device at wake); level 2 holds nothing
and reads the checkpoint again at wake (load time). The KV pool is zero-filled at wake (a write
of its bytes). Figures: ``benchmarks/bench_sleep_mode.py`` in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxserve.worker.kv_cache_alloc import allocate_kv_caches

logger = logging.getLogger(__name__)

SLEEP_TAGS = ("weights", "kv_cache")
"""What a runner can give back and take again (vLLM's wake-up tags)."""


@dataclasses.dataclass
class SleepState:
    """What a sleeping runner keeps to wake up.

    Attributes:
      level: 1 (weights on the host) or 2 (weights dropped).
      asleep: the tags not back yet ("weights", "kv_cache").
      host_params: level 1: the weights' leaves as numpy arrays (``runner.params`` order).
      avals: each leaf's ``(shape, dtype, sharding)`` the compiled steps expect.
    """

    level: int
    asleep: set[str]
    host_params: list[np.ndarray] | None
    avals: list[tuple[tuple[int, ...], Any, Any]]


def live_device_bytes() -> int:
    """Bytes of every live device buffer of this process's jax arrays, each buffer counted once
    (on CPU, what "device memory" means: the jax buffers' bytes, not the process's RSS). Arrays
    that share a buffer (a global array and the per-device arrays it was built from, as
    ``jax.make_array_from_callback`` leaves them) count it once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for a in jax.live_arrays():
        if a.is_deleted():
            continue
        for shard in a.addressable_shards:
            data = shard.data
            key = (shard.device.id, data.unsafe_buffer_pointer())
            if key not in seen:
                seen.add(key)
                total += data.nbytes
    return total


def sleep(runner: Any, level: int) -> None:
    """Frees the runner's device memory (see the module docstring); the runner must hold no
    request (the engine aborted or finished them and cleared the prefix cache).

    Args:
      runner: the ModelRunner (``params``, ``kv_caches``, ``sleep_state``).
      level: 1 (weights to host memory) or 2 (weights dropped).

    Raises:
      ValueError: level not 1 or 2, or the runner already sleeps.
    """
    if level not in (1, 2):
        raise ValueError(f"level must be 1 or 2 for the model runner, got {level}")
    if runner.sleep_state is not None:
        raise ValueError("the model runner is already asleep (wake it up first)")
    t0 = time.perf_counter()
    before = live_device_bytes()
    params = runner.params
    avals = [(p.shape, p.dtype, p.sharding) for p in params]
    host = None
    if level == 1:
        host = jax.device_get(params)  # one batched device -> host copy
        if runner.device.platform == "cpu":  # there those are views of the buffers deleted next
            host = [np.array(h, copy=True) for h in host]
    for p in params:
        p.delete()
    for k, v in runner.kv_caches:
        k.delete()
        v.delete()
    runner.params = runner.kv_caches = runner.state = None
    runner.reset_requests()
    runner.sleep_state = SleepState(level, set(SLEEP_TAGS), host, avals)
    logger.info(
        "sleep level %d: %.1f MiB of device buffers freed in %.2f s (%s)",
        level,
        (before - live_device_bytes()) / 2**20,
        time.perf_counter() - t0,
        "weights held in host memory" if level == 1 else "weights dropped",
    )


Loader = Callable[[], tuple[nnx.Module, Any]]
"""Returns ``(model, arch)`` freshly loaded from the checkpoint (``model.loader.load_model``)."""


def wake_up(runner: Any, tags: list[str] | None, load: Loader | None = None) -> bool:
    """Puts back what ``tags`` name ("weights", "kv_cache"; None: both) and returns True once
    nothing sleeps. A runner that is awake returns True at once.

    Args:
      runner: the ModelRunner.
      tags: what to put back; unknown tags are refused.
      load: level 2: the engine's loader of the checkpoint.

    Raises:
      ValueError: an unknown tag, or level-2 weights without ``load``, or reloaded weights whose
        leaves differ from the compiled ones (naming the first).
    """
    state = runner.sleep_state
    wanted = set(SLEEP_TAGS if tags is None else tags)
    unknown = sorted(wanted - set(SLEEP_TAGS))
    if unknown:
        raise ValueError(f"tags: unknown {unknown}; expected some of {list(SLEEP_TAGS)}")
    if state is None:
        return True
    t0 = time.perf_counter()
    if "weights" in wanted & state.asleep:
        leaves = state.host_params if state.level == 1 else _reloaded_leaves(runner, load)
        runner.params = [
            jax.device_put(leaf, sharding)
            for leaf, (_, _, sharding) in zip(leaves, state.avals, strict=True)
        ]
        _check_avals(runner.params, state.avals)
        runner.state = jax.tree.unflatten(runner.graph.state_def, runner.params)
        state.host_params = None
        state.asleep.discard("weights")
    if "kv_cache" in wanted & state.asleep:
        runner.kv_caches = allocate_kv_caches(runner.kv_spec, runner.kv_sharding)
        state.asleep.discard("kv_cache")
    jax.block_until_ready((runner.params, runner.kv_caches))
    logger.info(
        "wake up %s in %.2f s",
        sorted(wanted),
        time.perf_counter() - t0,
    )
    if state.asleep:
        return False
    runner.sleep_state = None
    return True


def _reloaded_leaves(runner: Any, load: Loader | None) -> list[jax.Array]:
    """The weights read again from the checkpoint, placed as the runner's were."""
    if load is None:
        raise ValueError("level 2 sleep needs the engine's loader to wake the weights")
    from jaxserve.model.sharding import place_model  # local: only a level-2 wake needs it

    model, arch = load()
    model, _ = place_model(model, arch, runner.mesh)
    leaves, state_def = jax.tree.flatten(nnx.split(model)[1])
    if state_def != runner.graph.state_def:
        raise ValueError(
            "the checkpoint reloaded at wake-up has other parameters than the model compiled "
            "at start-up"
        )
    return leaves


def _check_avals(params: list[jax.Array], avals: list[tuple]) -> None:
    """Raises ValueError naming the first leaf whose shape or dtype differs from the compiled."""
    for i, (p, (shape, dtype, _)) in enumerate(zip(params, avals, strict=True)):
        if p.shape != shape or p.dtype != dtype:
            raise ValueError(
                f"weights: parameter {i} came back as {p.dtype}{list(p.shape)}, but the steps "
                f"were compiled for {dtype}{list(shape)} (the checkpoint changed shape)"
            )
