"""Qwen3 dense (transformers' `Qwen3ForCausalLM`) over the paged KV pool: the Llama decoder
with an RMSNorm per head on q and on k, before RoPE; and its registry entry (`ARCHITECTURES`:
config.json keys, llama.cpp's `qwen3` form).

Where it differs from Llama, each computed as transformers computes it:
- q and k are normalised per head (`q_norm`, `k_norm`: Llama's RMSNorm over `head_dim`);
  on the CPU the layer kernel's rms_norm takes them as `[T * heads, head_dim]` rows;
- `head_dim` comes from the config and may differ from hidden / heads;
- `attention_bias` puts a bias on q, k, v and o alike (default none);
- with `use_sliding_window` the layers from `max_window_layers` on (or those `layer_types`
  names) read only their window (`config.window_of`).

llama.cpp's `qwen3` GGUF form is Qwen2's tensor names plus `attn_q_norm` / `attn_k_norm`,
q/k rows not permuted (convert_hf_to_gguf.py's Qwen3Model is a Qwen2Model, which does not
permute), the head dim in `attention.key_length`.

Small CPU batches take Llama's lean path (`LeanForward`), which binds the q/k norms too.

Threading: `forward` runs on the scheduler thread, which owns the KV pool it writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hicache.memory.device import DeviceKVPool
from hicache_server.models.attention import AttentionBackend
from hicache_server.models.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelArchConfig,
    layer_types,
    parse_rope,
    windows_of,
)
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.models.gguf_tokenizer import GGUFError
from hicache_server.models.llama import (
    LLAMA_TENSOR_NAMES,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    RMSNorm,
)
from hicache_server.models.registry import Architecture, GGUFForm, GGUFSource
from hicache_server.models.rope import RotaryEmbedding

QWEN3 = "Qwen3ForCausalLM"
# Qwen3Config's defaults, for the keys a config.json may leave out
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151_936, "hidden_size": 4096, "intermediate_size": 22_016,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "head_dim": 128, "max_position_embeddings": 32_768, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
    "sliding_window": 4096, "max_window_layers": 28, "hidden_act": "silu",
}


class Qwen3Attention(LlamaAttention):
    """Llama's attention (its window too, where the config names one for this layer) with
    q/k RMSNorm per head before RoPE."""

    def __init__(self, config: ModelArchConfig, layer_id: int, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(config, layer_id, backend, dtype, device)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, batch: ForwardBatch,
                kv_pool: DeviceKVPool) -> torch.Tensor:
        t, dim = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)  # [T, q_size | kv_size]
        # each head a row: [T * heads, head_dim], the layer kernel's 2-D rows
        q = self.q_norm(q.reshape(t * self.heads, dim)).view(t, self.heads, dim)
        k = self.k_norm(k.reshape(t * self.kv_heads, dim)).view(t, self.kv_heads, dim)
        q, k = rope(batch, q), rope(batch, k)
        v = v.view(t, self.kv_heads, dim)
        if batch.layer_hook is not None:  # the runner waits here for this layer's loads
            batch.layer_hook(self.layer_id)
        b = kv_pool.batch_for(self.layer_id, batch)  # a window layer's slots mapped
        kv_pool.set_kv(self.layer_id, b.out_slots, k, v)
        o = self.backend.forward(q, k, v, self.layer_id, b, kv_pool,
                                 window=self.window)  # [T, heads, head_dim]
        return self.o_proj(o.reshape(t, self.heads * dim))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """Llama's layer (its norms, MLP and forward) around a Qwen3Attention."""

    def __init__(self, config: ModelArchConfig, layer_id: int, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(config, layer_id, backend, dtype, device)
        # Llama's attention, built empty by the base (torch.empty: no memory touched), replaced
        self.self_attn = Qwen3Attention(config, layer_id, backend, dtype, device)


class Qwen3Model(LlamaModel):
    """Llama's body (embeddings, final norm, RoPE, lean path, forward) over Qwen3 layers."""

    def __init__(self, config: ModelArchConfig, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(config, backend, dtype, device)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, i, backend, dtype, device)
            for i in range(config.num_hidden_layers)
        )


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense decoder (`CausalLM`'s contract); every op on the layer kernel (its q/k
    norms are Llama's RMSNorm), small CPU batches on the lean path."""

    def __init__(self, config: ModelArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        device = torch.device(device)
        # CausalLM's __init__, past Llama's (which would build a LlamaModel)
        super(LlamaForCausalLM, self).__init__(
            config, Qwen3Model(config, attn_backend, dtype, device), dtype, device)


# ---------------------------------------------------------------------------------------------
# Registry entry: config.json keys, the GGUF form


def _config_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3's own keys: RoPE, the biases (q, k, v and o alike), and the window as
    Qwen3Config derives it: none unless `use_sliding_window`, then on the layers
    `layer_types` names sliding, by default those from `max_window_layers` on. Activations
    other than SiLU are refused."""
    if d["hidden_act"] != "silu":
        raise ValueError(f"config.json: hidden_act {d['hidden_act']!r} is not supported for "
                         f"{QWEN3}; supported: silu")
    theta, scaling = parse_rope(d)
    window = (int(d["sliding_window"]) if d["use_sliding_window"]
              and d["sliding_window"] is not None else None)
    first_sliding = int(d["max_window_layers"])
    types = layer_types(d, lambda i: SLIDING_ATTENTION if window is not None
                        and i >= first_sliding else FULL_ATTENTION)
    windows = windows_of(types, window)
    bias = bool(d["attention_bias"])
    return {"rope_theta": theta, "rope_scaling": scaling, "attention_bias": bias,
            "o_proj_bias": bias, "sliding_window": window,
            "layer_windows": windows if any(w is not None for w in windows) else ()}


# gguf-py's tensor map for qwen3: Qwen2's names (no biases) and the q/k norms
GGUF_TENSOR_NAMES = {
    **{k: v for k, v in LLAMA_TENSOR_NAMES.items() if ".bias" not in k},
    "blk.{}.attn_q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "blk.{}.attn_k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
}


def _gguf_config(source: GGUFSource) -> dict[str, Any]:
    """A `qwen3` file's own keys: no window (llama.cpp's qwen3 attends to everything), once
    attention biases (no Qwen3 checkpoint has them; this form does not map them) are
    refused."""
    biases = sorted(n for n in source.tensor_names if n.startswith("blk.0.attn_")
                    and n.endswith(".bias"))
    if biases:
        raise GGUFError(f"{source.file}: attention biases ({', '.join(biases)}) in a qwen3 "
                        "file are not supported; serve the model's Hugging Face folder instead")
    return {"use_sliding_window": False}


ARCHITECTURES = (
    Architecture(QWEN3, Qwen3ForCausalLM, _config_fields, model_types=("qwen3",),
                 config_defaults=_DEFAULTS,
                 gguf=GGUFForm("qwen3", GGUF_TENSOR_NAMES, config=_gguf_config)),
)
