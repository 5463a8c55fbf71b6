"""Phi-3 and Phi-4-mini (transformers' `Phi3ForCausalLM`) over the paged KV pool: the Llama
decoder, and its registry entry (`ARCHITECTURES`: config.json keys, llama.cpp's `phi3` form).

Where it differs from Llama, each computed as transformers computes it:
- q|k|v and gate|up come fused in the checkpoint (`qkv_proj`, `gate_up_proj`), the very
  stacking this engine keeps: each is loaded as Llama's shards (views, no copy);
- RoPE may rotate only the first `rotary_dim = int(head_dim * partial_rotary_factor)` values
  of each head (Phi-4-mini: 0.75), rotate-half over those (rope.py, the layer kernel);
- `longrope` scaling: within `original_max_position_embeddings` transformers rotates with
  `short_factor` and scales cos and sin by the attention factor, which rope.py does. Past it,
  transformers rotates every position of the sequence with `long_factor`, re-rotating the
  keys already cached (its `generate` drops its cache at the switch); a paged cache keeps
  each key rotated once, so such contexts are refused: the context ends at
  `original_max_position_embeddings` (the log says so when the config is read);
- `sliding_window`, where a context can outgrow it, applies on every layer
  (`config.window_of`, which Llama's attention and lean path read).

So the model is Llama's (`LlamaForCausalLM`: its modules, its lean path on the CPU kernels)
over a config that says all this; only the loading differs.

Threading: `forward` runs on the scheduler thread, which owns the KV pool it writes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from hicache_server.models.config import DEFAULT_ROPE_THETA, ModelArchConfig
from hicache_server.models.gguf_tokenizer import GGUFError
from hicache_server.models.llama import LLAMA_TENSOR_NAMES, LlamaForCausalLM
from hicache_server.models.registry import Architecture, GGUFForm, GGUFSource

PHI3 = "Phi3ForCausalLM"
# Phi3Config's defaults, for the keys a config.json may leave out
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
    "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 4096,
    "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 32000,
    "sliding_window": None, "hidden_act": "silu",
}
LONGROPE = "longrope"
# rope types Phi3Config renames to longrope (`convert_rope_params_to_dict`)
_LONGROPE_ALIASES = ("su", "yarn")
# transformers' fused projections -> the separate ones they stack, in their row order
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
logger = logging.getLogger(__name__)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-4-mini decoder (`CausalLM`'s contract): Llama's modules, which take the
    rotary dims, the longrope tables and the windows from the config; every op on the layer
    kernel, small CPU batches on the lean path."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """`CausalLM.load_weights`, each fused tensor given as the shards it stacks."""
        super().load_weights(_unfused(weights, self.config))


def _unfused(weights: Iterable[tuple[str, torch.Tensor]], config: ModelArchConfig
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """`...qkv_proj.weight` as `...q_proj.weight`, `...k_proj.weight`, `...v_proj.weight`
    (row views of it), `...gate_up_proj.weight` as gate and up; a fused tensor of another
    height passes whole, for the loader to name its shape."""
    rows = {"qkv_proj": [config.q_size, config.kv_size, config.kv_size],
            "gate_up_proj": [config.intermediate_size] * 2}
    for name, tensor in weights:
        parts = name.split(".")
        fused = parts[-2] if len(parts) >= 2 else ""
        if fused in _FUSED and tensor.shape[0] == sum(rows[fused]):
            for part, piece in zip(_FUSED[fused], tensor.split(rows[fused]), strict=True):
                yield ".".join([*parts[:-2], part, parts[-1]]), piece
        else:
            yield name, tensor


# ---------------------------------------------------------------------------------------------
# Registry entry: config.json keys, the GGUF form


def _config_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """Phi-3's own keys: RoPE (partial rotary, longrope), the window on every layer, and the
    context, capped at `original_max_position_embeddings` under longrope (module docstring).
    A window no context reaches is dropped (the same attention, the plain path). Biases and
    activations other than SiLU, which Phi3Config does not have, are refused."""
    if d.get("attention_bias"):
        raise ValueError(f"config.json: attention_bias={d['attention_bias']} is not supported "
                         f"for {PHI3}")
    if d["hidden_act"] != "silu":
        raise ValueError(f"config.json: hidden_act {d['hidden_act']!r} is not supported for "
                         f"{PHI3}; supported: silu")
    theta, scaling, partial = _rope(d)
    window = None if d["sliding_window"] is None else int(d["sliding_window"])
    context = int(d["max_position_embeddings"])
    if scaling is not None and context > scaling["original_max_position_embeddings"]:
        context = scaling["original_max_position_embeddings"]
        logger.warning("%s: contexts past original_max_position_embeddings=%d are not served "
                       "(max_position_embeddings=%s): longrope rotates every key of a longer "
                       "context with long_factor, and the KV cache keeps keys rotated once",
                       PHI3, context, d["max_position_embeddings"])
    applied = window is not None and window < context
    return {"rope_theta": theta, "rope_scaling": scaling, "partial_rotary_factor": partial,
            "sliding_window": window, "max_position_embeddings": context,
            "layer_windows": (window,) * int(d["num_hidden_layers"]) if applied else ()}


def _rope(d: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(theta, scaling or None, partial_rotary_factor) as Phi3Config reads them from either
    config.json generation; the scaling a longrope dict of the short factors and the
    attention factor (`_compute_longrope_parameters`)."""
    params = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
    theta = float(params.get("rope_theta", d.get("rope_theta", DEFAULT_ROPE_THETA)))
    partial = float(params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    kind = LONGROPE if kind in _LONGROPE_ALIASES else kind
    if kind == "default":
        return theta, None, partial
    if kind != LONGROPE:
        raise ValueError(f"config.json: rope type {kind!r} is not supported for {PHI3}; "
                         f"supported: default, {LONGROPE}")
    head_dim = int(d.get("head_dim") or int(d["hidden_size"]) // int(d["num_attention_heads"]))
    pairs = int(head_dim * partial) // 2
    for key in ("short_factor", "long_factor"):
        if len(params.get(key) or ()) != pairs:
            raise ValueError(f"config.json: longrope {key} must hold {pairs} numbers (one per "
                             f"rotated pair), got {params.get(key)}")
    # Phi3Config's own key wins over the one in rope_parameters (`standardize_rope_params`)
    original = int(d["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = int(d["max_position_embeddings"]) / original if factor is None else float(factor)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    scaling = {"rope_type": LONGROPE, "short_factor": [float(f) for f in params["short_factor"]],
               "original_max_position_embeddings": original, "attention_factor": float(attention)}
    return theta, scaling, partial


# gguf-py's tensor map for phi3: q|k|v fused in attn_qkv (not permuted), gate|up in ffn_up
GGUF_TENSOR_NAMES = {
    **{k: v for k, v in LLAMA_TENSOR_NAMES.items()
       if ".bias" not in k and "ffn_gate" not in k and "ffn_up" not in k},
    "blk.{}.attn_qkv.weight": "model.layers.{}.self_attn.qkv_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.gate_up_proj.weight",
}
# longrope's factors, which llama.cpp's converter writes as tensors (the config reads them)
LONG_FACTORS, SHORT_FACTORS = "rope_factors_long.weight", "rope_factors_short.weight"


def _gguf_config(source: GGUFSource) -> dict[str, Any]:
    """Phi-3's config.json keys beyond the shared ones, as convert_hf_to_gguf.py's
    Phi3MiniModel writes them: the rotated dims (`partial_rotary_factor`), the window (0:
    none), the pretraining context and longrope's factors tensors with their attention
    factor."""
    hidden, heads = int(source.key("embedding_length")), int(source.key("attention.head_count"))
    head_dim = hidden // heads
    rotary = int(source.key("rope.dimension_count", head_dim))
    partial = rotary / head_dim
    if not 2 <= rotary <= head_dim or rotary % 2 or int(head_dim * partial) != rotary:
        raise GGUFError(f"{source.file}: phi3 rope.dimension_count {rotary} is not an even "
                        f"part of the head dim {head_dim}")
    context = int(source.key("context_length"))
    out: dict[str, Any] = {
        "partial_rotary_factor": partial,
        "sliding_window": int(source.key("attention.sliding_window", 0)) or None,
        "original_max_position_embeddings":
            int(source.key("rope.scaling.original_context_length", context)),
    }
    factors = {LONG_FACTORS, SHORT_FACTORS} & source.tensor_names
    if factors and factors != {LONG_FACTORS, SHORT_FACTORS}:
        raise GGUFError(f"{source.file}: phi3 longrope needs both {LONG_FACTORS} and "
                        f"{SHORT_FACTORS}, got only {sorted(factors)}")
    if factors:
        out["rope_scaling"] = {
            "rope_type": LONGROPE, "long_factor": source.read(LONG_FACTORS).tolist(),
            "short_factor": source.read(SHORT_FACTORS).tolist(),
            "attention_factor": float(source.key("rope.scaling.attn_factor", 1.0))}
    return out


ARCHITECTURES = (
    Architecture(PHI3, Phi3ForCausalLM, _config_fields, model_types=("phi3",),
                 config_defaults=_DEFAULTS,
                 gguf=GGUFForm("phi3", GGUF_TENSOR_NAMES, config=_gguf_config,
                               config_tensors=(LONG_FACTORS, SHORT_FACTORS),
                               partial_rotary=True)),
)
