"""Hugging Face ``config.json`` -> our frozen, hashable ``ModelArchConfig``.

Reads both config layouts in the wild: transformers <= 4 (``rope_theta`` and ``rope_scaling`` at
the top level) and transformers >= 5 (``rope_parameters`` holding ``rope_theta`` and
``rope_type``; Gemma 3: one per layer type). Gemma configs may omit fields whose
transformers defaults they rely on (a ``Gemma3ForConditionalGeneration`` config's
``text_config`` names only a few); we fill them from those defaults (``_GEMMA_DEFAULTS``).
Jax-free, so the engine config can import it cheaply.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jaxserve.model.registry import supported_architectures

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
"""MLP gate activations, HF names (``jaxserve.model.layers.mlp.ACTIVATIONS``)."""
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")


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
class MoEConfig:
    """A mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE), HF's names in brackets.

    Attributes:
      num_experts: routed experts per sparse layer (``num_local_experts`` / ``num_experts``).
      top_k: experts each token reaches (``num_experts_per_tok``); dropless, no capacity factor.
      intermediate_size: each expert's SwiGLU width (``moe_intermediate_size``; Mixtral's
        ``intermediate_size``).
      norm_topk_prob: renormalise the top-k softmax probabilities to sum to 1 (Mixtral always;
        Qwen's ``norm_topk_prob``).
      shared_expert_intermediate_size: width of the always-on shared expert and its sigmoid gate
        (Qwen2-MoE), 0 for none.
      sparse_layers: per layer, True where the feed-forward is the MoE block, False where it is
        a dense SwiGLU of ``ModelArchConfig.intermediate_size`` (Qwen's ``mlp_only_layers`` and
        ``decoder_sparse_step``).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    sparse_layers: tuple[bool, ...] = ()

    def __post_init__(self):
        for name in ("num_experts", "top_k", "intermediate_size"):
            if int(getattr(self, name)) <= 0:
                raise ModelLoadError(
                    f"config field {name} must be positive, got {getattr(self, name)}"
                )
        if self.top_k > self.num_experts:
            raise ModelLoadError(
                f"num_experts_per_tok ({self.top_k}) exceeds the number of experts "
                f"({self.num_experts})"
            )


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
      qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3).
      hidden_act: the MLP's gate activation, one of ``SUPPORTED_ACTIVATIONS`` (Gemma:
        "gelu_pytorch_tanh", GeGLU).
      rms_norm_unit_offset: every RMSNorm scales by ``1 + weight`` in float32 (Gemma) instead of
        ``weight`` (``jaxserve.model.layers.norm.RMSNorm``).
      query_pre_attn_scalar: attention scores are scaled by ``query_pre_attn_scalar ** -0.5``
        (Gemma) instead of ``head_dim ** -0.5``; None: the latter.
      attn_logit_softcapping: attention scores become ``cap * tanh(s / cap)`` after the scale
        (Gemma 2), or None.
      final_logit_softcapping: the LM head's logits become ``cap * tanh(x / cap)`` (Gemma 2),
        or None.
      layer_sliding_windows: per layer, the sliding-window size in tokens (a query attends to the
        keys at positions ``> q_pos - window``, HF ``sliding_window_overlay``) or None for full
        causal attention.
      sliding_rope: the RoPE of the sliding-window layers when it differs from ``rope`` (Gemma 3:
        local base 10,000, no scaling, while global layers use ``rope``), else None.
      bos_token_id: from config.json, or None.
      eos_token_ids: from config.json (int or list), possibly empty.
      torch_dtype: the checkpoint's dtype name as HF writes it ("bfloat16", "float32", ...), or None.
      moe: the mixture-of-experts feed-forward, or None for a dense model.
      draft_vocab_size: a draft model's reduced LM head (EAGLE-3's ``draft_vocab_size``, the
        frequency-ranked vocabulary of FR-Spec): its head scores only these many of the
        ``vocab_size`` tokens, the checkpoint's ``d2t`` tensor maps its ids to the target's;
        None: the head covers the whole vocabulary.
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
    hidden_act: str = "silu"
    rms_norm_unit_offset: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    layer_sliding_windows: tuple[int | None, ...] = ()
    sliding_rope: RopeConfig | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    moe: MoEConfig | None = None
    draft_vocab_size: int | None = None

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
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ModelLoadError(
                f"unsupported hidden_act {self.hidden_act!r} for {self.architecture}; supported: "
                f"{', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not float(value) > 0:
                raise ModelLoadError(f"config field {name} must be positive or null, got {value}")
        if not self.layer_sliding_windows:
            object.__setattr__(self, "layer_sliding_windows", (None,) * self.num_layers)
        if len(self.layer_sliding_windows) != self.num_layers:
            raise ModelLoadError(
                f"layer_types has {len(self.layer_sliding_windows)} entries, expected num_hidden_layers "
                f"= {self.num_layers}"
            )
        if self.draft_vocab_size is not None and not (
            0 < self.draft_vocab_size <= self.vocab_size and not self.tie_word_embeddings
        ):
            raise ModelLoadError(
                f"config field draft_vocab_size ({self.draft_vocab_size}) must be in 1.."
                f"{self.vocab_size} (vocab_size) with an untied LM head (tie_word_embeddings false)"
            )
        if self.moe is not None and len(self.moe.sparse_layers) != self.num_layers:
            raise ModelLoadError(
                f"the MoE config names {len(self.moe.sparse_layers)} layers, expected "
                f"num_hidden_layers = {self.num_layers}"
            )

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelArchConfig:
        """Parses a HF ``config.json`` dict.

        A ``Gemma3ForConditionalGeneration`` config is read for its language model alone
        (``text_config``; the vision tower is not served).

        Raises:
          ModelLoadError: unsupported architecture (naming it and the supported list), an
            unsupported hidden_act or rope type, a bidirectional Gemma 3 (an embedding model),
            or a missing size field (naming it).
        """
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(hf.get("model_type", ""))
        if arch not in supported_architectures():
            raise ModelLoadError(
                f"unsupported architecture {arch or hf.get('model_type')!r}; supported: "
                f"{', '.join(supported_architectures())}"
            )
        arch = causal_lm_name(arch)
        gemma = arch in GEMMA_ARCHITECTURES
        if gemma:
            hf = _gemma_hf_config(hf, arch)
        act = hf.get("hidden_activation") if gemma else hf.get("hidden_act", "silu")

        def req(name):
            if hf.get(name) is None:
                raise ModelLoadError(f"config.json lacks the required field {name!r}")
            return int(hf[name])

        num_heads = req("num_attention_heads")
        num_layers = req("num_hidden_layers")
        hidden = req("hidden_size")
        is_qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        is_gemma2 = arch == "Gemma2ForCausalLM"
        attention_bias = bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        if gemma and not is_gemma2:  # Gemma 3: global and local RoPE
            rope, sliding_rope = _parse_gemma3_ropes(hf)
        else:
            rope, sliding_rope = _parse_rope(hf), None
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
            rope=rope,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=(is_qwen2 and bool(hf.get("qkv_bias", True))) or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
            or (gemma and not is_gemma2),
            hidden_act=act,
            rms_norm_unit_offset=gemma,
            query_pre_attn_scalar=_opt_float(hf.get("query_pre_attn_scalar")) if gemma else None,
            # Gemma 3 has the field but transformers and vLLM ignore it (always None in practice).
            attn_logit_softcapping=_opt_float(hf.get("attn_logit_softcapping"))
            if is_gemma2
            else None,
            # transformers' Gemma3ForConditionalGeneration never applies it (vLLM does); every
            # released Gemma 3 config has null.
            final_logit_softcapping=_opt_float(hf.get("final_logit_softcapping"))
            if gemma and arch != "Gemma3ForConditionalGeneration"
            else None,
            layer_sliding_windows=_parse_sliding_windows(hf, arch, num_layers),
            sliding_rope=sliding_rope,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos)
            if isinstance(eos, list)
            else (() if eos is None else (int(eos),)),
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
            moe=_parse_moe(hf, arch, num_layers),
            draft_vocab_size=None
            if hf.get("draft_vocab_size") in (None, hf.get("vocab_size"))
            else int(hf["draft_vocab_size"]),
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
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_MOE_ARCHS = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

# transformers' Gemma2Config / Gemma3TextConfig defaults, for the fields a config may omit.
_GEMMA_COMMON_DEFAULTS = dict(
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    bos_token_id=2,
    eos_token_id=1,
)
_GEMMA_DEFAULTS = {
    "Gemma2ForCausalLM": dict(
        _GEMMA_COMMON_DEFAULTS,
        vocab_size=256000,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    "Gemma3ForCausalLM": dict(
        _GEMMA_COMMON_DEFAULTS,
        vocab_size=262208,
        max_position_embeddings=131072,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        sliding_window_pattern=6,
    ),
}
_GEMMA_DEFAULTS["Gemma3ForConditionalGeneration"] = _GEMMA_DEFAULTS["Gemma3ForCausalLM"]


def _gemma_hf_config(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """A Gemma config with transformers' defaults filled in; for a
    ``Gemma3ForConditionalGeneration`` its ``text_config``, with the top level's dtype, tied
    embeddings and special ids where the text config has none.

    Raises:
      ModelLoadError: ``use_bidirectional_attention`` (EmbeddingGemma, not a causal LM).
    """
    if arch == "Gemma3ForConditionalGeneration":
        text = dict(hf.get("text_config") or {})
        for key in ("torch_dtype", "dtype", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
            if text.get(key) is None and hf.get(key) is not None:
                text[key] = hf[key]
        hf = text
    if hf.get("use_bidirectional_attention"):
        raise ModelLoadError(
            f"{arch} with use_bidirectional_attention (an embedding model) is not supported"
        )
    return {**_GEMMA_DEFAULTS[arch], **hf}


def _opt_float(x: Any) -> float | None:
    return None if x is None else float(x)


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


def _parse_gemma3_ropes(hf: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """Gemma 3's (global, local) RoPE: transformers >= 5 nests them in ``rope_parameters`` by
    layer type; older configs give the global one as ``rope_theta`` + ``rope_scaling`` and the
    local base as ``rope_local_base_freq``."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full = _parse_rope({"rope_parameters": params["full_attention"], "rope_theta": 1e6})
        local = params.get("sliding_attention") or {}
        return full, _parse_rope({"rope_parameters": local, "rope_theta": 1e4})
    full = _parse_rope({k: v for k, v in hf.items() if k != "rope_parameters"})
    return full, RopeConfig(theta=float(hf["rope_local_base_freq"]))


def _parse_sliding_windows(
    hf: dict[str, Any], arch: str, num_layers: int
) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    qwen = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
    if arch in qwen and not hf.get("use_sliding_window", False):
        window = None
    if not window:  # None, or Qwen2-MoE's 0 with the window off
        return (None,) * num_layers
    window = int(window)
    if hf.get("layer_types"):
        return tuple(window if t == "sliding_attention" else None for t in hf["layer_types"])
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return (window,) * num_layers
    if arch == "Gemma2ForCausalLM":  # even layers local, odd layers global
        return tuple(window if i % 2 == 0 else None for i in range(num_layers))
    if arch in GEMMA_ARCHITECTURES:  # Gemma 3: every sliding_window_pattern-th layer global
        pattern = int(hf["sliding_window_pattern"])
        return tuple(window if (i + 1) % pattern else None for i in range(num_layers))
    # Qwen2/3 before layer_types: layers from max_window_layers on use the window.
    first = int(hf.get("max_window_layers", num_layers))
    return tuple(window if i >= first else None for i in range(num_layers))


def _parse_moe(hf: dict[str, Any], arch: str, num_layers: int) -> MoEConfig | None:
    """The MoE fields of a Mixtral / Qwen2-MoE / Qwen3-MoE config, None for other architectures.

    Raises:
      ModelLoadError: a missing expert count or top-k (naming the field), or bad sizes.
    """
    if arch not in _MOE_ARCHS:
        return None
    num_experts = hf.get("num_local_experts") or hf.get("num_experts")
    if not num_experts:
        raise ModelLoadError(f"config.json of {arch} lacks num_local_experts / num_experts")
    if hf.get("num_experts_per_tok") is None:
        raise ModelLoadError("config.json lacks the required field 'num_experts_per_tok'")
    if arch == "MixtralForCausalLM":
        # Every layer sparse; the experts are intermediate_size wide; top-k always renormalised.
        width, norm, shared, sparse = hf["intermediate_size"], True, 0, (True,) * num_layers
    else:
        if hf.get("moe_intermediate_size") is None:
            raise ModelLoadError("config.json lacks the required field 'moe_intermediate_size'")
        width = hf["moe_intermediate_size"]
        norm = bool(hf.get("norm_topk_prob", False))
        shared = int(hf.get("shared_expert_intermediate_size") or 0)
        dense = set(hf.get("mlp_only_layers") or ())
        step = int(hf.get("decoder_sparse_step") or 1)
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return MoEConfig(
        num_experts=int(num_experts),
        top_k=int(hf["num_experts_per_tok"]),
        intermediate_size=int(width),
        norm_topk_prob=norm,
        shared_expert_intermediate_size=shared if arch == "Qwen2MoeForCausalLM" else 0,
        sparse_layers=sparse,
    )
