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

Its registry entry (`ARCHITECTURES`) reads its config.json keys (Gemma3TextConfig's defaults
for those left out) and llama.cpp's `gemma3` GGUF form.

Every layer's K/V is written to the pool at `batch.out_slots` (the cache keeps all layers'
KV of every token). On the CPU the layer kernel runs all of a layer's ops but its matmuls
and attention: RoPE, the norms (Gemma's arithmetic: `gemma_rms_norm`, and a norm after a
branch, the residual add and the next norm in one pass: `gemma_norm_add_norm`) and GeGLU
(`gelu_tanh_mul`); elsewhere their torch references of the same signature. Small batches with
all of this on the kernels take the lean path (gemma_forward.py, the modules' bits).

Threading: `forward` runs on the scheduler thread, which owns the KV pool it writes.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hicache.memory.device import DeviceKVPool
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
from hicache_server.models.cpu_forward import LeanForward
from hicache_server.models.cpu_kernels import KERNEL_DTYPES
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.models.gemma_forward import build_gemma_lean
from hicache_server.models.gguf_tokenizer import GGUFError
from hicache_server.models.kernels.cpu_layer import (
    CpuLayerKernel,
    NormAdd,
    gelu_tanh_mul_reference,
    gemma_norm_add_norm_reference,
    gemma_rms_norm_reference,
)
from hicache_server.models.linear import Linear, make_param
from hicache_server.models.llama import LLAMA_TENSOR_NAMES
from hicache_server.models.registry import Architecture, GGUFForm, GGUFSource
from hicache_server.models.rope import RotaryEmbedding

GEMMA3 = "Gemma3ForCausalLM"
# Gemma3TextConfig's defaults, for the keys a config.json may leave out
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
    "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "hidden_activation": "gelu_pytorch_tanh",
}
ROPE_THETAS = {FULL_ATTENTION: 1_000_000.0, SLIDING_ATTENTION: 10_000.0}
# Without `layer_types`, every Nth layer is full, the others slide (transformers' default N)
LAYER_PATTERN = 6
# The one activation: transformers' ACT2FN["gelu_pytorch_tanh"], GeGLU's (gelu_tanh_mul)
GELU_TANH = "gelu_pytorch_tanh"


class GemmaRMSNorm(nn.Module):
    """transformers' Gemma3RMSNorm: `x` normalised in float32, times `1 + w` in float32, then
    cast to x's dtype (Llama casts before its product). `weight` holds w, as checkpoints do;
    `one_plus_w` the float32 `1.0 + w.float()` that transformers computes every call, the
    same bits folded once per load (`fold`, which the model calls after `load_weights`)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = make_param((size,), dtype, device, fill=0.0)
        self.kernel: CpuLayerKernel | None = None  # on the CPU: one C pass
        self.register_buffer("one_plus_w", torch.ones(size, device=device), persistent=False)

    @torch.no_grad()
    def fold(self) -> None:
        """`one_plus_w` from the weight the module holds now."""
        self.one_plus_w = 1.0 + self.weight.detach().float()

    def _on_kernel(self, x: torch.Tensor) -> bool:
        return self.kernel is not None and x.dtype in KERNEL_DTYPES and x.device.type == "cpu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[M, H]`, or `[T, heads, H]` per head (q or k)."""
        if self._on_kernel(x):
            return self.kernel.gemma_rms_norm(x, self.one_plus_w, self.eps)
        return gemma_rms_norm_reference(x, self.one_plus_w, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor,
                 next_norm: GemmaRMSNorm) -> NormAdd:
        """`(next_norm(residual + self(x)), residual + self(x))`: this norm on a branch's
        output, the residual add, the norm of what comes next, in one pass on the kernel
        (every Gemma norm has the config's one eps)."""
        if self._on_kernel(x) and x.dim() == 2 and residual.is_contiguous():
            return self.kernel.gemma_norm_add_norm(x, self.one_plus_w, residual,
                                                   next_norm.one_plus_w, self.eps)
        return gemma_norm_add_norm_reference(x, self.one_plus_w, residual,
                                             next_norm.one_plus_w, self.eps)


class Gemma3Attention(nn.Module):
    """`qk_norm=False`: Gemma 2's, with no q/k norms; its scores soft-capped by the config's
    `attn_logit_softcapping` (None for Gemma 3)."""

    def __init__(self, config: ModelArchConfig, layer_id: int, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device, qk_norm: bool = True) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.backend = backend
        self.window, self.scale = config.window_of(layer_id), config.attention_scale
        self.softcap = config.attn_logit_softcapping
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.split = [config.q_size, config.kv_size, config.kv_size]
        self.qkv_proj = Linear(config.hidden_size, self.split, False, dtype, device)
        self.o_proj = Linear(config.q_size, [config.hidden_size], False, dtype, device)
        norm = functools.partial(GemmaRMSNorm, config.head_dim, config.rms_norm_eps, dtype, device)
        self.q_norm = norm() if qk_norm else nn.Identity()
        self.k_norm = norm() if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, batch: ForwardBatch,
                kv_pool: DeviceKVPool) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)  # [T, q_size | kv_size]
        q = rope(batch, self.q_norm(q.view(t, self.heads, self.head_dim)))
        k = rope(batch, self.k_norm(k.view(t, self.kv_heads, self.head_dim)))
        v = v.view(t, self.kv_heads, self.head_dim)
        if batch.layer_hook is not None:  # the runner waits here for this layer's loads
            batch.layer_hook(self.layer_id)
        b = kv_pool.batch_for(self.layer_id, batch)  # a window layer's slots mapped
        kv_pool.set_kv(self.layer_id, b.out_slots, k, v)
        o = self.backend.forward(q, k, v, self.layer_id, b, kv_pool, window=self.window,
                                 scale=self.scale, softcap=self.softcap)  # [T, heads, head_dim]
        return self.o_proj(o.reshape(t, self.heads * self.head_dim))


class Gemma3MLP(nn.Module):
    def __init__(self, config: ModelArchConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, [inter, inter], False, dtype, device)
        self.down_proj = Linear(inter, [config.hidden_size], False, dtype, device)
        self.kernel: CpuLayerKernel | None = None  # on the CPU: gelu_tanh * up in C

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * inter]
        if self.kernel is not None and gate_up.dtype in KERNEL_DTYPES and gate_up.dim() == 2:
            return self.down_proj(self.kernel.gelu_tanh_mul(gate_up))
        return self.down_proj(gelu_tanh_mul_reference(gate_up))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, layer_id: int, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device, qk_norm: bool = True) -> None:
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.self_attn = Gemma3Attention(config, layer_id, backend, dtype, device, qk_norm)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.mlp = Gemma3MLP(config, dtype, device)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)

    def forward(self, x: torch.Tensor, h: torch.Tensor, rope: RotaryEmbedding,
                batch: ForwardBatch, kv_pool: DeviceKVPool, next_norm: GemmaRMSNorm) -> NormAdd:
        """x: `input_layernorm(h)`, h the residual stream `[T, hidden]`; returns
        `next_norm` of the layer's output (the next layer's x) and the output itself, each
        norm after a branch fused with the add and the norm that follow it."""
        a = self.self_attn(x, rope, batch, kv_pool)
        x, h = self.post_attention_layernorm.add_norm(a, h, self.pre_feedforward_layernorm)
        return self.post_feedforward_layernorm.add_norm(self.mlp(x), h, next_norm)


class Gemma3Model(nn.Module):
    """Gemma 3's body; Gemma 2's with `qk_norm=False` (gemma2.py)."""

    def __init__(self, config: ModelArchConfig, backend: AttentionBackend,
                 dtype: torch.dtype, device: torch.device, qk_norm: bool = True) -> None:
        super().__init__()
        if config.hidden_act != GELU_TANH:
            raise ValueError(f"Gemma 3: hidden_act {config.hidden_act!r} is not supported; "
                             f"supported: {GELU_TANH}")
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = make_param((config.vocab_size, config.hidden_size), dtype,
                                              device)
        # transformers' Gemma3TextScaledWordEmbedding: sqrt(hidden) as a float32 scalar, cast
        # to the model dtype before the product (bfloat16 rounds it)
        scale = torch.tensor(config.hidden_size ** 0.5, dtype=torch.float32)
        self.register_buffer("embed_scale", scale.to(dtype=dtype, device=device),
                             persistent=False)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, backend, dtype, device, qk_norm)
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary_emb = RotaryEmbedding(config, device)  # full layers
        self.rotary_emb_local = RotaryEmbedding(
            replace(config, rope_theta=config.rope_local_theta, rope_scaling=None), device)
        # small batches with every op on the CPU kernels: the same calls, bound once (set by
        # the CausalLM whenever its kernels or weights change: `refresh_gemma`)
        self.lean: LeanForward | None = None

    def forward(self, batch: ForwardBatch, kv_pool: DeviceKVPool) -> torch.Tensor:
        if self.lean is not None:
            x = self.lean(batch, kv_pool)
            if x is not None:
                return x
        h = F.embedding(batch.input_ids, self.embed_tokens.weight) * self.embed_scale
        x = self.layers[0].input_layernorm(h)  # [T, hidden], as h
        next_norms = [*(layer.input_layernorm for layer in self.layers[1:]), self.norm]
        for layer, next_norm in zip(self.layers, next_norms):
            rope = self.rotary_emb if layer.self_attn.window is None else self.rotary_emb_local
            x, h = layer(x, h, rope, batch, kv_pool, next_norm)
        return x  # the final norm's


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3's text decoder (`CausalLM`'s contract)."""

    def __init__(self, config: ModelArchConfig, attn_backend: AttentionBackend,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        device = torch.device(device)
        super().__init__(config, Gemma3Model(config, attn_backend, dtype, device), dtype, device)

    def _layer_kernel_modules(self) -> list[nn.Module]:
        """Gemma's norms, RoPE (both bases) and GeGLU: all of a layer's ops but its matmuls
        and attention."""
        return gemma_kernel_modules(self)

    def _refresh_derived(self) -> None:
        refresh_gemma(self)


def refresh_gemma(lm: CausalLM) -> None:
    """What a Gemma 2 or 3 CausalLM derives from its weights and kernels: every norm's
    folded `1 + w` (`fold_norms`), then the lean path bound to them (or none)."""
    fold_norms(lm)
    lm.model.lean = build_gemma_lean(lm.model, lm.config, lm.dtype, gemma_kernel_modules(lm))


def fold_norms(model: nn.Module) -> None:
    """Every GemmaRMSNorm's `1 + w` from its weight now (after a load)."""
    for m in model.modules():
        if isinstance(m, GemmaRMSNorm):
            m.fold()


def gemma_kernel_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of a Gemma 2 or 3 model that run on the layer kernel (the first is a
    norm, which `CausalLM.layer_ops` reads)."""
    return [m for m in model.modules()
            if isinstance(m, (GemmaRMSNorm, RotaryEmbedding, Gemma3MLP))]


# ---------------------------------------------------------------------------------------------
# Registry entry: config.json keys, the GGUF form


def _config_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 3's own keys: a window per sliding layer, a RoPE base per layer type, the
    attention scale, the activation. What transformers' Gemma3ForCausalLM computes and this
    engine does not (softcapping, bidirectional attention, biases) is refused."""
    refused = {key: d.get(key) for key in ("attn_logit_softcapping", "final_logit_softcapping",
                                           "use_bidirectional_attention", "attention_bias")}
    for key, value in refused.items():
        if value:
            raise ValueError(f"config.json: {key}={value} is not supported for {GEMMA3}")
    if d["hidden_activation"] != GELU_TANH:
        raise ValueError(f"config.json: hidden_activation {d['hidden_activation']!r} is not "
                         f"supported; supported: {GELU_TANH}")
    window = None if d["sliding_window"] is None else int(d["sliding_window"])
    pattern = int(d.get("sliding_window_pattern") or LAYER_PATTERN)
    types = layer_types(d, lambda i: SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION)
    if window is None and SLIDING_ATTENTION in types:
        raise ValueError("config.json: sliding layers need a sliding_window, got none")
    (theta, scaling), local_theta = _rope(d)
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta,
            "sliding_window": window, "query_pre_attn_scalar": float(d["query_pre_attn_scalar"]),
            "layer_windows": windows_of(types, window), "hidden_act": d["hidden_activation"]}


def _rope(d: Mapping[str, Any]) -> tuple[tuple[float, dict[str, Any] | None], float]:
    """((theta, scaling) of the full layers, theta of the sliding ones) from either
    generation: `rope_parameters` per layer type, or `rope_theta` and `rope_scaling` (the full
    layers') and `rope_local_base_freq`."""
    params = dict(d.get("rope_parameters") or {})
    if not set(params) <= {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise ValueError(f"config.json: Gemma 3's rope_parameters must be keyed by layer type "
                         f"({FULL_ATTENTION}, {SLIDING_ATTENTION}), got {params}")
    full = {"rope_theta": d.get("rope_theta", ROPE_THETAS[FULL_ATTENTION]),
            **(d.get("rope_scaling") or {}), **(params.get(FULL_ATTENTION) or {})}
    local = {"rope_theta": d.get("rope_local_base_freq", ROPE_THETAS[SLIDING_ATTENTION]),
             **(params.get(SLIDING_ATTENTION) or {})}
    local_theta, local_scaling = parse_rope({"rope_parameters": local})
    if local_scaling is not None:
        raise ValueError(f"config.json: rope scaling of the sliding layers ({local}) is not "
                         "supported")
    return parse_rope({"rope_parameters": full}), local_theta


# Four norms a layer and q/k norms (gguf-py's tensor map): its `ffn_norm` is the norm before
# the MLP, the one after attention has a name of its own.
GGUF_TENSOR_NAMES = {
    **{k: v for k, v in LLAMA_TENSOR_NAMES.items() if ".bias" not in k},
    "blk.{}.ffn_norm.weight": "model.layers.{}.pre_feedforward_layernorm.weight",
    "blk.{}.post_attention_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.post_ffw_norm.weight": "model.layers.{}.post_feedforward_layernorm.weight",
    "blk.{}.attn_q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "blk.{}.attn_k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
}
# What llama.cpp assumes of every gemma3 file, which the metadata does not say
# (llama-model.cpp, `llama_load_hparams_gemma3`): every 6th layer full (LAYER_PATTERN), the
# sliding layers' RoPE base, and q.k scaled by 1/sqrt(head dim) except in the 27B model (62
# layers), by 1/sqrt(hidden / heads) as its config.json's query_pre_attn_scalar (168).
GGUF_LOCAL_ROPE_BASE = 10000.0
GGUF_27B_LAYERS = 62


def _gguf_config(source: GGUFSource) -> dict[str, Any]:
    """Gemma 3's config.json keys beyond the shared ones: its window from the file, the rest
    as llama.cpp assumes them; softcapping, should a file carry it, is passed on for
    `_config_fields` to refuse."""
    layers, hidden = int(source.key("block_count")), int(source.key("embedding_length"))
    heads = int(source.key("attention.head_count"))
    head_dim = int(source.key("attention.key_length", hidden // heads))
    if int(source.key("attention.value_length", head_dim)) != head_dim:
        raise GGUFError(f"{source.file}: gemma3 value_length "
                        f"{source.key('attention.value_length')} differs from key_length "
                        f"{head_dim}")
    return {"sliding_window": int(source.key("attention.sliding_window")),
            "sliding_window_pattern": LAYER_PATTERN,
            "rope_local_base_freq": GGUF_LOCAL_ROPE_BASE,
            "query_pre_attn_scalar": hidden // heads if layers == GGUF_27B_LAYERS else head_dim,
            "hidden_activation": GELU_TANH,
            "attn_logit_softcapping": source.meta.get("gemma3.attn_logit_softcapping"),
            "final_logit_softcapping": source.meta.get("gemma3.final_logit_softcapping")}


ARCHITECTURES = (
    Architecture(GEMMA3, Gemma3ForCausalLM, _config_fields, model_types=("gemma3_text",),
                 config_defaults=_DEFAULTS,
                 # the converter's norm_shift: every norm weight stored as 1 + w; a chat turn
                 # ends at <end_of_turn>, which the file names nowhere (no eot id)
                 gguf=GGUFForm("gemma3", GGUF_TENSOR_NAMES, norm_shift=1.0,
                               config=_gguf_config, eos_tokens=("<end_of_turn>",))),
)
