"""The CPU kernels of a decoder layer's other ops (kernels/src/cpu_layer.c): RMSNorm with the
residual add, RoPE and SiLU * up against torch's ops, each row alone (its bits independent
of the rows beside it), RoPE bit for bit; and the model on them. The cached-vs-recomputed
bits test of test_cpu_attention runs on these kernels too.

Runs where the kernels are supported (AVX-512F and a C compiler: this project's machines);
skipped elsewhere, and a supported machine whose build fails fails here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hicache.memory.device import DeviceKVPool
from hicache_server.models.config import ModelArchConfig
from hicache_server.models.cpu_kernels import CPU_LAYER_OPS_ENV, CPU_LINEAR_ENV, make_layer_kernel
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.models.kernels import cpu_layer
from hicache_server.models.llama import RotaryEmbedding
from hicache_server.models.loader import EMBEDDED_TINY_LLAMA, load_model

SEED = 23
EPS = 1e-5

pytestmark = pytest.mark.skipif(not cpu_layer.supported(),
                                reason="the CPU layer kernels need AVX-512F and a C compiler")


@pytest.fixture(scope="module")
def layer(tmp_path_factory: pytest.TempPathFactory) -> cpu_layer.CpuLayerKernel:
    built = cpu_layer.load(tmp_path_factory.mktemp("kernels"))
    assert built is not None, "supported() is true, so the kernels must build and load"
    return built


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED + sum(shape))
    return torch.randn(shape, generator=gen) * scale


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
