"""models/kernels/paged_attention: the torch reference against TorchAttention on CPU, argument
checks, compilation with nvcc/NVRTC, and the CUDA kernel against the reference on a GPU.

Every slot that a sequence does not own, the padding page included, is poisoned with NaN: an
implementation that reads one returns NaN and fails.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import compile_cubin, missing_tool

from hicache.kernels import cuda_utils
from hicache.memory.device import DeviceKVPool
from hicache_server.models.attention import CudaPagedAttention, TorchAttention
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.models.kernels import paged_attention
from hicache_server.models.kernels.paged_attention import (
    MAX_HEAD_DIM,
    paged_decode_attention,
    paged_decode_attention_reference,
)

SEED = 7
PAGE_SIZE = 16
NUM_PAGES = 64  # 1024 usable slots
SEQ_LENS = (1, 7, 64, 65, 200)  # 64 is the kernel's key tile: exactly one, one plus one, many
GQA_RATIOS = (1, 4, 8)
KV_HEADS = 2
HEAD_DIM = 64
# sliding windows: one key, shorter than a page, cutting pages (16) and the key tile (64) in
# the middle, and longer than every sequence
WINDOWS = (1, 5, 37, 70, 1000)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def poisoned_pool(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                  device: str) -> DeviceKVPool:
    pool = DeviceKVPool(NUM_PAGES, PAGE_SIZE, num_layers, kv_heads, head_dim, dtype, device)
    for buf in (*pool.k_buffers, *pool.v_buffers):
        buf.fill_(float("nan"))
    return pool


def decode_case(seq_lens: tuple[int, ...], heads: int, kv_heads: int, head_dim: int,
                dtype: torch.dtype, device: str) -> tuple[DeviceKVPool, ForwardBatch, torch.Tensor]:
    """A pool whose only finite slots are the sequences' (scattered), their decode batch
    and the queries `[S, heads, head_dim]`."""
    gen = torch.Generator().manual_seed(SEED)
    pool = poisoned_pool(1, kv_heads, head_dim, dtype, device)
    slots_all = pool.alloc(NUM_PAGES * PAGE_SIZE)
    slots_all = slots_all[torch.randperm(len(slots_all), generator=gen)]
    seq_slots, start = [], 0
    for n in seq_lens:
        seq_slots.append(slots_all[start:start + n])
        start += n
    used = torch.cat(seq_slots)
    for buf in (pool.k_buffers[0], pool.v_buffers[0]):
        values = torch.randn((len(used), kv_heads, head_dim), generator=gen)
        buf[used.to(device)] = values.to(device, dtype)
    last = torch.stack([s[-1] for s in seq_slots])
    batch = ForwardBatch(
        input_ids=torch.zeros(len(seq_lens), dtype=torch.int64),
        positions=torch.tensor([n - 1 for n in seq_lens]), out_slots=last,
        seq_slots=seq_slots, prefix_lens=[n - 1 for n in seq_lens],
        extend_lens=[1] * len(seq_lens)).to(torch.device(device))
    q = torch.randn((len(seq_lens), heads, head_dim), generator=gen).to(device, dtype)
    return pool, batch, q


# ---------------------------------------------------------------------------------------------
# CPU: the reference against TorchAttention (SDPA), argument checks


@pytest.mark.parametrize("ratio", GQA_RATIOS)
def test_reference_matches_torch_attention_decode(ratio: int) -> None:
    pool, batch, q = decode_case(SEQ_LENS, KV_HEADS * ratio, KV_HEADS, HEAD_DIM,
                                 torch.float32, "cpu")
    k_cache, v_cache = pool.get_kv(0)
    table, lens = batch.slot_table()
    ref = paged_decode_attention_reference(q, k_cache, v_cache, table, lens,
                                           1 / math.sqrt(HEAD_DIM))
    torch_out = TorchAttention().forward(q, q[:, :KV_HEADS], q[:, :KV_HEADS], 0, batch, pool)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(ref, torch_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ratio", GQA_RATIOS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_causal_fast_path_is_bit_identical_to_the_masked_one(
        ratio: int, dtype: torch.dtype) -> None:
    """A prompt with no cached prefix takes SDPA's causal path on the CPU; it must give the
    very bits of the masked call that a cached prefix goes through, or recomputation and
    the cache would disagree on greedy tokens."""
    lens = (2, 17, 64, 129, 300)  # (prefix 0, extend n): one prefill each
    pool, decode, _ = decode_case(lens, KV_HEADS * ratio, KV_HEADS, HEAD_DIM, dtype, "cpu")
    batch = ForwardBatch(
        input_ids=torch.zeros(sum(lens), dtype=torch.int64),
        positions=torch.cat([torch.arange(n) for n in lens]),
        out_slots=torch.cat(decode.seq_slots), seq_slots=decode.seq_slots,
        prefix_lens=[0] * len(lens), extend_lens=list(lens))
    gen = torch.Generator().manual_seed(SEED)
    q = torch.randn((sum(lens), KV_HEADS * ratio, HEAD_DIM), generator=gen).to(dtype)
    fast = TorchAttention().forward(q, q[:, :KV_HEADS], q[:, :KV_HEADS], 0, batch, pool)
    k_cache, v_cache = pool.get_kv(0)
    for start, n, slots in zip(batch.extend_starts, lens, batch.seq_slots):
        qs = q[start:start + n].transpose(0, 1)
        ks = k_cache[slots].repeat_interleave(ratio, dim=1).transpose(0, 1)
        vs = v_cache[slots].repeat_interleave(ratio, dim=1).transpose(0, 1)
        keys = torch.arange(n)
        masked = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=keys[None, :] <= keys[:, None])
        assert torch.equal(fast[start:start + n], masked.transpose(0, 1))


@pytest.mark.parametrize("window", WINDOWS)
def test_windowed_reference_matches_torch_attention_decode(window: int) -> None:
    """Each sequence reads its `window` latest keys, as TorchAttention's window layers do."""
    pool, batch, q = decode_case(SEQ_LENS, KV_HEADS * 4, KV_HEADS, HEAD_DIM,
                                 torch.float32, "cpu")
    k_cache, v_cache = pool.get_kv(0)
    table, lens = batch.slot_table()
    ref = paged_decode_attention_reference(q, k_cache, v_cache, table, lens, 0.3,
                                           window=window)
    k = q[:, :KV_HEADS]
    want = TorchAttention().forward(q, k, k, 0, batch, pool, window=window, scale=0.3)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)
    if window < max(SEQ_LENS):  # a window shorter than a sequence changes its answer
        full = paged_decode_attention_reference(q, k_cache, v_cache, table, lens, 0.3)
        assert not torch.allclose(ref, full)


def test_reference_ignores_the_table_before_the_window() -> None:
    pool, batch, q = decode_case((3, 90), 4, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    k_cache, v_cache = pool.get_kv(0)
    table, lens = batch.slot_table()
    garbage = table.clone()
    garbage[1, :90 - 37] = 10**9  # out of range: reading it would raise
    got = paged_decode_attention_reference(q, k_cache, v_cache, garbage, lens, 0.125, window=37)
    torch.testing.assert_close(got, paged_decode_attention_reference(
        q, k_cache, v_cache, table, lens, 0.125, window=37))


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_a_window_is_a_positive_int(window: object) -> None:
    pool, batch, q = decode_case((3,), 4, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    for fn in (paged_decode_attention_reference, paged_decode_attention):
        with pytest.raises(ValueError, match="window must be None"):
            fn(q, *pool.get_kv(0), *batch.slot_table(), 0.125, window=window)


def test_reference_ignores_the_table_past_seq_len() -> None:
    pool, batch, q = decode_case((3, 9), 4, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    k_cache, v_cache = pool.get_kv(0)
    table, lens = batch.slot_table()
    garbage = table.clone()
    garbage[0, 3:] = 10**9  # out of range: reading it would raise
    out = paged_decode_attention_reference(q, k_cache, v_cache, garbage, lens, 0.125)
    torch.testing.assert_close(
        out, paged_decode_attention_reference(q, k_cache, v_cache, table, lens, 0.125))
    one = paged_decode_attention_reference(q[:1], k_cache, v_cache, table[:1, :1],
                                           lens[:1].clamp(max=1), 0.125)
    v0 = v_cache[table[0, 0]].repeat_interleave(2, dim=0)  # one key: output is its V
    torch.testing.assert_close(one[0], v0)


@pytest.mark.parametrize(("change", "match"), [
    ({"q": torch.zeros(2, 4)}, "q must be"),
    ({"k_cache": torch.zeros(32, 2, 16)}, "k_cache must be"),
    ({"v_cache": torch.zeros(32, 2, 8, dtype=torch.float16)}, "v_cache must be"),
    ({"slot_table": torch.zeros(2, 5, dtype=torch.int32)}, "slot_table must be int64"),
    ({"slot_table": torch.zeros(3, 5, dtype=torch.int64)}, "slot_table must be"),
    ({"seq_lens": torch.ones(3, dtype=torch.int64)}, "seq_lens must be"),
    ({"q": torch.zeros(2, 3, 8)}, "do not divide"),
    ({"k_cache": torch.zeros(32, 0, 8), "v_cache": torch.zeros(32, 0, 8)}, "0 kv heads"),
    ({"q": torch.zeros(2, 4, 8, dtype=torch.float64)}, "q: dtype"),
])
def test_wrapper_checks_arguments(change: dict, match: str) -> None:
    args = {"q": torch.zeros(2, 4, 8), "k_cache": torch.zeros(32, 2, 8),
            "v_cache": torch.zeros(32, 2, 8), "slot_table": torch.zeros(2, 5, dtype=torch.int64),
            "seq_lens": torch.ones(2, dtype=torch.int64)} | change
    for fn in (paged_decode_attention_reference, paged_decode_attention):
        with pytest.raises(ValueError, match=match):
            fn(**args, scale=1.0)


def test_kernel_wrapper_rejects_cpu_tensors() -> None:
    pool, batch, q = decode_case((3,), 4, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    with pytest.raises(ValueError, match="CUDA"):
        paged_decode_attention(q, *pool.get_kv(0), *batch.slot_table(), 0.125)


# ---------------------------------------------------------------------------------------------
# Compilation: nvcc for the GPUs we target, NVRTC exactly as CuPy would (no GPU needed)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvcc_compiles_cubin(arch: str, tmp_path: Path) -> None:
    data = compile_cubin(paged_attention.SOURCE, arch, tmp_path)
    for suffix in ("f32", "f16", "bf16"):
        assert f"paged_decode_attention_{suffix}".encode() in data


def test_nvrtc_compiles_without_headers() -> None:
    if cuda_utils.load_nvrtc() is None:
        missing_tool("no NVRTC library installed (torch's CUDA wheels ship one)")
    ptx = cuda_utils.nvrtc_compile(cuda_utils.kernel_source(paged_attention.SOURCE))
    for suffix in ("f32", "f16", "bf16"):
        assert f".entry paged_decode_attention_{suffix}(" in ptx


# ---------------------------------------------------------------------------------------------
# CUDA: the kernel against the reference

TOLERANCES = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@requires_cuda
@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("ratio", GQA_RATIOS)
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_kernel_matches_reference(dtype: torch.dtype, ratio: int, head_dim: int) -> None:
    pytest.importorskip("cupy")
    pool, batch, q = decode_case(SEQ_LENS, KV_HEADS * ratio, KV_HEADS, head_dim, dtype, "cuda")
    k_cache, v_cache = pool.get_kv(0)
    table, lens = batch.slot_table()
    scale = 1 / math.sqrt(head_dim)
    got = paged_decode_attention(q, k_cache, v_cache, table, lens, scale)
    want = paged_decode_attention_reference(q, k_cache, v_cache, table, lens, scale)
    assert got.dtype == dtype and got.shape == q.shape
    assert torch.isfinite(got).all()  # no poisoned slot was read
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@requires_cuda
@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("window", WINDOWS)
def test_windowed_kernel_matches_reference(dtype: torch.dtype, window: int) -> None:
    """Each row from max(0, len - W) on, never the poisoned slots before it nor past it."""
    pytest.importorskip("cupy")
    pool, batch, q = decode_case(SEQ_LENS, KV_HEADS * 4, KV_HEADS, HEAD_DIM, dtype, "cuda")
    k_cache, v_cache = pool.get_kv(0)
    table, lens = batch.slot_table()
    table = table.clone()
    for s, n in enumerate(lens.tolist()):
        table[s, :max(0, n - window)] = 0  # slot 0: the NaN padding page, before the window
    got = paged_decode_attention(q, k_cache, v_cache, table, lens, 0.3, window=window)
    want = paged_decode_attention_reference(q, k_cache, v_cache, table, lens, 0.3,
                                            window=window)
    assert torch.isfinite(got).all()
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@requires_cuda
def test_kernel_ignores_padding_and_takes_strided_q() -> None:
    pytest.importorskip("cupy")
    pool, batch, q = decode_case((1, 130), 8, KV_HEADS, HEAD_DIM, torch.float32, "cuda")
    k_cache, v_cache = pool.get_kv(0)
    table, lens = batch.slot_table()
    table = table.clone()
    table[0, 1:] = 0  # slot 0 is in the NaN padding page, past sequence 0's length
    wide = torch.cat([q, q], dim=-1)  # q as a strided view
    got = paged_decode_attention(wide[..., :HEAD_DIM], k_cache, v_cache, table, lens, 0.125)
    want = paged_decode_attention_reference(q, k_cache, v_cache, table, lens, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@requires_cuda
@pytest.mark.parametrize(("window", "scale"), [(None, None), (37, None), (70, 0.3)])
def test_cuda_backend_decode_matches_torch_attention(window: int | None,
                                                     scale: float | None) -> None:
    pytest.importorskip("cupy")
    pool, batch, q = decode_case(SEQ_LENS, 8, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    k = q[:, :KV_HEADS]
    got = CudaPagedAttention().forward(q, k, k, 0, batch, pool, window=window, scale=scale)
    want = TorchAttention().forward(q, k, k, 0, batch, pool, window=window, scale=scale)
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1.6e-2)


def test_cuda_backend_glue_on_cpu_with_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """CudaPagedAttention's batching (slot table, scale, dtype, prefill fallback) checked on
    CPU with the kernel swapped for its reference."""
    from hicache_server.models import attention

    calls: list[int] = []

    def reference(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return paged_decode_attention_reference(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(attention, "paged_decode_attention", reference)
    pool, batch, q = decode_case(SEQ_LENS, 8, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    k = q[:, :KV_HEADS]
    got = CudaPagedAttention().forward(q, k, k, 0, batch, pool)
    torch.testing.assert_close(got, TorchAttention().forward(q, k, k, 0, batch, pool),
                               rtol=1e-5, atol=1e-5)
    assert calls == [1]
    # a sliding-window layer with its own scale takes the kernel too (no SDPA fallback)
    got = CudaPagedAttention().forward(q, k, k, 0, batch, pool, window=37, scale=0.3)
    want = TorchAttention().forward(q, k, k, 0, batch, pool, window=37, scale=0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == [1, 1]
    prefill = ForwardBatch(torch.zeros(3, dtype=torch.int64), torch.arange(3),
                           batch.seq_slots[4][:3], [batch.seq_slots[4][:3]], [0], [3])
    qp = q[:3]
    torch.testing.assert_close(CudaPagedAttention().forward(qp, k[:3], k[:3], 0, prefill, pool),
                               TorchAttention().forward(qp, k[:3], k[:3], 0, prefill, pool))
    assert calls == [1, 1]  # prefill did not go through the decode kernel


def test_cuda_backend_falls_back_past_the_kernel_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode batch whose head_dim the kernel cannot hold goes through SDPA, not an error."""
    from hicache_server.models import attention

    calls: list[int] = []
    monkeypatch.setattr(attention, "paged_decode_attention",
                        lambda *a, **kw: calls.append(1))
    head_dim = MAX_HEAD_DIM + 32
    pool, batch, q = decode_case((3, 9), 4, KV_HEADS, head_dim, torch.float32, "cpu")
    k = q[:, :KV_HEADS]
    got = CudaPagedAttention().forward(q, k, k, 0, batch, pool)
    torch.testing.assert_close(got, TorchAttention().forward(q, k, k, 0, batch, pool))
    assert calls == []


# ---------------------------------------------------------------------------------------------
# The launch, on CPU with CuPy and the stream replaced by recorders: CuPy packs each argument
# by its NumPy type, so the types must match the kernel's C signature one for one


_C_TO_NUMPY = {"T*": "uint64", "i64*": "uint64", "int": "int32", "i64": "int64",
               "float": "float32"}


def _kernel_param_types(source: str) -> list[str]:
    params = source.split("NAME(", 1)[1].split(")", 1)[0].replace("\\", " ")
    types = []
    for p in params.split(","):
        words = p.replace("*", " * ").replace("const", "").split()
        types.append(words[0] + ("*" if "*" in words else ""))
    return types


def _define(source: str, name: str) -> int:
    return int(source.split(f"#define {name} ", 1)[1].split()[0])


def test_launch_matches_the_kernel_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    launches: list = []

    def get_function(name: str):
        launches.append(name)
        return lambda grid, block, args: launches.append((grid, block, args))

    fake_cupy = SimpleNamespace(cuda=SimpleNamespace(
        Device=lambda index: contextlib.nullcontext(),
        ExternalStream=lambda ptr, index: contextlib.nullcontext()))
    monkeypatch.setattr(paged_attention, "import_cupy", lambda: fake_cupy)
    monkeypatch.setattr(paged_attention, "raw_module",
                        lambda source: SimpleNamespace(get_function=get_function))
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    pool, batch, q = decode_case((3, 70), 8, KV_HEADS, HEAD_DIM, torch.bfloat16, "cpu")
    k_cache, v_cache = pool.get_kv(0)
    table, lens = batch.slot_table()
    out = torch.empty_like(q)
    paged_attention._launch(q, k_cache, v_cache, table, lens, out, 0.125, 37)
    name, (grid, block, args) = launches
    source = cuda_utils.kernel_source(paged_attention.SOURCE)
    assert name == "paged_decode_attention_bf16" and name in source
    assert grid == (8, 2)  # one block per (query head, sequence)
    assert block == (_define(source, "THREADS"),) == (paged_attention._THREADS,)
    assert _define(source, "MAX_HEAD_DIM") == paged_attention.MAX_HEAD_DIM
    assert [type(a).__name__ for a in args] == [
        _C_TO_NUMPY[c] for c in _kernel_param_types(source)]
    ptrs = [q, k_cache, v_cache, table, lens, out]
    assert [int(a) for a in args[:6]] == [t.data_ptr() for t in ptrs]
    assert [int(a) for a in args[6:10]] == [8, KV_HEADS, HEAD_DIM, table.shape[1]]
    assert args[10] == np.float32(0.125)
    assert args[11] == np.int64(37)  # the window
