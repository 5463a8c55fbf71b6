"""Gemma 3's text decoder (transformers' `Gemma3ForCausalLM`) over the paged KV pool.

Where it differs from Llama, each computed as transformers computes it:
- the embeddings are scaled by sqrt(hidden_size), the scale cast to the model dtype first;
- RMSNorm is `x * (1 + w)`, product in float32 and cast after (`GemmaRMSNorm`); four per
  layer (before and after attention, before and after the MLP) and one on q and on k per
  head, before RoPE;
- the MLP is GeGLU: `down(gelu_tanh(gate) * up)`;
- attention scales q.k by `query_pre_attn_scalar ** -0.5`; a sliding layer reads only its
  window (`config.window_of`) and rotates with the local RoPE base, a full layer with the
  global base (and its scaling).

Every layer's K/V is written to the pool at `batch.out_slots` (the cache keeps all layers'
KV of every token). Of the layer kernel only RoPE applies: its RMSNorm is Llama's arithmetic
and its activation SiLU. There is no lean path (`LeanForward` is Llama's).

Threading: `forward` runs on the scheduler thread, which owns the KV pool it writes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from hicache.memory.device import DeviceKVPool
from hicache_server.models.attention import AttentionBackend
from hicache_server.models.causal_lm import CausalLM
from hicache_server.models.config import ModelArchConfig
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.models.linear import Linear, make_param
from hicache_server.models.rope import RotaryEmbedding

# config.hidden_act -> the function (transformers' ACT2FN["gelu_pytorch_tanh"] is this call)
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}


class GemmaRMSNorm(nn.Module):
    """transformers' Gemma3RMSNorm: `x` normalised in float32, times `1 + w` in float32, then
    cast to x's dtype (Llama casts before its product). `weight` holds w, as checkpoints do."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = make_param((size,), dtype, device, fill=0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(nn.Module):
    def __init__(self, config: ModelArchConfig, layer_id: int, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.backend = backend
        self.window, self.scale = config.window_of(layer_id), config.attention_scale
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.split = [config.q_size, config.kv_size, config.kv_size]
        self.qkv_proj = Linear(config.hidden_size, self.split, False, dtype, device)
        self.o_proj = Linear(config.q_size, [config.hidden_size], False, dtype, device)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, batch: ForwardBatch,
                kv_pool: DeviceKVPool) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)  # [T, q_size | kv_size]
        q = rope(batch, self.q_norm(q.view(t, self.heads, self.head_dim)))
        k = rope(batch, self.k_norm(k.view(t, self.kv_heads, self.head_dim)))
        v = v.view(t, self.kv_heads, self.head_dim)
        if batch.layer_hook is not None:  # the runner waits here for this layer's loads
            batch.layer_hook(self.layer_id)
        kv_pool.set_kv(self.layer_id, batch.out_slots, k, v)
        o = self.backend.forward(q, k, v, self.layer_id, batch, kv_pool, window=self.window,
                                 scale=self.scale)  # [T, heads, head_dim]
        return self.o_proj(o.reshape(t, self.heads * self.head_dim))


class Gemma3MLP(nn.Module):
    def __init__(self, config: ModelArchConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, [inter, inter], False, dtype, device)
        self.down_proj = Linear(inter, [config.hidden_size], False, dtype, device)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, layer_id: int, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.self_attn = Gemma3Attention(config, layer_id, backend, dtype, device)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.mlp = Gemma3MLP(config, dtype, device)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)

    def forward(self, h: torch.Tensor, rope: RotaryEmbedding, batch: ForwardBatch,
                kv_pool: DeviceKVPool) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(h), rope, batch, kv_pool)
        h = h + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(h))
        return h + self.post_feedforward_layernorm(m)


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelArchConfig, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"Gemma 3: hidden_act {config.hidden_act!r} is not one of "
                             f"{list(_ACTIVATIONS)}")
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = make_param((config.vocab_size, config.hidden_size), dtype, device)
        # transformers' Gemma3TextScaledWordEmbedding: sqrt(hidden) as a float32 scalar, cast
        # to the model dtype before the product (bfloat16 rounds it)
        scale = torch.tensor(config.hidden_size ** 0.5, dtype=torch.float32)
        self.register_buffer("embed_scale", scale.to(dtype=dtype, device=device),
                             persistent=False)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, backend, dtype, device)
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary_emb = RotaryEmbedding(config, device)  # full layers
        self.rotary_emb_local = RotaryEmbedding(
            replace(config, rope_theta=config.rope_local_theta, rope_scaling=None), device)

    def forward(self, batch: ForwardBatch, kv_pool: DeviceKVPool) -> torch.Tensor:
        h = F.embedding(batch.input_ids, self.embed_tokens.weight) * self.embed_scale
        for layer in self.layers:  # [T, hidden]
            window = layer.self_attn.window
            rope = self.rotary_emb if window is None else self.rotary_emb_local
            h = layer(h, rope, batch, kv_pool)
        return self.norm(h)


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3's text decoder (`CausalLM`'s contract)."""

    kernel_ops = "RoPE"

    def __init__(self, config: ModelArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        device = torch.device(device)
        super().__init__(config, Gemma3Model(config, attn_backend, dtype, device), dtype, device)

    def _layer_kernel_modules(self) -> list[nn.Module]:
        """RoPE, both bases: the kernel's RMSNorm is Llama's and its activation SiLU."""
        return [self.model.rotary_emb, self.model.rotary_emb_local]
