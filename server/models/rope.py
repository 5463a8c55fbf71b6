"""Rotary position embeddings as transformers computes them: the inverse frequencies of its rope
init functions (default, linear, llama3, longrope's short factors), cos/sin tables in float32
(and bfloat16, the tables a bfloat16 model rotates with) times longrope's attention factor, the
rotate-half pairing over the first `config.rotary_dim` values of each head (partial rotary).
Shared by every architecture; a model with two bases (Gemma 3's global and local layers) holds
two RotaryEmbeddings.

Threading: `forward` runs on the scheduler thread.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hicache_server.models.config import ROPE_FREQS, ModelArchConfig
from hicache_server.models.cpu_kernels import KERNEL_DTYPES
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.models.kernels.cpu_layer import CpuLayerKernel, check_positions


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """`[head_dim // 2]` float32 inverse frequencies, as transformers' rope init functions."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == ROPE_FREQS:  # as llama.cpp applies a GGUF's rope_freqs
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if scaling["rope_type"] == "longrope":  # within original_max_position_embeddings (phi3.py)
        short = torch.tensor(scaling["short_factor"], dtype=torch.float32)
        return 1.0 / (short * theta ** exponents)
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """transformers' `_compute_llama3_parameters`: long wavelengths slowed down by `factor`,
    short ones kept, the band between interpolated smoothly."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin of `config.rope_theta` and `config.rope_scaling` precomputed for positions
    `[0, max_position_embeddings)`; larger positions are an error."""

    def __init__(self, config: ModelArchConfig, device: torch.device) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling)
        pos = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [max_positions, rotary_dim // 2]
        scale = (config.rope_scaling or {}).get("attention_factor", 1.0)  # longrope's
        self.register_buffer("cos", (freqs.cos() * scale).to(device), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scale).to(device), persistent=False)
        # the tables as a bfloat16 model's RoPE uses them (transformers: cos.to(x.dtype))
        self.register_buffer("cos_bf16", self.cos.to(torch.bfloat16), persistent=False)
        self.register_buffer("sin_bf16", self.sin.to(torch.bfloat16), persistent=False)
        self.kernel: CpuLayerKernel | None = None  # on the CPU: in place, in C
        # a batch's tables are kept under this key: two bases in one model keep two
        self._memo_key = f"rope/{config.rope_theta}/{config.rope_scaling}"

    def cos_sin(self, batch: ForwardBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[T, 1, rotary_dim // 2]` of the batch's positions, once per forward."""
        def build() -> tuple[torch.Tensor, torch.Tensor]:
            return (self.cos[batch.positions].to(dtype)[:, None, :],
                    self.sin[batch.positions].to(dtype)[:, None, :])
        return batch.memo(f"{self._memo_key}/{dtype}", build)

    def forward(self, batch: ForwardBatch, x: torch.Tensor) -> torch.Tensor:
        """`x` `[T, heads, head_dim]` rotated by the batch's positions (rotate-half pairs of
        the first rotary_dim values, the rest kept); on the kernel in place (the same bits)."""
        if self.kernel is not None and x.dtype in KERNEL_DTYPES and self.cos.device.type == "cpu":
            batch.memo("rope_positions",
                       lambda: check_positions(batch.positions, self.cos.shape[0]))
            cos, sin = ((self.cos_bf16, self.sin_bf16) if x.dtype == torch.bfloat16
                        else (self.cos, self.sin))
            return self.kernel.rope_(x, batch.positions, cos, sin, checked=True)
        cos, sin = self.cos_sin(batch, x.dtype)
        rotary = 2 * cos.shape[-1]
        x1, x2 = x[..., :rotary].chunk(2, dim=-1)  # each [T, heads, rotary_dim // 2]
        out = torch.empty_like(x)
        o1, o2 = out[..., :rotary].chunk(2, dim=-1)
        torch.sub(x1 * cos, x2 * sin, out=o1)
        torch.add(x2 * cos, x1 * sin, out=o2)
        if rotary < x.shape[-1]:  # partial rotary: the rest of each head as it was
            out[..., rotary:] = x[..., rotary:]
        return out
