"""Gemma's ops on the CPU layer kernel (kernels/src/cpu_layer.c) against their torch references
of the same signature (kernels/cpu_layer.py: `gemma_rms_norm_reference`,
`gemma_norm_add_norm_reference`, `gelu_tanh_mul_reference`, transformers' arithmetic), in
float32 and bfloat16: within float32 rounding (bfloat16: one bfloat16 step), every row alone
(its bits independent of its batch), the layouts the model hands them (q and k heads of a
strided q|k|v row) and the refusals of what they do not take.

Runs where the kernels are supported (AVX-512F and a C compiler: this project's machines);
skipped elsewhere, and a supported machine whose build fails fails here.
"""

from __future__ import annotations

import pytest
import torch

from hicache_server.models.kernels import cpu_layer
from hicache_server.models.kernels.cpu_layer import (
    gelu_tanh_mul_reference,
    gemma_norm_add_norm_reference,
    gemma_rms_norm_reference,
)

SEED = 31
EPS = 1e-6  # Gemma 3's rms_norm_eps
DTYPES = [torch.float32, torch.bfloat16]
F32_REL, F32_ABS = 2e-6, 1e-6  # float32 rounding of a normalised row (scale ~1)
BF16_STEP = 2 ** -7  # one bfloat16 step, relative
# GeGLU: gelu_tanh's 1 + tanh cancels for negative gates (torch's too), so a result is good
# to a few float32 ulps of |gate| * |up|, not of itself
GELU_ULPS = 8

pytestmark = pytest.mark.skipif(not cpu_layer.supported(),
                                reason="the CPU layer kernels need AVX-512F and a C compiler")


@pytest.fixture(scope="module")
def layer(tmp_path_factory: pytest.TempPathFactory) -> cpu_layer.CpuLayerKernel:
    built = cpu_layer.load(tmp_path_factory.mktemp("kernels"))
    assert built is not None, "supported() is true, so the kernels must build and load"
    return built


def randn(*shape: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED + sum(shape))
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def one_plus_w(size: int) -> torch.Tensor:
    """Gemma's float32 `1 + w` of a w in [-0.5, 0.5) (checkpoints' shapes)."""
    gen = torch.Generator().manual_seed(SEED + size)
    return 1.0 + (torch.rand(size, generator=gen) - 0.5)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within float32 rounding, or one bfloat16 step."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), rtol=BF16_STEP, atol=1e-6)
    else:
        torch.testing.assert_close(got, want, rtol=F32_REL, atol=F32_ABS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [640, 40, 1152])
def test_gemma_rms_norm(layer, dtype: torch.dtype, hidden: int) -> None:
    x, w = randn(37, hidden, scale=3.0, dtype=dtype), one_plus_w(hidden)
    got = layer.gemma_rms_norm(x, w, EPS)
    close(got, gemma_rms_norm_reference(x, w, EPS))
    for lo, hi in [(0, 1), (5, 6), (3, 30)]:  # each row alone
        assert torch.equal(layer.gemma_rms_norm(x[lo:hi], w, EPS), got[lo:hi])
    wide = torch.zeros(37, hidden + 5, dtype=dtype)
    wide[:, 2:2 + hidden] = x
    assert torch.equal(layer.gemma_rms_norm(wide[:, 2:2 + hidden], w, EPS), got)
    big = randn(300, hidden, dtype=dtype)  # past the size where the call goes parallel
    assert torch.equal(layer.gemma_rms_norm(big, w, EPS)[100:101],
                       layer.gemma_rms_norm(big[100:101], w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_per_head_of_a_qkv_row(layer, dtype: torch.dtype) -> None:
    """q's 4 heads and k's 1 of Gemma 3 270M's q|k|v row (heads of 256), each normalised
    alone, read in place from the strided view, written contiguous."""
    tokens, heads, kv_heads, dim = 9, 4, 1, 256
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim, scale=2.0, dtype=dtype)
    before = qkv.clone()
    w = one_plus_w(dim)
    for view in (qkv[:, :heads * dim].view(tokens, heads, dim),
                 qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)):
        got = layer.gemma_rms_norm(view, w, EPS)
        assert got.shape == view.shape and got.is_contiguous()
        close(got, gemma_rms_norm_reference(view, w, EPS))
        rows = layer.gemma_rms_norm(view.reshape(-1, dim), w, EPS)  # the same rows as 2-D
        assert torch.equal(got.view(-1, dim), rows)
    assert torch.equal(qkv, before)  # the input untouched
    with pytest.raises(ValueError, match="each row's heads contiguous"):
        layer.gemma_rms_norm(qkv[:, :heads * dim].view(tokens, heads, dim).transpose(0, 1),
                             w, EPS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [640, 40])
def test_gemma_norm_add_norm(layer, dtype: torch.dtype, hidden: int) -> None:
    """A branch's norm, the residual add (bit for bit the reference's) and the next norm in
    one pass."""
    x, res = randn(37, hidden, scale=3.0, dtype=dtype), randn(37, hidden + 1, dtype=dtype)
    res = res[:, 1:].contiguous()
    w, w_next = one_plus_w(hidden), one_plus_w(hidden + 1)[1:].contiguous()
    got = layer.gemma_norm_add_norm(x, w, res, w_next, EPS)
    want = gemma_norm_add_norm_reference(x, w, res, w_next, EPS)
    close(got.total, want.total)
    close(got.out, want.out)
    # the sum is the residual plus the kernel's own norm of x: one rounding, no more
    assert torch.equal(got.total, res + layer.gemma_rms_norm(x, w, EPS))
    assert torch.equal(got.out, layer.gemma_rms_norm(got.total, w_next, EPS))
    for lo, hi in [(0, 1), (5, 6), (3, 30)]:
        part = layer.gemma_norm_add_norm(x[lo:hi], w, res[lo:hi], w_next, EPS)
        assert torch.equal(part.out, got.out[lo:hi])
        assert torch.equal(part.total, got.total[lo:hi])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_norms_refuse_what_they_do_not_take(layer, dtype: torch.dtype) -> None:
    x, res, w = randn(4, 64, dtype=dtype), randn(4, 64, dtype=dtype), one_plus_w(64)
    with pytest.raises(ValueError, match="weight must be float32 \\[64\\]"):
        layer.gemma_rms_norm(x, w.to(torch.bfloat16), EPS)
    with pytest.raises(ValueError, match="next_weight must be float32 \\[64\\]"):
        layer.gemma_norm_add_norm(x, w, res, w[:32], EPS)
    with pytest.raises(ValueError, match="residual must be contiguous"):
        layer.gemma_norm_add_norm(x, w, res.t().contiguous().t(), w, EPS)
    with pytest.raises(ValueError, match="2-D float32 or bfloat16"):
        layer.gemma_rms_norm(x.half(), w, EPS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul(layer, dtype: torch.dtype) -> None:
    gate_up = randn(19, 2 * 1000, scale=4.0, dtype=dtype)
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 9.0, -9.0, 1e-30, -1e-30])
    got = layer.gelu_tanh_mul(gate_up)
    want = gelu_tanh_mul_reference(gate_up)
    assert got.dtype == dtype and torch.isfinite(got.float()).all()
    gate, up = gate_up.float().chunk(2, dim=-1)
    bound = GELU_ULPS * torch.finfo(torch.float32).eps * (gate.abs() * up.abs())
    if dtype == torch.bfloat16:  # and a step of the rounded activation, of the product
        bound = bound + BF16_STEP * want.float().abs() + 1e-6
    assert ((got.float() - want.float()).abs() <= bound).all()
    for lo, hi in [(0, 1), (7, 8), (2, 19)]:
        assert torch.equal(layer.gelu_tanh_mul(gate_up[lo:hi]), got[lo:hi])
    big = randn(40, 2 * 2048, dtype=dtype)  # past the size where the call goes parallel
    assert torch.equal(layer.gelu_tanh_mul(big)[17:18], layer.gelu_tanh_mul(big[17:18]))
    with pytest.raises(ValueError, match="contiguous \\[M, 2 I\\]"):
        layer.gelu_tanh_mul(gate_up[:, :1999])
