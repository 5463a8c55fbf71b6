"""FlashInfer over hicache's pool (server/models/flashinfer_attention.py).

On any machine: the page table hicache hands FlashInfer (CSR `kv_indptr` / `kv_indices` /
`kv_last_page_len`, `qo_indptr`), read back the way FlashInfer reads it
(`paged_kv_reference`), gives the engine's per-sequence reference attention on mixed
prefill / extend / decode batches over scattered pages of a NaN pool (a wrong page or an
off-by-one length reads NaN), sliding-window layers included; a batch whose slots are not
whole pages gets no table (and takes the fallback). The planning, with FlashInfer replaced
by a stand-in that keeps each plan in its wrapper as FlashInfer does: a window W is planned
as `window_left = W - 1`, a scale as `sm_scale`, one plan per kind. Where a GPU and
`flashinfer` are there (`make gpu-check`): FlashInfer itself against both, in bfloat16 and
float16, decode and mixed batches, full and windowed layers.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from hicache.memory.device import DeviceKVPool, slots_of
from hicache_server.models import EMBEDDED_TINY_LLAMA, load_model
from hicache_server.models.attention import AttentionBackend, ReferenceAttention, TorchAttention
from hicache_server.models.attention_choice import (
    CUDA_ATTENTION_ENV,
    make_attention_backend,
)
from hicache_server.models.flashinfer_attention import (
    FlashInferAttention,
    PagedKV,
    flashinfer_available,
    paged_kv,
    paged_kv_reference,
)
from hicache_server.models.forward_batch import ForwardBatch

SEED = 5
PAGE = 16
KV_HEADS, HEAD_DIM, NUM_PAGES = 2, 64, 80
# (cached prefix, new tokens): prefills from scratch, extends on a prefix (page-aligned and
# not), decodes at page boundaries and inside pages
MIXED = ((0, 37), (120, 1), (0, 1), (64, 1), (48, 17), (5, 1), (200, 64), (1, 2), (31, 1))
DECODE = tuple((n, 1) for n in (0, 15, 16, 17, 255, 300))
# (window, scale) kinds of layer: full attention at the default scale, sliding windows
# cutting pages (16) in the middle with Gemma-like scales of their own, one key
KINDS = ((None, None), (37, None), (45, 0.3), (1, 0.3))


def paged_case(seqs: tuple[tuple[int, int], ...], heads: int, dtype: torch.dtype,
               device: str = "cpu") -> tuple[DeviceKVPool, ForwardBatch, torch.Tensor]:
    """A NaN pool whose only finite slots are the sequences', each sequence on whole pages
    taken in a shuffled order; the batch of their new tokens and its queries."""
    gen = torch.Generator().manual_seed(SEED)
    pool = DeviceKVPool(NUM_PAGES, PAGE, 1, KV_HEADS, HEAD_DIM, dtype, device)
    for buf in (*pool.k_buffers, *pool.v_buffers):
        buf.fill_(float("nan"))
    order = torch.randperm(NUM_PAGES, generator=gen) + 1  # page 0: the padding page
    seq_slots, out_slots, positions, used = [], [], [], 0
    for prefix, extend in seqs:
        n = prefix + extend
        pages = order[used:used + -(-n // PAGE)]
        used += pages.numel()
        slots = slots_of(pages, PAGE)[:n]
        seq_slots.append(slots.to(device))
        out_slots.append(slots[prefix:])
        positions.append(torch.arange(prefix, n))
    every = torch.cat(seq_slots)
    for buf in (*pool.k_buffers, *pool.v_buffers):
        buf[every] = torch.randn((every.numel(), KV_HEADS, HEAD_DIM), generator=gen).to(
            device, dtype)
    tokens = sum(e for _, e in seqs)
    batch = ForwardBatch(torch.zeros(tokens, dtype=torch.int64, device=device),
                         torch.cat(positions).to(device), torch.cat(out_slots).to(device),
                         seq_slots, [p for p, _ in seqs], [e for _, e in seqs])
    q = torch.randn((tokens, heads, HEAD_DIM), generator=gen).to(device, dtype)
    return pool, batch, q


@pytest.mark.parametrize("window", [None, 37, 1000])
@pytest.mark.parametrize("seqs", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("ratio", [1, 4])
def test_the_page_table_reads_back_each_sequences_keys(seqs, ratio: int,
                                                       window: int | None) -> None:
    pool, batch, q = paged_case(seqs, KV_HEADS * ratio, torch.float32)
    table = paged_kv(batch, PAGE)
    assert table is not None
    assert table.qo_indptr.tolist()[-1] == q.shape[0]
    assert table.kv_indptr.tolist()[-1] == table.kv_indices.numel()
    lens = [p + e for p, e in seqs]
    assert table.kv_last_page_len.tolist() == [n - (-(-n // PAGE) - 1) * PAGE for n in lens]
    assert all(1 <= n <= PAGE for n in table.kv_last_page_len.tolist())
    assert {t.dtype for t in (table.qo_indptr, table.kv_indptr, table.kv_indices,
                              table.kv_last_page_len)} == {torch.int32}
    k_cache, v_cache = pool.get_kv(0)
    got = paged_kv_reference(q, k_cache, v_cache, table, HEAD_DIM ** -0.5, window=window)
    want = ReferenceAttention().forward(q, None, None, 0, batch, pool, window=window)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_slots_that_are_not_whole_pages_get_no_table() -> None:
    _, batch, _ = paged_case(((0, 40), (20, 1)), KV_HEADS, torch.float32)
    assert paged_kv(batch, PAGE) is not None
    shuffled = batch.seq_slots[0][torch.randperm(40, generator=torch.Generator().manual_seed(1))]
    moved = ForwardBatch(batch.input_ids, batch.positions, batch.out_slots,
                         [shuffled, batch.seq_slots[1]], batch.prefix_lens, batch.extend_lens)
    assert paged_kv(moved, PAGE) is None
    offset = ForwardBatch(batch.input_ids[:1], batch.positions[:1], batch.out_slots[:1],
                          [batch.seq_slots[0][1:2]], [0], [1])  # starts inside a page
    assert paged_kv(offset, PAGE) is None


class StandIn:
    """A FlashInfer wrapper that keeps its plan in itself, as FlashInfer's do, and runs it
    as `paged_kv_reference` of the planned table, window (`window_left + 1`) and scale."""

    plans: ClassVar[list[dict]] = []  # every plan of every stand-in, in order

    def __init__(self, workspace: torch.Tensor, layout: str) -> None:
        assert layout == "NHD"
        self.planned: dict | None = None

    def plan(self, *args, **kwargs) -> None:
        if len(args) == 7:  # a decode plan: no qo_indptr, one new token per sequence
            args = (torch.arange(args[0].numel(), dtype=torch.int32), *args)
        self.planned = dict(zip(("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len",
                                 "heads", "kv_heads", "dim", "page_size"), args), **kwargs)
        StandIn.plans.append(self.planned)

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        p = self.planned
        table = PagedKV(p["qo_indptr"], p["kv_indptr"], p["kv_indices"],
                        p["kv_last_page_len"], p["page_size"])
        k_pages, v_pages = kv  # [pages, page_size, kv_heads, dim]
        window = None if p["window_left"] < 0 else p["window_left"] + 1
        return paged_kv_reference(q, k_pages.flatten(0, 1), v_pages.flatten(0, 1), table,
                                  p["sm_scale"], window=window)


@pytest.mark.parametrize("seqs", [MIXED, DECODE], ids=["mixed", "decode"])
def test_each_kind_of_layer_gets_its_own_plan(monkeypatch: pytest.MonkeyPatch, seqs) -> None:
    """Layers of several kinds in one batch, interleaved as in Gemma 3 (sliding, sliding,
    global, ...): each kind is planned once with `window_left = W - 1` and its `sm_scale`,
    on wrappers of its own (a second plan on one wrapper would replace the first), and every
    layer gives the reference's answer for its window and scale; nothing falls back."""
    fake = SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=StandIn,
                           BatchPrefillWithPagedKVCacheWrapper=StandIn)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(StandIn, "plans", [])
    pool, batch, q = paged_case(seqs, KV_HEADS * 4, torch.float16)
    backend = FlashInferAttention(fallback=Refuse())
    for window, scale in (*KINDS, *KINDS):
        got = backend.forward(q, None, None, 0, batch, pool, window=window, scale=scale)
        want = ReferenceAttention().forward(q.float(), None, None, 0, batch,
                                            as_float(pool), window=window, scale=scale)
        torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)
    planned = [(p["window_left"], p["sm_scale"]) for p in StandIn.plans]
    assert planned == [(-1, HEAD_DIM ** -0.5), (36, HEAD_DIM ** -0.5), (44, 0.3), (0, 0.3)]
    assert all(("causal" in p) != (seqs is DECODE) for p in StandIn.plans)


def as_float(pool: DeviceKVPool) -> DeviceKVPool:
    out = DeviceKVPool(NUM_PAGES, PAGE, 1, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    for src, dst in zip((*pool.k_buffers, *pool.v_buffers), (*out.k_buffers, *out.v_buffers)):
        dst.copy_(src)
    return out


def test_the_cuda_choice_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CUDA_ATTENTION_ENV, "triton")
    with pytest.raises(ValueError, match="flashinfer, cupy, sdpa"):
        make_attention_backend("cuda")
    monkeypatch.setenv(CUDA_ATTENTION_ENV, "sdpa")
    assert isinstance(make_attention_backend("cuda"), TorchAttention)


needs_flashinfer = pytest.mark.skipif(
    not torch.cuda.is_available() or not flashinfer_available(),
    reason="FlashInfer runs on CUDA with flashinfer-python installed (make gpu-check)")


@needs_flashinfer
@pytest.mark.parametrize("seqs", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_matches_the_reference_on_the_pool(seqs, dtype: torch.dtype) -> None:
    pool, batch, q = paged_case(seqs, KV_HEADS * 4, dtype, device="cuda")
    backend = make_attention_backend("cuda")
    assert isinstance(backend, FlashInferAttention)
    got = backend.forward(q, None, None, 0, batch, pool)
    assert batch.memo("flashinfer/None/None", lambda: None) is not None  # planned, no fallback
    want = ReferenceAttention().forward(q, None, None, 0, batch, pool)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    k_cache, v_cache = pool.get_kv(0)
    table = paged_kv(batch, PAGE)
    torch.testing.assert_close(got.float(), paged_kv_reference(
        q.float(), k_cache.float(), v_cache.float(), table, HEAD_DIM ** -0.5),
        rtol=2e-2, atol=2e-2)


class Refuse(AttentionBackend):
    """A fallback that fails the test: every layer of every batch went through FlashInfer."""

    def forward(self, q, k, v, layer, batch, kv_pool, *, window=None, scale=None):
        raise AssertionError("FlashInferAttention fell back")


@needs_flashinfer
@pytest.mark.parametrize(("window", "scale"), KINDS[1:])
@pytest.mark.parametrize("seqs", [MIXED, DECODE], ids=["mixed", "decode"])
def test_flashinfer_windows_match_the_reference(seqs, window: int, scale: float | None) -> None:
    """Sliding-window layers through FlashInfer itself (`window_left = W - 1`), with their
    own scale, between full layers of the same batch, against both references."""
    pool, batch, q = paged_case(seqs, KV_HEADS * 4, torch.bfloat16, device="cuda")
    backend = FlashInferAttention(fallback=Refuse())
    full = backend.forward(q, None, None, 0, batch, pool)
    got = backend.forward(q, None, None, 0, batch, pool, window=window, scale=scale)
    again = backend.forward(q, None, None, 0, batch, pool)  # the full plan is still there
    assert torch.equal(again, full)
    want = ReferenceAttention().forward(q, None, None, 0, batch, pool, window=window,
                                        scale=scale)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    k_cache, v_cache = pool.get_kv(0)
    ref = paged_kv_reference(q.float(), k_cache.float(), v_cache.float(), paged_kv(batch, PAGE),
                             scale or HEAD_DIM ** -0.5, window=window)
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)


def use_backend(lm, backend: AttentionBackend) -> None:
    for layer in lm.model.model.layers:
        layer.self_attn.backend = backend


@needs_flashinfer
def test_the_model_in_bfloat16_through_flashinfer_stays_within_its_tolerance() -> None:
    """The embedded Llama in bfloat16 on CUDA with FlashInfer for every batch: a whole
    prefill, a cached prefix then its extend, and token-by-token decode, each against
    float32 through SDPA over the same 250 tokens: logits within 5% of their scale, the same
    argmax at >= 95% of positions, a differing argmax only where float32's top two were within
    the bound (the CPU's bfloat16 rule, tests/test_model.py)."""
    f32 = load_model(EMBEDDED_TINY_LLAMA, dtype="float32", device="cuda")
    use_backend(f32, TorchAttention())
    b16 = load_model(EMBEDDED_TINY_LLAMA, dtype="bfloat16", device="cuda")
    use_backend(b16, FlashInferAttention(fallback=Refuse()))
    c = f32.config

    def pool(dtype: torch.dtype) -> DeviceKVPool:
        return DeviceKVPool(32, PAGE, c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                            dtype, "cuda")

    prompt = torch.randint(0, 256, (250,), generator=torch.Generator().manual_seed(SEED))
    tokens = prompt.cuda()
    slots = pool(torch.float32).alloc(256)[:len(prompt)].cuda()

    def logits(lm, kv: DeviceKVPool, prefix: int, end: int) -> torch.Tensor:
        batch = ForwardBatch(tokens[prefix:end], torch.arange(prefix, end, device="cuda"),
                             slots[prefix:end], [slots[:end]], [prefix], [end - prefix])
        return lm.model.forward_all_logits(batch, kv).float()

    ref = logits(f32, pool(torch.float32), 0, 250)
    whole = logits(b16, pool(torch.bfloat16), 0, 250)
    split_pool = pool(torch.bfloat16)
    split = torch.cat([logits(b16, split_pool, 0, 128), logits(b16, split_pool, 128, 250)])
    step_pool = pool(torch.bfloat16)
    stepped = torch.cat([logits(b16, step_pool, 0, 200),
                         *(logits(b16, step_pool, t, t + 1) for t in range(200, 250))])
    bound = 0.05 * ref.abs().max().item()
    top2 = ref.topk(2, dim=-1).values
    for low in (whole, split, stepped):
        assert torch.isfinite(low).all()
        assert (low - ref).abs().max().item() < bound
        same = low.argmax(-1) == ref.argmax(-1)
        assert same.float().mean().item() >= 0.95
        assert ((top2[:, 0] - top2[:, 1])[~same] < 2 * bound).all()
