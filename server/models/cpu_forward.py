"""The forward pass of a small batch (a decode step, a short extend) on the CPU kernels, with
the per-call Python taken out.

Through the modules, each of a decode step's ~330 kernel calls checks its tensors and
allocates its output again. `LeanForward` does both once per batch size: a `_Plan` keeps
buffers of T rows and every kernel call bound to them (the kernels' `bind*` methods), so a
step copies its positions in, binds attention to its slots, and runs the bound calls. The
same kernels in the same order on the same inputs: the modules' bits (tests compare).

It takes a batch of at most LEAN_MAX_ROWS new tokens when every Linear runs on the linear
kernel's panels, the layer's other ops on the layer kernel and every layer's attention (full or
over its window) on one CpuKernelAttention, in float32 or bfloat16, over a CPU pool of the
model's dtype, plain or a WindowedKVPool (`_BoundAttention`: a slot set per pool);
otherwise the model runs its modules. `LeanForward` binds Llama's layers (RMSNorm, RoPE,
SiLU * up; Qwen3's q/k norms); gemma_forward.py binds Gemma's on the same frame.

What must stay true: a plan's calls hold raw pointers into its buffers and into the model's
packed weights, so a plan keeps references to every tensor it bound, and is dropped when a
Linear repacks (`Linear.packings` moves) or the model changes kernels (the model builds a new
LeanForward).

Threading: the scheduler thread (the model's forward); plans are kept per thread.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from hicache.memory.device import DeviceKVPool
from hicache_server.models.attention import CpuKernelAttention, kernel_indices
from hicache_server.models.config import ModelArchConfig
from hicache_server.models.cpu_kernels import KERNEL_DTYPES
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.models.kernels.cpu_attention import BoundLayers
from hicache_server.models.kernels.cpu_layer import CpuLayerKernel, check_positions
from hicache_server.models.kernels.cpu_linear import CpuLinearKernel
from hicache_server.models.linear import Linear

# New tokens up to which a batch takes the lean path: decode batches and short extends,
# where the Python per call is a visible share of the step (at 300 rows it is under 1%).
LEAN_MAX_ROWS = 64
# Plans kept per thread, one per batch size (and thread count, kernel paths) seen lately.
MAX_PLANS = 16
# The architectures whose layers `_Plan` binds: Llama's (RMSNorm, RoPE, SiLU * up, attention
# full or windowed), with q/k norms where the attention has them (Qwen3's, `_qk_norms`);
# Gemma's are gemma_forward.py's.
LEAN_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                      "Phi3ForCausalLM", "Qwen3ForCausalLM")


class LayerCalls(NamedTuple):
    """One decoder layer's bound calls, in order around its attention."""

    before_attention: tuple[Callable[[], object], ...]  # input norm, q|k|v, RoPE
    after_attention: tuple[Callable[[], object], ...]  # o, post norm, gate|up, SiLU, down


class _Plan:
    """Buffers of `rows` rows and every call of one forward bound to them. What
    `LeanForward.__call__` reads of a plan: `positions`, `h[0]` (the embeddings land there),
    `embedded` (calls on them), `layers`, `q`/`k`/`v` (views of this step's q, k, v rows)
    and `attention_out` (what attention reads and writes), `final` and `out`."""

    embedded: tuple[Callable[[], object], ...] = ()  # Llama's embeddings are the residual

    def __init__(self, lean: LeanForward, rows: int, threads: int) -> None:
        model, config = lean.model, lean.config
        self.packings = Linear.packings
        self.rows, self.threads = rows, threads
        dtype, hidden = lean.dtype, config.hidden_size
        q_size, kv_size = config.q_size, config.kv_size

        def empty(*shape: int) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype)
        self.positions = torch.zeros(rows, dtype=torch.int64)
        self.h = (empty(rows, hidden), empty(rows, hidden))  # the residual stream, in turn
        self.x, self.a, self.m, self.out = (empty(rows, hidden) for _ in range(4))
        self.qkv = empty(rows, q_size + 2 * kv_size)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        dim = config.head_dim
        self.q = self.qkv[:, :q_size].view(rows, heads, dim)
        self.k = self.qkv[:, q_size:q_size + kv_size].view(rows, kv_heads, dim)
        self.v = self.qkv[:, q_size + kv_size:].view(rows, kv_heads, dim)
        if _qk_norms(model.layers[0].self_attn):
            # q and k normalised per head: each norm runs over every head row of qkv (one
            # uniform [rows * all heads, dim] view: one call, a few spare rows) into its own
            # buffer, of which q's (k's) heads are read
            all_heads = heads + 2 * kv_heads
            self.qkv_heads = self.qkv.view(rows * all_heads, dim)
            self.q_normed, self.k_normed = (empty(rows * all_heads, dim) for _ in range(2))
            self.q = self.q_normed.view(rows, all_heads, dim)[:, :heads]
            self.k = self.k_normed.view(rows, all_heads, dim)[:, heads:heads + kv_heads]
        self.attention_out = empty(rows, heads, dim)
        self.gate_up = empty(rows, 2 * config.intermediate_size)
        self.act = empty(rows, config.intermediate_size)
        self._current = 0  # which of self.h holds the residual while binding
        self._keep: list[torch.Tensor] = []  # packed weights the calls point into
        self.layers = [self._bind_layer(lean, layer, i) for i, layer in enumerate(model.layers)]
        self.final = (self._norm(lean.layer_kernel, model.norm, self.m, self.out),)

    def _bind_layer(self, lean: LeanForward, layer: nn.Module, i: int) -> LayerCalls:
        """Layer i's calls (`layer` a LlamaDecoderLayer: llama.py imports this module)."""
        attn, mlp, ops = layer.self_attn, layer.mlp, lean.layer_kernel
        if i == 0:  # the embeddings are the residual: h[0]
            in_norm = ops.bind_rms_norm(self.h[0], layer.input_layernorm.weight,
                                        layer.input_layernorm.eps, self.x,
                                        threads=self.threads)
        else:  # the previous layer's h + mlp, added here (the same bits as apart)
            in_norm = self._norm(ops, layer.input_layernorm, self.m, self.x)
        cos, sin = lean.rope_tables
        before = (in_norm, self._linear(lean, attn.qkv_proj, self.x, self.qkv))
        norms = _qk_norms(attn)
        if norms:  # q and k normalised into their buffers, then each rotated
            before += tuple(ops.bind_rms_norm(self.qkv_heads, norm.weight, norm.eps, out,
                                              threads=self.threads)
                            for norm, out in zip(norms, (self.q_normed, self.k_normed)))
            rotated = (self.q, self.k)
        else:  # q and k are neighbours in qkv: one rotation of both
            rotated = (self.qkv[:, :attn.split[0] + attn.split[1]].view(
                self.rows, attn.heads + attn.kv_heads, attn.head_dim),)
        before += tuple(ops.bind_rope_(x, self.positions, cos, sin, self.threads)
                        for x in rotated)
        after = (self._linear(lean, attn.o_proj, self.attention_out.view(self.rows, -1),
                              self.a),
                 self._norm(ops, layer.post_attention_layernorm, self.a, self.x),
                 self._linear(lean, mlp.gate_up_proj, self.x, self.gate_up),
                 ops.bind_silu_mul(self.gate_up, self.act, self.threads),
                 self._linear(lean, mlp.down_proj, self.act, self.m))
        return LayerCalls(before, after)

    def _norm(self, ops: CpuLayerKernel, norm: nn.Module, x: torch.Tensor,
              out: torch.Tensor) -> Callable[[], None]:
        """`out = norm(h + x)` with the sum into the other residual buffer, which then holds
        the residual."""
        h, total = self.h[self._current], self.h[1 - self._current]
        self._current = 1 - self._current
        return ops.bind_rms_norm(x, norm.weight, norm.eps, out, residual=h, total=total,
                                 threads=self.threads)

    def _linear(self, lean: LeanForward, linear: Linear, x: torch.Tensor,
                y: torch.Tensor) -> Callable[[], int]:
        return bind_linear(lean, linear, x, y, self.threads, self._keep)


def bind_linear(lean: LeanForward, linear: Linear, x: torch.Tensor, y: torch.Tensor,
                threads: int, keep: list[torch.Tensor]) -> Callable[[], int]:
    """`y = linear(x)` on the lean path's linear kernel, bound now; the packed weights the
    call points into are appended to `keep` (the plan's)."""
    keep.append(linear.panels)
    return lean.linear_kernel.bind(x, linear.panels, linear.weight.shape[0], linear.bias, y,
                                   threads)


class LeanForward:
    """A model's forward for small batches on the CPU kernels (the module docstring): the
    frame (plans kept per batch size, embeddings, attention bound per batch, the layers'
    calls in order); `new_plan(lean, rows, threads)` makes a plan binding the architecture's
    layers (what `__call__` reads of one: `_Plan`'s docstring): `_Plan` Llama's (`build`),
    gemma_forward.py's `_GemmaPlan` Gemma's."""

    def __init__(self, model: nn.Module, config: ModelArchConfig, dtype: torch.dtype,
                 linear_kernel: CpuLinearKernel, layer_kernel: CpuLayerKernel,
                 rope_tables: tuple[torch.Tensor, torch.Tensor],
                 new_plan: Callable[[LeanForward, int, int], Any] = _Plan) -> None:
        self.model, self.config, self.dtype = model, config, dtype
        self.new_plan = new_plan
        self.linear_kernel, self.layer_kernel = linear_kernel, layer_kernel
        self.rope_tables = rope_tables
        self.max_positions = rope_tables[0].shape[0]
        # each layer's window (Mistral's, Qwen2's, Gemma's), None: full attention
        self.windows = [config.window_of(i) for i in range(config.num_hidden_layers)]
        # what each attention module passes its backend (Gemma's; Llama's pass none): its
        # softcap, and the one scale of every layer (None: CpuKernelAttention's default)
        attns = [layer.self_attn for layer in model.layers]
        self.softcaps = [getattr(a, "softcap", None) for a in attns]
        scale = getattr(attns[0], "scale", None)
        if any(getattr(a, "scale", None) != scale for a in attns):
            raise ValueError("the lean path binds one attention scale for every layer")
        self.scale = 1.0 / math.sqrt(config.head_dim) if scale is None else scale
        self._local = threading.local()

    @classmethod
    def build(cls, model: nn.Module, config: ModelArchConfig,
              dtype: torch.dtype) -> LeanForward | None:
        """A LeanForward of Llama's layers for `model` (a LlamaModel) when all of it runs on
        the CPU kernels (the module docstring); None otherwise, and for any other
        architecture."""
        if config.architecture not in LEAN_ARCHITECTURES:
            return None
        found = lean_kernels(model, dtype, [
            model.norm, model.rotary_emb, *(layer.mlp for layer in model.layers),
            *(norm for layer in model.layers for norm in _qk_norms(layer.self_attn))])
        if found is None:
            return None
        rotary = model.rotary_emb
        tables = ((rotary.cos_bf16, rotary.sin_bf16) if dtype == torch.bfloat16
                  else (rotary.cos, rotary.sin))
        return cls(model, config, dtype, *found, tables)

    @torch.inference_mode()  # its plans' buffers are inference tensors
    def __call__(self, batch: ForwardBatch, kv_pool: DeviceKVPool) -> torch.Tensor | None:
        """The final norm's `[T, hidden]` output, as the model's forward; None when this
        batch, pool or attention backend is not the lean path's (the caller runs the
        modules)."""
        backend = self._attention(batch, kv_pool)
        if backend is None:
            return None
        plan = self._plan(batch.num_tokens, torch.get_num_threads())
        check_positions(batch.positions, self.max_positions)
        plan.positions.copy_(batch.positions)
        torch.index_select(self.model.embed_tokens.weight, 0, batch.input_ids, out=plan.h[0])
        _run(plan.embedded)
        attention = _BoundAttention(self, backend, batch, kv_pool, plan)
        hook = batch.layer_hook
        for i, layer in enumerate(plan.layers):
            _run(layer.before_attention)
            if hook is not None:  # the runner waits here for this layer's loads
                hook(i)
            attention(i)
            _run(layer.after_attention)
        _run(plan.final)
        return plan.out.clone()  # the plan's buffer is the next step's

    def _attention(self, batch: ForwardBatch, kv_pool: DeviceKVPool
                   ) -> CpuKernelAttention | None:
        """The layers' one CpuKernelAttention when the batch and pool are the lean path's."""
        layers = self.model.layers
        backend = layers[0].self_attn.backend
        if (not 0 < batch.num_tokens <= LEAN_MAX_ROWS
                or not isinstance(backend, CpuKernelAttention)
                or batch.input_ids.device.type != "cpu"
                or kv_pool.dtype != self.dtype or kv_pool.device.type != "cpu"
                or not backend.takes(self.dtype, self.config.head_dim)
                or any(layer.self_attn.backend is not backend for layer in layers)):
            return None
        return backend

    def _plan(self, rows: int, threads: int) -> _Plan:
        plans = getattr(self._local, "plans", None)
        if plans is None:
            plans = self._local.plans = OrderedDict()
        key = (rows, threads, self.linear_kernel.bf16_path)
        plan = plans.get(key)
        if plan is None or plan.packings != Linear.packings:
            plan = plans[key] = self.new_plan(self, rows, threads)
            if len(plans) > MAX_PLANS:
                plans.popitem(last=False)
        plans.move_to_end(key)
        return plan


def lean_kernels(model: nn.Module, dtype: torch.dtype, layer_modules: Iterable[nn.Module]
                 ) -> tuple[CpuLinearKernel, CpuLayerKernel] | None:
    """(the linear kernel, the layer kernel) when all of `model` runs on them, on the CPU in
    a kernel dtype: every Linear on one linear kernel's panels, every one of `layer_modules`
    (its norms, RoPE, MLP activation) on one layer kernel; None otherwise."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    kernels = {m.kernel for m in linears}
    layer_kernels = {m.kernel for m in layer_modules}
    if (dtype not in KERNEL_DTYPES or model.norm.weight.device.type != "cpu"
            or len(kernels) != 1 or None in kernels or any(m.panels is None for m in linears)
            or len(layer_kernels) != 1 or None in layer_kernels):
        return None
    return kernels.pop(), layer_kernels.pop()


class _BoundAttention:
    """Every layer's K/V write and attention for one batch, bound: `self(i)` writes layer
    i's new K/V (the plan's k, v) at the batch's out slots and runs its attention into the
    plan's `attention_out`. A plain pool has one slot set for every layer; a WindowedKVPool
    one for its full layers and one for each window group (`batch_for`: mapped once), each
    bound over its layers' buffers."""

    def __init__(self, lean: LeanForward, backend: CpuKernelAttention, batch: ForwardBatch,
                 kv_pool: DeviceKVPool, plan: _Plan) -> None:
        groups: dict[int, list[int]] = {}
        for i in range(len(lean.windows)):
            groups.setdefault(kv_pool.kv_group(i) if kv_pool.has_windows else 0, []).append(i)
        self.k, self.v = plan.k, plan.v
        self.k_buffers, self.v_buffers = kv_pool.k_buffers, kv_pool.v_buffers
        # layer -> (its group's BoundLayers, its index there, the group's out slots)
        self.bound: list[tuple[BoundLayers, int, torch.Tensor] | None] = [None] * len(
            lean.windows)
        for layers in groups.values():
            b = kv_pool.batch_for(layers[0], batch) if kv_pool.has_windows else batch
            slots, seqs = kernel_indices(b)  # checked by bind_layers
            bound = backend.kernel.bind_layers(
                plan.q, [(self.k_buffers[i], self.v_buffers[i]) for i in layers], slots, seqs,
                lean.scale, plan.attention_out, plan.threads,
                windows=[lean.windows[i] for i in layers],
                softcaps=[lean.softcaps[i] for i in layers])
            for j, i in enumerate(layers):
                self.bound[i] = (bound, j, b.out_slots)

    def __call__(self, layer: int) -> None:
        bound, j, out_slots = self.bound[layer]
        self.k_buffers[layer].index_copy_(0, out_slots, self.k)
        self.v_buffers[layer].index_copy_(0, out_slots, self.v)
        bound(j)


def _qk_norms(attention: nn.Module) -> tuple[nn.Module, ...]:
    """The attention's per-head RMSNorms of q and of k (Qwen3's), or () where it has none."""
    q_norm = getattr(attention, "q_norm", None)
    return () if q_norm is None else (q_norm, attention.k_norm)


def _run(calls: tuple[Callable[[], object], ...]) -> None:
    for call in calls:
        if call():  # the linear kernel's refusal (never, for the shapes bound); else None
            raise RuntimeError(f"a CPU kernel refused a call bound by LeanForward: {call}")
