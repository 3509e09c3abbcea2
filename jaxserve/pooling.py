"""Pooling models (embeddings): which runner a model gets, how its hidden states are pooled, and
what is done to a pooled vector before a client sees it. Jax-free (numpy only).

vLLM's names: ``--runner {auto,generate,pooling}``, ``--convert {auto,none,embed}`` (a causal-LM
checkpoint served as an embedding model) and ``--pooler-config`` (JSON, ``{"pooling_type":
"MEAN", "normalize": false}``). Without ``--pooler-config`` the pooling is read from the
checkpoint's sentence-transformers files when present (``modules.json`` naming a ``Pooling``
module whose ``config.json`` sets ``pooling_mode_lasttoken`` / ``pooling_mode_mean_tokens`` /
``pooling_mode_cls_token``, and a ``Normalize`` module); otherwise LAST with normalisation (the
Qwen3-Embedding recipe, vLLM's default for a converted decoder).

The runner pools the final-norm hidden states of a request's prompt (``ModelRunner`` in pooling
mode): LAST takes the last prompt token's, CLS the first's, MEAN the average over every prompt
token (summed chunk by chunk across prefill steps). MEAN and CLS need every token computed, so
the engine turns prefix caching off for them; LAST keeps it (the last token is always computed).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNER_CHOICES = ("auto", "generate", "pooling")
CONVERT_CHOICES = ("auto", "none", "embed")

# sentence-transformers' Pooling config key -> our pooling type
_ST_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model turns a prompt's hidden states into one vector.

    Attributes:
      pooling_type: "LAST", "MEAN" or "CLS".
      normalize: L2-normalise the pooled vector (after ``dimensions`` truncation).
      source: where it was read from (for the start-up line): "--pooler-config",
        "sentence-transformers" or "default".

    Raises:
      ValueError: an unknown pooling_type.
    """

    pooling_type: str = "LAST"
    normalize: bool = True
    source: str = "default"

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooler_config: pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                f"got {self.pooling_type!r}"
            )


def read_sentence_transformers_pooling(model_dir: str) -> PoolerConfig | None:
    """The pooling a sentence-transformers checkpoint declares, or None without its files.

    Raises:
      ValueError: the files exist but name a pooling mode we do not run (max, weighted mean,
        several at once), naming the file.
    """
    path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        modules = json.load(f)
    pooling_dir = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith(".Pooling"):
            pooling_dir = os.path.join(model_dir, module.get("path", ""))
        elif kind.endswith(".Normalize"):
            normalize = True
    if pooling_dir is None:
        return None
    config_path = os.path.join(pooling_dir, "config.json")
    with open(config_path) as f:
        pooling: dict[str, Any] = json.load(f)
    modes = [k for k, v in pooling.items() if k.startswith("pooling_mode_") and v]
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(
            f"{config_path}: pooling modes {modes} are not supported (one of "
            f"{', '.join(_ST_MODES)}); pass --pooler-config to choose one"
        )
    return PoolerConfig(_ST_MODES[modes[0]], normalize, "sentence-transformers")


def resolve_pooler_config(model_dir: str, pooler_config: str | None) -> PoolerConfig:
    """``--pooler-config`` (JSON; keys ``pooling_type``, ``normalize``) over the checkpoint's
    sentence-transformers files over the default (LAST, normalised).

    Raises:
      ValueError: bad JSON or an unknown key or value (naming ``pooler_config``).
    """
    base = None
    if os.path.isdir(model_dir):
        base = read_sentence_transformers_pooling(model_dir)
    base = base or PoolerConfig()
    if not pooler_config:
        return base
    try:
        override = json.loads(pooler_config)
    except json.JSONDecodeError as exc:
        raise ValueError(f"pooler_config: not JSON ({exc})") from None
    if not isinstance(override, dict) or set(override) - {"pooling_type", "normalize"}:
        raise ValueError(
            "pooler_config: a JSON object with pooling_type and/or normalize, got "
            f"{pooler_config!r}"
        )
    kind = str(override.get("pooling_type", base.pooling_type)).upper()
    normalize = override.get("normalize", base.normalize)
    if not isinstance(normalize, bool):
        raise ValueError(f"pooler_config: normalize must be true or false, got {normalize!r}")
    return PoolerConfig(kind, normalize, "--pooler-config")


def resolve_runner(runner: str, convert: str, architecture: str) -> str:
    """``--runner`` and ``--convert`` -> "generate" or "pooling".

    "auto" picks pooling for an embedding checkpoint (an architecture named ``*Model``, such as
    ``Qwen3Model``) or ``--convert embed``, else generate.

    Raises:
      ValueError: an unknown choice, or ``--convert embed`` with ``--runner generate``.
    """
    if runner not in RUNNER_CHOICES:
        raise ValueError(f"runner must be one of {', '.join(RUNNER_CHOICES)}, got {runner!r}")
    if convert not in CONVERT_CHOICES:
        raise ValueError(f"convert must be one of {', '.join(CONVERT_CHOICES)}, got {convert!r}")
    if convert == "embed" and runner == "generate":
        raise ValueError("convert: --convert embed serves embeddings; use it with --runner pooling")
    if runner != "auto":
        return runner
    if convert == "embed" or architecture.endswith("Model"):
        return "pooling"
    return "generate"


def finish_embedding(
    pooled: np.ndarray, *, normalize: bool, dimensions: int | None = None
) -> np.ndarray:
    """A pooled vector as a client gets it: the first ``dimensions`` entries (Matryoshka
    truncation) then L2-normalised if ``normalize`` (vLLM's order).

    Args:
      pooled: float32 ``[hidden_size]`` from the runner.
      dimensions: keep this many leading entries (None: all).

    Returns:
      float32 ``[dimensions or hidden_size]``.

    Raises:
      ValueError: dimensions < 1 or larger than the vector (naming ``dimensions``).
    """
    vec = np.asarray(pooled, np.float32)
    if dimensions is not None:
        if not 1 <= dimensions <= vec.shape[-1]:
            raise ValueError(
                f"dimensions must be between 1 and the model's {vec.shape[-1]}, got {dimensions}"
            )
        vec = vec[..., :dimensions]
    if normalize:
        norm = float(np.linalg.norm(vec))
        vec = vec / max(norm, 1e-12)
    return vec.astype(np.float32)


def cosine_similarity(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine of two float vectors of one length (0 when either is all zeros)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    denom = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b) / denom if denom else 0.0
