"""Multi-process (multi-host) serving: one global mesh, one scheduler, the same step everywhere.

``--distributed-coordinator HOST:PORT --num-processes P --process-id I`` start JAX's distributed
runtime (``jax.distributed.initialize``) before anything touches a device, so the P processes see
one global device list and the tensor-parallel mesh spans them. Every process loads the weights,
places its shards, sizes the KV pool (all take the smallest pool any of them can hold) and
compiles the same steps, in the same order.

Then the roles split (SPMD with a single controller of the schedule):

* process 0 builds the engine: tokenizer, scheduler, KV-cache manager, HTTP server or offline
  API. Before each step it publishes the step's ``SchedulerOutput`` (plain data, pickled) in the
  coordinator's key-value store, then runs the step;
* every other process (``run_worker``) reads each step's ``SchedulerOutput`` in order and feeds
  it to its own ``ModelRunner``. The runner's state (persistent batch, seeds) is a function of
  the scheduler outputs alone, so every process builds identical step inputs and all of them run
  the same jitted step, whose collectives tie them together. All processes bring back the same
  (replicated) sampled tokens; only process 0 uses them.

Failure: if a process other than 0 dies, the next step's collective fails on process 0 (gloo on
CPU reports the closed connection at once; NCCL / ICI time out), the engine dies and process 0
exits non-zero. While idle, JAX's coordinator notices the missing heartbeats (after
``jax.distributed.initialize``'s ``heartbeat_timeout_seconds``, 100 s) and ends every process
with an error. If process 0
ends, it publishes a stop message and the workers exit 0; if it dies, the coordinator goes with
it and the workers' reads fail, so they exit non-zero.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxserve.config import ParallelConfig
    from jaxserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

STEP_KEY = "jaxserve/step/{}"
_STOP = "stop"
_POLL_MS = 1000


def initialize(parallel: ParallelConfig) -> bool:
    """Starts JAX's distributed runtime for ``parallel`` (a no-op for one process); returns
    whether it did. Must run before JAX initialises its backends (before any device is used).

    On CPU, cross-process collectives use gloo (``jax_cpu_collectives_implementation``).

    Raises:
      ValueError: the runtime is already up with another process layout, or JAX's backends
        were initialised first (naming what to change).
    """
    if parallel.num_processes == 1:
        return False
    import jax
    from jax._src import distributed as jax_distributed

    state = jax_distributed.global_state
    if state.client is not None:
        if (state.num_processes, state.process_id) != (
            parallel.num_processes,
            parallel.process_id,
        ):
            raise ValueError(
                f"the distributed runtime already runs as process {state.process_id} of "
                f"{state.num_processes}, not {parallel.process_id} of {parallel.num_processes}"
            )
        return True
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=parallel.distributed_coordinator,
            num_processes=parallel.num_processes,
            process_id=parallel.process_id,
        )
    except RuntimeError as e:
        raise ValueError(f"distributed_coordinator: could not start the runtime: {e}") from e
    if parallel.tensor_parallel_size != jax.device_count():
        raise ValueError(
            f"tensor_parallel_size ({parallel.tensor_parallel_size}) must equal the devices of all "
            f"{parallel.num_processes} processes ({jax.device_count()}) on a multi-process mesh"
        )
    logger.info(
        "distributed: process %d of %d, coordinator %s, %d local / %d global devices",
        parallel.process_id,
        parallel.num_processes,
        parallel.distributed_coordinator,
        jax.local_device_count(),
        jax.device_count(),
    )
    return True


def _client():
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    assert client is not None, "initialize() first"
    return client


class StepPublisher:
    """Process 0's side: publishes each step's SchedulerOutput for the other processes.

    Keys are numbered in step order. A key is deleted once a later step has run a collective:
    every process must have read it to take part in that step.
    """

    def __init__(self) -> None:
        self._client = _client()
        self._next = 0
        self._unsynced: list[int] = []
        self.closed = False

    def publish(self, obj: Any) -> None:
        """Makes ``obj`` (picklable) the next step every other process runs."""
        self._client.key_value_set_bytes(STEP_KEY.format(self._next), pickle.dumps(obj))
        self._unsynced.append(self._next)
        self._next += 1

    def synced(self) -> None:
        """Every process ran the latest published step's collectives: drop the older keys."""
        for seq in self._unsynced[:-1]:
            self._client.key_value_delete(STEP_KEY.format(seq))
        self._unsynced = self._unsynced[-1:]

    def close(self) -> None:
        """Tells the other processes to exit (idempotent)."""
        if not self.closed:
            self.closed = True
            self.publish(_STOP)


class LeaderRunner:
    """Process 0's ModelRunner: publishes each step before running it; otherwise the runner
    itself (every other attribute is the wrapped runner's)."""

    def __init__(self, runner: ModelRunner, publisher: StepPublisher) -> None:
        self._runner = runner
        self._publisher = publisher

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def execute_model(self, sched, token_mask=None):
        """Publishes ``(sched, token_mask)`` then runs the step (see
        ``ModelRunner.execute_model``): ``collect(dispatch(sched, token_mask))``.

        Raises:
          RuntimeError: the step failed on the mesh, most likely because another process died
            (the message says so; the original error is chained).
        """
        return self.collect(self.dispatch(sched, token_mask))

    def dispatch(self, sched, token_mask=None):
        """Publishes ``(sched, token_mask)`` then launches the step (``ModelRunner.dispatch``;
        async scheduling publishes step N+1 before it collects step N). Raises as
        ``execute_model``."""
        self._publisher.publish((sched, token_mask))
        with _mesh_errors():
            return self._runner.dispatch(sched, token_mask)

    def collect(self, pending):
        """Waits for a dispatched step (``ModelRunner.collect``); once it ran, every process has
        read its step, so older keys go. Raises as ``execute_model``."""
        with _mesh_errors():
            out = self._runner.collect(pending)
        if pending is not None:
            self._publisher.synced()
        return out


@contextlib.contextmanager
def _mesh_errors():
    try:
        yield
    except Exception as e:
        msg = f"a step failed on the multi-process mesh (did another process die?): {e}"
        _fail(msg)
        raise RuntimeError(msg) from e


_failed = threading.Event()


def _fail(message: str) -> None:
    if not _failed.is_set():
        _failed.set()
        logger.error("distributed: %s", message)


def _exit_handler(publisher: StepPublisher) -> None:
    """At exit of process 0: stop the workers, or, after a failure, leave at once with status 1
    (JAX's own shutdown would wait for the dead process until its heartbeat times out)."""
    if _failed.is_set():
        sys.stderr.flush()
        os._exit(1)
    try:
        publisher.close()
    except Exception as e:  # noqa: BLE001 - the runtime may already be gone
        logger.warning("distributed: could not tell the workers to stop: %s", e)


def lead(runner: ModelRunner) -> LeaderRunner:
    """Process 0: wraps ``runner`` so each step reaches every process, and stops the workers
    at exit."""
    publisher = StepPublisher()
    atexit.register(_exit_handler, publisher)
    return LeaderRunner(runner, publisher)


def run_worker(runner: ModelRunner) -> int:
    """Processes other than 0: runs every step process 0 publishes, in order, until it says
    stop. Returns the exit status (0 on stop).

    Raises:
      RuntimeError: the coordinator went away (process 0 died) or a step failed.
    """
    client = _client()
    seq = 0
    logger.info("distributed: worker ready, waiting for steps from process 0")
    while True:
        key = STEP_KEY.format(seq)
        try:
            data = client.blocking_key_value_get_bytes(key, _POLL_MS)
        except Exception as e:  # noqa: BLE001 - the client raises a plain error type
            if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
                continue
            raise RuntimeError(f"lost process 0's coordinator: {e}") from e
        step = pickle.loads(data)
        if isinstance(step, str) and step == _STOP:
            logger.info("distributed: process 0 stopped; worker exits after %d steps", seq)
            return 0
        sched, token_mask = step
        runner.execute_model(sched, token_mask)
        seq += 1
