"""The Llama family (Llama, Mistral, Qwen2) over the paged KV pool.

Numerics follow transformers' modelling code: RMSNorm in float32, RoPE with the rotate-half
convention (HF checkpoints' q/k rows are permuted for it), GQA by repeating KV heads, SwiGLU.
q/k/v and gate/up are stored stacked (`qkv_proj`, `gate_up_proj`) so each is one matmul;
`load_weights` maps transformers' separate names onto the stacked rows.

Threading: `forward` runs on the scheduler thread, which owns the KV pool it writes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from hicache.memory.device import DeviceKVPool
from hicache_server.models.attention import AttentionBackend
from hicache_server.models.config import ModelArchConfig
from hicache_server.models.cpu_forward import LeanForward
from hicache_server.models.cpu_kernels import KERNEL_DTYPES
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.models.kernels.cpu_layer import CpuLayerKernel, check_positions
from hicache_server.models.kernels.cpu_linear import CpuLinearKernel
from hicache_server.models.linear import Linear, linear, make_param, onednn_linear_works

# transformers' separate projections -> (our stacked parameter, shard index within it)
_STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
# Checkpoint entries that are not weights (buffers some exporters save).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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
        # the tables as a bfloat16 model's RoPE uses them (transformers: cos.to(x.dtype))
        self.register_buffer("cos_bf16", self.cos.to(torch.bfloat16), persistent=False)
        self.register_buffer("sin_bf16", self.sin.to(torch.bfloat16), persistent=False)
        self.kernel: CpuLayerKernel | None = None  # on the CPU: in place, in C

    def cos_sin(self, batch: ForwardBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[T, 1, head_dim // 2]` of the batch's positions, once per forward."""
        def build() -> tuple[torch.Tensor, torch.Tensor]:
            return (self.cos[batch.positions].to(dtype)[:, None, :],
                    self.sin[batch.positions].to(dtype)[:, None, :])
        return batch.memo("rope", build)

    def forward(self, batch: ForwardBatch, x: torch.Tensor) -> torch.Tensor:
        """`x` `[T, heads, head_dim]` rotated by the batch's positions (rotate-half pairs);
        on the kernel in place (the same bits)."""
        if self.kernel is not None and x.dtype in KERNEL_DTYPES and self.cos.device.type == "cpu":
            batch.memo("rope_positions",
                       lambda: check_positions(batch.positions, self.cos.shape[0]))
            cos, sin = ((self.cos_bf16, self.sin_bf16) if x.dtype == torch.bfloat16
                        else (self.cos, self.sin))
            return self.kernel.rope_(x, batch.positions, cos, sin, checked=True)
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
        # a tied LM head is the embedding table: on the linear kernel, a packed copy of the
        # table (`_pack_head`); else oneDNN, its choice made once
        self._onednn_head = self.device.type == "cpu" and onednn_linear_works(dtype)
        self._head_kernel: CpuLinearKernel | None = None
        self._head_panels: torch.Tensor | None = None
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
        """What the Linears run on: CpuLinearKernel (in bfloat16 with its path, e.g.
        `CpuLinearKernel (amx)`), oneDNN (packed) or torch."""
        first = self.model.layers[0].self_attn.qkv_proj
        if first.panels is not None:
            name = type(first.kernel).__name__
            if self.dtype == torch.bfloat16:  # which of its bfloat16 paths: amx, ...
                return f"{name} ({first.kernel.bf16_path})"
            return name
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
        self._refresh_lean()

    @torch.no_grad()
    def use_linear_kernel(self, kernel: CpuLinearKernel | None) -> None:
        """Run the Linears on `kernel` (None: back to oneDNN), repacking loaded weights."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.kernel = kernel if m.weight.device.type == "cpu" else None
                if m.packed is not None or m.panels is not None:
                    m.unpack()
                    m.pack()
        self._head_kernel = kernel if self.device.type == "cpu" else None
        self._pack_head()
        self._refresh_lean()

    def _refresh_lean(self) -> None:
        """The lean path for the kernels and packed weights the model has now (or none)."""
        self.model.lean = LeanForward.build(self.model, self.config, self.dtype)

    def _pack_head(self) -> None:
        """A tied LM head on the linear kernel: the table packed once (one more copy of it:
        113 MB for SmolLM2 in float32, 56 in bfloat16). The kernel gives a row's logits the
        same bits in any batch, as oneDNN does not promise, and streams the table faster
        for decode batches (SmolLM2's float32 head, from memory: 1 row 3.30 -> 2.64 ms,
        8 rows 5.39 -> 3.05 against oneDNN)."""
        self._head_panels = None
        if self._head_kernel is not None and self.config.tie_word_embeddings:
            self._head_panels = self._head_kernel.pack(self.model.embed_tokens.weight)

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
        if self._head_panels is not None:
            return self._head_kernel(h.contiguous(), self._head_panels,
                                     self.config.vocab_size).float()
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
            self._pack_head()
            self._refresh_lean()

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

