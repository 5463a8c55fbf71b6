"""Attention on CUDA through FlashInfer (`flashinfer-python`, the library SGLang and vLLM use),
reading K/V straight from hicache's pool through its page table.

hicache's pool is one `[num_slots, kv_heads, head_dim]` tensor per layer for K and one for
V, slot = page * page_size + offset: viewed as `[num_pages, page_size, kv_heads, head_dim]`
it is FlashInfer's "NHD" paged layout as it is, no copy. A sequence's slots are whole
pages in order (the allocator hands out pages, the radix tree is page-aligned), so its page
table in FlashInfer's CSR form is

    kv_indptr        [S + 1] int32   page counts, prefix-summed
    kv_indices       [pages] int32   every sequence's pages, in order
    kv_last_page_len [S] int32       tokens on each sequence's last page (1 .. page_size)
    qo_indptr        [S + 1] int32   new-token counts, prefix-summed (the rows of q)

(`paged_kv`, which returns None for a batch whose slots are not whole pages: then the
batch takes the CuPy / torch path). A decode batch runs through
`BatchDecodeWithPagedKVCacheWrapper`, any other batch through
`BatchPrefillWithPagedKVCacheWrapper` with the causal mask aligned to each sequence's end
(new token t of a sequence with a cached prefix attends keys 0 .. prefix + t), both planned
once per batch and run at every layer. A sliding-window layer (window W: the W latest keys,
`prefix + t - W < j <= prefix + t`) plans with FlashInfer's `window_left = W - 1` (the keys
left of the query it reads, as vLLM passes it), a layer's `scale` as `sm_scale` and its
`softcap` c (Gemma 2) as `logits_soft_cap` (FlashInfer's LogitsSoftCap variant computes
`c * tanh(sm_scale * q.k / c)`, as transformers does): one plan per (window, scale, softcap)
kind per batch, each on its own pair of wrappers (a plan lives in its wrapper), all sharing
one float workspace as their runs never overlap on the stream.

`paged_kv_reference` is that contract in plain torch (pages -> slots, SDPA with the
offset-causal mask, windowed for a window layer, scores soft-capped for a softcapped one):
the tests check the page table against the engine's reference attention on any machine,
and FlashInfer against both where a GPU is lent.

Threading: the scheduler thread (the model's forward), like every AttentionBackend.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from hicache.memory.device import DeviceKVPool
from hicache_server.models.attention import AttentionBackend, CudaPagedAttention, softcapped
from hicache_server.models.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's float workspace (its examples' size)
HEAD_DIMS = (64, 128, 256)  # the head dims FlashInfer's prebuilt kernels cover
DTYPES = (torch.float16, torch.bfloat16)  # FlashInfer has no float32 attention


@dataclass(frozen=True)
class PagedKV:
    """One batch's page table in FlashInfer's CSR form (see the module docstring)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    page_size: int


def paged_kv(batch: ForwardBatch, page_size: int) -> PagedKV | None:
    """The batch's page table; None when some sequence's slots are not whole pages in order
    from a page boundary (checked on the slots themselves). The layout is worked out on the
    host in NumPy from the sequences' lengths (tensor metadata, no device read); the device
    does a dozen small ops and one read of the check's result, whatever the batch size (a
    loop over sequences with two syncs each took 8 ms to plan a decode batch of 32 on an
    H200; the same work in torch ops on the host, 0.6 ms). `kv_indices` is on the batch's
    device; the indptrs and last-page lengths stay on the host, where FlashInfer's planner
    reads them."""
    seqs = batch.seq_slots
    lens = np.fromiter((s.numel() for s in seqs), dtype=np.int64, count=len(seqs))
    pages = (lens + page_size - 1) // page_size
    page_end = np.cumsum(pages)
    page_seq = np.repeat(np.arange(len(lens)), pages)
    page_rank = np.arange(int(page_end[-1])) - (page_end - pages)[page_seq]
    page_row = (np.cumsum(lens) - lens)[page_seq] + page_rank * page_size  # its first row
    page_len = np.minimum(lens[page_seq] - page_rank * page_size, page_size)
    slots = torch.cat(seqs) if len(seqs) > 1 else seqs[0]
    n, device = slots.numel(), slots.device
    rows, lengths = torch.from_numpy(np.concatenate([page_row, page_len])).to(device).split(
        page_row.size)
    # whole pages in order: a row's slot minus its row number is its page's first slot
    # minus the page's first row, all through the page
    shifted = slots - torch.arange(n, device=device)
    first = slots[rows]
    bad = ((shifted != shifted[rows].repeat_interleave(lengths, output_size=n)).any()
           | (first % page_size != 0).any())
    if bool(bad):
        return None

    def prefix_sum(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([[0], np.cumsum(values)]).astype(np.int32))

    last = (lens - (pages - 1) * page_size).astype(np.int32)
    return PagedKV(prefix_sum(np.asarray(batch.extend_lens, dtype=np.int64)), prefix_sum(pages),
                   (first // page_size).to(torch.int32), torch.from_numpy(last), page_size)


def paged_kv_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       table: PagedKV, scale: float, *, window: int | None = None,
                       softcap: float | None = None) -> torch.Tensor:
    """What FlashInfer computes from `table`, in plain torch: per sequence, its pages'
    slots (the last page cut at its length), KV heads repeated, SDPA with the causal mask
    aligned to the sequence's end (and with a `window` W, each row's W latest keys only;
    with a `softcap`, the scores capped: attention.softcapped).
    `q` `[T, H, D]`, the caches `[num_slots, KVH, D]`."""
    group = q.shape[1] // k_cache.shape[1]
    out = torch.empty_like(q)
    p = table.page_size
    qo, kv = table.qo_indptr.tolist(), table.kv_indptr.tolist()
    for i, last in enumerate(table.kv_last_page_len.tolist()):
        pages = table.kv_indices[kv[i]:kv[i + 1]].long()
        slots = (pages[:, None] * p + torch.arange(p, device=pages.device)).reshape(-1)
        slots = slots[:(pages.numel() - 1) * p + last]
        rows = slice(qo[i], qo[i + 1])
        new, keys = qo[i + 1] - qo[i], slots.numel()
        ks = k_cache.index_select(0, slots).repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v_cache.index_select(0, slots).repeat_interleave(group, dim=1).transpose(0, 1)
        key = torch.arange(keys, device=q.device)[None, :]
        query = torch.arange(keys - new, keys, device=q.device)[:, None]  # its position
        allowed = key <= query  # [new, keys]
        if window is not None:
            allowed &= key > query - window
        if softcap is None:
            o = F.scaled_dot_product_attention(q[rows].transpose(0, 1), ks, vs,
                                               attn_mask=allowed, scale=scale)
        else:
            o = softcapped(q[rows].transpose(0, 1), ks, vs, allowed, scale, softcap)
        out[rows] = o.transpose(0, 1)
    return out


class FlashInferAttention(AttentionBackend):
    """Every CUDA batch through FlashInfer over the pool's pages (see the module
    docstring); a batch whose slots are not whole pages, a head dim FlashInfer's kernels
    do not cover, or a float32 pool (FlashInfer computes in 16-bit types only), through
    `fallback` (the CuPy decode kernel with SDPA for prefill)."""

    def __init__(self, fallback: AttentionBackend | None = None) -> None:
        import flashinfer  # the caller checked it imports (make_attention_backend)

        self._flashinfer = flashinfer
        self._fallback = fallback or CudaPagedAttention()
        self._workspace: torch.Tensor | None = None
        # (window_left, sm_scale, logits_soft_cap) -> its (decode, prefill) wrappers: a model
        # has one kind per attention type (Gemma 2 and 3: their sliding and global layers)
        self._kinds: dict[tuple[int, float, float | None], tuple] = {}

    def _wrappers(self, device: torch.device, kind: tuple[int, float, float | None]) -> tuple:
        if self._workspace is None:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        if kind not in self._kinds:
            fi = self._flashinfer
            self._kinds[kind] = (fi.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD"),
                                 fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD"))
        return self._kinds[kind]

    def _plan(self, batch: ForwardBatch, q: torch.Tensor, k_cache: torch.Tensor,
              page_size: int, window: int | None, scale: float | None,
              softcap: float | None):
        """(the wrapper planned for this window, scale and softcap, or None for the
        fallback), once per batch and kind."""
        heads, dim = q.shape[1], q.shape[2]
        kv_heads = k_cache.shape[1]
        if dim not in HEAD_DIMS or heads % kv_heads or k_cache.dtype not in DTYPES:
            return None
        table = batch.memo("flashinfer/table", lambda: paged_kv(batch, page_size))
        if table is None:
            return None
        # FlashInfer's window_left counts the keys left of the query: W - 1 (-1: every key)
        window_left = -1 if window is None else window - 1
        sm_scale = 1.0 / math.sqrt(dim) if scale is None else scale
        decode, prefill = self._wrappers(q.device, (window_left, sm_scale, softcap))
        if batch.is_decode:
            decode.plan(table.kv_indptr, table.kv_indices, table.kv_last_page_len, heads,
                        kv_heads, dim, page_size, window_left=window_left, sm_scale=sm_scale,
                        logits_soft_cap=softcap, q_data_type=q.dtype,
                        kv_data_type=k_cache.dtype)
            return decode
        prefill.plan(table.qo_indptr, table.kv_indptr, table.kv_indices,
                     table.kv_last_page_len, heads, kv_heads, dim, page_size, causal=True,
                     window_left=window_left, sm_scale=sm_scale, logits_soft_cap=softcap,
                     q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        return prefill

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
        batch: ForwardBatch, kv_pool: DeviceKVPool, *, window: int | None = None,
        scale: float | None = None, softcap: float | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_pool.get_kv(layer)
        page_size = kv_pool.page_size
        kind = f"flashinfer/{window}/{scale}" + ("" if softcap is None else f"/{softcap}")
        wrapper = batch.memo(kind, lambda: self._plan(batch, q, k_cache, page_size, window,
                                                      scale, softcap))
        if wrapper is None:
            return self._fallback.forward(q, k, v, layer, batch, kv_pool, window=window,
                                          scale=scale, softcap=softcap)
        shape = (-1, page_size, *k_cache.shape[1:])  # [pages, page_size, kv_heads, dim]
        out = wrapper.run(q.contiguous().to(k_cache.dtype),
                          (k_cache.view(shape), v_cache.view(shape)))
        return out.to(q.dtype)


def flashinfer_available() -> bool:
    """Whether `flashinfer` imports (the `flashinfer` extra: `pip install -e
    '.[flashinfer]'`)."""
    try:
        import flashinfer  # noqa: F401
    except (ImportError, OSError, RuntimeError) as exc:  # absent, or its CUDA libraries
        logger.info("FlashInfer unavailable (%s): CUDA attention through CuPy / SDPA", exc)
        return False
    return True

