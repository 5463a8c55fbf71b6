"""The Llama family (Llama, Mistral, Qwen2) over the paged KV pool.

Numerics follow transformers' modelling code: RMSNorm in float32, RoPE with the rotate-half
convention (HF checkpoints' q/k rows are permuted for it), GQA by repeating KV heads, SwiGLU.
The LM head, the loading and the kernels' choice are every architecture's (`CausalLM`).

Threading: `forward` runs on the scheduler thread, which owns the KV pool it writes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hicache.memory.device import DeviceKVPool
from hicache_server.models.attention import AttentionBackend
from hicache_server.models.causal_lm import CausalLM
from hicache_server.models.config import ModelArchConfig
from hicache_server.models.cpu_forward import LeanForward
from hicache_server.models.cpu_kernels import KERNEL_DTYPES
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.models.kernels.cpu_layer import CpuLayerKernel
from hicache_server.models.linear import Linear, make_param
from hicache_server.models.rope import RotaryEmbedding

__all__ = ["LlamaForCausalLM", "RMSNorm", "RotaryEmbedding"]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = make_param((size,), dtype, device, fill=1.0)
        self.kernel: CpuLayerKernel | None = None  # on the CPU: one C pass

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(self(residual + x), residual + x)`: the residual add and the norm in one pass
        on the kernel (the sum is the same bits either way)."""
        if (self.kernel is not None and x.dtype in KERNEL_DTYPES and x.dim() == 2
                and residual.is_contiguous() and residual.dtype == x.dtype):
            return self.kernel.rms_norm(x, self.weight, self.eps, residual)
        total = residual + x
        return self(total), total

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.kernel is not None and x.dtype in KERNEL_DTYPES and x.dim() == 2
                and x.dtype == self.weight.dtype):
            return self.kernel.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused op, the same bits (a test checks)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelArchConfig, layer_id: int, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.backend = backend
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.split = [config.q_size, config.kv_size, config.kv_size]
        self.qkv_proj = Linear(config.hidden_size, self.split, config.attention_bias,
                               dtype, device)
        self.o_proj = Linear(config.q_size, [config.hidden_size], config.o_proj_bias,
                             dtype, device)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, batch: ForwardBatch,
                kv_pool: DeviceKVPool) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        # q and k are neighbours in qkv: one rotation of both, [T, heads + kv_heads, hd]
        qk = rope(batch, qkv[:, :self.split[0] + self.split[1]].view(
            t, self.heads + self.kv_heads, self.head_dim))
        q, k = qk[:, :self.heads], qk[:, self.heads:]
        v = qkv[:, self.split[0] + self.split[1]:].view(t, self.kv_heads, self.head_dim)
        if batch.layer_hook is not None:  # the runner waits here for this layer's loads
            batch.layer_hook(self.layer_id)
        kv_pool.set_kv(self.layer_id, batch.out_slots, k, v)
        o = self.backend.forward(q, k, v, self.layer_id, batch, kv_pool)  # [T, heads, hd]
        return self.o_proj(o.reshape(t, self.heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelArchConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, [inter, inter], False, dtype, device)
        self.down_proj = Linear(inter, [config.hidden_size], False, dtype, device)
        self.kernel: CpuLayerKernel | None = None  # on the CPU: SiLU * up in C

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernel is not None and gate_up.dtype in KERNEL_DTYPES and gate_up.dim() == 2:
            return self.down_proj(self.kernel.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, layer_id: int, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps, dtype, device)
        self.self_attn = LlamaAttention(config, layer_id, backend, dtype, device)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, device)
        self.mlp = LlamaMLP(config, dtype, device)

    def forward(self, h: torch.Tensor, rope: RotaryEmbedding, batch: ForwardBatch,
                kv_pool: DeviceKVPool) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(h), rope, batch, kv_pool)
        x, h = self.post_attention_layernorm.add_forward(a, h)
        return h + self.mlp(x)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelArchConfig, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = make_param((config.vocab_size, config.hidden_size), dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, backend, dtype, device)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary_emb = RotaryEmbedding(config, device)
        # small batches with every op on the CPU kernels: the same calls, bound once
        # (set by LlamaForCausalLM whenever its kernels or weights change)
        self.lean: LeanForward | None = None

    def forward(self, batch: ForwardBatch, kv_pool: DeviceKVPool) -> torch.Tensor:
        if self.lean is not None:
            h = self.lean(batch, kv_pool)
            if h is not None:
                return h
        h = F.embedding(batch.input_ids, self.embed_tokens.weight)  # [T, hidden]
        for layer in self.layers:
            h = layer(h, self.rotary_emb, batch, kv_pool)
        return self.norm(h)


class LlamaForCausalLM(CausalLM):
    """Llama / Mistral / Qwen2 decoder (`CausalLM`'s contract); on the CPU kernels, small
    batches take the lean path (`LeanForward`)."""

    def __init__(self, config: ModelArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        device = torch.device(device)
        super().__init__(config, LlamaModel(config, attn_backend, dtype, device), dtype, device)

    def _layer_kernel_modules(self) -> list[nn.Module]:
        """RMSNorm, RoPE and SiLU * up: all of a Llama layer's ops but its matmuls."""
        return [m for m in self.modules() if isinstance(m, (RMSNorm, RotaryEmbedding, LlamaMLP))]

    def _refresh_lean(self) -> None:
        """The lean path for the kernels and packed weights the model has now (or none)."""
        self.model.lean = LeanForward.build(self.model, self.config, self.dtype)
