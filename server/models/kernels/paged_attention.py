"""Paged decode attention: one query token per sequence, K/V read through a slot table.

Layouts (the device KV pool's, hicache/memory/device.py)::

    q, out          [S, H, D]                 S sequences, H query heads, head dim D
    k_cache/v_cache [num_slots, KVH, D]       one layer of the pool, slot-major
    slot_table      [S, max_len] int64        row s: slots of sequence s's tokens, then padding
    seq_lens        [S] int64                 tokens of sequence s (>= 1); padding is never read

GQA: query head h reads KV head `h // (H // KVH)` (consecutive heads share a KV head, as in
transformers' `repeat_kv`). With a `window` W (a sliding-window layer) sequence s reads only
its W latest keys, `max(0, seq_lens[s] - W) .. seq_lens[s] - 1`. With a `softcap` c (Gemma 2)
each scaled score s becomes `c * tanh(s / c)` before the softmax. Softmax and accumulation
run in float32 for every input dtype; the output has q's dtype.

Two implementations, one signature: `paged_decode_attention` (the CuPy kernel of
paged_attention.cu, CUDA tensors only) and `paged_decode_attention_reference` (pure torch, any
device). Values of `seq_lens` are not checked (that would synchronise): each must be in
[1, max_len]. The kernel is enqueued on torch's current stream and returns without waiting.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hicache.kernels.cuda_utils import import_cupy, raw_module
from hicache_server.models.kernels.cpu_attention import softcap_arg

SOURCE = Path(__file__).with_name("src") / "paged_attention.cu"
_KERNELS = {
    torch.float32: "paged_decode_attention_f32",
    torch.float16: "paged_decode_attention_f16",
    torch.bfloat16: "paged_decode_attention_bf16",
}
# Must match THREADS and MAX_HEAD_DIM in paged_attention.cu.
_THREADS = 128
MAX_HEAD_DIM = 256
MAX_NUM_SEQS = 65535  # CUDA's limit on gridDim.y, which indexes sequences


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
    window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention by the CUDA kernel; `[S, H, D]` in q's dtype. See the module docstring."""
    _validate(q, k_cache, v_cache, slot_table, seq_lens)
    w, cap = _window_arg(window), softcap_arg(softcap)
    if q.device.type != "cuda":
        raise ValueError(f"q: the CUDA kernel needs CUDA tensors, got device {q.device}")
    if q.shape[2] > MAX_HEAD_DIM or q.shape[0] > MAX_NUM_SEQS:
        raise ValueError(
            f"q: head_dim must be <= {MAX_HEAD_DIM} and sequences <= {MAX_NUM_SEQS}, "
            f"got shape {tuple(q.shape)}"
        )
    q = q.contiguous()
    slot_table, seq_lens = slot_table.contiguous(), seq_lens.contiguous()
    out = torch.empty_like(q)  # [S, H, D]
    if q.numel() == 0:  # no sequence, head or dim: a (0, ...) grid is an invalid launch
        return out
    _launch(q, k_cache, v_cache, slot_table, seq_lens, out, scale, w, cap)
    return out


def paged_decode_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
    window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Pure-torch decode attention with the kernel's semantics (float32 math, q's dtype out)."""
    _validate(q, k_cache, v_cache, slot_table, seq_lens)
    w, cap = _window_arg(window), softcap_arg(softcap)
    group = q.shape[1] // k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # [S, H, D]
    for s, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        first = max(0, n - w) if w else 0  # the window's W latest keys, or every key
        slots = slot_table[s, first:n]  # [keys]
        k = k_cache.index_select(0, slots).float().repeat_interleave(group, dim=1)  # [keys, H, D]
        v = v_cache.index_select(0, slots).float().repeat_interleave(group, dim=1)  # [keys, H, D]
        scores = torch.einsum("hd,nhd->hn", q[s].float(), k) * scale  # [H, keys]
        if cap:
            scores = torch.tanh(scores / cap) * cap
        out[s] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v)
    return out.to(q.dtype)


def _window_arg(window: int | None) -> int:
    """The kernel's window argument: W, or 0 for every key (None); ValueError unless W >= 1."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be None (every key) or an int >= 1, got {window!r}")
    return window


def _validate(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_table: torch.Tensor, seq_lens: torch.Tensor,
) -> None:
    """ValueError naming the argument for any shape, dtype, layout or device mismatch."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_seqs, heads, head_dim], got shape {tuple(q.shape)}")
    num_seqs, heads, head_dim = q.shape
    if q.dtype not in _KERNELS:
        raise ValueError(f"q: dtype must be one of {list(_KERNELS)}, got {q.dtype}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 3 or cache.shape[2] != head_dim:
            raise ValueError(
                f"{name} must be [num_slots, kv_heads, {head_dim}], got {tuple(cache.shape)}")
        if cache.dtype != q.dtype or cache.device != q.device:
            raise ValueError(f"{name} must be {q.dtype} on {q.device}, got "
                             f"{cache.dtype} on {cache.device}")
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape "
                         f"{tuple(k_cache.shape)}")
    if k_cache.shape[1] < 1 or heads % k_cache.shape[1] != 0:
        raise ValueError(f"k_cache: {k_cache.shape[1]} kv heads do not divide {heads} q heads")
    if slot_table.dim() != 2 or slot_table.shape[0] != num_seqs:
        raise ValueError(f"slot_table must be [{num_seqs}, max_len], got "
                         f"{tuple(slot_table.shape)}")
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must be [{num_seqs}], got {tuple(seq_lens.shape)}")
    for name, t in (("slot_table", slot_table), ("seq_lens", seq_lens)):
        if t.dtype != torch.int64 or t.device != q.device:
            raise ValueError(f"{name} must be int64 on {q.device}, got {t.dtype} on {t.device}")


def _launch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_table: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, scale: float,
    window: int = 0, softcap: float = 0.0,
) -> None:
    cupy = import_cupy()  # imported here: CuPy is optional and only this path needs it
    num_seqs, heads, head_dim = q.shape
    device = q.device
    stream = torch.cuda.current_stream(device)
    args = (
        np.uint64(q.data_ptr()), np.uint64(k_cache.data_ptr()), np.uint64(v_cache.data_ptr()),
        np.uint64(slot_table.data_ptr()), np.uint64(seq_lens.data_ptr()),
        np.uint64(out.data_ptr()),
        np.int32(heads), np.int32(k_cache.shape[1]), np.int32(head_dim),
        np.int64(slot_table.shape[1]), np.float32(scale), np.int64(window), np.float32(softcap),
    )
    with torch.cuda.device(device), cupy.cuda.Device(device.index), \
            cupy.cuda.ExternalStream(stream.cuda_stream, device.index):
        kernel = raw_module(SOURCE).get_function(_KERNELS[q.dtype])
        kernel((heads, num_seqs), (_THREADS,), args)
