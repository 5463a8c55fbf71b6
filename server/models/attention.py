"""Attention backends: how a layer's queries read the paged KV cache.

Every backend computes, for sequence i of a ForwardBatch and its new token t (0-based within
the extend, position p = prefix_lens[i] + t), causal attention over the keys at positions
`0 .. p`, read from the pool through `seq_slots[i]`, or for a sliding-window layer (`window`
W) over its W latest, `p - W < j <= p`. GQA: query head h reads KV head
`h // (heads // kv_heads)`.

`TorchAttention` batches a layer's work instead of looping over sequences in Python:

    decode sequences     one gather of every decode sequence's K/V through a padded slot
                         table, one SDPA call; GQA by folding each KV head's query heads
                         into the query length (`[S, kv_heads, group, head_dim]`), so K/V
                         are never repeated
    prefill sequences    one gather of all their K/V; per sequence one SDPA call with K/V
                         broadcast over the query heads of each KV head (a stride-0 view, no
                         copy). On the CPU: SDPA's causal path when nothing is cached,
                         otherwise the additive offset-causal mask `j <= prefix + t`, built
                         once per batch and shared by every layer. On CUDA: no mask at all,
                         torch's lower-right causal bias (`causal_lower_right`), which is that
                         same rule and which SDPA runs in the flash kernel (FlashAttention's
                         causal flag is lower-right aligned when the key length exceeds the
                         query length; the memory-efficient kernel where flash does not run,
                         as in float32), so a cached prefix is read at flash speed and a
                         prompt from scratch takes the very same kernel

What a batch needs for this (tables, masks, index tensors) is built at the first layer and
kept on the ForwardBatch (`ForwardBatch.memo`). `ReferenceAttention` is the plain per-sequence
loop, kept as the reference the tests compare against.

On the CPU in float32 and bfloat16 the engine's default is `CpuKernelAttention`, one call
of the C kernel (kernels/src/cpu_attention.c) per layer for the whole batch, K/V read through
the slots, windows and scales included; it computes each row alike however its sequence was
split, so prefilled, extended and decoded tokens (and their K/V) are bit-identical.
TorchAttention serves where the kernel cannot (no AVX-512 or C compiler, float16, head dims
it does not take, `HICACHE_CPU_ATTENTION=sdpa`). On CUDA `CudaPagedAttention` runs decode
batches, windowed or not, on the CuPy kernel (kernels/src/paged_attention.cu). Every backend
soft-caps scores where asked (`softcap`: Gemma 2; SDPA cannot: `softcapped`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right

from hicache.memory import INDEX_DTYPE
from hicache.memory.device import DeviceKVPool
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.models.kernels import cpu_attention
from hicache_server.models.kernels.paged_attention import (
    MAX_HEAD_DIM,
    MAX_NUM_SEQS,
    paged_decode_attention,
)

logger = logging.getLogger(__name__)


class AttentionBackend(ABC):
    """Attention of one layer over the paged KV cache.

    Threading: called only by the scheduler thread, inside the model's forward, once per layer.
    No locks; the pool is the scheduler's.
    """

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
        batch: ForwardBatch, kv_pool: DeviceKVPool, *, window: int | None = None,
        scale: float | None = None, softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention output `[T, heads, head_dim]` in q's dtype.

        `window` W (a sliding-window layer, transformers' `sliding_window`): the query at
        position p reads only the keys at positions `p - W < j <= p`, the W latest, itself
        included; None reads every earlier key. `scale` multiplies q.k (None: 1/sqrt(head_dim);
        Gemma's is `query_pre_attn_scalar ** -0.5`). `softcap` c (Gemma 2's
        `attn_logit_softcapping`) caps the scaled scores s to `c * tanh(s / c)` before the mask
        and the softmax, as transformers' eager attention does; None leaves them.

        `q` is `[T, heads, head_dim]`, `k`/`v` are `[T, kv_heads, head_dim]` (RoPE applied to q
        and k), all for the batch's new tokens. K/V of the new tokens are already written into
        `kv_pool` at `batch.out_slots` for `layer`, so a backend may read every key through
        `batch.seq_slots`; `k`/`v` are passed for backends that prefer them. The batch's index
        tensors are on the pool's device.
        """


# ------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class _Prefill:
    """One sequence with more than one new token."""

    rows: slice                # its new tokens in `[T]`
    keys: slice                # its keys in the plan's prefill gather
    # [extend, seq_len] additive (0 / -inf); None: SDPA's causal path; or the lower-right
    # causal bias (no tensor: the kernel applies `j <= prefix + t` itself)
    mask: torch.Tensor | CausalBias | None


@dataclass(frozen=True)
class _Plan:
    """How one batch's attention runs, the same at every layer (built once, `_plan`)."""

    decode_rows: torch.Tensor | None   # [Sd] rows of `[T]` of the decode sequences
    decode_table: torch.Tensor | None  # [Sd, max_len] slots, padded with the row's first
    decode_mask: torch.Tensor | None   # [Sd, 1, 1, max_len] additive: 0 a key of the row, -inf
    all_decode: bool                   # every sequence is a decode one (rows in order)
    prefill_slots: torch.Tensor | None  # [sum of prefill seq_lens] slots, one gather
    prefills: tuple[_Prefill, ...]


def _plan(batch: ForwardBatch, causal_flag: bool, lower_right: bool,
          dtype: torch.dtype, window: int | None = None) -> _Plan:
    """The plan of `batch`; a `window` layer's masks also hide the keys before its window
    (so it never takes the causal flag or the lower-right bias)."""
    device = batch.device
    decode = [i for i, e in enumerate(batch.extend_lens) if e == 1]
    prefill = [i for i, e in enumerate(batch.extend_lens) if e > 1]
    starts = batch.extend_starts
    rows = table = mask = None
    if decode:
        lens = [batch.prefix_lens[i] + 1 for i in decode]
        slots = [batch.seq_slots[i] for i in decode]
        width = max(lens)
        # Padding repeats the row's first slot: a finite key of its own, weighted 0 by the
        # mask (a padding-page read could be anything, and 0 * NaN is NaN).
        table = torch.stack([torch.cat([s, s[:1].expand(width - s.numel())])
                             for s in slots])  # [Sd, width]
        length = torch.tensor(lens, dtype=INDEX_DTYPE).to(device)
        keys = torch.arange(width, device=device)[None, :]
        allowed = keys < length[:, None]
        if window is not None:
            allowed &= keys >= length[:, None] - window
        mask = _additive(allowed, dtype)[:, None, None, :]
        rows = torch.tensor([starts[i] for i in decode], dtype=INDEX_DTYPE).to(device)
    parts, offset = [], 0
    gather = []
    for i in prefill:
        prefix, extend = batch.prefix_lens[i], batch.extend_lens[i]
        if window is not None and window < prefix + extend:
            m = _additive(_causal_mask(prefix, extend, device, window), dtype)
        elif lower_right:
            m = causal_lower_right(extend, prefix + extend)
        elif prefix == 0 and causal_flag:
            m = None
        else:
            m = _additive(_causal_mask(prefix, extend, device), dtype)
        parts.append(_Prefill(slice(starts[i], starts[i] + extend),
                              slice(offset, offset + prefix + extend), m))
        gather.append(batch.seq_slots[i])
        offset += prefix + extend
    return _Plan(rows, table, mask, not prefill,
                 torch.cat(gather) if gather else None, tuple(parts))


# The prompt lengths `causal_flag_is_exact` compares the two paths at: below, at and above
# the CPU kernels' block sizes.
CAUSAL_PROBE_LENGTHS = (2, 17, 64, 129, 300, 520, 800)


@functools.cache
def causal_flag_is_exact(dtype: torch.dtype, kv_heads: int, group: int, dim: int) -> bool:
    """Whether SDPA's causal path on the CPU gives the very bits of its masked call for this
    dtype and head geometry, at CAUSAL_PROBE_LENGTHS: the torch build and the CPU pick the
    kernels (so on torch 2.14 and an AVX-512 EPYC; not on torch 2.11 and a Xeon with AMX,
    2026-12-04). Where it does not, every CPU prefill takes the masked call, which a cached
    prefix goes through too, so a prompt computed from scratch and one extending a cached
    prefix still give the same tokens. Probed once per process and geometry."""
    gen = torch.Generator().manual_seed(0)
    for n in CAUSAL_PROBE_LENGTHS:
        q = torch.randn((n, kv_heads * group, dim), generator=gen).to(dtype)
        k = torch.randn((n, kv_heads, dim), generator=gen).to(dtype)
        v = torch.randn((n, kv_heads, dim), generator=gen).to(dtype)
        masked = _additive(_causal_mask(0, n, torch.device("cpu")), dtype)
        if not torch.equal(_prefill(q, k, v, None), _prefill(q, k, v, masked)):
            logger.warning("SDPA's causal path differs from its masked call here (%s, %d "
                           "tokens): CPU prefills take the masked call", dtype, n)
            return False
    return True


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as SDPA's additive one: 0 where allowed, -inf elsewhere
    (SDPA builds this itself on every call: once per batch halves a decode layer's time)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf"))


def _causal_mask(prefix: int, extend: int, device: torch.device,
                 window: int | None = None) -> torch.Tensor:
    """True where new token t may attend key j: `j <= prefix + t` (and, with a `window` W,
    `j > prefix + t - W`); `[extend, prefix + extend]`."""
    keys = torch.arange(prefix + extend, device=device)  # [seq_len]
    queries = torch.arange(extend, device=device) + prefix  # [extend]
    allowed = keys[None, :] <= queries[:, None]
    if window is not None:
        allowed &= keys[None, :] > queries[:, None] - window
    return allowed


# ---------------------------------------------------------------------------- backends


class TorchAttention(AttentionBackend):
    """Batched attention through SDPA on any device (see the module docstring).

    On the CPU a sequence with no cached prefix takes SDPA's causal path instead of a
    materialised mask where that is bit-identical to the masked call (`causal_flag_is_exact`;
    so over 642 shapes in float32 and bfloat16 on this project's machine), so a prompt
    computed from scratch and one extending a cached prefix give the same tokens.
    `lower_right` (default: on CUDA) runs every prefill through the lower-right causal bias
    instead, mask-free; on the CPU torch materialises that bias on each call, which is why it
    is not the CPU's default (tests use it there to check it).
    """

    def __init__(self, lower_right: bool | None = None) -> None:
        self.lower_right = lower_right

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
        batch: ForwardBatch, kv_pool: DeviceKVPool, *, window: int | None = None,
        scale: float | None = None, softcap: float | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_pool.get_kv(layer)  # each [num_slots, kv_heads, head_dim]
        cpu = q.device.type == "cpu"
        lower_right = not cpu if self.lower_right is None else self.lower_right
        # full and window layers plan apart (one plan per window size); a softcapped layer's
        # scores are computed here (`softcapped`), its masks tensors
        tensors = softcap is not None
        plan = batch.memo(f"torch_attention/{window}" + "/masks" * tensors, lambda: _plan(
            batch, cpu and not lower_right and not tensors and causal_flag_is_exact(
                q.dtype, k_cache.shape[1], q.shape[1] // k_cache.shape[1], q.shape[2]),
            lower_right and not tensors, q.dtype, window))
        if plan.all_decode:
            return _decode(q, k_cache, v_cache, plan, scale, softcap)
        out = torch.empty_like(q)  # [T, heads, head_dim]
        if plan.decode_rows is not None:
            out[plan.decode_rows] = _decode(q.index_select(0, plan.decode_rows),
                                            k_cache, v_cache, plan, scale, softcap)
        keys = k_cache.index_select(0, plan.prefill_slots).to(q.dtype)  # [sum seq_len, kvh, d]
        values = v_cache.index_select(0, plan.prefill_slots).to(q.dtype)
        for p in plan.prefills:
            out[p.rows] = _prefill(q[p.rows], keys[p.keys], values[p.keys], p.mask, scale,
                                   softcap)
        return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            plan: _Plan, scale: float | None = None, softcap: float | None = None
            ) -> torch.Tensor:
    """One query token per sequence: `q` `[Sd, heads, d]` -> `[Sd, heads, d]`."""
    s, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    table = plan.decode_table
    # [Sd * width, kvh, d] -> [Sd, kvh, width, d]; the group's heads are the query length
    # (index_select of the flat table: several times faster than advanced indexing)
    keys = k_cache.index_select(0, table.view(-1)).to(q.dtype).view(
        *table.shape, kv_heads, dim).transpose(1, 2)
    values = v_cache.index_select(0, table.view(-1)).to(q.dtype).view(
        *table.shape, kv_heads, dim).transpose(1, 2)
    queries = q.view(s, kv_heads, heads // kv_heads, dim)  # [Sd, kvh, group, d]
    attend = (F.scaled_dot_product_attention if softcap is None
              else functools.partial(softcapped, softcap=softcap))
    return attend(queries, keys, values, plan.decode_mask, scale=scale).reshape(s, heads, dim)


def _prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             mask: torch.Tensor | CausalBias | None, scale: float | None = None,
             softcap: float | None = None) -> torch.Tensor:
    """One sequence's new tokens: `q` `[extend, heads, d]`, keys/values `[seq_len, kvh, d]`."""
    extend, heads, dim = q.shape
    seq_len, kv_heads = keys.shape[:2]
    group = heads // kv_heads
    queries = q.view(extend, kv_heads, group, dim).permute(1, 2, 0, 3)  # [kvh, group, ext, d]
    shape = (kv_heads, group, seq_len, dim)  # each KV head seen by its group: stride 0
    ks = keys.permute(1, 0, 2)[:, None].expand(shape)
    vs = values.permute(1, 0, 2)[:, None].expand(shape)
    if softcap is not None:  # its plan's masks are tensors (TorchAttention.forward)
        o = softcapped(queries, ks, vs, mask, scale, softcap)
    elif mask is None:
        o = F.scaled_dot_product_attention(queries, ks, vs, is_causal=True, scale=scale)
    else:
        o = F.scaled_dot_product_attention(queries, ks, vs, attn_mask=mask, scale=scale)
    return o.permute(2, 0, 1, 3).reshape(extend, heads, dim)


def softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float | None, softcap: float) -> torch.Tensor:
    """SDPA with the scores soft-capped: `s = scale * q.k`, `softcap * tanh(s / softcap)`, the
    mask (boolean, True: attend; additive; or None), softmax, P V (transformers' eager order),
    q's dtype out; q `[..., L, d]`, k/v `[..., S, d]`, mask broadcast to `[..., L, S]`. Sums in
    float64 on the CPU, float32 on CUDA (docs/kernels.md, soft-capped scores)."""
    wide = torch.float64 if q.device.type == "cpu" else torch.float32
    s = q.to(wide) @ k.to(wide).transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
    s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return (s.softmax(-1) @ v.to(wide)).to(q.dtype)


class ReferenceAttention(AttentionBackend):
    """The per-sequence reference: gather K/V through its slots, repeat KV heads, SDPA with
    the offset-causal mask (none for one query token of a full layer), windowed for a
    window layer. Slow; tests compare against it."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
        batch: ForwardBatch, kv_pool: DeviceKVPool, *, window: int | None = None,
        scale: float | None = None, softcap: float | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_pool.get_kv(layer)
        group = q.shape[1] // k_cache.shape[1]
        out = torch.empty_like(q)
        for start, prefix, extend, slots in zip(
            batch.extend_starts, batch.prefix_lens, batch.extend_lens, batch.seq_slots
        ):
            qs = q[start:start + extend].transpose(0, 1)  # [heads, extend, head_dim]
            ks = k_cache.index_select(0, slots).to(q.dtype).repeat_interleave(group, dim=1)
            vs = v_cache.index_select(0, slots).to(q.dtype).repeat_interleave(group, dim=1)
            mask = (None if extend == 1 and window is None
                    else _causal_mask(prefix, extend, q.device, window))
            attend = (F.scaled_dot_product_attention if softcap is None
                      else functools.partial(softcapped, softcap=softcap))
            o = attend(qs, ks.transpose(0, 1), vs.transpose(0, 1), mask, scale=scale)
            out[start:start + extend] = o.transpose(0, 1)
        return out


class CudaPagedAttention(AttentionBackend):
    """Decode batches through the CuPy paged kernel (window and softcapped layers too: each
    row reads its W latest keys); prefill and mixed batches, and decode shapes past the
    kernel's limits (head_dim, sequences per launch), through TorchAttention.

    The kernel runs on torch's current stream, after `set_kv` wrote the new token's K/V there.
    """

    def __init__(self) -> None:
        self._prefill = TorchAttention()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
        batch: ForwardBatch, kv_pool: DeviceKVPool, *, window: int | None = None,
        scale: float | None = None, softcap: float | None = None,
    ) -> torch.Tensor:
        if (not batch.is_decode or q.shape[-1] > MAX_HEAD_DIM
                or batch.num_seqs > MAX_NUM_SEQS):
            return self._prefill.forward(q, k, v, layer, batch, kv_pool, window=window,
                                         scale=scale, softcap=softcap)
        k_cache, v_cache = kv_pool.get_kv(layer)
        table, lens = batch.slot_table()  # built once per batch, shared by every layer
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        out = paged_decode_attention(q.to(k_cache.dtype), k_cache, v_cache, table, lens, scale,
                                     window=window, softcap=softcap)
        return out.to(q.dtype)


class CpuKernelAttention(AttentionBackend):
    """Every float32 or bfloat16 CPU batch (prefill, extend, decode, mixed; full or
    sliding-window layers, any scale and softcap) in one call of the C kernel
    (kernels/src/cpu_attention.c), K/V read from the pool through each sequence's slots: no
    gather, no mask, no per-sequence loop; a window layer's rows skip the key blocks before
    their window. A row's result depends only on its query and its keys, so a token gets the
    same bits prefilled, extended on a cached prefix, or decoded, and recomputed and cached
    K/V agree bit for bit across every path. Other dtypes (and a pool of another dtype than
    q), and head dims the kernel does not take, go to TorchAttention."""

    def __init__(self, kernel: cpu_attention.CpuAttentionKernel) -> None:
        self.kernel = kernel
        self._fallback = TorchAttention()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
        batch: ForwardBatch, kv_pool: DeviceKVPool, *, window: int | None = None,
        scale: float | None = None, softcap: float | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_pool.get_kv(layer)
        if k_cache.dtype != q.dtype or not self.takes(q.dtype, q.shape[-1]):
            return self._fallback.forward(q, k, v, layer, batch, kv_pool, window=window,
                                          scale=scale, softcap=softcap)
        # the same indices for every layer, full or windowed: the window is the kernel's
        slots, seqs = batch.memo("cpu_kernel_attention",
                                 lambda: _kernel_plan(batch, q, k_cache, v_cache))
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        return self.kernel(q, k_cache, v_cache, slots, seqs, scale, checked=True,
                           window=window, softcap=softcap)

    @staticmethod
    def takes(dtype: torch.dtype, head_dim: int) -> bool:
        """Whether the kernel runs this dtype and head dim (else TorchAttention does)."""
        return dtype in cpu_attention.DTYPES and cpu_attention.supports_head_dim(head_dim)


def kernel_indices(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's `slots` (every sequence's, concatenated) and `seqs` rows (first row in
    `[T]`, prefix_len, extend_len, first entry in `slots`) of a batch (not checked)."""
    firsts = itertools.accumulate(batch.seq_lens[:-1], initial=0)
    seqs = torch.tensor(list(zip(batch.extend_starts, batch.prefix_lens, batch.extend_lens,
                                 firsts)), dtype=torch.int64)  # [S, 4]
    slots = torch.cat(batch.seq_slots).to(torch.int64).contiguous()
    return slots, seqs


def _kernel_plan(batch: ForwardBatch, q: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernel_indices`, built once per batch and checked against the first layer's
    tensors (every layer's q and pool have the same layout)."""
    slots, seqs = kernel_indices(batch)
    cpu_attention.check(q, k_cache, v_cache, slots, seqs)
    return slots, seqs
