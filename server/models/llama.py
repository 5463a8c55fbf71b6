"""The Llama family (Llama, Mistral, Qwen2) over the paged KV pool, and its registry entries
(`ARCHITECTURES`: the config.json keys of each, the GGUF forms `llama` and `qwen2`).

Numerics follow transformers' modelling code: RMSNorm in float32, RoPE with the rotate-half
convention (HF checkpoints' q/k rows are permuted for it), GQA by repeating KV heads, SwiGLU.
The LM head, the loading and the kernels' choice are every architecture's (`CausalLM`).

Threading: `forward` runs on the scheduler thread, which owns the KV pool it writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hicache.memory.device import DeviceKVPool
from hicache_server.models.attention import AttentionBackend
from hicache_server.models.causal_lm import CausalLM
from hicache_server.models.config import (
    FULL_ATTENTION,
    ROPE_FREQS,
    SLIDING_ATTENTION,
    ModelArchConfig,
    layer_types,
    parse_rope,
    windows_of,
)
from hicache_server.models.cpu_forward import LeanForward
from hicache_server.models.cpu_kernels import KERNEL_DTYPES
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.models.gguf_tokenizer import GGUFError
from hicache_server.models.kernels.cpu_layer import CpuLayerKernel
from hicache_server.models.linear import Linear, make_param
from hicache_server.models.registry import Architecture, GGUFForm, GGUFSource
from hicache_server.models.rope import RotaryEmbedding

__all__ = ["ARCHITECTURES", "LLAMA_TENSOR_NAMES", "LlamaForCausalLM", "RMSNorm",
           "RotaryEmbedding"]


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
        self.window = config.window_of(layer_id)  # Mistral's, Qwen2's upper layers'
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
        b = kv_pool.batch_for(self.layer_id, batch)  # a window layer's slots mapped
        kv_pool.set_kv(self.layer_id, b.out_slots, k, v)
        o = self.backend.forward(q, k, v, self.layer_id, b, kv_pool,
                                 window=self.window)  # [T, heads, hd]
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
        self.embed_tokens.weight = make_param((config.vocab_size, config.hidden_size), dtype,
                                              device)
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

    def _refresh_derived(self) -> None:
        """The lean path for the kernels and packed weights the model has now (or none)."""
        self.model.lean = LeanForward.build(self.model, self.config, self.dtype)


# ---------------------------------------------------------------------------------------------
# Registry entries: config.json keys, GGUF forms


def _llama_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """RoPE and the biases: Llama's `attention_bias` puts one on q, k, v and o."""
    theta, scaling = parse_rope(d)
    bias = bool(d.get("attention_bias", False))
    return {"rope_theta": theta, "rope_scaling": scaling, "attention_bias": bias,
            "o_proj_bias": bias}


def _mistral_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """Llama's keys and the window, on every layer (transformers' MistralForCausalLM; a
    `layer_types` it warns about and ignores)."""
    window = d.get("sliding_window")
    windows = () if window is None else (int(window),) * int(d["num_hidden_layers"])
    return {**_llama_fields(d), "sliding_window": window, "layer_windows": windows}


def _qwen2_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """Llama's keys, biases on q, k and v only (Qwen2Config has them by default), the window
    where `use_sliding_window`: on the layers `layer_types` names, or, without it, on layers
    `max_window_layers` and up (Qwen2Config's derivation)."""
    theta, scaling = parse_rope(d)
    window = d.get("sliding_window") if d.get("use_sliding_window", False) else None
    first = int(d.get("max_window_layers", QWEN2_MAX_WINDOW_LAYERS))
    types = layer_types(d, lambda i: SLIDING_ATTENTION if window is not None and i >= first
                        else FULL_ATTENTION)
    windows = windows_of(types, None if window is None else int(window))
    return {"rope_theta": theta, "rope_scaling": scaling,
            "attention_bias": bool(d.get("attention_bias", True)), "o_proj_bias": False,
            "sliding_window": window,
            "layer_windows": windows if any(w is not None for w in windows) else ()}


ROPE_FREQS_TENSOR = "rope_freqs.weight"  # a llama file's RoPE factors, read into config.json
# Qwen2Config's default: without `layer_types`, layers from this one up slide (when any do)
QWEN2_MAX_WINDOW_LAYERS = 28
# GGUF tensor name -> transformers name; `{}` is the layer index (gguf-py's tensor map)
LLAMA_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_q.bias": "model.layers.{}.self_attn.q_proj.bias",
    "blk.{}.attn_k.bias": "model.layers.{}.self_attn.k_proj.bias",
    "blk.{}.attn_v.bias": "model.layers.{}.self_attn.v_proj.bias",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
}


def _llama_gguf_config(source: GGUFSource) -> dict[str, Any]:
    """A `llama` file's own keys: Llama 3.x's RoPE scaling, which llama.cpp's converter stores
    as per-frequency factors (`rope_freqs.weight`: 1, `factor`, or the smoothed band between)
    and leaves out of the metadata, applied as llama.cpp applies it (each inverse frequency
    divided by its factor). What a file may hold and this engine does not run is refused."""
    if any(n.endswith(("attn_q.bias", "attn_output.bias")) for n in source.tensor_names):
        raise GGUFError(f"{source.file}: attention biases in a Llama file are not supported in "
                        "GGUF files; serve the model's Hugging Face folder instead")
    if ROPE_FREQS_TENSOR not in source.tensor_names:
        return {}
    kind = source.key("rope.scaling.type", "none")
    if kind != "none":  # llama.cpp would apply both; no checkpoint we know of has both
        raise GGUFError(f"{source.file}: {ROPE_FREQS_TENSOR} beside rope scaling {kind!r} is "
                        "not supported; supported: rope_freqs alone")
    factors = source.read(ROPE_FREQS_TENSOR).reshape(-1)
    return {"rope_scaling": {"rope_type": ROPE_FREQS, "factors": factors.tolist()}}


def _qwen2_gguf_config(source: GGUFSource) -> dict[str, Any]:
    return {"use_sliding_window": False}  # llama.cpp's qwen2 attends to everything


# Mistral's GGUFs say "llama" (the same decoder, run by llama.cpp without a window).
ARCHITECTURES = (
    Architecture("LlamaForCausalLM", LlamaForCausalLM, _llama_fields, model_types=("llama",),
                 gguf=GGUFForm("llama", LLAMA_TENSOR_NAMES, permuted_qk=True,
                               config=_llama_gguf_config,
                               config_tensors=(ROPE_FREQS_TENSOR,))),
    Architecture("MistralForCausalLM", LlamaForCausalLM, _mistral_fields,
                 model_types=("mistral",)),
    Architecture("Qwen2ForCausalLM", LlamaForCausalLM, _qwen2_fields, model_types=("qwen2",),
                 gguf=GGUFForm("qwen2", LLAMA_TENSOR_NAMES, config=_qwen2_gguf_config)),
)
