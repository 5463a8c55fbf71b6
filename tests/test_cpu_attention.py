"""The CPU attention kernel (kernels/src/cpu_attention.c) against its torch reference (full
and sliding-window layers; windows through the backends in tests/test_attention_window.py),
the row-invariance it promises (a token's bits do not depend on how its sequence was split
into prefix, extend and decode), and the model on it: cached and recomputed K/V
bit-identical.

Runs where the kernel is supported (AVX-512F or AVX2, and a C compiler: this project's
machines); skipped elsewhere, and a supported machine whose build fails fails here.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
from conftest import bf16_paths as paths
from test_attention import make_case, new_kv

from hicache.memory.device import DeviceKVPool
from hicache_server.models.attention import CpuKernelAttention, TorchAttention
from hicache_server.models.attention_choice import CPU_ATTENTION_ENV, make_attention_backend
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.models.kernels import cpu_attention, cpu_build
from hicache_server.models.kernels.cpu_attention import paged_attention_reference
from hicache_server.models.loader import EMBEDDED_TINY_LLAMA, load_model

SEED = 5
KV_HEADS = 2
SCALE = 0.125
TOLERANCE = 2e-5  # float32: the kernel's exp and summation order against SDPA's
# (prefix, extend): decode rows, prompts from scratch and on a cached prefix, lengths on and
# around the kernel's key block (64) and token tile (16)
MIXED = ((0, 37), (120, 1), (0, 1), (64, 1), (48, 17), (5, 1), (200, 64), (1, 2), (300, 1),
         (63, 66), (0, 129))

pytestmark = pytest.mark.skipif(not cpu_attention.supported(),
                                reason="the CPU attention kernel needs AVX-512F or AVX2, and a C compiler")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> cpu_attention.CpuAttentionKernel:
    built = cpu_attention.load(tmp_path_factory.mktemp("kernels"))
    assert built is not None, "supported() is true, so the kernel must build and load"
    return built


def case(seqs: tuple[tuple[int, int], ...], heads: int, dim: int = 64,
         num_slots: int = 4096, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """q as a strided view (the model's q of q|k), pools, scattered slots, the seqs rows."""
    gen = torch.Generator().manual_seed(SEED)
    k_cache = torch.randn((num_slots, KV_HEADS, dim), generator=gen).to(dtype)
    v_cache = torch.randn((num_slots, KV_HEADS, dim), generator=gen).to(dtype)
    perm = torch.randperm(num_slots, generator=gen)
    rows, used, first = [], 0, 0
    for prefix, extend in seqs:
        rows.append([first, prefix, extend, used])
        used += prefix + extend
        first += extend
    q = torch.randn((first, heads + KV_HEADS, dim), generator=gen).to(dtype)[:, :heads]
    return q, k_cache, v_cache, perm[:used].clone(), torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize("ratio", (1, 4, 8))
@pytest.mark.parametrize("dim", (64, 80, 128))
def test_mixed_batches_match_the_reference(kernel, ratio: int, dim: int) -> None:
    q, kc, vc, slots, seqs = case(MIXED, KV_HEADS * ratio, dim)
    got = kernel(q, kc, vc, slots, seqs, dim ** -0.5)
    want = paged_attention_reference(q, kc, vc, slots, seqs, dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize("window", (1, 37, 64, 100))
@pytest.mark.parametrize("dim", (64, 80))
def test_windowed_batches_match_the_reference(kernel, dim: int, window: int) -> None:
    """A sliding-window layer: each row reads its `window` latest keys (the backends' own
    tests: tests/test_attention_window.py)."""
    q, kc, vc, slots, seqs = case(MIXED, KV_HEADS * 4, dim)
    got = kernel(q, kc, vc, slots, seqs, SCALE, window=window)
    want = paged_attention_reference(q, kc, vc, slots, seqs, SCALE, window=window)
    torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)
    full = paged_attention_reference(q, kc, vc, slots, seqs, SCALE)
    assert not torch.allclose(got, full)  # the window hid keys of the longer rows


def test_bound_layers_take_each_layers_window(kernel) -> None:
    """`bind_layers` with a window per layer (Gemma's sliding and global layers): each bound
    call gives the bits of a direct call with that layer's window."""
    q, kc, vc, slots, seqs = case(MIXED, KV_HEADS * 4)
    q = q.contiguous()
    caches = [(kc, vc), (vc.clone(), kc.clone()), (kc, vc)]
    windows = [37, None, 1]
    out = torch.empty_like(q)
    bound = kernel.bind_layers(q, caches, slots, seqs, SCALE, out, 2, windows=windows)
    for layer, ((k, v), window) in enumerate(zip(caches, windows)):
        bound(layer)
        assert torch.equal(out, kernel(q, k, v, slots, seqs, SCALE, window=window)), layer
    with pytest.raises(ValueError, match="one window per layer"):
        kernel.bind_layers(q, caches, slots, seqs, SCALE, out, 2, windows=[37])
    with pytest.raises(ValueError, match="window must be None"):
        kernel.bind_layers(q, caches, slots, seqs, SCALE, out, 2, windows=[37, 0, None])


BF16_PATHS = cpu_attention.BF16_PATHS
# the paths that round P to bfloat16 for PV, and the head dims they take
PAIR_DIMS = {"avx512bf16": 32, "amx": 64}


def test_bfloat16_takes_the_fastest_path_this_cpu_has(kernel) -> None:
    """vdpbf16ps where /proc/cpuinfo lists AVX512-BF16, AMX's tiles where it lists them
    (and Linux grants them), the last of `bf16_paths` by default."""
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    assert ("avx512bf16" in kernel.bf16_paths) == ("avx512_bf16" in flags)
    if "amx" in kernel.bf16_paths:
        assert "amx_bf16" in flags
    assert kernel.bf16_path == kernel.bf16_paths[-1]


@pytest.mark.parametrize(("dim", "ratio"), ((64, 3), (128, 4), (80, 4), (96, 2), (64, 1)))
def test_bfloat16_matches_the_reference(kernel, dim: int, ratio: int) -> None:
    """bfloat16 q and pool, read exactly as float32; float32 math (on the pair paths, AMX
    and vdpbf16ps, P rounded to bfloat16 for PV), the output rounded once: within a
    bfloat16 step or two of the float32 reference on those values, and of SDPA in bfloat16
    (which rounds more). head_dim 80 is not a multiple of 32 nor 64: the pair paths leave it
    to AVX-512F."""
    for on_path in paths(kernel, BF16_PATHS):
        bfloat16_against_the_reference(on_path, dim, ratio)


def bfloat16_against_the_reference(kernel, dim: int, ratio: int) -> None:
    q, kc, vc, slots, seqs = case(MIXED, KV_HEADS * ratio, dim, dtype=torch.bfloat16)
    got = kernel(q, kc, vc, slots, seqs, dim ** -0.5)
    assert got.dtype == torch.bfloat16
    exact = paged_attention_reference(q.float(), kc.float(), vc.float(), slots, seqs,
                                      dim ** -0.5)
    # P in bfloat16 (AMX): each weight off by up to 2^-9 of itself, summed over the keys
    pairs = dim % PAIR_DIMS.get(kernel.bf16_path, dim + 1) == 0
    atol = 4e-3 if pairs else 1e-3
    torch.testing.assert_close(got.float(), exact, rtol=2 ** -7, atol=atol)
    sdpa = paged_attention_reference(q, kc, vc, slots, seqs, dim ** -0.5)
    torch.testing.assert_close(got.float(), sdpa.float(), rtol=2 ** -6, atol=2e-2)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("ratio", (1, 3, 8))
def test_a_row_has_the_same_bits_however_its_sequence_is_split(
        kernel, ratio: int, dtype: torch.dtype) -> None:
    """From scratch, extending a cached prefix at any split, decoded one token at a time,
    or beside other sequences: every row of a 300-token sequence gets the same bits, in
    float32 and in bfloat16 on each path this CPU has (AMX's 16-row tiles and shared K/V
    tiles too)."""
    wanted = BF16_PATHS if dtype == torch.bfloat16 else (kernel.bf16_path,)
    for on_path in paths(kernel, wanted):
        split_invariance(on_path, ratio, dtype)


def split_invariance(kernel, ratio: int, dtype: torch.dtype) -> None:
    q, kc, vc, slots, seqs = case(((0, 300),), KV_HEADS * ratio, dtype=dtype)
    full = kernel(q, kc, vc, slots, seqs, SCALE)
    for prefix in (1, 15, 16, 63, 64, 65, 200, 299):
        ext = kernel(q[prefix:], kc, vc, slots, torch.tensor([[0, prefix, 300 - prefix, 0]]),
                     SCALE)
        assert torch.equal(ext, full[prefix:]), prefix
    for pos in (0, 1, 63, 64, 150, 299):
        one = kernel(q[pos:pos + 1], kc, vc, slots, torch.tensor([[0, pos, 1, 0]]), SCALE)
        assert torch.equal(one, full[pos:pos + 1]), pos
    # the same sequence's tail as the second of a batch with an unrelated prefill first
    other, tail = 40, 300 - 100
    mixed_q = torch.cat([torch.randn(other, q.shape[1], q.shape[2]).to(dtype), q[100:]])
    rows = torch.tensor([[0, 0, other, 0], [other, 100, tail, 0]])
    got = kernel(mixed_q, kc, vc, slots, rows, SCALE)
    assert torch.equal(got[other:], full[100:])


def test_bad_inputs_are_value_errors(kernel) -> None:
    q, kc, vc, slots, seqs = case(((0, 8),), 8)
    with pytest.raises(ValueError, match="of q's dtype torch.bfloat16"):
        kernel(q.to(torch.bfloat16), kc, vc, slots, seqs, SCALE)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernel(q.half(), kc.half(), vc.half(), slots, seqs, SCALE)
    with pytest.raises(ValueError, match="head_dim"):
        kernel(q[..., :40].contiguous(), kc[..., :40].contiguous(), vc[..., :40].contiguous(),
               slots, seqs, SCALE)
    with pytest.raises(ValueError, match="seqs"):
        kernel(q, kc, vc, slots, seqs[:, :3].contiguous(), SCALE)
    with pytest.raises(ValueError, match="multiple of 2"):
        kernel(q[:, :3], kc, vc, slots, seqs, SCALE)
    with pytest.raises(ValueError, match=r"slots must lie in \[0, 4096\)"):
        kernel(q, kc, vc, slots + 4096, seqs, SCALE)  # past the pool: never read
    with pytest.raises(ValueError, match="does not fit"):
        kernel(q, kc, vc, slots[:4], seqs, SCALE)  # fewer slots than the sequence has
    for window in (0, -1, 2.0):
        with pytest.raises(ValueError, match=r"window must be None \(full attention\) or an"):
            kernel(q, kc, vc, slots, seqs, SCALE, window=window)


def test_the_backend_matches_torch_attention_on_a_pool(kernel) -> None:
    """Through the AttentionBackend contract, on a NaN pool whose only finite slots are the
    sequences' (a read of any other slot would turn the result NaN)."""
    pool, batch, q = make_case(MIXED, KV_HEADS * 4, torch.float32)
    k, v = new_kv(pool, batch)
    got = CpuKernelAttention(kernel).forward(q, k, v, 0, batch, pool)
    want = TorchAttention().forward(q, k, v, 0, batch, pool)
    torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)


def test_head_dims_the_kernel_does_not_take_go_to_sdpa(kernel) -> None:
    """head_dim 40 (not a multiple of 16): the backend answers through TorchAttention."""
    gen = torch.Generator().manual_seed(SEED)
    pool, batch, q = make_case(MIXED, KV_HEADS * 4, torch.float32)
    small = type(pool)(pool.num_pages, pool.page_size, 1, KV_HEADS, 40, torch.float32, "cpu")
    for src, dst in zip((*pool.k_buffers, *pool.v_buffers), (*small.k_buffers,
                                                              *small.v_buffers)):
        dst.copy_(src[..., :40])
    q40 = torch.randn((q.shape[0], q.shape[1], 40), generator=gen)
    k, v = new_kv(small, batch)
    got = CpuKernelAttention(kernel).forward(q40, k, v, 0, batch, small)
    want = TorchAttention().forward(q40, k, v, 0, batch, small)
    assert torch.equal(got, want)


def test_make_attention_backend_picks_the_kernel_unless_told(tmp_path: Path,
                                                              monkeypatch) -> None:
    assert isinstance(make_attention_backend("cpu", kernel_dir=tmp_path), CpuKernelAttention)
    assert isinstance(make_attention_backend("cpu"), TorchAttention)  # no kernel dir
    monkeypatch.setenv(CPU_ATTENTION_ENV, "sdpa")
    assert isinstance(make_attention_backend("cpu", kernel_dir=tmp_path), TorchAttention)
    monkeypatch.setenv(CPU_ATTENTION_ENV, "flash")
    with pytest.raises(ValueError, match="kernel, sdpa"):
        make_attention_backend("cpu", kernel_dir=tmp_path)


def test_a_failed_build_falls_back_to_none(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    assert cpu_attention.load(tmp_path / "failing") is None


def test_the_build_is_kept_and_reused(tmp_path: Path) -> None:
    first = cpu_attention._build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert cpu_attention._build(tmp_path) == first
    assert first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind


def _pool_kv(pool, slots: torch.Tensor) -> list[torch.Tensor]:
    return [buf[slots].clone() for buf in (*pool.k_buffers, *pool.v_buffers)]


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_the_model_caches_the_bits_it_would_recompute(monkeypatch, tmp_path: Path,
                                                      dtype: str) -> None:
    """The embedded model on the kernels, in float32 and in bfloat16: a 150-token prompt
    prefilled at once; the same prompt as a cached 70-token prefix then an extend; and 20 of
    its tokens decoded one at a time after the first 130: every layer's K/V of every token
    is the same bits, and so are the last token's logits."""
    from hicache.memory.device import DeviceKVPool

    monkeypatch.setenv("HICACHE_HOME", str(tmp_path))
    lm = load_model(EMBEDDED_TINY_LLAMA, dtype, "cpu")
    assert isinstance(lm.model.attn_backend, CpuKernelAttention)
    assert lm.model.linear_backend.startswith("CpuLinearKernel")
    assert lm.model.layer_ops == "CpuLayerKernel"
    c = lm.config
    ids = torch.randint(0, c.vocab_size, (150,), generator=torch.Generator().manual_seed(SEED))

    def fresh_pool() -> DeviceKVPool:
        return DeviceKVPool(16, 16, c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                            lm.dtype, "cpu")

    def run(pool: DeviceKVPool, prefix: int, extend: int) -> torch.Tensor:
        slots = torch.arange(16, 16 + prefix + extend)
        batch = ForwardBatch(ids[prefix:prefix + extend], torch.arange(prefix, prefix + extend),
                             slots[prefix:], [slots], [prefix], [extend])
        return lm.model.forward(batch, pool)

    whole = fresh_pool()
    logits = run(whole, 0, 150)
    split = fresh_pool()
    run(split, 0, 70)
    assert torch.equal(run(split, 70, 80), logits)
    decoded = fresh_pool()
    run(decoded, 0, 130)
    for pos in range(130, 150):
        last = run(decoded, pos, 1)
    assert torch.equal(last, logits)
    slots = torch.arange(16, 166)
    for a, b, d in zip(_pool_kv(whole, slots), _pool_kv(split, slots), _pool_kv(decoded, slots)):
        assert torch.equal(a, b) and torch.equal(a, d)


def test_the_avx2_build_gives_the_avx512_builds_bits(kernel, tmp_path: Path) -> None:
    """The AVX2 build (cpu_v16.h's vectors as two halves), which also runs on an AVX-512
    CPU, gives every row the bits of the AVX-512 build's float32 and plain bfloat16 paths:
    mixed batches, windows that cut blocks, soft-capped scores, GQA, head dims of one and
    several chunks."""
    if kernel.isa != "avx512":
        pytest.skip("the AVX-512 build to compare with needs an AVX-512 CPU")
    path = cpu_build.build(cpu_attention._SOURCE, tmp_path, cpu_build.AVX2_FLAGS)
    avx2 = cpu_attention.CpuAttentionKernel(ctypes.CDLL(str(path)), path)
    assert avx2.isa == "avx2" and avx2.bf16_paths == ("avx2",)
    for dtype in (torch.float32, torch.bfloat16):
        for dim, ratio, window, softcap in [(64, 4, None, None), (80, 1, 37, None),
                                            (128, 8, 100, 50.0), (256, 2, None, 30.0)]:
            q, kc, vc, slots, seqs = case(MIXED, KV_HEADS * ratio, dim, dtype=dtype)
            for on_path in paths(kernel, ("avx512f",)):
                want = on_path(q, kc, vc, slots, seqs, SCALE, window=window, softcap=softcap)
                got = avx2(q, kc, vc, slots, seqs, SCALE, window=window, softcap=softcap)
                assert torch.equal(got, want), (dtype, dim, ratio, window, softcap)
