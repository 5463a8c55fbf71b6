"""ModelArchConfig: the architecture of a checkpoint (the Llama family, Gemma 3), read from its
`config.json`.

Both config.json generations are understood: the old one (`rope_theta` and `rope_scaling` at
the top level, Gemma's `rope_local_base_freq`, `torch_dtype`) and transformers 5's
(`rope_parameters`, per layer type for Gemma 3; `dtype`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

GEMMA3 = "Gemma3ForCausalLM"
# transformers' layer types (Gemma 3's `layer_types`)
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
# Gemma3TextConfig's defaults, for the keys a config.json may leave out
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
    "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "hidden_activation": "gelu_pytorch_tanh",
}
GEMMA3_ROPE_THETAS = {FULL_ATTENTION: 1_000_000.0, SLIDING_ATTENTION: 10_000.0}
# Without `layer_types`, every Nth layer is full, the others slide (transformers' default N)
GEMMA3_LAYER_PATTERN = 6
GEMMA3_ACTIVATIONS = ("gelu_pytorch_tanh",)  # GELU, tanh approximation (F.gelu's "tanh")
SUPPORTED_ROPE_TYPES = ("llama3", "linear")
_ROPE_KEYS = {  # the keys each scaling type needs
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_ROPE_THETA = 10000.0  # transformers' default when a config names none
DEFAULT_RMS_NORM_EPS = 1e-6


@dataclass(frozen=True)
class ModelArchConfig:
    """Shapes and hyper-parameters the model needs; `rope_scaling` is None or a llama3/linear
    dict (the keys of transformers' `rope_parameters`)."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = DEFAULT_RMS_NORM_EPS
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False  # bias on o_proj (Llama's attention_bias covers it, Qwen2's not)
    dtype: str = "float32"  # the checkpoint's dtype name
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mistral's window is not applied (full attention, exact within `sliding_window` tokens);
    # Gemma 3's is, on the layers `layer_windows` names
    sliding_window: int | None = None
    hicache_embedded: str | None = None  # set for the generated embedded model
    # Gemma 3 (the Llama family leaves these at their defaults)
    layer_windows: tuple[int | None, ...] = ()  # per layer its window W, None: full; () none
    query_pre_attn_scalar: float | None = None  # q.k scaled by this ** -0.5 (None: head_dim)
    rope_local_theta: float | None = None  # the RoPE base of the window layers
    hidden_act: str = "silu"  # the MLP's gate activation

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"config.json: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"config.json: num_attention_heads={self.num_attention_heads} is not a multiple "
                f"of num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"config.json: head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"config.json: dtype {self.dtype!r} is not one of {list(_DTYPES)}")
        if self.layer_windows and len(self.layer_windows) != self.num_hidden_layers:
            raise ValueError(f"config.json: {len(self.layer_windows)} layer types for "
                             f"{self.num_hidden_layers} layers")
        if any(w is not None and w < 1 for w in self.layer_windows):
            raise ValueError(f"config.json: sliding_window must be >= 1, got {self.layer_windows}")

    def window_of(self, layer: int) -> int | None:
        """The sliding window W of `layer`: its query at position p reads the keys at
        `p - W < j <= p`; None for a full-attention layer (every layer of a model without
        applied windows)."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def attention_scale(self) -> float | None:
        """What q.k is multiplied by (Gemma's `query_pre_attn_scalar ** -0.5`); None for the
        default, `head_dim ** -0.5`."""
        if self.query_pre_attn_scalar is None:
            return None
        return self.query_pre_attn_scalar ** -0.5

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_file(cls, path: str | Path) -> ModelArchConfig:
        """Parse `path` (a config.json, or a folder holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no model config: {path} does not exist")
        with path.open(encoding="utf-8") as f:
            return cls.from_hf_dict(json.load(f))

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> ModelArchConfig:
        """Parse a Hugging Face config dict; ValueError for an unsupported model."""
        arch = _architecture(d)
        defaults, own_fields = _ARCHITECTURES[arch]
        d = {**defaults, **d}
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        if d.get("mlp_bias"):
            raise ValueError("config.json: mlp_bias=true is not supported")
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            vocab_size=int(d["vocab_size"]),
            rms_norm_eps=float(d.get("rms_norm_eps", DEFAULT_RMS_NORM_EPS)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            dtype=_dtype_name(d),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_eos_ids(d.get("eos_token_id")),
            hicache_embedded=d.get("hicache_embedded"),
            **own_fields(d, arch),
        )


def _llama_fields(d: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """The Llama family's own keys: RoPE, the q/k/v (Qwen2) or every (Llama) bias, the
    window (not applied)."""
    theta, scaling = _rope(d)
    qwen2 = arch == "Qwen2ForCausalLM"
    bias = bool(d.get("attention_bias", qwen2))
    return {"rope_theta": theta, "rope_scaling": scaling, "attention_bias": bias,
            "o_proj_bias": bias and not qwen2,
            "sliding_window": d.get("sliding_window") if d.get("use_sliding_window", True)
            else None}


def _gemma3_fields(d: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """Gemma 3's own keys: a window per sliding layer, a RoPE base per layer type, the
    attention scale, the activation. What transformers' Gemma3ForCausalLM computes and this
    engine does not (softcapping, bidirectional attention, biases) is refused."""
    refused = {key: d.get(key) for key in ("attn_logit_softcapping", "final_logit_softcapping",
                                           "use_bidirectional_attention", "attention_bias")}
    for key, value in refused.items():
        if value:
            raise ValueError(f"config.json: {key}={value} is not supported for {arch}")
    if d["hidden_activation"] not in GEMMA3_ACTIVATIONS:
        raise ValueError(f"config.json: hidden_activation {d['hidden_activation']!r} is not "
                         f"supported; supported: {', '.join(GEMMA3_ACTIVATIONS)}")
    window = None if d["sliding_window"] is None else int(d["sliding_window"])
    types = _gemma3_layer_types(d)
    if window is None and SLIDING_ATTENTION in types:
        raise ValueError("config.json: sliding layers need a sliding_window, got none")
    (theta, scaling), local_theta = _gemma3_rope(d)
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta,
            "sliding_window": window, "query_pre_attn_scalar": float(d["query_pre_attn_scalar"]),
            "layer_windows": tuple(window if t == SLIDING_ATTENTION else None for t in types),
            "hidden_act": d["hidden_activation"]}


def _gemma3_layer_types(d: Mapping[str, Any]) -> list[str]:
    """`layer_types`, or as transformers derives it: every `sliding_window_pattern`th layer
    full, the others sliding."""
    layers = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if types is None:
        pattern = int(d.get("sliding_window_pattern") or GEMMA3_LAYER_PATTERN)
        types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION
                 for i in range(layers)]
    unknown = set(types) - {FULL_ATTENTION, SLIDING_ATTENTION}
    if unknown or len(types) != layers:
        raise ValueError(f"config.json: layer_types must name each of the {layers} layers "
                         f"{FULL_ATTENTION} or {SLIDING_ATTENTION}, got {types}")
    return list(types)


def _gemma3_rope(d: Mapping[str, Any]) -> tuple[tuple[float, dict[str, Any] | None], float]:
    """((theta, scaling) of the full layers, theta of the sliding ones) from either
    generation: `rope_parameters` per layer type, or `rope_theta` and `rope_scaling` (the full
    layers') and `rope_local_base_freq`."""
    params = dict(d.get("rope_parameters") or {})
    if not set(params) <= {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise ValueError(f"config.json: Gemma 3's rope_parameters must be keyed by layer type "
                         f"({FULL_ATTENTION}, {SLIDING_ATTENTION}), got {params}")
    full = {"rope_theta": d.get("rope_theta", GEMMA3_ROPE_THETAS[FULL_ATTENTION]),
            **(d.get("rope_scaling") or {}), **(params.get(FULL_ATTENTION) or {})}
    local = {"rope_theta": d.get("rope_local_base_freq", GEMMA3_ROPE_THETAS[SLIDING_ATTENTION]),
             **(params.get(SLIDING_ATTENTION) or {})}
    local_theta, local_scaling = _rope({"rope_parameters": local})
    if local_scaling is not None:
        raise ValueError(f"config.json: rope scaling of the sliding layers ({local}) is not "
                         "supported")
    return _rope({"rope_parameters": full}), local_theta


# architecture -> (its config class's defaults for keys a config.json may omit, its own keys)
_ARCHITECTURES: dict[str, tuple[dict[str, Any],
                                Callable[[Mapping[str, Any], str], dict[str, Any]]]] = {
    "LlamaForCausalLM": ({}, _llama_fields),
    "MistralForCausalLM": ({}, _llama_fields),
    "Qwen2ForCausalLM": ({}, _llama_fields),
    GEMMA3: (_GEMMA3_DEFAULTS, _gemma3_fields),
}
SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)


def _architecture(d: Mapping[str, Any]) -> str:
    archs = d.get("architectures") or []
    if not archs:  # a config saved from a bare config object: fall back on model_type
        by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                   "qwen2": "Qwen2ForCausalLM", "gemma3_text": GEMMA3}
        archs = [by_type.get(str(d.get("model_type")), str(d.get("model_type")))]
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"config.json: architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _rope(d: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either config.json generation."""
    params = dict(d.get("rope_parameters") or {})
    legacy = dict(d.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", d.get("rope_theta", DEFAULT_ROPE_THETA)))
    scaling = {**legacy, **params}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json: rope type {rope_type!r} is not supported; supported: default, "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    scaling.pop("rope_theta", None)
    scaling.pop("type", None)
    scaling["rope_type"] = rope_type
    missing = [k for k in _ROPE_KEYS[rope_type] if scaling.get(k) is None]
    if missing:
        raise ValueError(f"config.json: {rope_type} rope scaling needs {missing}, got {scaling}")
    return theta, scaling


def _dtype_name(d: Mapping[str, Any]) -> str:
    name = d.get("dtype") or d.get("torch_dtype") or "float32"
    return str(name).removeprefix("torch.")


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return (int(value),)
