"""Reading a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) into
our layout, checked against the model it will serve (jax-free: numpy only).

PEFT stores, per adapted projection, ``<prefix>.<module>.lora_A.weight [r, in]`` and
``lora_B.weight [out, r]`` (torch's ``[out, in]`` orientation), with ``<prefix>`` =
``base_model.model.`` (+ the base model's ``model.``). We keep ``A [in, r]`` and ``B [r, out]``
as float32, with the scaling folded into ``B``: ``lora_alpha / r``, or ``lora_alpha /
sqrt(r)`` with ``use_rslora`` (Kalajdzievski 2023). Target modules must be among
``LORA_TARGETS`` and present in the model; anything the pool cannot serve (rank over
``--max-lora-rank``, DoRA, per-module rank or alpha patterns, trained biases, extra modules to
save, a shape that is not the model's) is refused with a ``LoRAAdapterError`` naming it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target (Hugging Face module names)."""


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served: missing file, bad config, rank over the limit, unknown
    target, shape mismatch. The message is one line naming the adapter and the field."""


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """One adapter in our layout, on the host.

    Attributes:
      name: the served name (``"model": name`` selects it).
      path: the directory it was read from.
      rank: its rank r (<= max_lora_rank).
      scaling: ``lora_alpha / r`` (or ``/ sqrt(r)`` with rsLoRA), already folded into ``weights``.
      weights: module path (``"layers.0.self_attn.q_proj"``) -> ``(A [in, r], B [r, out])``
        float32, flattened input and output axes.
    """

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        """Host bytes of its matrices."""
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _config(name: str, path: str) -> dict:
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isdir(path):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: no directory {path}")
    if not os.path.isfile(cfg_path):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: missing {cfg_path}")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: unreadable {cfg_path}: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {cfg_path} is not a JSON object")
    return cfg


def load_peft_adapter(
    name: str,
    path: str,
    *,
    max_rank: int,
    targets: dict[str, tuple[int, int]],
) -> LoRAAdapter:
    """Reads and checks the PEFT adapter in directory ``path``.

    Args:
      name: its served name.
      path: the adapter directory.
      max_rank: ``--max-lora-rank``.
      targets: the model's adaptable projections, module path -> ``(in, out)`` sizes.

    Raises:
      LoRAAdapterError: anything that cannot be served (one line naming the field).
    """
    cfg = _config(name, path)
    where = f"LoRA adapter {name!r} ({path})"
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type {peft_type!r} is not LORA")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAAdapterError(f"{where}: rank {rank} is over --max-lora-rank {max_rank}")
    alpha = cfg.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)):
        raise LoRAAdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    for key in ("use_dora", "fan_in_fan_out", "lora_bias"):
        if cfg.get(key):
            raise LoRAAdapterError(f"{where}: {key}=true is not supported")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if cfg.get(key):
            raise LoRAAdapterError(f"{where}: {key} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{where}: bias={cfg['bias']!r} is not supported (only 'none')")
    wanted = cfg.get("target_modules")
    if isinstance(wanted, list):
        unknown = sorted(set(wanted) - set(LORA_TARGETS))
        if unknown:
            raise LoRAAdapterError(
                f"{where}: target_modules {unknown} are not among {list(LORA_TARGETS)}"
            )
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise LoRAAdapterError(f"{where}: missing {file}")
    from safetensors.numpy import load_file

    try:
        tensors = load_file(file)
    except Exception as e:  # a truncated or foreign file
        raise LoRAAdapterError(f"{where}: unreadable {file}: {e}") from None
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        module, sep, part = key.partition(".lora_")
        if not sep or part not in ("A.weight", "B.weight"):
            raise LoRAAdapterError(f"{where}: unexpected tensor {key!r}")
        for prefix in ("base_model.model.model.", "base_model.model."):
            if module.startswith(prefix):
                module = module[len(prefix) :]
                break
        proj = module.rsplit(".", 1)[-1]
        if proj not in LORA_TARGETS:
            raise LoRAAdapterError(f"{where}: target {module!r} is not among {list(LORA_TARGETS)}")
        if module not in targets:
            raise LoRAAdapterError(f"{where}: target {module!r} is not in this model")
        pairs.setdefault(module, {})[part[0]] = value
    if not pairs:
        raise LoRAAdapterError(f"{where}: {file} holds no LoRA tensors")
    weights = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"{where}: {module} lacks lora_{'B' if 'A' in ab else 'A'}")
        n_in, n_out = targets[module]
        a, b = ab["A"], ab["B"]
        if a.shape != (rank, n_in) or b.shape != (n_out, rank):
            raise LoRAAdapterError(
                f"{where}: {module} lora_A {list(a.shape)} / lora_B {list(b.shape)} do not "
                f"match the model's [{rank}, {n_in}] / [{n_out}, {rank}]"
            )
        weights[module] = (
            np.ascontiguousarray(a.T, np.float32),
            np.ascontiguousarray(b.T.astype(np.float32) * np.float32(scaling)),
        )
    return LoRAAdapter(name, path, rank, float(scaling), weights)
