"""Hugging Face ``config.json`` -> our frozen, hashable ``ModelArchConfig``.

Reads both config layouts in the wild: transformers <= 4 (``rope_theta`` and ``rope_scaling`` at
the top level) and transformers >= 5 (``rope_parameters`` holding ``rope_theta`` and
``rope_type``). Jax-free, so the engine config can import it cheaply.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jaxserve.model.registry import supported_architectures

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelLoadError(ValueError):
    """A model directory, its config or its weights cannot be used; the message names the path,
    field or tensor at fault."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters (Su et al. 2021, "RoFormer"), HF's names.

    Attributes:
      theta: base wavelength ``rope_theta``.
      rope_type: "default" | "linear" (positions divided by ``factor``) | "llama3"
        (Llama 3.1's frequency-dependent scaling, HF ``_compute_llama3_parameters``).
      factor, low_freq_factor, high_freq_factor, original_max_position_embeddings: scaling
        parameters; unused (None) for "default".
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None


@dataclasses.dataclass(frozen=True)
class ModelArchConfig:
    """The model's shape and per-architecture switches; static (hashable) under jit.

    Attributes:
      architecture: HF class name, one of ``registry.supported_architectures()``.
      vocab_size, hidden_size, intermediate_size, num_layers: sizes.
      num_heads, num_kv_heads, head_dim: attention heads (grouped-query attention when
        ``num_kv_heads < num_heads``); ``head_dim`` may differ from hidden_size // num_heads (Qwen3).
      rms_norm_eps: RMSNorm epsilon.
      rope: rotary embedding parameters.
      max_position_embeddings: longest sequence the model was trained for, tokens.
      tie_word_embeddings: the LM head reuses the token embedding matrix.
      qkv_bias: q/k/v projections have a bias (Qwen2, Llama ``attention_bias``).
      o_bias: the output projection has a bias (Llama ``attention_bias``).
      mlp_bias: the MLP projections have a bias (Llama ``mlp_bias``).
      qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
      layer_sliding_windows: per layer, the sliding-window size in tokens (a query attends to the
        keys at positions ``> q_pos - window``, HF ``sliding_window_overlay``) or None for full
        causal attention.
      bos_token_id: from config.json, or None.
      eos_token_ids: from config.json (int or list), possibly empty.
      torch_dtype: the checkpoint's dtype name as HF writes it ("bfloat16", "float32", ...), or None.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    layer_sliding_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if int(getattr(self, name)) <= 0:
                raise ModelLoadError(
                    f"config field {name} must be positive, got {getattr(self, name)}"
                )
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})"
            )
        if not self.layer_sliding_windows:
            object.__setattr__(self, "layer_sliding_windows", (None,) * self.num_layers)
        if len(self.layer_sliding_windows) != self.num_layers:
            raise ModelLoadError(
                f"layer_types has {len(self.layer_sliding_windows)} entries, expected num_hidden_layers "
                f"= {self.num_layers}"
            )

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelArchConfig:
        """Parses a HF ``config.json`` dict.

        Raises:
          ModelLoadError: unsupported architecture (naming it and the supported list), hidden_act
            other than silu, unsupported rope type, or a missing size field (naming it).
        """
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(hf.get("model_type", ""))
        if arch not in supported_architectures():
            raise ModelLoadError(
                f"unsupported architecture {arch or hf.get('model_type')!r}; supported: "
                f"{', '.join(supported_architectures())}"
            )
        arch = causal_lm_name(arch)
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(
                f"unsupported hidden_act {act!r} for {arch}; only 'silu' is implemented"
            )

        def req(name):
            if hf.get(name) is None:
                raise ModelLoadError(f"config.json lacks the required field {name!r}")
            return int(hf[name])

        num_heads = req("num_attention_heads")
        num_layers = req("num_hidden_layers")
        hidden = req("hidden_size")
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=req("vocab_size"),
            hidden_size=hidden,
            intermediate_size=req("intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(hf),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            layer_sliding_windows=_parse_sliding_windows(hf, arch, num_layers),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos)
            if isinstance(eos, list)
            else (() if eos is None else (int(eos),)),
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str) -> ModelArchConfig:
        """Reads ``model_dir/config.json``; ModelLoadError names the path when it is missing."""
        return cls.from_hf_config(read_hf_config(model_dir))

    @property
    def kv_elements_per_token(self) -> int:
        """KV cache elements per token, ``2 * num_layers * num_kv_heads * head_dim`` (K and V);
        multiply by the cache dtype's itemsize for bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def causal_lm_name(architecture: str) -> str:
    """A base model's architecture as its causal LM's ("Qwen3Model" -> "Qwen3ForCausalLM", whose
    switches it shares; it is served with ``--runner pooling``); any other name unchanged."""
    if architecture.endswith("Model") and architecture in supported_architectures():
        lm = architecture[: -len("Model")] + "ForCausalLM"
        if lm in supported_architectures():
            return lm
    return architecture


def read_hf_config(model_dir: str) -> dict[str, Any]:
    """Loads ``model_dir/config.json`` as a dict.

    Raises:
      ModelLoadError: the directory or the file is missing, or the file is not JSON.
    """
    if not os.path.isdir(model_dir):
        raise ModelLoadError(f"model directory not found: {model_dir}")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"config.json not found in model directory {model_dir}")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e


def _parse_rope(hf: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes rope_parameters (theta inside); older writes rope_theta + rope_scaling.
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if "factor" not in params:
        raise ModelLoadError(f"rope_scaling of type {rope_type!r} lacks 'factor'")
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(params["factor"]))
    for key in ("low_freq_factor", "high_freq_factor"):
        if key not in params:
            raise ModelLoadError(f"rope_scaling of type 'llama3' lacks {key!r}")
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))
        ),
    )


def _parse_sliding_windows(
    hf: dict[str, Any], arch: str, num_layers: int
) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not hf.get("use_sliding_window", False):
        window = None
    if window is None:
        return (None,) * num_layers
    window = int(window)
    if hf.get("layer_types"):
        return tuple(window if t == "sliding_attention" else None for t in hf["layer_types"])
    if arch == "MistralForCausalLM":
        return (window,) * num_layers
    # Qwen2/3 before layer_types: layers from max_window_layers on use the window.
    first = int(hf.get("max_window_layers", num_layers))
    return tuple(window if i >= first else None for i in range(num_layers))
