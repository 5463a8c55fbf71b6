"""Gemma 2's decoder (transformers' `Gemma2ForCausalLM`) over the paged KV pool, and its
registry entry (`ARCHITECTURES`: config.json keys, llama.cpp's `gemma2` GGUF form).

Gemma 3's body (gemma3.py: scaled embeddings, Gemma's `(1 + w)` float32 RMSNorm four times
a layer, GeGLU, `query_pre_attn_scalar`, a tied head) with what differs computed as
transformers' eager Gemma 2 computes it:
- no q/k norms (`Gemma3Model(..., qk_norm=False)`);
- the attention scores soft-capped, `c * tanh(s / c)` after the scale and before the mask
  (`attn_logit_softcapping`, the backends' `softcap`);
- the final logits soft-capped likewise (`final_logit_softcapping`), on the float32 logits;
- every other layer slides, from layer 0 (`layer_types`, or transformers' default), and
  every layer rotates with the one RoPE base.

llama.cpp's `gemma2` form is Gemma 3's tensor names without q/k norms, every norm weight
stored as `1 + w`, the window and both caps in the metadata (llama.cpp's defaults where a
file leaves them out: window 4096, caps 50 and 30), q.k scaled as llama.cpp scales it.

Threading: `forward` runs on the scheduler thread, which owns the KV pool it writes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hicache_server.models.attention import AttentionBackend
from hicache_server.models.causal_lm import CausalLM
from hicache_server.models.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelArchConfig,
    layer_types,
    parse_rope,
    windows_of,
)
from hicache_server.models.gemma3 import (
    GELU_TANH,
    Gemma3Model,
    gemma_kernel_modules,
    refresh_gemma,
)
from hicache_server.models.gemma3 import GGUF_TENSOR_NAMES as GEMMA3_TENSOR_NAMES
from hicache_server.models.gguf_tokenizer import GGUFError
from hicache_server.models.registry import Architecture, GGUFForm, GGUFSource

GEMMA2 = "Gemma2ForCausalLM"
# Gemma2Config's defaults, for the keys a config.json may leave out
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 256_000, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "hidden_activation": GELU_TANH,
    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
}


class Gemma2ForCausalLM(CausalLM):
    """Gemma 2's decoder (`CausalLM`'s contract): Gemma 3's body without q/k norms, its
    logits soft-capped."""

    def __init__(self, config: ModelArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        device = torch.device(device)
        body = Gemma3Model(config, attn_backend, dtype, device, qk_norm=False)
        super().__init__(config, body, dtype, device)

    def _layer_kernel_modules(self) -> list[nn.Module]:
        """Gemma 3's: the norms, RoPE and GeGLU."""
        return gemma_kernel_modules(self)

    def _refresh_derived(self) -> None:
        refresh_gemma(self)

    @property
    def screens_head(self) -> bool:
        """No head screen under a final cap: tanh may round two logits to one value, so
        the argmax of the capped row is not the screen's (models/head_screen.py)."""
        return self.config.final_logit_softcapping is None

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head's float32 logits, `c * tanh(x / c)` with c the final cap."""
        logits = super()._logits(h)  # [rows, vocab]
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


# ---------------------------------------------------------------------------------------------
# Registry entry: config.json keys, the GGUF form


def _config_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 2's own keys: a window per sliding layer (layers 0, 2, 4, ... without
    `layer_types`), one RoPE base, the attention scale, both soft caps. What transformers'
    Gemma2ForCausalLM computes and this engine does not (bidirectional attention, biases,
    RoPE scaling) is refused."""
    for key in ("use_bidirectional_attention", "attention_bias"):
        if d.get(key):
            raise ValueError(f"config.json: {key}={d[key]} is not supported for {GEMMA2}")
    if d["hidden_activation"] != GELU_TANH:
        raise ValueError(f"config.json: hidden_activation {d['hidden_activation']!r} is not "
                         f"supported for {GEMMA2}; supported: {GELU_TANH}")
    theta, scaling = parse_rope(d)
    if scaling is not None:
        raise ValueError(f"config.json: rope scaling ({scaling}) is not supported for {GEMMA2}")
    window = None if d["sliding_window"] is None else int(d["sliding_window"])
    types = layer_types(d, lambda i: FULL_ATTENTION if i % 2 else SLIDING_ATTENTION)
    if window is None and SLIDING_ATTENTION in types:
        raise ValueError("config.json: sliding layers need a sliding_window, got none")
    return {"rope_theta": theta, "rope_local_theta": theta, "sliding_window": window,
            "query_pre_attn_scalar": float(d["query_pre_attn_scalar"]),
            "layer_windows": windows_of(types, window), "hidden_act": GELU_TANH,
            "attn_logit_softcapping": _cap(d, "attn_logit_softcapping"),
            "final_logit_softcapping": _cap(d, "final_logit_softcapping")}


def _cap(d: Mapping[str, Any], key: str) -> float | None:
    """A soft cap of config.json: None (not capped) or a finite number > 0."""
    value = d.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"config.json: {key} must be null or a number > 0, got {value!r}")
    return float(value)


# Gemma 3's names without its q/k norms (gguf-py's tensor map: MODEL_ARCH.GEMMA2)
GGUF_TENSOR_NAMES = {k: v for k, v in GEMMA3_TENSOR_NAMES.items()
                     if not k.endswith(("attn_q_norm.weight", "attn_k_norm.weight"))}
# What llama.cpp assumes of a gemma2 file (llama-model.cpp, LLM_ARCH_GEMMA2): its window and
# caps where the metadata has none, and q.k scaled by 1/sqrt(head dim) except in the 27B
# model (46 layers), by 1/sqrt(hidden / heads) as its config.json's query_pre_attn_scalar
# (144). Layers alternate from a sliding layer 0, as transformers' default.
GGUF_WINDOW = 4096
GGUF_ATTN_SOFTCAP, GGUF_FINAL_SOFTCAP = 50.0, 30.0
GGUF_27B_LAYERS = 46


def _gguf_config(source: GGUFSource) -> dict[str, Any]:
    """Gemma 2's config.json keys beyond the shared ones: its window and caps from the file
    (llama.cpp's defaults where it has none), the rest as llama.cpp assumes them."""
    layers, hidden = int(source.key("block_count")), int(source.key("embedding_length"))
    heads = int(source.key("attention.head_count"))
    head_dim = int(source.key("attention.key_length", hidden // heads))
    if int(source.key("attention.value_length", head_dim)) != head_dim:
        raise GGUFError(f"{source.file}: gemma2 value_length "
                        f"{source.key('attention.value_length')} differs from key_length "
                        f"{head_dim}")
    return {"sliding_window": int(source.key("attention.sliding_window", GGUF_WINDOW)),
            "query_pre_attn_scalar": hidden // heads if layers == GGUF_27B_LAYERS else head_dim,
            "hidden_activation": GELU_TANH,
            "attn_logit_softcapping": float(source.key("attn_logit_softcapping",
                                                       GGUF_ATTN_SOFTCAP)),
            "final_logit_softcapping": float(source.key("final_logit_softcapping",
                                                        GGUF_FINAL_SOFTCAP))}


ARCHITECTURES = (
    Architecture(GEMMA2, Gemma2ForCausalLM, _config_fields, model_types=("gemma2",),
                 config_defaults=_DEFAULTS,
                 # the converter's norm_shift: every norm weight stored as 1 + w; a chat turn
                 # ends at <end_of_turn>, as Gemma 2's generation_config.json has it
                 gguf=GGUFForm("gemma2", GGUF_TENSOR_NAMES, norm_shift=1.0,
                               config=_gguf_config, eos_tokens=("<end_of_turn>",))),
)
