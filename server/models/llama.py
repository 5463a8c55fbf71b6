"""The Llama family (Llama, Mistral, Qwen2) over the paged KV pool.

Numerics follow transformers' modelling code: RMSNorm in float32, RoPE with the rotate-half
convention (HF checkpoints' q/k rows are permuted for it), GQA by repeating KV heads, SwiGLU.
q/k/v and gate/up are stored stacked (`qkv_proj`, `gate_up_proj`) so each is one matmul;
`load_weights` maps transformers' separate names onto the stacked rows.

Threading: `forward` runs on the scheduler thread, which owns the KV pool it writes.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from hicache.memory.device import DeviceKVPool
from kernels import cpu_layer, cpu_linear
from kernels.cpu_layer import CpuLayerKernel, check_positions
from kernels.cpu_linear import CpuLinearKernel
from server.models.attention import AttentionBackend
from server.models.config import ModelArchConfig
from server.models.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)
KernelT = TypeVar("KernelT")

# transformers' separate projections -> (our stacked parameter, shard index within it)
_STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
# Checkpoint entries that are not weights (buffers some exporters save).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _param(shape: Sequence[int], dtype: torch.dtype, device: torch.device,
           fill: float | None = None) -> nn.Parameter:
    t = torch.empty(tuple(shape), dtype=dtype, device=device)
    if fill is not None:
        t.fill_(fill)
    return nn.Parameter(t, requires_grad=False)


# Rows up to which a plain CPU weight goes through oneDNN rather than MKL's sgemm: decode-
# sized batches, where MKL spends its time packing the weight (vLLM's CPU backend switches at
# the same size). Only the tied LM head (it is the embedding table too) and a weight that
# cannot be packed take this path; the other CPU Linears have a packed copy (`Linear.pack`).
ONEDNN_MAX_ROWS = 32
# The batch size oneDNN is told to expect when it reorders a weight: any hint from 2 up gives
# the same layout and speed from 1 to 256 rows here (a hint of 1 keeps it unblocked).
PACK_ROWS_HINT = 16
# A packed matmul of one row may take another oneDNN kernel whose bits differ from the same
# row in a batch of 2 or more (seen for in_features 1,536, the embedded model's down_proj,
# not for 512), so a lone decode token would not match its prefilled self. `Linear.pack`
# checks each weight once; where one row differs, a lone row runs as 2 copies of itself.
SINGLE_ROW_PAD = 2
SINGLE_ROW_PROBE_SEED = 0  # any: the probe's input only has to be random-looking


@functools.cache
def onednn_linear_works(dtype: torch.dtype) -> bool:
    """Whether torch's oneDNN linear (`mkldnn._linear_pointwise`, what inductor calls on the
    CPU) runs here in `dtype` and agrees with `F.linear`; checked once per dtype."""
    if not torch.backends.mkldnn.is_available():
        return False
    return _onednn_agrees(dtype, lambda w: w)


@functools.cache
def onednn_packing_works(dtype: torch.dtype) -> bool:
    """Whether a weight reordered once into oneDNN's blocked layout
    (`mkldnn._reorder_linear_weight`, what inductor's weight freezing does on the CPU) runs
    here in `dtype`, gives `F.linear`'s result, and unpacks to the same weight."""
    if not onednn_linear_works(dtype):
        return False

    def pack(w: torch.Tensor) -> torch.Tensor:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
        if not torch.equal(packed.to_dense(), w):
            raise RuntimeError("the packed weight does not unpack to itself")
        return packed
    return _onednn_agrees(dtype, pack)


def _onednn_agrees(dtype: torch.dtype,
                   prepare: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """oneDNN's linear on `prepare(w)` runs and gives `F.linear(x, w)` in `dtype`."""
    x, w = torch.randn(5, 16).to(dtype), torch.randn(8, 16).to(dtype)
    try:
        y = torch.ops.mkldnn._linear_pointwise(x, prepare(w), None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.allclose(y.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2))


# On the kernel, a batch of this many rows or more (a prefill chunk) runs on oneDNN's packed
# copy instead where oneDNN gives the kernel's very bits for that weight's shape
# (`onednn_matches_kernel`): oneDNN's blocking was 2-5% faster on 1,024-2,048 rows here, the
# kernel as fast up to ~300 rows and 1.4-2x faster on decode batches.
ONEDNN_MIN_ROWS = 512
ONEDNN_PROBE_ROWS = (ONEDNN_MIN_ROWS, 2048)  # 2,048: the engine's largest chunk
ONEDNN_PROBE_SEED = 1


@functools.cache
def onednn_matches_kernel(kernel: CpuLinearKernel, out_features: int, in_features: int,
                          bias: bool) -> bool:
    """Whether oneDNN's packed matmul gives the kernel's bits (one FMA chain per output in
    input order, then the bias) for a float32 weight of this shape, at ONEDNN_PROBE_ROWS
    rows: so on oneDNN 3.x with 512 inputs, not with 1,536 (it sums blocks of 1,024).
    Checked once per shape with random values, which any other order would not match."""
    if not onednn_packing_works(torch.float32):
        return False
    gen = torch.Generator().manual_seed(ONEDNN_PROBE_SEED)
    w = torch.randn((out_features, in_features), generator=gen)
    b = torch.randn((out_features,), generator=gen) if bias else None
    packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
    panels = kernel.pack(w)
    for rows in ONEDNN_PROBE_ROWS:
        x = torch.randn((rows, in_features), generator=gen)
        with torch.inference_mode():
            got = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
            if not torch.equal(got, kernel(x, panels, out_features, b)):
                return False
    return True


# The CPU linear kernel by default; `onednn` keeps every Linear on oneDNN (comparisons).
CPU_LINEAR_ENV = "HICACHE_CPU_LINEAR"
CPU_LINEAR_CHOICES = ("kernel", "onednn")


def make_linear_kernel(device: str | torch.device, dtype: torch.dtype,
                       kernel_dir: Path | None) -> CpuLinearKernel | None:
    """The C linear kernel for a float32 model on the CPU, built into `kernel_dir` (None: not
    tried), unless `HICACHE_CPU_LINEAR` says `onednn`; None leaves the Linears on oneDNN
    (or, on CUDA, on cuBLAS)."""
    return _cpu_kernel(CPU_LINEAR_ENV, CPU_LINEAR_CHOICES, device, dtype, kernel_dir,
                       cpu_linear.load)


# RMSNorm, RoPE and SiLU * up in C by default; `torch` keeps torch's ops (comparisons).
CPU_LAYER_OPS_ENV = "HICACHE_CPU_LAYER_OPS"
CPU_LAYER_OPS_CHOICES = ("kernel", "torch")


def make_layer_kernel(device: str | torch.device, dtype: torch.dtype,
                      kernel_dir: Path | None) -> CpuLayerKernel | None:
    """The C kernels of a decoder layer's RMSNorm, RoPE and SiLU * up, for a float32 model
    on the CPU, built into `kernel_dir` (None: not tried), unless `HICACHE_CPU_LAYER_OPS`
    says `torch`; None leaves them on torch's ops."""
    return _cpu_kernel(CPU_LAYER_OPS_ENV, CPU_LAYER_OPS_CHOICES, device, dtype, kernel_dir,
                       cpu_layer.load)


def _cpu_kernel(env: str, choices: tuple[str, str], device: str | torch.device,
                dtype: torch.dtype, kernel_dir: Path | None,
                load: Callable[[Path], KernelT | None]) -> KernelT | None:
    """`load(kernel_dir)` for float32 on the CPU when `env` says `choices[0]` (its default);
    else None. ValueError names an `env` value that is not one of `choices`."""
    choice = os.environ.get(env, choices[0])
    if choice not in choices:
        raise ValueError(f"{env}={choice!r}: expected one of {', '.join(choices)}")
    if (torch.device(device).type != "cpu" or dtype != torch.float32 or kernel_dir is None
            or choice != choices[0]):
        return None
    return load(kernel_dir)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           onednn: bool = False) -> torch.Tensor:
    """`F.linear`, through oneDNN for a CPU batch of at most ONEDNN_MAX_ROWS rows when
    `onednn` (the model checked `onednn_linear_works`)."""
    if onednn and x.shape[0] <= ONEDNN_MAX_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """`y = x @ W.T (+ b)`; W stacks `len(out_sizes)` matrices row-wise (q|k|v, gate|up).

    On the CPU, once the weights are loaded, `pack` keeps a second copy of W laid out for the
    matmul, and every call runs on it:

    - float32 where the C kernel builds (`kernel`, set by `LlamaForCausalLM.use_linear_kernel`;
      kernels/cpu_linear.c): every output one FMA chain over the inputs in order, whatever
      the batch size, so a row's bits do not depend on the rows beside it; a decode batch
      streams the weight at memory bandwidth (the embedded model's 97 MB of weights in a
      one-row step: 2.7 ms against oneDNN's 4.6 on 2 cores). Chunks of ONEDNN_MIN_ROWS
      rows or more take a oneDNN copy too, where its bits are the kernel's.
    - otherwise oneDNN's blocked layout (vLLM's CPU backend does the same): no per-call
      reorder of the weight (measured on 2 cores, the embedded model's gate|up at 8 rows:
      505 -> 272 us), and a row's result does not depend on how many rows share the call
      (but see SINGLE_ROW_PAD). MKL's sgemm on the plain W is not used for large batches
      either: on the AMD EPYCs here it was 8% faster for a 2,048-token prefill on one
      machine and 10-20% slower on another.

    Either way a token's K/V are the same bits whether it was prefilled or extended. Each
    copy adds the memory of the Linear weights once (not of the embedding table nor of a
    tied LM head): one copy on oneDNN, one or two on the kernel.
    """

    def __init__(self, in_features: int, out_sizes: Sequence[int], bias: bool,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.out_sizes = list(out_sizes)
        self.weight = _param((sum(out_sizes), in_features), dtype, device)
        self.bias = _param((sum(out_sizes),), dtype, device) if bias else None
        self.onednn = device.type == "cpu" and onednn_linear_works(dtype)
        self.packable = device.type == "cpu" and onednn_packing_works(dtype)
        self.packed: torch.Tensor | None = None  # not a parameter: derived from W
        self.pad_single_row = False  # set by `pack`
        self.kernel: CpuLinearKernel | None = None  # the C kernel, for float32 on the CPU
        self.panels: torch.Tensor | None = None  # W packed for `kernel`, by `pack`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            if self.packed is not None and x.shape[0] >= ONEDNN_MIN_ROWS:
                return self._packed(x)  # the same bits (`onednn_matches_kernel`)
            x = x if x.stride(-1) == 1 else x.contiguous()
            return self.kernel(x, self.panels, self.weight.shape[0], self.bias)
        if self.packed is None:
            return linear(x, self.weight, self.bias, self.onednn)
        if x.shape[0] == 1 and self.pad_single_row:  # see SINGLE_ROW_PAD
            return self._packed(x.expand(SINGLE_ROW_PAD, -1).contiguous())[:1]
        return self._packed(x)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @torch.no_grad()
    def pack(self) -> None:
        """(Re)build the packed copy of W: the kernel's panels where it takes this weight,
        else oneDNN's layout where packing works (CPU); else nothing."""
        if self.kernel is not None and self.weight.dtype == torch.float32:
            self.panels = self.kernel.pack(self.weight)
            if self.packable and onednn_matches_kernel(self.kernel, *self.weight.shape,
                                                       self.bias is not None):
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(),
                                                                      PACK_ROWS_HINT)
        elif self.packable:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(),
                                                                  PACK_ROWS_HINT)
            gen = torch.Generator().manual_seed(SINGLE_ROW_PROBE_SEED)
            x = torch.randn((SINGLE_ROW_PAD, self.weight.shape[1]), generator=gen).to(
                self.weight.dtype)
            self.pad_single_row = not torch.equal(self._packed(x[:1]), self._packed(x)[:1])

    def unpack(self) -> None:
        self.packed = self.panels = None

    def shard(self, param: torch.Tensor, index: int) -> torch.Tensor:
        """Rows of stacked matrix `index` in `param` (the weight or the bias), a view."""
        start = sum(self.out_sizes[:index])
        return param[start:start + self.out_sizes[index]]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param((size,), dtype, device, fill=1.0)
        self.kernel: CpuLayerKernel | None = None  # float32 on the CPU: one C pass

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(self(residual + x), residual + x)`: the residual add and the norm in one pass
        on the kernel (the sum is the same bits either way)."""
        if (self.kernel is not None and x.dtype == torch.float32 and x.dim() == 2
                and residual.is_contiguous()):
            return self.kernel.rms_norm(x, self.weight, self.eps, residual)
        total = residual + x
        return self(total), total

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dtype == torch.float32 and x.dim() == 2:
            return self.kernel.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused op, the same bits (a test checks)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """`[head_dim // 2]` float32 inverse frequencies, as transformers' rope init functions."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
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
    """cos/sin precomputed for positions `[0, max_positions)`; larger positions are an error."""

    def __init__(self, config: ModelArchConfig, device: torch.device) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        pos = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [max_positions, head_dim // 2]
        self.register_buffer("cos", freqs.cos().to(device), persistent=False)
        self.register_buffer("sin", freqs.sin().to(device), persistent=False)
        self.kernel: CpuLayerKernel | None = None  # float32 on the CPU: in place, in C

    def cos_sin(self, batch: ForwardBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[T, 1, head_dim // 2]` of the batch's positions, once per forward."""
        def build() -> tuple[torch.Tensor, torch.Tensor]:
            return (self.cos[batch.positions].to(dtype)[:, None, :],
                    self.sin[batch.positions].to(dtype)[:, None, :])
        return batch.memo("rope", build)

    def forward(self, batch: ForwardBatch, x: torch.Tensor) -> torch.Tensor:
        """`x` `[T, heads, head_dim]` rotated by the batch's positions (rotate-half pairs);
        on the kernel in place (the same bits)."""
        if self.kernel is not None and x.dtype == torch.float32 and self.cos.device.type == "cpu":
            batch.memo("rope_positions",
                       lambda: check_positions(batch.positions, self.cos.shape[0]))
            return self.kernel.rope_(x, batch.positions, self.cos, self.sin, checked=True)
        cos, sin = self.cos_sin(batch, x.dtype)
        x1, x2 = x.chunk(2, dim=-1)  # each [T, heads, head_dim // 2]
        out = torch.empty_like(x)
        o1, o2 = out.chunk(2, dim=-1)
        torch.sub(x1 * cos, x2 * sin, out=o1)
        torch.add(x2 * cos, x1 * sin, out=o2)
        return out


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
        self.kernel: CpuLayerKernel | None = None  # float32 on the CPU: SiLU * up in C

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernel is not None and gate_up.dtype == torch.float32 and gate_up.dim() == 2:
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
        self.embed_tokens.weight = _param((config.vocab_size, config.hidden_size), dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, backend, dtype, device)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary_emb = RotaryEmbedding(config, device)

    def forward(self, batch: ForwardBatch, kv_pool: DeviceKVPool) -> torch.Tensor:
        h = F.embedding(batch.input_ids, self.embed_tokens.weight)  # [T, hidden]
        for layer in self.layers:
            h = layer(h, self.rotary_emb, batch, kv_pool)
        return self.norm(h)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 decoder. `forward` -> float32 logits of each sequence's last
    new token (or of `batch.output_rows`); K/V of the new tokens land in `kv_pool` at
    `batch.out_slots`, every layer."""

    def __init__(self, config: ModelArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.model = LlamaModel(config, attn_backend, dtype, self.device)
        # a tied LM head is the embedding table (never packed): its oneDNN choice, once
        self._onednn_head = self.device.type == "cpu" and onednn_linear_works(dtype)
        if config.tie_word_embeddings:
            self.lm_head = nn.Module()
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = Linear(config.hidden_size, [config.vocab_size], False, dtype,
                                  self.device)

    @property
    def attn_backend(self) -> AttentionBackend:
        """The attention backend (every layer shares one)."""
        return self.model.layers[0].self_attn.backend

    @property
    def linear_backend(self) -> str:
        """What the Linears run on: CpuLinearKernel, oneDNN (packed) or torch."""
        first = self.model.layers[0].self_attn.qkv_proj
        if first.panels is not None:
            return type(first.kernel).__name__
        return "oneDNN" if first.packed is not None else "torch"

    @property
    def layer_ops(self) -> str:
        """What RMSNorm, RoPE and SiLU * up run on: CpuLayerKernel or torch."""
        kernel = self.model.norm.kernel
        return "torch" if kernel is None else type(kernel).__name__

    def use_layer_kernel(self, kernel: CpuLayerKernel | None) -> None:
        """Run RMSNorm, RoPE and SiLU * up on `kernel` (None: torch ops), on the CPU."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, RotaryEmbedding, LlamaMLP)):
                m.kernel = kernel if self.device.type == "cpu" else None

    @torch.no_grad()
    def use_linear_kernel(self, kernel: CpuLinearKernel | None) -> None:
        """Run the Linears on `kernel` (None: back to oneDNN), repacking loaded weights."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.kernel = kernel if m.weight.device.type == "cpu" else None
                if m.packed is not None or m.panels is not None:
                    m.unpack()
                    m.pack()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_pool: DeviceKVPool) -> torch.Tensor:
        """`[num_seqs, vocab]` float32 logits of each sequence's last new token, or
        `[len(output_rows), vocab]` of those rows when the batch names them. Only the rows
        returned go through the LM head."""
        batch = batch.to(kv_pool.device)
        h = self.model(batch, kv_pool)  # [T, hidden]
        return self._logits(h.index_select(0, batch.logit_rows()))

    @torch.inference_mode()
    def forward_all_logits(self, batch: ForwardBatch, kv_pool: DeviceKVPool) -> torch.Tensor:
        """`[T, vocab]` float32 logits of every new token (tests, scoring)."""
        return self._logits(self.model(batch.to(kv_pool.device), kv_pool))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        if isinstance(self.lm_head, Linear):
            return self.lm_head(h).float()
        return linear(h, self.lm_head.weight, onednn=self._onednn_head).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformers-named tensors in (cast to the model's dtype and device).

        ValueError for an unknown name, a shape mismatch, or a weight missing at the end.
        The CPU Linears' packed copies are dropped while loading and rebuilt after.
        """
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        for m in linears:
            m.unpack()
        try:
            self._load_all(weights)
        finally:
            for m in linears:
                m.pack()

    def _load_all(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        pending = self._expected_keys()
        for name, tensor in weights:
            key = self._load_one(name, tensor, params)
            if key is not None:
                pending.discard(key)
        if pending:
            missing = sorted(n if i is None else f"{n}[shard {i}]" for n, i in pending)
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:5]}")

    def _expected_keys(self) -> set[tuple[str, int | None]]:
        """(parameter, shard) pairs a complete checkpoint fills; shard None = the whole."""
        keys: set[tuple[str, int | None]] = set()
        for mod_name, mod in self.named_modules():
            shards = len(mod.out_sizes) if isinstance(mod, Linear) else 1
            for p_name, _ in mod.named_parameters(recurse=False):
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                keys |= {(full, None)} if shards == 1 else {(full, i) for i in range(shards)}
        if self.config.tie_word_embeddings:
            keys.discard(("lm_head.weight", None))
        return keys

    def _load_one(self, name: str, tensor: torch.Tensor,
                  params: dict[str, nn.Parameter]) -> tuple[str, int | None] | None:
        if name.endswith(_IGNORED_SUFFIXES):
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # some tied checkpoints still store the copy
        target_name, shard = _stacked_name(name)
        if target_name not in params:
            raise ValueError(f"checkpoint weight {name!r} has no place in {type(self).__name__}")
        target = params[target_name]
        if shard is not None:
            owner = self.get_submodule(target_name.rsplit(".", 1)[0])
            target = owner.shard(target, shard)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint weight {name!r} has shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(target.shape)}")
        target.copy_(tensor)
        return target_name, shard


def _stacked_name(name: str) -> tuple[str, int | None]:
    """`...self_attn.k_proj.weight` -> (`...self_attn.qkv_proj.weight`, 1); others unchanged."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _STACKED:
        stacked, shard = _STACKED[parts[-2]]
        return ".".join([*parts[:-2], stacked, parts[-1]]), shard
    return name, None

