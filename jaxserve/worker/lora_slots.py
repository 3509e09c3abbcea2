"""The runner's side of multi-LoRA (#33): the model's adapter pool and each step's slots.

``enable_model_lora`` gives every adaptable projection of the decoder layers (``Linear``s
named in ``jaxserve.lora.peft.LORA_TARGETS``) a zeroed pool of ``max_loras`` slots of rank
``max_lora_rank``, before the model is placed on its mesh, so adapters shard like their base
layers. ``LoRASlots`` then writes an adapter into a slot (one ``.at[slot].set`` per pool array
of the runner's flat parameter list: no recompile, the step executables take the pools as
inputs) and builds each step's ``LoraBatch`` from the adapter of each of its sequences. A step
with no adapter token gets None, and the runner runs the same executable as without
``--enable-lora``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.lora.peft import LORA_TARGETS, LoRAAdapter
from jaxserve.model.layers.linear import Linear
from jaxserve.model.layers.lora import LoraBatch


def _module_name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def enable_model_lora(model: nnx.Module, max_loras: int, max_rank: int) -> dict:
    """Adds the adapter pools to ``model``'s decoder projections, in place.

    Returns:
      module path (``"layers.0.self_attn.q_proj"``) -> ``(in, out)`` sizes, the checkpoint's
      shapes that adapters are checked against (``LoRAManager``'s ``targets``).

    Raises:
      ValueError: the model has no adaptable projection.
    """
    dtype = getattr(model, "dtype", jnp.float32)
    targets = {}
    for path, module in nnx.iter_graph(model):
        if isinstance(module, Linear) and path and str(path[-1]) in LORA_TARGETS:
            if path[0] != "layers":
                continue
            module.enable_lora(max_loras, max_rank, dtype)
            targets[_module_name(path)] = (math.prod(module.in_shape), math.prod(module.out_shape))
    if not targets:
        raise ValueError("--enable-lora: this model has no projection LoRA adapters can target")
    return targets


class LoRASlots:
    """Writes adapters into the device pools held in ``params`` and builds step batches.

    Args:
      model: the placed model (its ``Linear`` pools' current shapes: heads may have been
        replicated for tensor parallelism since ``enable_model_lora``).
      targets: ``enable_model_lora``'s result (the checkpoint's shapes).
      state: the model's ``nnx.State`` whose flattened leaves are ``params``.
      params: returns the runner's flat parameter list (a new list after a sleep-mode wake-up),
        whose pool leaves ``write_slot`` replaces in place.
      max_loras: slots.
      backend: the ``lora_delta`` backend (``jaxserve.model.layers.lora.LORA_BACKENDS``).
    """

    def __init__(
        self, model, targets, state, params: Callable[[], list], max_loras: int, backend: str
    ):
        self._params, self.max_loras, self.backend = params, max_loras, backend
        leaf_index = {}
        for i, (kp, _) in enumerate(jax.tree_util.tree_flatten_with_path(state)[0]):
            keys = tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in kp)
            leaf_index[keys[:-1] if keys[-1] == "value" else keys] = i
        # module -> (index of lora_a, index of lora_b, its Linear, original in/out shapes)
        self.modules = {}
        for path, module in nnx.iter_graph(model):
            name = _module_name(path)
            if isinstance(module, Linear) and name in targets:
                ia = leaf_index[(*path, "lora_a")]
                ib = leaf_index[(*path, "lora_b")]
                self.modules[name] = (ia, ib, module)
        assert set(self.modules) == set(targets), sorted(set(targets) - set(self.modules))
        # every pool's slot written in one dispatch (not donated: a step in flight may still
        # read the old pools under async scheduling)
        self._set = jax.jit(
            lambda pools, slot, values: tuple(
                p.at[slot].set(v.astype(p.dtype)) for p, v in zip(pools, values)
            )
        )

    def write_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Puts ``adapter``'s matrices (zero-padded to the pool's rank; zeros for a projection
        it does not target) into ``slot`` of every pool; None clears the slot."""
        params = self._params()
        indices, values = [], []
        for name, (ia, ib, lin) in self.modules.items():
            pool_a, pool_b = params[ia], params[ib]
            rank = pool_a.shape[-1]
            a = np.zeros((math.prod(lin.in_shape), rank), np.float32)
            b = np.zeros((rank, math.prod(lin.out_shape)), np.float32)
            if adapter is not None and name in adapter.weights:
                wa, wb = adapter.weights[name]
                wa = _fit_input(wa, lin.in_shape)
                wb = _fit_output(wb, lin.out_shape)
                a[:, : wa.shape[1]] = wa
                b[: wb.shape[0]] = wb
            indices += [ia, ib]
            values += [a.reshape(pool_a.shape[1:]), b.reshape(pool_b.shape[1:])]
        pools = self._set(tuple(params[i] for i in indices), np.int32(slot), tuple(values))
        for i, pool in zip(indices, pools):
            params[i] = pool

    def step_batch(
        self, seq_slots: np.ndarray, num_scheduled: np.ndarray, num_tokens: int
    ) -> LoraBatch | None:
        """The step's ``LoraBatch``: sequence ``i``'s ``num_scheduled[i]`` tokens (laid out in
        step order) get ``seq_slots[i]`` (-1: base model), padding up to ``num_tokens`` -1;
        None when no token has an adapter."""
        if not (seq_slots >= 0).any():
            return None
        tokens = np.full(num_tokens, -1, np.int32)
        slots = np.repeat(np.asarray(seq_slots, np.int32), num_scheduled)
        tokens[: slots.size] = slots
        return LoraBatch.from_slots(tokens, self.max_loras, self.backend)

    def padding_batch(self, num_tokens: int) -> LoraBatch:
        """A ``LoraBatch`` of ``num_tokens`` tokens on slot 0, for compiling the LoRA step."""
        return LoraBatch.from_slots(np.zeros(num_tokens, np.int32), self.max_loras, self.backend)


def _fit_input(a: np.ndarray, in_shape: tuple) -> np.ndarray:
    """``A [in, r]`` of the checkpoint's input size onto a replicated input axis 0 (tensor
    parallelism's repeated query heads feeding o_proj): the first copy keeps the rows, the
    others are zero, as ``Linear.repeat_input`` does for the weight."""
    n_in = math.prod(in_shape)
    if a.shape[0] == n_in:
        return a
    reps = n_in // a.shape[0]
    head = in_shape[0] // reps
    x = a.reshape(head, 1, -1, a.shape[1])
    x = np.concatenate([x, np.zeros((head, reps - 1, *x.shape[2:]), a.dtype)], axis=1)
    return x.reshape(n_in, a.shape[1])


def _fit_output(b: np.ndarray, out_shape: tuple) -> np.ndarray:
    """``B [r, out]`` onto a replicated output axis 0 (repeated KV or query heads), as
    ``Linear.repeat_output`` does for the weight."""
    n_out = math.prod(out_shape)
    if b.shape[1] == n_out:
        return b
    reps = n_out // b.shape[1]
    x = b.reshape(b.shape[0], out_shape[0] // reps, -1)
    return np.repeat(x, reps, axis=1).reshape(b.shape[0], n_out)
