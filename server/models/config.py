"""ModelArchConfig: the architecture of a checkpoint, read from its `config.json`.

The keys every architecture shares are read here; an architecture's own keys, defaults and
refusals are its file's (`Architecture.config_fields`, found through registry.py). Both
config.json generations are understood: the old one (`rope_theta` and `rope_scaling` at the
top level, `torch_dtype`) and transformers 5's (`rope_parameters`, `dtype`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hicache_server.models import registry

# transformers' layer types (config.json's `layer_types`)
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
# "rope_freqs" is this engine's own, not transformers': a GGUF's per-frequency factors
# (llama.cpp's `rope_freqs.weight`, Llama 3.x's scaling as its converter stores it), each
# inverse frequency divided by its factor
ROPE_FREQS = "rope_freqs"
SUPPORTED_ROPE_TYPES = ("llama3", "linear", ROPE_FREQS)
_ROPE_KEYS = {  # the keys each scaling type needs
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
    ROPE_FREQS: ("factors",),
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_ROPE_THETA = 10000.0  # transformers' default when a config names none
DEFAULT_RMS_NORM_EPS = 1e-6


@dataclass(frozen=True)
class ModelArchConfig:
    """Shapes and hyper-parameters the model needs; `rope_scaling` is None, a llama3 or linear
    dict (the keys of transformers' `rope_parameters`), a ROPE_FREQS one (`factors`, one a
    frequency), or Phi-3's longrope (phi3.py)."""

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
    sliding_window: int | None = None  # config.json's window, applied where layer_windows says
    hicache_embedded: str | None = None  # set for the generated embedded model
    # per layer its window W, None: full; () for a model without windows (Llama). Mistral's on
    # every layer, Qwen2's (use_sliding_window) on its upper layers, Gemma 3's on its
    # sliding layers
    layer_windows: tuple[int | None, ...] = ()
    # Gemma 3 (the Llama family leaves these at their defaults)
    query_pre_attn_scalar: float | None = None  # q.k scaled by this ** -0.5 (None: head_dim)
    rope_local_theta: float | None = None  # the RoPE base of the window layers
    hidden_act: str = "silu"  # the MLP's gate activation
    # Gemma 2's soft caps, c * tanh(x / c): of the scaled attention scores, of the final
    # logits (None: not capped)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # RoPE rotates the first `rotary_dim` values of each head (Phi-4-mini: 0.75), keeps the rest
    partial_rotary_factor: float = 1.0

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
        factors = (self.rope_scaling or {}).get("factors")
        if factors is not None and len(factors) != self.head_dim // 2:
            raise ValueError(f"config.json: {ROPE_FREQS} scaling needs head_dim / 2 = "
                             f"{self.head_dim // 2} factors, got {len(factors)}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"config.json: dtype {self.dtype!r} is not one of {list(_DTYPES)}")
        if self.layer_windows and len(self.layer_windows) != self.num_hidden_layers:
            raise ValueError(f"config.json: {len(self.layer_windows)} layer types for "
                             f"{self.num_hidden_layers} layers")
        if any(w is not None and w < 1 for w in self.layer_windows):
            raise ValueError(f"config.json: sliding_window must be >= 1, got {self.layer_windows}")
        if not 2 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"config.json: partial_rotary_factor={self.partial_rotary_factor} "
                             f"rotates {self.rotary_dim} of head_dim {self.head_dim}; RoPE "
                             "needs an even number from 2 to head_dim")

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
    def rotary_dim(self) -> int:
        """The values of each head RoPE rotates, as transformers counts them."""
        return int(self.head_dim * self.partial_rotary_factor)

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
        arch = registry.architecture_of_config(d)
        d = {**arch.config_defaults, **d}
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        if d.get("mlp_bias"):
            raise ValueError("config.json: mlp_bias=true is not supported")
        own = arch.config_fields(d)  # it may set the context (Phi-3's under longrope)
        context = own.pop("max_position_embeddings", d.get("max_position_embeddings", 2048))
        return cls(
            architecture=arch.name,
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            vocab_size=int(d["vocab_size"]),
            rms_norm_eps=float(d.get("rms_norm_eps", DEFAULT_RMS_NORM_EPS)),
            max_position_embeddings=int(context),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            dtype=_dtype_name(d),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_eos_ids(d.get("eos_token_id")),
            hicache_embedded=d.get("hicache_embedded"),
            **own,
        )


def parse_rope(d: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either config.json generation (`rope_theta`
    and `rope_scaling`, or `rope_parameters`); ValueError for a scaling not computed."""
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


def layer_types(d: Mapping[str, Any], default_type: Callable[[int], str]) -> list[str]:
    """Each layer's type from config.json's `layer_types`, or, where it has none,
    `default_type(i)`: the type transformers gives layer i."""
    layers = int(d["num_hidden_layers"])
    types: Sequence[str] = d.get("layer_types") or [default_type(i) for i in range(layers)]
    if set(types) - {FULL_ATTENTION, SLIDING_ATTENTION} or len(types) != layers:
        raise ValueError(f"config.json: layer_types must name each of the {layers} layers "
                         f"{FULL_ATTENTION} or {SLIDING_ATTENTION}, got {list(types)}")
    return list(types)


def windows_of(types: Sequence[str], window: int | None) -> tuple[int | None, ...]:
    """`layer_windows` of these layer types: `window` for a sliding layer, None for a full
    one (and for every layer without a window, as transformers' masks are then)."""
    return tuple(window if t == SLIDING_ATTENTION else None for t in types)


def _dtype_name(d: Mapping[str, Any]) -> str:
    name = d.get("dtype") or d.get("torch_dtype") or "float32"
    return str(name).removeprefix("torch.")


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return (int(value),)
