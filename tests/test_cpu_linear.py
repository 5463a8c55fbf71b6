"""The CPU linear kernel (kernels/src/cpu_linear.c): F.linear's result, the exact arithmetic it
promises (float32: one FMA chain per output, in input order; bfloat16: one float32 chain
over the input pairs, then one rounding), and that a row's bits depend on nothing else in
the call: not the rows beside it, their number, the row stride nor the thread count; in
bfloat16 on each path this CPU has (AVX-512F, AVX512-BF16, AMX; the AVX2 build's one). The
model on it: test_cpu_layer (either backend, the same logits) and test_cpu_attention (cached
and recomputed K/V, the same bits).

Runs where the kernel is supported (AVX-512F, or AVX2 and FMA, and a C compiler: this
project's machines); skipped elsewhere, and a supported machine whose build fails fails here.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import bf16_paths as paths

from hicache_server.models.cpu_kernels import CPU_LINEAR_ENV, make_linear_kernel
from hicache_server.models.kernels import cpu_build, cpu_linear
from hicache_server.models.linear import Linear, onednn_matches_kernel

SEED = 11
# (out_features, in_features): the embedded model's q|k|v, gate|up, down and LM head; and
# sizes off the kernel's panel (64 outputs), register tile (6 rows) and vector (16) grids
SHAPES = ((768, 512), (3072, 512), (512, 1536), (260, 512), (100, 40), (65, 17), (1, 7))
ROWS = (1, 2, 5, 6, 7, 13, 300)

pytestmark = pytest.mark.skipif(not cpu_linear.supported(),
                                reason="the CPU linear kernel needs AVX-512F or AVX2, and a C compiler")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> cpu_linear.CpuLinearKernel:
    built = cpu_linear.load(tmp_path_factory.mktemp("kernels"))
    assert built is not None, "supported() is true, so the kernel must build and load"
    return built


def weights(n: int, k: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED + n + k)
    return (torch.randn(n, k, generator=gen), torch.randn(n, generator=gen),
            torch.randn(rows, k, generator=gen))


def fma_chain(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """acc = fma(x[m][k], w[n][k], acc) for k in order from 0, then + b: in float64, where
    the product of two float32s is exact and one rounding to float32 follows the add."""
    xs, ws = x.double().numpy(), w.double().numpy()
    acc = np.zeros((x.shape[0], w.shape[0]), dtype=np.float32)
    for k in range(x.shape[1]):
        acc = (acc.astype(np.float64) + xs[:, k, None] * ws[None, :, k]).astype(np.float32)
    out = torch.from_numpy(acc)
    return out if b is None else out + b


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_the_kernel_gives_f_linear(kernel, shape: tuple[int, int], rows: int) -> None:
    n, k = shape
    w, b, x = weights(n, k, rows)
    packed = kernel.pack(w)
    for bias in (None, b):
        got = kernel(x, packed, n, bias)
        want = torch.nn.functional.linear(x, w, bias)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(k, 16) ** 0.5)


@pytest.mark.parametrize("shape", [(100, 40), (65, 17), (130, 64)])
def test_every_output_is_one_fma_chain_in_input_order(kernel, shape: tuple[int, int]) -> None:
    n, k = shape
    w, b, x = weights(n, k, 13)
    packed = kernel.pack(w)
    assert torch.equal(kernel(x, packed, n), fma_chain(x, w, None))
    assert torch.equal(kernel(x, packed, n, b), fma_chain(x, w, b))


@pytest.mark.parametrize("shape", [(768, 512), (512, 1536), (65, 17)])
def test_a_rows_bits_depend_on_nothing_else_in_the_call(kernel, shape: tuple[int, int]) -> None:
    """Any slice of the rows, one row alone, a strided view, one thread or two: the same
    bits as the whole batch's call (so decode, extend and prefill agree)."""
    n, k = shape
    w, b, x = weights(n, k, 300)
    packed = kernel.pack(w)
    whole = kernel(x, packed, n, b)
    for lo, hi in [(0, 1), (5, 6), (7, 9), (13, 300), (299, 300), (1, 200), (0, 299)]:
        assert torch.equal(kernel(x[lo:hi], packed, n, b), whole[lo:hi])
    wide = torch.zeros(300, k + 9)
    wide[:, 3:3 + k] = x
    assert torch.equal(kernel(wide[:, 3:3 + k], packed, n, b), whole)  # row stride k + 9
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernel(x, packed, n, b), whole)
    finally:
        torch.set_num_threads(threads)


def test_no_rows_and_bad_arguments(kernel) -> None:
    w, b, x = weights(70, 32, 4)
    packed = kernel.pack(w)
    assert kernel(x[:0], packed, 70).shape == (0, 70)
    with pytest.raises(ValueError, match="2-D float32"):
        kernel(x.double(), packed, 70)
    with pytest.raises(ValueError, match="contiguous rows"):
        kernel(x.t().contiguous().t(), packed, 70)
    with pytest.raises(ValueError, match="overlap"):
        kernel(x[:1].expand(4, -1), packed, 70)
    with pytest.raises(ValueError, match="panels of a \\[70, 16\\]"):
        kernel(x[:, :16], packed, 70)
    with pytest.raises(ValueError, match="panels of a \\[200, 32\\]"):
        kernel(x, packed, 200)
    with pytest.raises(ValueError, match="bias must be \\[70\\]"):
        kernel(x, packed, 70, b[:60])
    with pytest.raises(ValueError, match="2-D float32 or bfloat16 CPU"):
        kernel.pack(w.to(torch.float16))
    with pytest.raises(ValueError, match="panels of a \\[70, 32\\] torch.bfloat16"):
        kernel(x.bfloat16(), packed, 70)  # a float32 weight's panels
    with pytest.raises(ValueError, match="bias must be \\[70\\] contiguous torch.bfloat16"):
        kernel(x.bfloat16(), kernel.pack(w.bfloat16()), 70, b)


def test_linear_runs_on_the_kernel_once_packed(kernel) -> None:
    """A Linear given the kernel packs panels (and a oneDNN copy only where its bits
    match), and its rows match a Linear on oneDNN within float rounding; unpack drops both."""
    gen = torch.Generator().manual_seed(SEED)
    lins = [Linear(512, [512, 256], True, torch.float32, torch.device("cpu")) for _ in range(2)]
    w, b = torch.randn(768, 512, generator=gen), torch.randn(768, generator=gen)
    for lin in lins:
        with torch.no_grad():
            lin.weight.copy_(w)
            lin.bias.copy_(b)
    lins[0].kernel = kernel
    for lin in lins:
        lin.pack()
    assert lins[0].panels is not None
    assert (lins[0].packed is not None) == onednn_matches_kernel(kernel, 768, 512, True)
    x = torch.randn(9, 512, generator=gen)
    with torch.inference_mode():
        got = lins[0](x)
        assert torch.equal(got, kernel(x, lins[0].panels, 768, b))
        torch.testing.assert_close(got, lins[1](x), rtol=1e-5, atol=1e-4)
        assert torch.equal(lins[0](x.t().contiguous().t()), got)  # made contiguous first
    lins[0].unpack()
    assert lins[0].panels is None and lins[0].packed is None


@pytest.mark.parametrize("in_features", [512, 1536])
def test_a_linear_on_the_kernel_gives_a_row_the_same_bits_in_any_batch(
        kernel, in_features: int) -> None:
    """Chunks of ONEDNN_MIN_ROWS rows or more may take oneDNN's copy (where its bits match:
    512 inputs here, not 1,536); a row's bits are the same in a 2,048-row prefill, a 600-row
    chunk and a decode batch either way."""
    gen = torch.Generator().manual_seed(SEED)
    lin = Linear(in_features, [512, 256], True, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        lin.weight.copy_(torch.randn(768, in_features, generator=gen))
        lin.bias.copy_(torch.randn(768, generator=gen))
    lin.kernel = kernel
    lin.pack()
    assert (lin.packed is not None) == onednn_matches_kernel(kernel, 768, in_features, True)
    x = torch.randn(2048, in_features, generator=gen)
    with torch.inference_mode():
        whole = lin(x)
        for lo, hi in [(0, 1), (3, 11), (100, 700), (1500, 2048), (7, 519)]:
            assert torch.equal(lin(x[lo:hi]), whole[lo:hi])


def test_the_kernel_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(make_linear_kernel("cpu", torch.float32, tmp_path),
                      cpu_linear.CpuLinearKernel)
    assert make_linear_kernel("cpu", torch.float32, None) is None  # no kernel dir
    assert isinstance(make_linear_kernel("cpu", torch.bfloat16, tmp_path),
                      cpu_linear.CpuLinearKernel)
    assert make_linear_kernel("cpu", torch.float16, tmp_path) is None  # oneDNN's
    assert make_linear_kernel("cuda", torch.float32, tmp_path) is None  # cuBLAS
    monkeypatch.setenv(CPU_LINEAR_ENV, "onednn")
    assert make_linear_kernel("cpu", torch.float32, tmp_path) is None
    monkeypatch.setenv(CPU_LINEAR_ENV, "mkl")
    with pytest.raises(ValueError, match="kernel, onednn"):
        make_linear_kernel("cpu", torch.float32, tmp_path)


def test_a_failed_build_falls_back_to_none(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    assert cpu_linear.load(tmp_path / "failing") is None


# ---------------------------------------------------------------------------- bfloat16


def bf16_weights(n: int, k: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(t.to(torch.bfloat16) for t in weights(n, k, rows))


def pair_chain(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The bfloat16 kernel's promise in float64 emulation: from acc = 0 in float32, over the
    input pairs in order, acc = (acc + x[2q+1] w[2q+1]) + x[2q] w[2q], each product exact
    and each add rounded to float32; then + b in float32; then one rounding to bfloat16."""
    xs, ws = x.double().numpy(), w.double().numpy()
    acc = np.zeros((x.shape[0], w.shape[0]), dtype=np.float32)
    for q in range(0, x.shape[1], 2):
        for k in (q + 1, q):
            if k < x.shape[1]:
                acc = (acc.astype(np.float64) + xs[:, k, None] * ws[None, :, k]).astype(
                    np.float32)
    out = torch.from_numpy(acc)
    return (out if b is None else out + b.float()).to(torch.bfloat16)


# the pair chain exactly (the AVX2 build's one path too); AMX rounds its own way
EXACT_PATHS = ("avx512f", "avx512bf16", "avx2")
ALL_PATHS = (*EXACT_PATHS, "amx")


@pytest.mark.parametrize("shape", [(768, 512), (512, 1536), (260, 512), (65, 17), (1, 7)])
@pytest.mark.parametrize("rows", [1, 5, 17, 300])
def test_bfloat16_gives_f_linear(kernel, shape: tuple[int, int], rows: int) -> None:
    """Within one bfloat16 rounding of F.linear (float32 sums, then rounded) on every path."""
    for bf16_path in paths(kernel, ALL_PATHS):
        f_linear_within_rounding(bf16_path, shape, rows)


def f_linear_within_rounding(bf16_path, shape: tuple[int, int], rows: int) -> None:
    n, k = shape
    w, b, x = bf16_weights(n, k, rows)
    packed = bf16_path.pack(w)
    assert packed.dtype == torch.bfloat16
    for bias in (None, b):
        got = bf16_path(x, packed, n, bias)
        assert got.dtype == torch.bfloat16
        want = torch.nn.functional.linear(x.float(), w.float(),
                                          None if bias is None else bias.float())
        torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-3 * k ** 0.5)


@pytest.mark.parametrize("shape", [(100, 40), (65, 17), (130, 64), (64, 1)])
def test_bfloat16_is_the_pair_chain(kernel, shape: tuple[int, int]) -> None:
    n, k = shape
    w, b, x = bf16_weights(n, k, 13)
    for bf16_path in paths(kernel, EXACT_PATHS):
        packed = bf16_path.pack(w)
        assert torch.equal(bf16_path(x, packed, n), pair_chain(x, w, None))
        assert torch.equal(bf16_path(x, packed, n, b), pair_chain(x, w, b))


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (65, 17)])
def test_a_bfloat16_rows_bits_depend_on_nothing_else_in_the_call(
        kernel, shape: tuple[int, int]) -> None:
    """As in float32: any slice of the rows, one row alone, a strided view, one thread or
    two give the whole batch's bits, on every path (AMX's 16-row tiles included)."""
    for bf16_path in paths(kernel, ALL_PATHS):
        rows_alone(bf16_path, shape)


def rows_alone(bf16_path, shape: tuple[int, int]) -> None:
    n, k = shape
    w, b, x = bf16_weights(n, k, 300)
    packed = bf16_path.pack(w)
    whole = bf16_path(x, packed, n, b)
    for lo, hi in [(0, 1), (5, 6), (7, 9), (13, 300), (299, 300), (1, 200), (0, 299), (3, 19)]:
        assert torch.equal(bf16_path(x[lo:hi], packed, n, b), whole[lo:hi])
    wide = torch.zeros(300, k + 9, dtype=torch.bfloat16)
    wide[:, 3:3 + k] = x
    assert torch.equal(bf16_path(wide[:, 3:3 + k], packed, n, b), whole)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(bf16_path(x, packed, n, b), whole)
    finally:
        torch.set_num_threads(threads)


def test_the_bfloat16_paths_agree(kernel) -> None:
    """vdpbf16ps and its AVX-512F emulation: the same bits; AMX within float32 rounding of
    them, so within one bfloat16 step."""
    w, b, x = bf16_weights(512, 1536, 40)
    packed = kernel.pack(w)
    default, got = kernel.bf16_path, {}
    try:
        for path in kernel.bf16_paths:
            kernel.bf16_path = path
            got[path] = kernel(x, packed, 512, b)
    finally:
        kernel.bf16_path = default
    assert kernel.bf16_path == kernel.bf16_paths[-1]  # the fastest this CPU has
    if "avx512bf16" in got:
        assert torch.equal(got["avx512bf16"], got["avx512f"])
    if "amx" in got:
        torch.testing.assert_close(got["amx"].float(), got["avx512f"].float(),
                                   rtol=2 ** -7, atol=1e-2)


def test_a_bfloat16_linear_runs_on_the_kernel(kernel) -> None:
    """A bfloat16 Linear given the kernel keeps only the kernel's panels (no oneDNN copy),
    and a row's bits are the same in a 2,048-row prefill and any smaller batch."""
    gen = torch.Generator().manual_seed(SEED)
    lin = Linear(576, [576, 192, 192], True, torch.bfloat16, torch.device("cpu"))
    with torch.no_grad():
        lin.weight.copy_(torch.randn(960, 576, generator=gen))
        lin.bias.copy_(torch.randn(960, generator=gen))
    lin.kernel = kernel
    lin.pack()
    assert lin.panels is not None and lin.packed is None
    x = torch.randn(2048, 576, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        whole = lin(x)
        assert torch.equal(whole, kernel(x, lin.panels, 960, lin.bias))
        for lo, hi in [(0, 1), (3, 11), (100, 700), (1500, 2048), (7, 519)]:
            assert torch.equal(lin(x[lo:hi]), whole[lo:hi])


def test_the_avx2_build_gives_the_avx512_builds_bits(kernel, tmp_path: Path) -> None:
    """The AVX2 build (cpu_linear_avx2.h), which also runs on an AVX-512 CPU: every output's
    bits equal those of the build this CPU loads by default, float32 and bfloat16 on its
    exact paths, every row count of a register tile and over."""
    path = cpu_build.build(cpu_linear._SOURCE, tmp_path, cpu_build.AVX2_FLAGS)
    avx2 = cpu_linear.CpuLinearKernel(ctypes.CDLL(str(path)), path)
    assert avx2.isa == "avx2" and avx2.bf16_paths == ("avx2",)
    for dtype in (torch.float32, torch.bfloat16):
        for n, k in [(130, 64), (65, 17), (960, 576)]:
            w, b, x = (t.to(dtype) for t in weights(n, k, 300))
            packed = kernel.pack(w)
            assert torch.equal(avx2.pack(w), packed)
            for rows in (1, 2, 3, 5, 6, 7, 300):
                for on_path in paths(kernel, EXACT_PATHS) if dtype == torch.bfloat16 else [kernel]:
                    assert torch.equal(avx2(x[:rows], packed, n, b), on_path(x[:rows], packed, n, b))
