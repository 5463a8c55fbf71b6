"""The CPU kernels of a decoder layer's other ops (kernels/src/cpu_layer.c): RMSNorm with the
residual add, RoPE and SiLU * up against torch's ops, each row alone (its bits independent
of the rows beside it), RoPE bit for bit; and the model on them. The cached-vs-recomputed
bits test of test_cpu_attention runs on these kernels too.

Runs where the kernels are supported (AVX-512F or AVX2, and a C compiler: this project's
machines); skipped elsewhere, and a supported machine whose build fails fails here.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import needs_cpu_kernel

from hicache.memory.device import DeviceKVPool
from hicache_server.models.config import ModelArchConfig
from hicache_server.models.cpu_kernels import CPU_LAYER_OPS_ENV, CPU_LINEAR_ENV, make_layer_kernel
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.models.kernels import cpu_build, cpu_layer
from hicache_server.models.kernels.cpu_layer import (
    gelu_tanh_mul_reference,
    gemma_norm_add_norm_reference,
    gemma_rms_norm_reference,
)
from hicache_server.models.llama import RotaryEmbedding
from hicache_server.models.loader import EMBEDDED_TINY_LLAMA, load_model

SEED = 23
EPS = 1e-5



@pytest.fixture(autouse=True, scope="module")
def _kernels_supported() -> None:
    """Every test here needs the kernels: skipped on a CPU without AVX-512 or AVX2; without a C
    compiler a failure under CI (`needs_cpu_kernel`)."""
    if not cpu_layer.supported():
        needs_cpu_kernel("the CPU layer kernels")


@pytest.fixture(scope="module")
def layer(tmp_path_factory: pytest.TempPathFactory) -> cpu_layer.CpuLayerKernel:
    built = cpu_layer.load(tmp_path_factory.mktemp("kernels"))
    assert built is not None, "supported() is true, so the kernels must build and load"
    return built


def randn(*shape: int, scale: float = 1.0,
          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED + sum(shape))
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("hidden", [512, 40, 2048])
def test_rms_norm_and_the_residual_add(layer, hidden: int) -> None:
    x, res = randn(37, hidden, scale=3.0), randn(37, hidden + 1)[:, 1:].contiguous()
    w = randn(hidden, scale=0.1) + 1
    want = F.rms_norm(x, (hidden,), w, EPS)
    got = layer.rms_norm(x, w, EPS)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    out, total = layer.rms_norm(x, w, EPS, res)
    assert torch.equal(total, res + x)  # the add is exact
    torch.testing.assert_close(out, F.rms_norm(res + x, (hidden,), w, EPS), rtol=2e-6,
                               atol=1e-6)
    for lo, hi in [(0, 1), (5, 6), (3, 30)]:  # each row alone
        assert torch.equal(layer.rms_norm(x[lo:hi], w, EPS), got[lo:hi])
        assert torch.equal(layer.rms_norm(x[lo:hi], w, EPS, res[lo:hi])[0], out[lo:hi])
    wide = torch.zeros(37, hidden + 5)
    wide[:, 2:2 + hidden] = x
    assert torch.equal(layer.rms_norm(wide[:, 2:2 + hidden], w, EPS), got)  # strided rows
    big = randn(300, hidden)  # past the size where the call goes parallel
    assert torch.equal(layer.rms_norm(big, w, EPS)[100:101], layer.rms_norm(big[100:101], w, EPS))


def test_rope_is_torchs_arithmetic_bit_for_bit(layer) -> None:
    """In place on q|k of a q|k|v row (the model's strided view), every position: the very
    bits of the torch path (RotaryEmbedding without the kernel)."""
    cfg = ModelArchConfig(architecture="LlamaForCausalLM", hidden_size=512, intermediate_size=1024, num_hidden_layers=1,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                          vocab_size=300, max_position_embeddings=4096)
    rope = RotaryEmbedding(cfg, torch.device("cpu"))
    positions = torch.tensor([0, 1, 7, 4095, 1000, 3, 3, 2048])
    batch = ForwardBatch(torch.zeros(8, dtype=torch.int64), positions, torch.arange(8),
                         [torch.arange(8)], [0], [8])
    qkv = randn(8, 768, scale=5.0)
    view = qkv[:, :640].view(8, 10, 64)
    want = rope(batch, view.clone())
    v_before = qkv[:, 640:].clone()
    got = layer.rope_(view, positions, rope.cos, rope.sin)
    assert got.data_ptr() == qkv.data_ptr() and torch.equal(got, want)
    assert torch.equal(qkv[:, 640:], v_before)  # v untouched
    with pytest.raises(ValueError, match="positions must lie in \\[0, 4096\\)"):
        layer.rope_(view, torch.tensor([0, 1, 2, 3, 4, 5, 6, 4096]), rope.cos, rope.sin)
    with pytest.raises(ValueError, match="each row's heads contiguous"):
        layer.rope_(view.transpose(0, 1), positions, rope.cos, rope.sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rope_is_transformers_arithmetic_bit_for_bit(layer, dtype: torch.dtype) -> None:
    """Partial rotary (Phi-4-mini's, tables of rotary_dim // 2 columns): the first 48 values
    of each 64-value head rotated with rotate-half pairs over those 48, the other 16 kept:
    transformers' Phi-3 `apply_rotary_pos_emb` bit for bit, the tables scaled as longrope's
    attention factor scales them, in place on q|k of a strided q|k|v row."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    rotary_dim, factor = 48, 1.19
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(torch.arange(4096).float(), inv_freq)  # [positions, rotary_dim // 2]
    cos, sin = (freqs.cos() * factor).to(dtype), (freqs.sin() * factor).to(dtype)
    positions = torch.tensor([0, 1, 7, 4095, 1000, 3, 3, 2048])
    qkv = randn(8, 12 * 64, scale=5.0).to(dtype)
    view = qkv[:, :10 * 64].view(8, 10, 64)
    doubled = [torch.cat([t[positions], t[positions]], dim=-1)[None] for t in (cos, sin)]
    heads_first = view.transpose(0, 1)[None]  # transformers' [batch, heads, T, head_dim]
    want = apply_rotary_pos_emb(heads_first, heads_first, *doubled)[0][0].transpose(0, 1)
    v_before = qkv[:, 10 * 64:].clone()
    passed = view[:, :, rotary_dim:].clone()
    got = layer.rope_(view, positions, cos, sin)
    assert got.data_ptr() == qkv.data_ptr() and torch.equal(got, want)
    assert torch.equal(got[:, :, rotary_dim:], passed)  # the rest of each head untouched
    assert torch.equal(qkv[:, 10 * 64:], v_before)
    with pytest.raises(ValueError, match="rotary_dim // 2 <= 32"):
        layer.rope_(view, positions, torch.zeros(4096, 33, dtype=dtype),
                    torch.zeros(4096, 33, dtype=dtype))


def test_silu_mul(layer) -> None:
    gate_up = randn(19, 2 * 1000, scale=4.0)
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.0, -88.0, 1e-30, -1e-30])
    gate, up = gate_up.chunk(2, dim=-1)
    got = layer.silu_mul(gate_up)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-6, atol=1e-7)
    assert torch.isfinite(got).all()
    for lo, hi in [(0, 1), (7, 8), (2, 19)]:
        assert torch.equal(layer.silu_mul(gate_up[lo:hi]), got[lo:hi])
    with pytest.raises(ValueError, match="contiguous \\[M, 2 I\\]"):
        layer.silu_mul(gate_up[:, :1999])


def test_the_layer_ops_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(make_layer_kernel("cpu", torch.float32, tmp_path),
                      cpu_layer.CpuLayerKernel)
    assert make_layer_kernel("cpu", torch.float32, None) is None
    assert isinstance(make_layer_kernel("cpu", torch.bfloat16, tmp_path),
                      cpu_layer.CpuLayerKernel)
    assert make_layer_kernel("cpu", torch.float16, tmp_path) is None
    assert make_layer_kernel("cuda", torch.float32, tmp_path) is None
    monkeypatch.setenv(CPU_LAYER_OPS_ENV, "torch")
    assert make_layer_kernel("cpu", torch.float32, tmp_path) is None
    monkeypatch.setenv(CPU_LAYER_OPS_ENV, "fused")
    with pytest.raises(ValueError, match="kernel, torch"):
        make_layer_kernel("cpu", torch.float32, tmp_path)
    monkeypatch.setenv("CC", "false")
    monkeypatch.delenv(CPU_LAYER_OPS_ENV)
    assert cpu_layer.load(tmp_path / "failing") is None  # a failed build: torch's ops


# ---------------------------------------------------------------------------- bfloat16
# Each op against transformers' bfloat16 arithmetic in torch (float32 math, rounded where a
# bfloat16 module stores): RoPE and the residual add bit for bit, RMSNorm and SiLU within
# one bfloat16 step (their float32 insides round differently), every row alone.


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16)


def hf_rms_norm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm on bfloat16."""
    x = h.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return w * x.to(torch.bfloat16)


def within_one_step(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("hidden", [576, 40, 2048])
def test_bfloat16_rms_norm_and_the_residual_add(layer, hidden: int) -> None:
    x, res = bf16(randn(37, hidden, scale=3.0)), bf16(randn(37, hidden))
    w = bf16(randn(hidden, scale=0.1) + 1)
    got = layer.rms_norm(x, w, EPS)
    within_one_step(got, hf_rms_norm(x, w))
    out, total = layer.rms_norm(x, w, EPS, res)
    assert torch.equal(total, res + x)  # torch's bfloat16 add, bit for bit
    within_one_step(out, hf_rms_norm(res + x, w))
    for lo, hi in [(0, 1), (5, 6), (3, 30)]:
        assert torch.equal(layer.rms_norm(x[lo:hi], w, EPS), got[lo:hi])
        assert torch.equal(layer.rms_norm(x[lo:hi], w, EPS, res[lo:hi])[0], out[lo:hi])
    big = bf16(randn(300, hidden))
    assert torch.equal(layer.rms_norm(big, w, EPS)[100:101], layer.rms_norm(big[100:101], w, EPS))
    with pytest.raises(ValueError, match="weight must be"):
        layer.rms_norm(x, w.float(), EPS)
    with pytest.raises(ValueError, match="residual must be contiguous torch.bfloat16"):
        layer.rms_norm(x, w, EPS, res.float())


def test_bfloat16_rope_is_torchs_arithmetic_bit_for_bit(layer) -> None:
    """The torch path of a bfloat16 model (cos and sin cast to bfloat16, each product and
    sum rounded) bit for bit, in place on q|k of a strided q|k|v row."""
    cfg = ModelArchConfig(architecture="LlamaForCausalLM", hidden_size=576,
                          intermediate_size=1536, num_hidden_layers=1, num_attention_heads=9,
                          num_key_value_heads=3, head_dim=64, vocab_size=300,
                          max_position_embeddings=8192)
    rope = RotaryEmbedding(cfg, torch.device("cpu"))
    positions = torch.tensor([0, 1, 7, 8191, 1000, 3, 3, 2048])
    batch = ForwardBatch(torch.zeros(8, dtype=torch.int64), positions, torch.arange(8),
                         [torch.arange(8)], [0], [8])
    qkv = bf16(randn(8, 960, scale=5.0))
    view = qkv[:, :768].view(8, 12, 64)
    want = rope(batch, view.clone())  # no kernel: torch's ops in bfloat16
    got = layer.rope_(view, positions, rope.cos_bf16, rope.sin_bf16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    with pytest.raises(ValueError, match="cos must be contiguous torch.bfloat16"):
        layer.rope_(view, positions, rope.cos, rope.sin)


def test_bfloat16_silu_mul(layer) -> None:
    gate_up = bf16(randn(19, 2 * 1536, scale=4.0))
    gate_up[0, :6] = bf16(torch.tensor([0.0, -0.0, 100.0, -100.0, 88.0, -88.0]))
    gate, up = gate_up.chunk(2, dim=-1)
    got = layer.silu_mul(gate_up)
    within_one_step(got, F.silu(gate) * up)  # transformers' act_fn(gate) * up in bfloat16
    assert torch.isfinite(got.float()).all()
    for lo, hi in [(0, 1), (7, 8), (2, 19)]:
        assert torch.equal(layer.silu_mul(gate_up[lo:hi]), got[lo:hi])


@pytest.mark.parametrize(("env", "off", "reads", "names"), [
    (CPU_LAYER_OPS_ENV, "torch", "layer_ops", ("CpuLayerKernel", "torch")),
    (CPU_LINEAR_ENV, "onednn", "linear_backend", ("CpuLinearKernel", "oneDNN")),
])
def test_the_embedded_model_on_either_backend(monkeypatch, tmp_path: Path, env: str, off: str,
                                              reads: str, names: tuple[str, str]) -> None:
    """The embedded model runs its norms, RoPE and SiLU (and its Linears) in C by default,
    on torch's ops (oneDNN) when the environment says so; the logits over a prompt agree
    within float rounding, and the model names what it runs on."""
    monkeypatch.setenv("HICACHE_HOME", str(tmp_path))
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(SEED))
    slots = torch.arange(16, 56)
    batch = ForwardBatch(ids, torch.arange(40), slots, [slots], [0], [40])
    logits = []
    for choice, name in zip(("kernel", off), names):
        monkeypatch.setenv(env, choice)
        lm = load_model(EMBEDDED_TINY_LLAMA, "float32", "cpu")
        c = lm.config
        pool = DeviceKVPool(4, 16, c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                            torch.float32, "cpu")
        logits.append(lm.model.forward_all_logits(batch, pool))
        assert getattr(lm.model, reads) == name
    assert (logits[0] - logits[1]).abs().max() <= 1e-4 * logits[1].abs().max()


# ---------------------------------------------------------------------------- Gemma's ops
# Gemma 2 and 3's norms and GeGLU against their torch references of the same signature
# (kernels/cpu_layer.py: transformers' arithmetic), in both dtypes: within float32 rounding
# (bfloat16: one bfloat16 step), every row alone, the layouts the model hands them (q and k
# heads of a strided q|k|v row) and the refusals of what they do not take.

GEMMA_EPS = 1e-6  # Gemma 3's rms_norm_eps
BOTH_DTYPES = [torch.float32, torch.bfloat16]
F32_REL, F32_ABS = 2e-6, 1e-6  # float32 rounding of a normalised row (scale ~1)
BF16_STEP = 2 ** -7  # one bfloat16 step, relative
# GeGLU: gelu_tanh's 1 + tanh cancels for negative gates (torch's too), so a result is good
# to a few float32 ulps of |gate| * |up|, not of itself
GELU_ULPS = 8


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


@pytest.mark.parametrize("dtype", BOTH_DTYPES)
@pytest.mark.parametrize("hidden", [640, 40, 1152])
def test_gemma_rms_norm(layer, dtype: torch.dtype, hidden: int) -> None:
    x, w = randn(37, hidden, scale=3.0, dtype=dtype), one_plus_w(hidden)
    got = layer.gemma_rms_norm(x, w, GEMMA_EPS)
    close(got, gemma_rms_norm_reference(x, w, GEMMA_EPS))
    for lo, hi in [(0, 1), (5, 6), (3, 30)]:  # each row alone
        assert torch.equal(layer.gemma_rms_norm(x[lo:hi], w, GEMMA_EPS), got[lo:hi])
    wide = torch.zeros(37, hidden + 5, dtype=dtype)
    wide[:, 2:2 + hidden] = x
    assert torch.equal(layer.gemma_rms_norm(wide[:, 2:2 + hidden], w, GEMMA_EPS), got)
    big = randn(300, hidden, dtype=dtype)  # past the size where the call goes parallel
    assert torch.equal(layer.gemma_rms_norm(big, w, GEMMA_EPS)[100:101],
                       layer.gemma_rms_norm(big[100:101], w, GEMMA_EPS))


@pytest.mark.parametrize("dtype", BOTH_DTYPES)
def test_gemma_rms_norm_per_head_of_a_qkv_row(layer, dtype: torch.dtype) -> None:
    """q's 4 heads and k's 1 of Gemma 3 270M's q|k|v row (heads of 256), each normalised
    alone, read in place from the strided view, written contiguous."""
    tokens, heads, kv_heads, dim = 9, 4, 1, 256
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim, scale=2.0, dtype=dtype)
    before = qkv.clone()
    w = one_plus_w(dim)
    for view in (qkv[:, :heads * dim].view(tokens, heads, dim),
                 qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)):
        got = layer.gemma_rms_norm(view, w, GEMMA_EPS)
        assert got.shape == view.shape and got.is_contiguous()
        close(got, gemma_rms_norm_reference(view, w, GEMMA_EPS))
        rows = layer.gemma_rms_norm(view.reshape(-1, dim), w, GEMMA_EPS)  # the same rows as 2-D
        assert torch.equal(got.view(-1, dim), rows)
    assert torch.equal(qkv, before)  # the input untouched
    with pytest.raises(ValueError, match="each row's heads contiguous"):
        layer.gemma_rms_norm(qkv[:, :heads * dim].view(tokens, heads, dim).transpose(0, 1),
                             w, GEMMA_EPS)


@pytest.mark.parametrize("dtype", BOTH_DTYPES)
@pytest.mark.parametrize("hidden", [640, 40])
def test_gemma_norm_add_norm(layer, dtype: torch.dtype, hidden: int) -> None:
    """A branch's norm, the residual add (bit for bit the reference's) and the next norm in
    one pass."""
    x, res = randn(37, hidden, scale=3.0, dtype=dtype), randn(37, hidden + 1, dtype=dtype)
    res = res[:, 1:].contiguous()
    w, w_next = one_plus_w(hidden), one_plus_w(hidden + 1)[1:].contiguous()
    got = layer.gemma_norm_add_norm(x, w, res, w_next, GEMMA_EPS)
    want = gemma_norm_add_norm_reference(x, w, res, w_next, GEMMA_EPS)
    close(got.total, want.total)
    close(got.out, want.out)
    # the sum is the residual plus the kernel's own norm of x: one rounding, no more
    assert torch.equal(got.total, res + layer.gemma_rms_norm(x, w, GEMMA_EPS))
    assert torch.equal(got.out, layer.gemma_rms_norm(got.total, w_next, GEMMA_EPS))
    for lo, hi in [(0, 1), (5, 6), (3, 30)]:
        part = layer.gemma_norm_add_norm(x[lo:hi], w, res[lo:hi], w_next, GEMMA_EPS)
        assert torch.equal(part.out, got.out[lo:hi])
        assert torch.equal(part.total, got.total[lo:hi])


@pytest.mark.parametrize("dtype", BOTH_DTYPES)
def test_gemma_norms_refuse_what_they_do_not_take(layer, dtype: torch.dtype) -> None:
    x, res, w = randn(4, 64, dtype=dtype), randn(4, 64, dtype=dtype), one_plus_w(64)
    with pytest.raises(ValueError, match="weight must be float32 \\[64\\]"):
        layer.gemma_rms_norm(x, w.to(torch.bfloat16), GEMMA_EPS)
    with pytest.raises(ValueError, match="next_weight must be float32 \\[64\\]"):
        layer.gemma_norm_add_norm(x, w, res, w[:32], GEMMA_EPS)
    with pytest.raises(ValueError, match="residual must be contiguous"):
        layer.gemma_norm_add_norm(x, w, res.t().contiguous().t(), w, GEMMA_EPS)
    with pytest.raises(ValueError, match="2-D float32 or bfloat16"):
        layer.gemma_rms_norm(x.half(), w, GEMMA_EPS)


@pytest.mark.parametrize("dtype", BOTH_DTYPES)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_avx2_build_gives_the_avx512_builds_bits(layer, dtype: torch.dtype,
                                                    tmp_path: Path) -> None:
    """The AVX2 build (cpu_v16.h's vectors as two halves), which also runs on an AVX-512
    CPU: every op's bits equal the AVX-512 build's, rows whose width ends in a partial
    vector (masked lanes) included."""
    if cpu_build.built_isa(layer.path) != "avx512":
        pytest.skip("the AVX-512 build to compare with needs an AVX-512 CPU")
    path = cpu_build.build(cpu_layer._SOURCE, tmp_path, cpu_build.AVX2_FLAGS)
    avx2 = cpu_layer.CpuLayerKernel(ctypes.CDLL(str(path)), path)
    for hidden in (40, 640, 1000):
        x, res = randn(9, hidden, scale=3.0, dtype=dtype), randn(9, hidden, dtype=dtype)
        w = randn(hidden, dtype=dtype)
        for a, b in zip(layer.rms_norm(x, w, 1e-6, res), avx2.rms_norm(x, w, 1e-6, res)):
            assert torch.equal(a, b)
        w1, w2 = one_plus_w(hidden), one_plus_w(hidden + 3)[3:].contiguous()
        assert torch.equal(layer.gemma_rms_norm(x, w1, 1e-6), avx2.gemma_rms_norm(x, w1, 1e-6))
        for a, b in zip(layer.gemma_norm_add_norm(x, w1, res, w2, 1e-6),
                        avx2.gemma_norm_add_norm(x, w1, res, w2, 1e-6)):
            assert torch.equal(a, b)
        gate_up = randn(9, 2 * hidden, scale=4.0, dtype=dtype)
        assert torch.equal(layer.silu_mul(gate_up), avx2.silu_mul(gate_up))
        assert torch.equal(layer.gelu_tanh_mul(gate_up), avx2.gelu_tanh_mul(gate_up))
    # partial rotary: 40 of 80 dims, 20 pairs (a vector and 4 lanes)
    angles = torch.arange(512.0)[:, None] * 10000.0 ** (-torch.arange(20.0) / 20)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    qk, positions = randn(7, 5, 80, dtype=dtype), torch.tensor([0, 3, 17, 100, 200, 511, 2])
    a, b = qk.clone(), qk.clone()
    layer.rope_(a, positions, cos, sin)
    avx2.rope_(b, positions, cos, sin)
    assert torch.equal(a, b) and not torch.equal(a, qk)
