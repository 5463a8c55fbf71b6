"""Attention logit soft-capping (a layer's `softcap` c: each scaled score s becomes
`c * tanh(s / c)` before the mask and the softmax, Gemma 2's `attn_logit_softcapping`) on
every backend: ReferenceAttention against transformers' eager Gemma 2 attention itself;
TorchAttention (with and without the lower-right bias) and the C kernel in float32 and in
bfloat16 on each path this CPU has against ReferenceAttention, with and without windows, on
prompts from scratch, extends, decode rows and mixes of them; caps that saturate the scores
(1), bend them (5) and barely touch them (50), so both halves of the kernel's tanh run. Then
the C kernel's promise with a cap (a row's bits do not depend on how its sequence was split),
`bind_layers` with a cap per layer, the CuPy decode kernel's reference, glue and launch, and
FlashInfer's plans (`logits_soft_cap`) through a stand-in; the CUDA kernel and FlashInfer
themselves where a GPU is lent.

Every slot a sequence does not own is NaN (test_attention.make_case): a backend that reads
one returns NaN and fails.
"""

from __future__ import annotations

import contextlib
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import needs_cpu_kernel, requires_cuda
from test_attention import KV_HEADS, make_case
from test_attention_window import (
    BATCHES,
    PAIR_DIMS,
    TOLERANCE,
    as_pool,
    kernels_on_paths,
    one_sequence,
    run,
    split,
)
from test_flashinfer_attention import PAGE, Refuse, StandIn, as_float, paged_case
from test_paged_attention import decode_case
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

from hicache.memory.device import DeviceKVPool
from hicache_server.models.attention import (
    AttentionBackend,
    CpuKernelAttention,
    CudaPagedAttention,
    ReferenceAttention,
    TorchAttention,
    kernel_indices,
)
from hicache_server.models.flashinfer_attention import (
    FlashInferAttention,
    PagedKV,
    flashinfer_available,
    paged_kv,
    paged_kv_reference,
)
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.models.kernels import cpu_attention, paged_attention
from hicache_server.models.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
)

# saturating (most |s| > c), bending (|s / c| mostly below the kernel's 0.625 switch) and
# barely touching the scores (std 2.4 at scale 0.3 and head_dim 64)
SOFTCAPS = (1.0, 5.0, 50.0)
WINDOWS = (None, 37, 70)  # full; cutting pages (16) and key blocks (64) in the middle
SCALE = 0.3


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> cpu_attention.CpuAttentionKernel:
    if not cpu_attention.supported():
        needs_cpu_kernel("the CPU attention kernel")
    built = cpu_attention.load(tmp_path_factory.mktemp("kernels"))
    assert built is not None, "supported() is true, so the kernel must build and load"
    return built


def capped(backend: AttentionBackend, q: torch.Tensor, batch: ForwardBatch,
           pool: DeviceKVPool, window: int | None, softcap: float | None,
           scale: float | None = SCALE) -> torch.Tensor:
    """`run` of test_attention_window with a softcap."""
    k_cache, v_cache = pool.get_kv(0)
    return backend.forward(q, k_cache[batch.out_slots], v_cache[batch.out_slots], 0, batch,
                           pool, window=window, scale=scale, softcap=softcap)


# ------------------------------------------------------------------- the reference itself


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_the_reference_is_transformers_eager_gemma2_attention(window: int | None,
                                                              softcap: float) -> None:
    """One prompt from scratch: ReferenceAttention with a cap gives what transformers'
    eager Gemma 2 attention gives (scaled, capped, masked, softmax), in float32."""
    pool, batch, q = make_case(((0, 100),), KV_HEADS * 4, torch.float32)
    got = capped(ReferenceAttention(), q, batch, pool, window, softcap)
    k_cache, v_cache = pool.get_kv(0)
    keys, queries = torch.arange(100)[None, :], torch.arange(100)[:, None]
    allowed = keys <= queries
    if window is not None:
        allowed &= keys > queries - window
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    module = SimpleNamespace(num_key_value_groups=4, training=False, head_dim=q.shape[-1])
    want, _ = eager_attention_forward(
        module, q.transpose(0, 1)[None], k_cache[batch.out_slots].transpose(0, 1)[None],
        v_cache[batch.out_slots].transpose(0, 1)[None], mask[None, None], scaling=SCALE,
        softcap=softcap)
    torch.testing.assert_close(got, want[0], rtol=TOLERANCE, atol=TOLERANCE)


def test_a_cap_changes_the_answer_as_much_as_it_bends_the_scores() -> None:
    """A cap far past every score is no cap (within float32); a cap of 1 moves every row
    that reads several keys, and not the prompt's first row, which reads one (its V,
    whatever its score)."""
    pool, batch, q = make_case(((0, 80),), KV_HEADS * 2, torch.float32)
    plain = capped(ReferenceAttention(), q, batch, pool, None, None)
    torch.testing.assert_close(capped(ReferenceAttention(), q, batch, pool, None, 1e4), plain,
                               rtol=TOLERANCE, atol=TOLERANCE)
    saturated = capped(ReferenceAttention(), q, batch, pool, None, 1.0)
    moved = (saturated - plain).abs().amax(dim=(1, 2)) > 1e-3  # [80] rows
    assert torch.equal(saturated[0], plain[0]) and moved[1:].all()


# ------------------------------------------------------------- every backend, the reference


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize("lower_right", (False, True))
def test_torch_attention_matches_the_reference(kind: str, window: int | None, softcap: float,
                                               lower_right: bool) -> None:
    for ratio, dtype in ((1, torch.float32), (4, torch.float32), (4, torch.bfloat16)):
        pool, batch, q = make_case(BATCHES[kind], KV_HEADS * ratio, dtype)
        got = capped(TorchAttention(lower_right=lower_right), q, batch, pool, window, softcap)
        want = capped(ReferenceAttention(), q, batch, pool, window, softcap)
        assert got.dtype == dtype and torch.isfinite(got).all()
        tol = TOLERANCE if dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("kind", list(BATCHES))
def test_the_kernel_in_float32_matches_the_reference(kernel, kind: str, window: int | None,
                                                     softcap: float) -> None:
    for ratio in (1, 4):
        pool, batch, q = make_case(BATCHES[kind], KV_HEADS * ratio, torch.float32)
        got = capped(CpuKernelAttention(kernel), q, batch, pool, window, softcap)
        want = capped(ReferenceAttention(), q, batch, pool, window, softcap)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize("scale", (0.05, 3.0))
def test_the_kernels_tanh_holds_over_the_whole_range(kernel, scale: float) -> None:
    """Scores from ~0 (scale 0.05, cap 50: tanh's polynomial near 0) to far past the cap
    (scale 3, cap 1: tanh at +-1), float32 against the reference."""
    pool, batch, q = make_case(BATCHES["mixed"], KV_HEADS * 2, torch.float32)
    for softcap in (1.0, 50.0):
        got = capped(CpuKernelAttention(kernel), q, batch, pool, 37, softcap, scale)
        want = capped(ReferenceAttention(), q, batch, pool, 37, softcap, scale)
        torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("kind", list(BATCHES))
def test_the_kernel_in_bfloat16_matches_the_reference(kernel, kind: str, window: int | None,
                                                      softcap: float) -> None:
    """On each bfloat16 path: within a bfloat16 step or two of the float32 reference on the
    same (bfloat16) values; a little more where P is rounded to bfloat16 for PV."""
    pool, batch, q = make_case(BATCHES[kind], KV_HEADS * 4, torch.bfloat16)
    exact = capped(ReferenceAttention(), q.float(), batch, as_pool(pool, torch.float32),
                   window, softcap)
    for on_path in kernels_on_paths(kernel, torch.bfloat16):
        got = capped(CpuKernelAttention(on_path), q, batch, pool, window, softcap)
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        atol = 4e-3 if on_path.bf16_path in PAIR_DIMS else 1e-3
        torch.testing.assert_close(got.float(), exact, rtol=2 ** -7, atol=atol)


@pytest.mark.parametrize("window", (None, 37))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16),
                         ids=("float32", "bfloat16"))
def test_a_capped_row_has_the_same_bits_however_its_sequence_is_split(
        kernel, window: int | None, dtype: torch.dtype) -> None:
    """From scratch, extending a cached prefix at any split, decoded, or beside another
    sequence: every row of a 300-token sequence gets the same bits under a cap of 5, with
    and without a window, in float32 and in bfloat16 on each path."""
    pool, slots, other, q = one_sequence(dtype, KV_HEADS * 4)
    for on_path in kernels_on_paths(kernel, dtype):
        backend = CpuKernelAttention(on_path)
        full = capped(backend, q, split(slots, 0, 300), pool, window, 5.0)
        assert torch.isfinite(full).all()
        assert not torch.equal(full, run(backend, q, split(slots, 0, 300), pool, window, SCALE))
        for prefix in (1, 16, 37, 63, 64, 65, 200, 299):
            ext = capped(backend, q[prefix:], split(slots, prefix, 300 - prefix), pool,
                         window, 5.0)
            assert torch.equal(ext, full[prefix:]), (on_path.bf16_path, prefix)
        for pos in (0, 36, 64, 150, 299):
            one = capped(backend, q[pos:pos + 1], split(slots, pos, 1), pool, window, 5.0)
            assert torch.equal(one, full[pos:pos + 1]), (on_path.bf16_path, pos)
        beside = ForwardBatch(torch.zeros(240, dtype=torch.int64),
                              torch.cat([torch.arange(40), torch.arange(100, 300)]),
                              torch.cat([other, slots[100:]]), [other, slots], [0, 100],
                              [40, 200])
        gen = torch.Generator().manual_seed(3)
        mixed_q = torch.cat([torch.randn((40, *q.shape[1:]), generator=gen).to(dtype), q[100:]])
        got = capped(backend, mixed_q, beside, pool, window, 5.0)
        assert torch.equal(got[40:], full[100:]), on_path.bf16_path


def test_bound_layers_take_each_layers_softcap(kernel) -> None:
    """`bind_layers` with a cap and a window per layer (Gemma 2's sliding and global
    layers): each bound call gives the bits of a direct call with that layer's; the raw
    kernel's reference agrees; bad caps are refused with the value."""
    pool, batch, q = make_case(BATCHES["mixed"], KV_HEADS * 4, torch.float32)
    slots, seqs = kernel_indices(batch)
    k_cache, v_cache = pool.get_kv(0)
    caches = [(k_cache, v_cache)] * 3
    windows, softcaps = [37, None, 37], [5.0, 5.0, None]
    out = torch.empty_like(q)
    bound = kernel.bind_layers(q, caches, slots, seqs, SCALE, out, 2, windows=windows,
                               softcaps=softcaps)
    for layer, (window, softcap) in enumerate(zip(windows, softcaps)):
        bound(layer)
        direct = kernel(q, k_cache, v_cache, slots, seqs, SCALE, window=window, softcap=softcap)
        assert torch.equal(out, direct), layer
        want = cpu_attention.paged_attention_reference(q, k_cache, v_cache, slots, seqs, SCALE,
                                                       window=window, softcap=softcap)
        torch.testing.assert_close(direct, want, rtol=TOLERANCE, atol=TOLERANCE)
    with pytest.raises(ValueError, match="one softcap per layer"):
        kernel.bind_layers(q, caches, slots, seqs, SCALE, out, 2, softcaps=[5.0])
    for bad in (0.0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match=r"softcap must be None \(none\) or a finite"):
            kernel(q, k_cache, v_cache, slots, seqs, SCALE, softcap=bad)


# --------------------------------------------------------------- the CuPy decode kernel


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_the_decode_reference_matches_torch_attention(window: int | None,
                                                      softcap: float) -> None:
    pool, batch, q = decode_case((1, 7, 64, 65, 200), 8, KV_HEADS, 64, torch.float32, "cpu")
    got = paged_decode_attention_reference(q, *pool.get_kv(0), *batch.slot_table(), SCALE,
                                           window=window, softcap=softcap)
    want = capped(ReferenceAttention(), q, batch, pool, window, softcap)
    torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)


def test_the_cuda_backend_hands_the_cap_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """CudaPagedAttention on the CPU with the kernel swapped for its reference: a decode
    batch's cap reaches the kernel, a prefill's goes to TorchAttention."""
    from hicache_server.models import attention

    caps: list[float | None] = []

    def reference(*args: object, softcap: float | None = None, **kwargs: object) -> torch.Tensor:
        caps.append(softcap)
        return paged_decode_attention_reference(*args, softcap=softcap, **kwargs)

    monkeypatch.setattr(attention, "paged_decode_attention", reference)
    pool, batch, q = decode_case((3, 70, 200), 8, KV_HEADS, 64, torch.float32, "cpu")
    got = capped(CudaPagedAttention(), q, batch, pool, 37, 5.0)
    torch.testing.assert_close(got, capped(ReferenceAttention(), q, batch, pool, 37, 5.0),
                               rtol=TOLERANCE, atol=TOLERANCE)
    assert caps == [5.0]
    prefill = ForwardBatch(torch.zeros(3, dtype=torch.int64), torch.arange(3),
                           batch.seq_slots[2][:3], [batch.seq_slots[2][:3]], [0], [3])
    got = capped(CudaPagedAttention(), q[:3], prefill, pool, None, 5.0)
    torch.testing.assert_close(got, capped(ReferenceAttention(), q[:3], prefill, pool, None,
                                           5.0), rtol=TOLERANCE, atol=TOLERANCE)
    assert caps == [5.0]


def test_the_launch_passes_the_cap_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's last argument is the cap as float32 (0: none); the signature's types
    are checked one for one in test_paged_attention."""
    launches: list = []
    fake_cupy = SimpleNamespace(cuda=SimpleNamespace(
        Device=lambda index: contextlib.nullcontext(),
        ExternalStream=lambda ptr, index: contextlib.nullcontext()))
    monkeypatch.setattr(paged_attention, "import_cupy", lambda: fake_cupy)
    monkeypatch.setattr(paged_attention, "raw_module", lambda source: SimpleNamespace(
        get_function=lambda name: lambda grid, block, args: launches.append(args)))
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    pool, batch, q = decode_case((3, 70), 8, KV_HEADS, 64, torch.bfloat16, "cpu")
    out = torch.empty_like(q)
    for softcap in (50.0, 0.0):
        paged_attention._launch(q, *pool.get_kv(0), *batch.slot_table(), out, 0.125, 37,
                                softcap)
    assert [a[-1] for a in launches] == [np.float32(50.0), np.float32(0.0)]
    assert all(type(a[-1]) is np.float32 for a in launches)


@requires_cuda
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("float32", "bfloat16"))
def test_the_cuda_kernel_caps_as_the_reference(window: int | None, dtype: torch.dtype) -> None:
    pytest.importorskip("cupy")
    pool, batch, q = decode_case((1, 7, 64, 65, 200), 8, KV_HEADS, 64, dtype, "cuda")
    args = (q, *pool.get_kv(0), *batch.slot_table(), SCALE)
    for softcap in SOFTCAPS:
        got = paged_decode_attention(*args, window=window, softcap=softcap)
        want = paged_decode_attention_reference(*args, window=window, softcap=softcap)
        tol = TOLERANCE if dtype == torch.float32 else 1.6e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


# ------------------------------------------------------------------------------ FlashInfer


class CappingStandIn(StandIn):
    """test_flashinfer_attention's stand-in, running its plan's `logits_soft_cap` too."""

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        p = self.planned
        window = None if p["window_left"] < 0 else p["window_left"] + 1
        table = PagedKV(p["qo_indptr"], p["kv_indptr"], p["kv_indices"],
                        p["kv_last_page_len"], p["page_size"])
        return paged_kv_reference(q, kv[0].flatten(0, 1), kv[1].flatten(0, 1), table,
                                  p["sm_scale"], window=window, softcap=p["logits_soft_cap"])


def test_flashinfer_plans_each_cap_as_its_own_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 2's layers (sliding and global, both capped at 50) beside an uncapped full
    layer: each kind planned once with `logits_soft_cap`, every layer the reference's
    answer for its window, scale and cap; nothing falls back."""
    fake = SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=CappingStandIn,
                           BatchPrefillWithPagedKVCacheWrapper=CappingStandIn)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(StandIn, "plans", [])
    pool, batch, q = paged_case(BATCHES["mixed"], KV_HEADS * 4, torch.float16)
    kinds = ((37, 0.3, 5.0), (None, 0.3, 5.0), (None, 0.3, None))
    backend = FlashInferAttention(fallback=Refuse())
    for window, scale, softcap in (*kinds, *kinds):
        got = capped(backend, q, batch, pool, window, softcap, scale)
        want = capped(ReferenceAttention(), q.float(), batch, as_float(pool), window, softcap,
                      scale)
        torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)
    planned = [(p["window_left"], p["sm_scale"], p["logits_soft_cap"]) for p in StandIn.plans]
    assert planned == [(36, 0.3, 5.0), (-1, 0.3, 5.0), (-1, 0.3, None)]


@pytest.mark.parametrize("window", WINDOWS)
def test_the_page_table_reference_caps_as_the_engines(window: int | None) -> None:
    pool, batch, q = paged_case(BATCHES["mixed"], KV_HEADS * 4, torch.float32)
    got = paged_kv_reference(q, *pool.get_kv(0), paged_kv(batch, PAGE), SCALE, window=window,
                             softcap=5.0)
    want = capped(ReferenceAttention(), q, batch, pool, window, 5.0)
    torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.skipif(not torch.cuda.is_available() or not flashinfer_available(),
                    reason="FlashInfer runs on CUDA with flashinfer-python installed")
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("kind", ("mixed", "decode"))
def test_flashinfer_caps_as_the_reference(kind: str, window: int | None) -> None:
    pool, batch, q = paged_case(BATCHES[kind], KV_HEADS * 4, torch.bfloat16, device="cuda")
    backend = FlashInferAttention(fallback=Refuse())
    for softcap in SOFTCAPS:
        got = capped(backend, q, batch, pool, window, softcap)
        want = capped(ReferenceAttention(), q, batch, pool, window, softcap)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
