"""TorchAttention (batched: one decode call per layer, one gather, no repeated KV heads)
against ReferenceAttention (the per-sequence loop) on mixed prefill + decode batches.

Every slot a sequence does not own, the padding page included, is NaN: a backend that lets
one into a result returns NaN and fails.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.attention.bias import CausalBias

from hicache.memory.device import DeviceKVPool
from hicache_server.models.attention import ReferenceAttention, TorchAttention
from hicache_server.models.forward_batch import ForwardBatch

SEED = 11
PAGE_SIZE = 16
NUM_PAGES = 120  # 1920 usable slots
KV_HEADS = 2
HEAD_DIM = 64
GQA_RATIOS = (1, 4, 8)
# (prefix, extend): decode rows of several lengths, prompts from scratch and extending a
# cached prefix, a one-token prompt (prefix 0, extend 1: a decode row of length 1)
MIXED = ((0, 37), (120, 1), (0, 1), (64, 1), (48, 17), (5, 1), (200, 64), (1, 2), (300, 1))
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# on CUDA the two backends run different kernels (flash or memory-efficient against the
# reference's masked call): float32 gets a looser bound than on the CPU
CUDA_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_case(seqs: tuple[tuple[int, int], ...], heads: int, dtype: torch.dtype,
              num_layers: int = 1, device: str = "cpu",
              ) -> tuple[DeviceKVPool, ForwardBatch, torch.Tensor]:
    """A NaN pool whose only finite slots are the sequences' (scattered over the pool), the
    batch of their new tokens, and its queries `[T, heads, head_dim]`, on `device`."""
    gen = torch.Generator().manual_seed(SEED)
    pool = DeviceKVPool(NUM_PAGES, PAGE_SIZE, num_layers, KV_HEADS, HEAD_DIM, dtype, device)
    for buf in (*pool.k_buffers, *pool.v_buffers):
        buf.fill_(float("nan"))
    free = pool.alloc(NUM_PAGES * PAGE_SIZE)
    free = free[torch.randperm(len(free), generator=gen)]
    seq_slots, out_slots, positions, start = [], [], [], 0
    for prefix, extend in seqs:
        slots = free[start:start + prefix + extend]
        start += prefix + extend
        seq_slots.append(slots)
        out_slots.append(slots[prefix:])
        positions.append(torch.arange(prefix, prefix + extend))
    used = torch.cat(seq_slots)
    for buf in (*pool.k_buffers, *pool.v_buffers):
        buf[used.to(device)] = torch.randn((len(used), KV_HEADS, HEAD_DIM),
                                           generator=gen).to(device, dtype)
    tokens = sum(e for _, e in seqs)
    batch = ForwardBatch(
        input_ids=torch.zeros(tokens, dtype=torch.int64), positions=torch.cat(positions),
        out_slots=torch.cat(out_slots), seq_slots=seq_slots,
        prefix_lens=[p for p, _ in seqs], extend_lens=[e for _, e in seqs]
    ).to(torch.device(device))
    q = torch.randn((tokens, heads, HEAD_DIM), generator=gen).to(device, dtype)
    return pool, batch, q


def new_kv(pool: DeviceKVPool, batch: ForwardBatch, layer: int = 0):
    """K/V of the batch's new tokens, as the model passes them (already in the pool)."""
    k_cache, v_cache = pool.get_kv(layer)
    return k_cache[batch.out_slots], v_cache[batch.out_slots]


@pytest.mark.parametrize("ratio", GQA_RATIOS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_matches_the_per_sequence_reference(ratio: int, dtype: torch.dtype) -> None:
    pool, batch, q = make_case(MIXED, KV_HEADS * ratio, dtype)
    k, v = new_kv(pool, batch)
    got = TorchAttention().forward(q, k, v, 0, batch, pool)
    want = ReferenceAttention().forward(q, k, v, 0, batch, pool)
    assert got.dtype == dtype and got.shape == q.shape
    assert torch.isfinite(got).all()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("ratio", GQA_RATIOS)
def test_decode_batch_matches_the_per_sequence_reference(ratio: int) -> None:
    seqs = tuple((n, 1) for n in (0, 6, 63, 64, 65, 250, 511))
    pool, batch, q = make_case(seqs, KV_HEADS * ratio, torch.float32)
    k, v = new_kv(pool, batch)
    got = TorchAttention().forward(q, k, v, 0, batch, pool)
    torch.testing.assert_close(got, ReferenceAttention().forward(q, k, v, 0, batch, pool),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("ratio", GQA_RATIOS)
def test_prefill_from_scratch_is_bit_identical_to_the_reference(ratio: int) -> None:
    """No cached prefix: SDPA's causal path over KV heads broadcast to their group gives the
    very bits of the masked call over repeated KV heads (what a cached prefix goes through)."""
    seqs = ((0, 2), (0, 17), (0, 129), (0, 300))
    pool, batch, q = make_case(seqs, KV_HEADS * ratio, torch.float32)
    k, v = new_kv(pool, batch)
    got = TorchAttention().forward(q, k, v, 0, batch, pool)
    assert torch.equal(got, ReferenceAttention().forward(q, k, v, 0, batch, pool))


def test_every_layer_shares_one_plan() -> None:
    """Tables and masks are built at the first layer and reused (not rebuilt per layer)."""
    pool, batch, q = make_case(MIXED, KV_HEADS * 4, torch.float32, num_layers=3)
    backend = TorchAttention()
    outs = []
    for layer in range(3):
        k, v = new_kv(pool, batch, layer)
        outs.append(backend.forward(q, k, v, layer, batch, pool))
    plan = batch.memo("torch_attention/None", lambda: pytest.fail("the plan was not kept"))
    assert plan.decode_table.shape[0] == sum(1 for _, e in MIXED if e == 1)
    for layer, out in enumerate(outs):
        k, v = new_kv(pool, batch, layer)
        torch.testing.assert_close(out, ReferenceAttention().forward(q, k, v, layer, batch, pool),
                                   rtol=2e-5, atol=2e-5)


@given(st.lists(st.tuples(st.integers(0, 90), st.integers(1, 24)), min_size=1, max_size=6),
       st.sampled_from(GQA_RATIOS), st.booleans())
def test_any_batch_matches_the_reference(seqs: list[tuple[int, int]], ratio: int,
                                         lower_right: bool) -> None:
    pool, batch, q = make_case(tuple(seqs), KV_HEADS * ratio, torch.float32)
    k, v = new_kv(pool, batch)
    got = TorchAttention(lower_right=lower_right).forward(q, k, v, 0, batch, pool)
    torch.testing.assert_close(got, ReferenceAttention().forward(q, k, v, 0, batch, pool),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("ratio", GQA_RATIOS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_right_prefill_matches_the_reference(ratio: int, dtype: torch.dtype) -> None:
    """CUDA's default: every prefill through the lower-right causal bias, no mask tensor in
    the plan, the reference's result. On the CPU torch materialises the bias per call, so
    this checks the rule, not the kernel (the CUDA test below runs the kernel)."""
    pool, batch, q = make_case(MIXED, KV_HEADS * ratio, dtype)
    k, v = new_kv(pool, batch)
    got = TorchAttention(lower_right=True).forward(q, k, v, 0, batch, pool)
    plan = batch.memo("torch_attention/None", lambda: pytest.fail("no plan"))
    assert plan.prefills and all(isinstance(p.mask, CausalBias) for p in plan.prefills)
    want = ReferenceAttention().forward(q, k, v, 0, batch, pool)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@requires_cuda
@pytest.mark.parametrize("ratio", GQA_RATIOS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_batches_match_the_reference(ratio: int, dtype: torch.dtype) -> None:
    """On a GPU the default backend (lower-right flash for prefills) against the per-sequence
    loop, both on the GPU, for mixed batches and a longer cached prefix."""
    seqs = (*MIXED, (700, 129))
    pool, batch, q = make_case(seqs, KV_HEADS * ratio, dtype, device="cuda")
    k, v = new_kv(pool, batch)
    got = TorchAttention().forward(q, k, v, 0, batch, pool)
    assert torch.isfinite(got).all()
    want = ReferenceAttention().forward(q, k, v, 0, batch, pool)
    tol = CUDA_TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_a_cpu_whose_causal_path_differs_takes_the_masked_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the probe finds SDPA's causal path off the masked call's bits (another torch
    build or CPU), prompts from scratch take the masked call: still the reference's bits."""
    from hicache_server.models import attention
    monkeypatch.setattr(attention, "causal_flag_is_exact", lambda *shape: False)
    seqs = ((0, 2), (0, 17), (0, 129), (0, 300))
    pool, batch, q = make_case(seqs, KV_HEADS * 4, torch.float32)
    k, v = new_kv(pool, batch)
    got = TorchAttention().forward(q, k, v, 0, batch, pool)
    plan = batch.memo("torch_attention/None", lambda: pytest.fail("no plan kept"))
    assert all(p.mask is not None for p in plan.prefills)  # no causal flag
    assert torch.equal(got, ReferenceAttention().forward(q, k, v, 0, batch, pool))


def test_the_causal_probe_passes_only_where_the_paths_agree() -> None:
    """A probe that says "exact" means the two calls agree at its lengths (129 among them)."""
    from hicache_server.models.attention import (
        _additive,
        _causal_mask,
        _prefill,
        causal_flag_is_exact,
    )
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn((129, h, 64), generator=gen) for h in (8, 2, 2))
    same = torch.equal(_prefill(q, k, v, None),
                       _prefill(q, k, v, _additive(_causal_mask(0, 129, q.device), q.dtype)))
    assert same or not causal_flag_is_exact(torch.float32, 2, 4, 64)
