"""Sliding-window attention (a layer's `window` W: the query at position p reads the keys
`p - W < j <= p`) on every CPU backend against ReferenceAttention: the C kernel in float32
and in bfloat16 on each path this CPU has, TorchAttention with and without the lower-right
bias; prompts from scratch, extends on a cached prefix, decode rows and mixes of them, with
windows of one key, cutting pages (16) and key blocks (64) in the middle, and longer than
the prompt; a scale other than 1/sqrt(head_dim). Then the C kernel's promise with a window:
a row's bits do not depend on how its sequence was split, and the key blocks before a row's
window are never read.

Every slot a sequence does not own is NaN (test_attention.make_case): a backend that reads
one returns NaN and fails.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from conftest import bf16_paths, needs_cpu_kernel
from hypothesis import given
from hypothesis import strategies as st
from test_attention import KV_HEADS, NUM_PAGES, PAGE_SIZE, make_case, new_kv

from hicache.memory.device import DeviceKVPool
from hicache_server.models.attention import (
    AttentionBackend,
    CpuKernelAttention,
    ReferenceAttention,
    TorchAttention,
)
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.models.kernels import cpu_attention

GQA_RATIOS = (1, 4)
# one key; shorter than a page; cutting pages of 16 (37, 45) and key blocks of 64 (45, 70) in
# the middle; one whole key block; longer than every sequence below
WINDOWS = (1, 5, 37, 45, 64, 70, 1000)
SCALES = (None, 0.3)  # the default 1/sqrt(head_dim) (0.125 here) and another
# (prefix, extend) batches
FROM_SCRATCH = ((0, 37), (0, 100), (0, 3), (0, 1), (0, 130))
EXTEND = ((40, 30), (128, 17), (5, 60), (200, 64), (63, 2))
DECODE = ((0, 1), (36, 1), (44, 1), (63, 1), (64, 1), (300, 1), (500, 1))
MIXED = ((0, 37), (120, 1), (48, 17), (5, 1), (200, 64), (1, 2), (300, 1), (63, 66))
BATCHES = {"from_scratch": FROM_SCRATCH, "extend": EXTEND, "decode": DECODE, "mixed": MIXED}
TOLERANCE = 2e-5  # float32: the kernels' exp and summation order against SDPA's
BF16_PATHS = cpu_attention.BF16_PATHS
PAIR_DIMS = {"avx512bf16": 32, "amx": 64}  # the paths that round P to bfloat16 (head_dim 64)

@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> cpu_attention.CpuAttentionKernel:
    if not cpu_attention.supported():
        needs_cpu_kernel("the CPU attention kernel")
    built = cpu_attention.load(tmp_path_factory.mktemp("kernels"))
    assert built is not None, "supported() is true, so the kernel must build and load"
    return built


def run(backend: AttentionBackend, q: torch.Tensor, batch: ForwardBatch, pool: DeviceKVPool,
        window: int | None, scale: float | None) -> torch.Tensor:
    k, v = new_kv(pool, batch)
    return backend.forward(q, k, v, 0, batch, pool, window=window, scale=scale)


def as_pool(pool: DeviceKVPool, dtype: torch.dtype) -> DeviceKVPool:
    """A copy of the pool's values in `dtype` (NaN stays NaN)."""
    out = DeviceKVPool(NUM_PAGES, PAGE_SIZE, 1, KV_HEADS, pool.k_buffers[0].shape[-1], dtype,
                       "cpu")
    for src, dst in zip((*pool.k_buffers, *pool.v_buffers), (*out.k_buffers, *out.v_buffers)):
        dst.copy_(src)
    return out


# ------------------------------------------------------------- every backend, the reference


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize("lower_right", (False, True))
def test_torch_attention_matches_the_reference(kind: str, window: int, scale: float | None,
                                               lower_right: bool) -> None:
    for ratio in GQA_RATIOS:
        pool, batch, q = make_case(BATCHES[kind], KV_HEADS * ratio, torch.float32)
        got = run(TorchAttention(lower_right=lower_right), q, batch, pool, window, scale)
        want = run(ReferenceAttention(), q, batch, pool, window, scale)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("kind", list(BATCHES))
def test_the_kernel_in_float32_matches_the_reference(kernel, kind: str, window: int,
                                                     scale: float | None) -> None:
    for ratio in GQA_RATIOS:
        pool, batch, q = make_case(BATCHES[kind], KV_HEADS * ratio, torch.float32)
        got = run(CpuKernelAttention(kernel), q, batch, pool, window, scale)
        want = run(ReferenceAttention(), q, batch, pool, window, scale)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("kind", list(BATCHES))
def test_the_kernel_in_bfloat16_matches_the_reference(kernel, kind: str, window: int) -> None:
    """On each bfloat16 path: within a bfloat16 step or two of the float32 reference on the
    same (bfloat16) values; a little more where P is rounded to bfloat16 for PV."""
    pool, batch, q = make_case(BATCHES[kind], KV_HEADS * 4, torch.bfloat16)
    exact = run(ReferenceAttention(), q.float(), batch, as_pool(pool, torch.float32), window,
                0.3)
    for on_path in bf16_paths(kernel, BF16_PATHS):
        got = run(CpuKernelAttention(on_path), q, batch, pool, window, 0.3)
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        atol = 4e-3 if on_path.bf16_path in PAIR_DIMS else 1e-3
        torch.testing.assert_close(got.float(), exact, rtol=2 ** -7, atol=atol)


# any mix of prefills, extends and decode rows, with any window around the page (16) and key
# block (64) sizes
ANY_BATCH = st.lists(st.tuples(st.integers(0, 150), st.integers(1, 40)), min_size=1,
                     max_size=5)
ANY_WINDOW = st.sampled_from((1, 2, 15, 16, 17, 37, 45, 63, 64, 65, 129))


@given(ANY_BATCH, ANY_WINDOW, st.sampled_from(GQA_RATIOS), st.booleans())
def test_torch_attention_on_any_windowed_batch(seqs: list[tuple[int, int]], window: int,
                                               ratio: int, lower_right: bool) -> None:
    pool, batch, q = make_case(tuple(seqs), KV_HEADS * ratio, torch.float32)
    got = run(TorchAttention(lower_right=lower_right), q, batch, pool, window, 0.3)
    want = run(ReferenceAttention(), q, batch, pool, window, 0.3)
    torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)


@given(seqs=ANY_BATCH, window=ANY_WINDOW, ratio=st.sampled_from(GQA_RATIOS))
def test_the_kernel_on_any_windowed_batch(kernel, seqs: list[tuple[int, int]], window: int,
                                          ratio: int) -> None:
    pool, batch, q = make_case(tuple(seqs), KV_HEADS * ratio, torch.float32)
    got = run(CpuKernelAttention(kernel), q, batch, pool, window, 0.3)
    want = run(ReferenceAttention(), q, batch, pool, window, 0.3)
    torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)


def test_a_window_changes_the_answer_only_where_it_hides_keys() -> None:
    """The reference itself: a window at least as long as the sequence is full attention, a
    shorter one differs exactly on the rows whose position reaches past it."""
    pool, batch, q = make_case(((0, 80),), KV_HEADS * 2, torch.float32)
    full = run(ReferenceAttention(), q, batch, pool, None, None)
    assert torch.equal(run(ReferenceAttention(), q, batch, pool, 80, None), full)
    windowed = run(ReferenceAttention(), q, batch, pool, 37, None)
    assert torch.equal(windowed[:37], full[:37])  # positions 0 .. 36 see every key anyway
    assert not torch.isclose(windowed[37:], full[37:]).all(dim=-1).all(dim=-1).any()
    one = run(ReferenceAttention(), q, batch, pool, 1, None)  # each row reads itself only
    _, v_cache = pool.get_kv(0)
    own_v = v_cache[batch.out_slots].repeat_interleave(2, dim=1)
    torch.testing.assert_close(one, own_v)


# ---------------------------------------------- the C kernel: a row's bits, whatever the split


def one_sequence(dtype: torch.dtype, heads: int, length: int = 300
                 ) -> tuple[DeviceKVPool, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A NaN pool holding one `length`-token sequence (scattered slots) and a second
    sequence's 40 tokens; their slots and the queries of every position of the first."""
    pool, batch, _ = make_case(((0, length), (0, 40)), KV_HEADS, dtype)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn((length, heads, pool.k_buffers[0].shape[-1]), generator=gen).to(dtype)
    return pool, batch.seq_slots[0], batch.seq_slots[1], q


def split(slots: torch.Tensor, prefix: int, extend: int) -> ForwardBatch:
    """The batch of one sequence's tokens prefix .. prefix + extend - 1, cached before."""
    return ForwardBatch(torch.zeros(extend, dtype=torch.int64),
                        torch.arange(prefix, prefix + extend), slots[prefix:prefix + extend],
                        [slots[:prefix + extend]], [prefix], [extend])


def kernels_on_paths(kernel, dtype: torch.dtype) -> Iterator:
    """The kernel on each bfloat16 path this CPU has, or once for float32."""
    if dtype == torch.bfloat16:
        yield from bf16_paths(kernel, BF16_PATHS)
    else:
        yield kernel


@pytest.mark.parametrize("window", (1, 37, 45, 64, 100))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16),
                         ids=("float32", "bfloat16"))
def test_a_windowed_row_has_the_same_bits_however_its_sequence_is_split(
        kernel, window: int, dtype: torch.dtype) -> None:
    """From scratch, extending a cached prefix at any split, decoded, or beside another
    sequence: every row of a 300-token sequence gets the same bits under a window, in
    float32 and in bfloat16 on each path (so its K/V in the next layer would too)."""
    pool, slots, other, q = one_sequence(dtype, KV_HEADS * 4)
    for on_path in kernels_on_paths(kernel, dtype):
        backend = CpuKernelAttention(on_path)
        full = run(backend, q, split(slots, 0, 300), pool, window, 0.3)
        assert torch.isfinite(full).all()
        for prefix in (1, 15, 16, 36, 37, 63, 64, 65, 200, 299):
            ext = run(backend, q[prefix:], split(slots, prefix, 300 - prefix), pool, window, 0.3)
            assert torch.equal(ext, full[prefix:]), (on_path.bf16_path, prefix)
        for pos in (0, 1, 36, 44, 63, 64, 150, 299):
            one = run(backend, q[pos:pos + 1], split(slots, pos, 1), pool, window, 0.3)
            assert torch.equal(one, full[pos:pos + 1]), (on_path.bf16_path, pos)
        beside = ForwardBatch(torch.zeros(240, dtype=torch.int64),
                              torch.cat([torch.arange(40), torch.arange(100, 300)]),
                              torch.cat([other, slots[100:]]), [other, slots], [0, 100],
                              [40, 200])
        gen = torch.Generator().manual_seed(3)
        mixed_q = torch.cat([torch.randn((40, *q.shape[1:]), generator=gen).to(dtype), q[100:]])
        got = run(backend, mixed_q, beside, pool, window, 0.3)
        assert torch.equal(got[40:], full[100:]), on_path.bf16_path


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16),
                         ids=("float32", "bfloat16"))
def test_the_blocks_before_a_window_are_never_read(kernel, dtype: torch.dtype) -> None:
    """Rows start at the key block (64 keys, from key 0) of their first key: K/V of the
    blocks before it turned NaN change no bit of a decode row at 299 (first key 263, block
    256 ..) nor of an extend from 200 (first key 164, block 128 ..), window 37."""
    pool, slots, _, q = one_sequence(dtype, KV_HEADS * 4)
    cases = ((299, 1, 256), (200, 100, 128))  # (prefix, extend, first key block)
    for on_path in kernels_on_paths(kernel, dtype):
        backend = CpuKernelAttention(on_path)
        clean = [run(backend, q[p:p + e], split(slots, p, e), pool, 37, None)
                 for p, e, _ in cases]
        for (p, e, block), want in zip(cases, clean):
            poisoned = as_pool(pool, dtype)
            for buf in (*poisoned.k_buffers, *poisoned.v_buffers):
                buf[slots[:block]] = float("nan")
            got = run(backend, q[p:p + e], split(slots, p, e), poisoned, 37, None)
            assert torch.equal(got, want), (on_path.bf16_path, p)
