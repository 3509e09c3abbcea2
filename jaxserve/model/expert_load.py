"""Expert load of a MoE model: tokens routed to each expert of each MoE layer, counted on the
host (opt-in, ``--expert-load-metrics``).

Each ``SparseMoeBlock`` given a recorder (``attach_recorder``) sends its step's per-expert token
counts (real tokens only, not the bucket's padding) through ``jax.debug.callback``: one small
device-to-host copy per MoE layer per step, which is why it is off by default. The recorder
sums them; ``/metrics`` exports the running totals per (layer, expert) and each layer's max/mean
over the interval since the previous scrape (``jaxserve.metrics.EngineMetrics.add_expert_load``),
and ``benchmarks/bench_moe.py`` prints them. A perfectly balanced layer has max/mean 1; a
layer sending every token to its top-k experts only has ``E / k``.

Numpy and threading only (the callback runs on a runtime thread).
"""

from __future__ import annotations

import threading

import numpy as np


class ExpertLoadRecorder:
    """Running token counts per (MoE layer, expert).

    Args:
      layers: the decoder-layer indices of the MoE layers, in order (the rows).
      num_experts: E (the columns).
    """

    def __init__(self, layers: tuple[int, ...], num_experts: int) -> None:
        self.layers = tuple(layers)
        self.num_experts = num_experts
        self._row = {layer: i for i, layer in enumerate(self.layers)}
        self._totals = np.zeros((len(self.layers), num_experts), np.int64)
        self._lock = threading.Lock()

    def record(self, layer_index: int, counts) -> None:
        """Adds one step's ``counts`` (int ``[E]``) to decoder layer ``layer_index``'s row (the
        MoE layer's ``jax.debug.callback``)."""
        with self._lock:
            self._totals[self._row[int(layer_index)]] += np.asarray(counts, np.int64)

    def totals(self) -> np.ndarray:
        """int64 ``[num MoE layers, E]``: tokens routed to each expert since start (a copy)."""
        with self._lock:
            return self._totals.copy()


def max_over_mean(counts: np.ndarray) -> np.ndarray:
    """Per row of ``counts [L, E]``, the most loaded expert's tokens over the mean: float64
    ``[L]``, 1.0 for a perfectly balanced layer, NaN for a row with no tokens."""
    counts = np.asarray(counts, np.float64)
    mean = counts.mean(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mean > 0, counts.max(axis=-1) / np.where(mean > 0, mean, 1.0), np.nan)
