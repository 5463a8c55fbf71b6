"""Gemma 2's and 3's layers on the lean path (cpu_forward.py's frame: small batches, every
call bound once per batch size, the modules' bits).

A Gemma layer, as gemma3.py's modules compute it, each op on the layer or linear kernel:

    x        the layer's input norm of the residual h (layer 0's here; every later layer's
             is the previous layer's last call, fused with its add)
    qkv      qkv_proj(x); Gemma 3 normalises q and k per head (`1 + w`) into their own
             buffers, then rotates them with the layer's RoPE base (local for a window
             layer, global for a full one); Gemma 2 rotates q and k inside qkv
    attn     the K/V write and attention (`_BoundAttention`), scaled by
             `query_pre_attn_scalar ** -0.5`, Gemma 2's scores soft-capped
    a        o_proj(attn); x, h = pre_ff_norm(h + post_attn_norm(a)), h updated in place
    m        down(gelu_tanh(gate) * up) of x; x, h = next_norm(h + post_ff_norm(m)), next_norm
             the next layer's input norm, or the final norm after the last layer

The embeddings are scaled by sqrt(hidden) in the model dtype (`embed_scale`), in place.

What must stay true: the same as cpu_forward.py's plans (raw pointers into the plan's
buffers and the packed weights; a plan dropped when a Linear repacks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
from torch import nn

from hicache_server.models.config import ModelArchConfig
from hicache_server.models.cpu_forward import LayerCalls, LeanForward, bind_linear, lean_kernels
from hicache_server.models.linear import Linear

# The architectures whose layers `build_gemma_lean` binds (gemma3.py's and gemma2.py's)
GEMMA_ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma2ForCausalLM")


class _GemmaPlan:
    """Buffers of `rows` rows and every call of one Gemma forward bound to them: what
    `LeanForward.__call__` reads of a plan (cpu_forward.py's `_Plan`)."""

    def __init__(self, lean: LeanForward, rows: int, threads: int) -> None:
        model, config = lean.model, lean.config
        bf16 = lean.dtype == torch.bfloat16
        # the global base's cos and sin, then the local base's (a window layer's)
        self._tables = [(r.cos_bf16, r.sin_bf16) if bf16 else (r.cos, r.sin)
                        for r in (model.rotary_emb, model.rotary_emb_local)]
        self._qk_norm = _has_qk_norms(model)
        self.packings = Linear.packings
        self.rows, self.threads = rows, threads
        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, \
            config.num_key_value_heads
        q_size, kv_size, dim = config.q_size, config.kv_size, config.head_dim

        def empty(*shape: int) -> torch.Tensor:
            return torch.empty(shape, dtype=lean.dtype)
        self.positions = torch.zeros(rows, dtype=torch.int64)
        self.h = (empty(rows, hidden),)  # the residual stream, updated in place
        self.x, self.a, self.m = (empty(rows, hidden) for _ in range(3))
        self.out = self.x  # the final norm's output is the last layer's x
        self.qkv = empty(rows, q_size + 2 * kv_size)
        self.q = self.qkv[:, :q_size].view(rows, heads, dim)
        self.k = self.qkv[:, q_size:q_size + kv_size].view(rows, kv_heads, dim)
        self.v = self.qkv[:, q_size + kv_size:].view(rows, kv_heads, dim)
        self._qkv_views = (self.q, self.k)  # q and k as qkv_proj writes them
        if self._qk_norm:  # each normalised into its own buffer, which RoPE rotates
            self.q, self.k = empty(rows, heads, dim), empty(rows, kv_heads, dim)
        self.attention_out = empty(rows, heads, dim)
        self.gate_up = empty(rows, 2 * config.intermediate_size)
        self.act = empty(rows, config.intermediate_size)
        self._keep: list[torch.Tensor] = []  # packed weights the calls point into
        scale = model.embed_scale
        self.embedded = (functools.partial(_scale, self.h[0], scale),)  # no cycle to self
        layers = model.layers
        next_norms = [*(layer.input_layernorm for layer in layers[1:]), model.norm]
        self.layers = [self._bind_layer(lean, layer, i, next_norm)
                       for i, (layer, next_norm) in enumerate(zip(layers, next_norms))]
        self.final = ()  # the last layer's x is the final norm's output

    def _bind_layer(self, lean: LeanForward, layer: nn.Module, i: int,
                    next_norm: nn.Module) -> LayerCalls:
        """Layer i's calls (`layer` a Gemma3DecoderLayer, `next_norm` the norm after it)."""
        attn, ops, threads = layer.self_attn, lean.layer_kernel, self.threads
        h = self.h[0]
        before: tuple[Callable[[], object], ...] = ()
        if i == 0:
            norm = layer.input_layernorm
            before += (ops.bind_gemma_norm(h, norm.one_plus_w, norm.eps, self.x,
                                           threads=threads),)
        before += (self._linear(lean, attn.qkv_proj, self.x, self.qkv),)
        if self._qk_norm:
            before += tuple(ops.bind_gemma_norm(view, norm.one_plus_w, norm.eps, out,
                                                threads=threads)
                            for view, norm, out in zip(self._qkv_views,
                                                       (attn.q_norm, attn.k_norm),
                                                       (self.q, self.k)))
        # a window layer rotates with the local base (the modules' choice, Gemma3Model)
        cos, sin = self._tables[lean.windows[i] is not None]
        before += tuple(ops.bind_rope_(x, self.positions, cos, sin, threads)
                        for x in (self.q, self.k))
        self._keep += [norm.one_plus_w for norm in (  # the norm weights the calls point into
            layer.input_layernorm, attn.q_norm, attn.k_norm, layer.post_attention_layernorm,
            layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm, next_norm)
            if hasattr(norm, "one_plus_w")]  # Gemma 2's q/k norms are nn.Identity
        post_attn, pre_ff = layer.post_attention_layernorm, layer.pre_feedforward_layernorm
        post_ff = layer.post_feedforward_layernorm
        after = (self._linear(lean, attn.o_proj, self.attention_out.view(self.rows, -1),
                              self.a),
                 ops.bind_gemma_norm(self.a, post_attn.one_plus_w, post_attn.eps, self.x,
                                     residual=h, next_weight=pre_ff.one_plus_w,
                                     threads=threads),
                 self._linear(lean, layer.mlp.gate_up_proj, self.x, self.gate_up),
                 ops.bind_gelu_tanh_mul(self.gate_up, self.act, threads),
                 self._linear(lean, layer.mlp.down_proj, self.act, self.m),
                 ops.bind_gemma_norm(self.m, post_ff.one_plus_w, post_ff.eps, self.x,
                                     residual=h, next_weight=next_norm.one_plus_w,
                                     threads=threads))
        return LayerCalls(before, after)

    def _linear(self, lean: LeanForward, linear: Linear, x: torch.Tensor,
                y: torch.Tensor) -> Callable[[], int]:
        return bind_linear(lean, linear, x, y, self.threads, self._keep)


def _scale(h: torch.Tensor, scale: torch.Tensor) -> None:
    """`h * scale` in place: the modules' `F.embedding(...) * embed_scale`, the same bits."""
    h.mul_(scale)


def _has_qk_norms(model: nn.Module) -> bool:
    """Gemma 3's q/k norms (Gemma 2 has nn.Identity in their place)."""
    return not isinstance(model.layers[0].self_attn.q_norm, nn.Identity)


def build_gemma_lean(model: nn.Module, config: ModelArchConfig, dtype: torch.dtype,
                     kernel_modules: Iterable[nn.Module]) -> LeanForward | None:
    """A LeanForward of Gemma's layers for `model` (a Gemma3Model, Gemma 2's too) when all
    of it runs on the CPU kernels: its Linears on the linear kernel's panels,
    `kernel_modules` (its norms, RoPE and GeGLU: `gemma_kernel_modules`) on one layer
    kernel; None otherwise."""
    if config.architecture not in GEMMA_ARCHITECTURES:
        return None
    found = lean_kernels(model, dtype, kernel_modules)
    if found is None:
        return None
    rotary, local = model.rotary_emb, model.rotary_emb_local
    if rotary.cos.shape[0] != local.cos.shape[0]:  # one positions check covers both
        raise ValueError("Gemma's two RoPE tables must cover the same positions, got "
                         f"{rotary.cos.shape[0]} and {local.cos.shape[0]}")
    tables = ((rotary.cos_bf16, rotary.sin_bf16) if dtype == torch.bfloat16
              else (rotary.cos, rotary.sin))
    return LeanForward(model, config, dtype, *found, tables, new_plan=_GemmaPlan)
