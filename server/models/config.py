"""ModelArchConfig: the architecture of a Llama-family checkpoint, read from its `config.json`.

Both config.json generations are understood: the old one (`rope_theta` and `rope_scaling` at
the top level, `torch_dtype`) and transformers 5's (`rope_parameters`, `dtype`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# Architectures served, all the same decoder: pre-norm, RoPE, GQA, SwiGLU. Qwen2 adds a bias
# to q/k/v; Mistral's sliding window is not applied (full attention; exact while the context
# stays within `sliding_window`).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
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
    sliding_window: int | None = None
    hicache_embedded: str | None = None  # set for the generated embedded model

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
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        theta, scaling = _rope(d)
        qwen2 = arch == "Qwen2ForCausalLM"
        bias = bool(d.get("attention_bias", qwen2))
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
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bias,
            o_proj_bias=bias and not qwen2,
            dtype=_dtype_name(d),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_eos_ids(d.get("eos_token_id")),
            sliding_window=d.get("sliding_window") if d.get("use_sliding_window", True) else None,
            hicache_embedded=d.get("hicache_embedded"),
        )


def _architecture(d: Mapping[str, Any]) -> str:
    archs = d.get("architectures") or []
    if not archs:  # a config saved from a bare config object: fall back on model_type
        by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                   "qwen2": "Qwen2ForCausalLM"}
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
