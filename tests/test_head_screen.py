"""The LM head's greedy screen (models/head_screen.py, kernels/src/cpu_head.c): a screened
row's argmax is the whole head's, first index on ties, in float32 and bfloat16; its
candidates' logits are the whole head's bits and every other output is -inf; rows built to
tie (equal outputs, outputs one float32 step apart, logits that round to one bfloat16) and
non-finite rows; every output's screened logit within its bound of the exact one, rows with
outliers included; and served: a greedy model gives the same tokens with the screen on (each
path) and off, a request that asks for logprobs gets the whole row.

Runs where the kernels are supported (AVX-512F, or AVX2 and FMA, and a C compiler); each
screen test runs on both paths (fma and vnni; vnni's sums by vpdpbusd where the CPU has
AVX512-VNNI, by plain integer C elsewhere)."""

from __future__ import annotations

import math

import pytest
import torch

from hicache_server.models import head_screen
from hicache_server.models.head_screen import HEAD_SCREEN_ENV, MAX_PANEL_SHARE, HeadScreen
from hicache_server.models.kernels import cpu_head, cpu_linear

pytestmark = pytest.mark.skipif(not cpu_head.supported(),
                                reason="the head screen needs AVX-512F or AVX2, and a C compiler")

SEED = 5
DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[cpu_head.CpuHeadKernel, cpu_linear.CpuLinearKernel]:
    folder = tmp_path_factory.mktemp("kernels")
    head, linear = cpu_head.load(folder), cpu_linear.load(folder)
    assert head is not None and linear is not None, "supported, so both must build"
    return head, linear


@pytest.fixture(params=cpu_head.PATHS)
def path(request: pytest.FixtureRequest) -> str:
    """Each path; vnni's sums come from vpdpbusd on AVX512-VNNI CPUs, from plain integer C
    elsewhere (the same exact sums)."""
    return request.param


def screen_of(kernels, w: torch.Tensor, path: str | None = "fma"
              ) -> tuple[HeadScreen, torch.Tensor]:
    head, linear = kernels
    panels = linear.pack(w)
    return HeadScreen.build(w, head, linear, panels, path), panels


def check_row(kernels, screen: HeadScreen, panels: torch.Tensor, x: torch.Tensor) -> None:
    """The screen's rows of x against the whole head's: the same argmax; exact bits where
    not -inf; the argmax's every tie among the exact outputs."""
    whole = kernels[1](x, panels, screen.vocab).float()
    got = screen.logits(x)
    assert got is not None
    assert torch.equal(got.argmax(dim=1), whole.argmax(dim=1))
    kept = got != -math.inf
    assert torch.equal(got[kept], whole[kept])
    top = whole.max(dim=1, keepdim=True).values
    assert bool(kept[whole == top].all())  # every output equal to the largest is exact


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(20000, 96), (16384, 64), (8257, 17)])
def test_a_screened_row_has_the_whole_heads_argmax(kernels, path, dtype, shape) -> None:
    vocab, k = shape
    gen = torch.Generator().manual_seed(SEED + vocab)
    w = (torch.randn(vocab, k, generator=gen) * 0.05).to(dtype)
    screen, panels = screen_of(kernels, w, path)
    for rows in (1, 3, 8, 13):
        x = (torch.randn(rows, k, generator=gen) * 4).to(dtype)
        # half the rows aimed at an output, as a trained model's are, half random
        x[: rows // 2] = (w[torch.randint(0, vocab, (rows // 2,), generator=gen)].float()
                          * 40).to(dtype)
        check_row(kernels, screen, panels, x)
    assert screen.screened_rows == 25


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_go_to_the_first_output_as_in_the_whole_head(kernels, path, dtype) -> None:
    """Outputs equal to the winner (copies of its weights), a float32 step below it, and a
    bfloat16 head whose logits round to one value: the argmax is the whole head's."""
    vocab, k = 12000, 64
    gen = torch.Generator().manual_seed(SEED)
    w = (torch.randn(vocab, k, generator=gen) * 0.05).to(dtype)
    w[2000] = w[100]
    w[11999] = w[100]
    w[50] = w[100]
    w[1500] = (w[100].float() * (1 - 2.0 ** -20)).to(dtype)  # just below in float32
    w[10] = (w[100].float() * (1 - 2.0 ** -9)).to(dtype)    # rounds with it in bfloat16
    screen, panels = screen_of(kernels, w, path)
    x = (w[100].float() * 30).to(dtype).repeat(4, 1)
    x[1] *= -1
    x[2] += (torch.randn(k, generator=gen) * 0.01).to(dtype)
    check_row(kernels, screen, panels, x)
    whole = kernels[1](x[:1], panels, vocab).float()
    assert int(whole.argmax()) in (10, 50)  # the first of the tied, in either dtype


def test_a_non_finite_row_and_a_wide_screen_take_the_whole_head(kernels, path) -> None:
    gen = torch.Generator().manual_seed(SEED)
    w = torch.randn(1024, 32, generator=gen)
    screen, _ = screen_of(kernels, w, path)
    x = torch.randn(2, 32, generator=gen)
    x[1, 3] = math.nan
    assert screen.logits(x) is None
    x[1, 3] = math.inf
    assert screen.logits(x) is None
    # an all-equal head: every output a candidate, more panels than the screen keeps
    flat = screen_of(kernels, torch.ones(1024, 32), path)[0]
    assert flat.logits(torch.ones(1, 32)) is None
    assert flat.exact_rows == 1 and MAX_PANEL_SHARE < 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_weights_keep_the_whole_heads_argmax(kernels, path, dtype) -> None:
    """Rows of zeros, of denormal-sized weights and with a NaN: the screen's rows give the
    whole head's argmax (a NaN output, torch's largest, included). A row 2^60 times the
    others: exact where the screen takes it (in bfloat16 its wide bound widens the rounding
    slack past an eighth of the panels, and the whole head serves)."""
    vocab, k = 8192, 48
    gen = torch.Generator().manual_seed(SEED)
    w = (torch.randn(vocab, k, generator=gen) * 0.05).to(dtype)
    w[7] = 0
    w[300] = (w[300].float() * 2.0 ** -130).to(dtype)  # below float32's normals
    x = (w[torch.tensor([11, 4000, 8000])].float() * 30).to(dtype)
    screen, panels = screen_of(kernels, w, path)
    check_row(kernels, screen, panels, x)
    w[9, 3] = math.nan
    screen, panels = screen_of(kernels, w, path)
    got = screen.logits(x)
    whole = kernels[1](x, panels, vocab).float()
    assert torch.equal(got.argmax(dim=1), whole.argmax(dim=1))
    assert int(got[0].argmax()) == 9  # the NaN, as torch.argmax finds it in the whole row
    w[9, 3] = 0
    w[5000] = (w[5000].float() * 2.0 ** 60).to(dtype)
    screen, panels = screen_of(kernels, w, path)
    got = screen.logits(x)
    if dtype == torch.float32:
        check_row(kernels, screen, panels, x)
    elif got is not None:
        assert torch.equal(got.argmax(dim=1),
                           kernels[1](x, panels, vocab).float().argmax(dim=1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_screened_logit_is_within_its_bound(kernels, path, dtype,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each output's screened logit against the whole head's exact one: within ||x|| reach[j]
    plus (VNNI path) err ||s[j] q[j]||, for rows aimed at an output, random rows, and rows
    with one input 300 times the rest (what quantizing x per row loses most on); and those
    rows' argmaxes are the whole head's."""
    vocab, k = 6000, 130
    gen = torch.Generator().manual_seed(SEED + 1)
    w = (torch.randn(vocab, k, generator=gen) * 0.05).to(dtype)
    screen, panels = screen_of(kernels, w, path)
    x = (torch.randn(9, k, generator=gen) * 3).float()
    x[:3] = w[torch.tensor([5, 999, 5999])].float() * 40
    x[6:, 17] *= 300
    x = x.to(dtype)
    monkeypatch.setattr(head_screen, "MAX_PANEL_SHARE", 1.0)  # random rows: keep the screen
    check_row(kernels, screen, panels, x)
    rows = x.shape[0]
    screened = screen.screened[: rows * vocab].view(rows, vocab).double()
    exact = kernels[1](x, panels, vocab).float().double()
    norm = x.double().norm(dim=1, keepdim=True) * (1 + 2.0 ** -20)
    err = screen.err[:rows, None]
    bound = norm * screen.reach.double() + err * screen.qnorm.double()
    assert bool(((exact - screened).abs() <= bound).all())
    if path == "vnni":
        assert bool((err > 0).all())
        assert float(err[-1]) > float(err[3])  # the outlier's row loses more
    else:
        assert bool((err == 0).all())


def test_calibration_keeps_the_screen_for_the_batches_where_it_was_faster(
        kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """`calibrate` times both at each probe size and keeps the screen up to the last size
    from which down it won; a larger batch takes the whole head, with the same argmax."""
    gen = torch.Generator().manual_seed(SEED)
    w = torch.randn(20000, 64, generator=gen) * 0.05
    screen, _ = screen_of(kernels, w)
    monkeypatch.setattr(head_screen, "PROBE_ROWS", (1, 2, 4))
    got = screen.calibrate(w)
    probed = list(screen.probed)
    won = [s < whole for s, whole in screen.probed.values()]
    assert probed == [1, 2, 4][:len(probed)]  # in order, stopping at the first loss
    assert all(won[:-1])
    assert got == (head_screen.MAX_ROWS if all(won) and len(won) == 3
                   else ([0] + probed)[len(probed) - 1])
    assert screen.screened_rows == screen.exact_rows == 0
    # a pinned outcome: whole-head batches above two rows
    screen.max_rows = 2
    x = (w[torch.tensor([3, 7, 11])] * 40).contiguous()
    assert screen.logits(x) is None and screen.logits(x[:2]) is not None
    assert screen.path in screen.describe() and "up to 2 rows" in screen.describe()
    # timed again, it starts over (a pinned limit does not cut the probes short)
    monkeypatch.setattr(head_screen, "PROBE_ROWS", (1, 4))
    screen.calibrate(w)
    assert list(screen.probed)[:1] == [1] and 2 not in screen.probed


def test_a_head_too_wide_for_int32_sums_takes_the_fma_path(kernels) -> None:
    w = torch.randn(16, cpu_head.VNNI_MAX_INPUTS + 1) * 0.01
    screen, _ = screen_of(kernels, w, None)
    assert screen.path == "fma"


def test_the_vnni_paths_two_tiles_give_the_same_screen(kernels) -> None:
    """vpdpbusd's sums (where the CPU has them) and the plain C ones: the same screened
    logits, errors and flags, bit for bit."""
    head = kernels[0]
    gen = torch.Generator().manual_seed(SEED + 2)
    w = torch.randn(3000, 70, generator=gen) * 0.05
    screen, _ = screen_of(kernels, w, "vnni")
    x = torch.randn(11, 70, generator=gen) * 3
    x[4, 9] *= 200
    norm = x.double().norm(dim=1) * (1 + 2.0 ** -20)
    got = []
    for plain in (False, True):
        screened = torch.empty(11 * 3000)
        flags, err = torch.empty_like(screen.flags), torch.empty(11, dtype=torch.float64)
        head.screen(x, screen.packed, screen.scale, screen.reach, screen.qnorm, norm, 0.0,
                    screened, flags, err, "vnni", plain_sums=plain)
        got.append((screened, flags, err))
    assert all(torch.equal(a, b) for a, b in zip(*got))


def test_a_row_that_could_overflow_takes_the_whole_head(kernels, path) -> None:
    gen = torch.Generator().manual_seed(SEED)
    w = torch.randn(4096, 32, generator=gen)
    screen, _ = screen_of(kernels, w, path)
    x = torch.randn(2, 32, generator=gen)
    assert screen.logits(x) is not None
    x[1] *= 2.0 ** 95  # ||x|| ||W[j]|| past MAX_PRODUCT
    assert screen.logits(x) is None


def test_only_heads_whose_logits_are_the_heads_take_the_screen() -> None:
    """Gemma 2's capped logits never take it; a model whose `_logits` is CausalLM's does."""
    from hicache_server.models.causal_lm import CausalLM
    from hicache_server.models.gemma2 import Gemma2ForCausalLM
    from hicache_server.models.llama import LlamaForCausalLM

    assert LlamaForCausalLM._logits is CausalLM._logits
    assert Gemma2ForCausalLM._logits is not CausalLM._logits


def test_the_screen_refuses_what_it_does_not_take(kernels) -> None:
    head, _ = kernels
    with pytest.raises(ValueError, match="int8"):
        head.pack(torch.zeros(4, 4))
    w = torch.randn(128, 16)
    screen, _ = screen_of(kernels, w)
    with pytest.raises(ValueError, match="refused"):
        head.screen(torch.zeros(2, 15), screen.packed, screen.scale, screen.reach,
                    screen.qnorm, torch.ones(2, dtype=torch.float64), 0.0, screen.screened,
                    screen.flags, screen.err[:2])
    with pytest.raises(ValueError, match="expected one of fma, vnni"):
        head.pack(torch.zeros(4, 4, dtype=torch.int8), "avx")


# ------------------------------------------------------------------------------- served


def greedy_tokens(engine, prompts: list[list[int]], **options) -> list[list[int]]:
    """Each prompt's greedy tokens, all taken in by one step (so decoded in one batch, the
    same batches every run: on a CPU without the attention kernel, SDPA's decode bits
    follow the batch)."""
    from conftest import WAIT_S, submit_in_one_step

    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    reqs = [r for p in prompts
            for r in engine.make_requests(input_ids=p, sampling_params=params, **options)]
    return [f.result(WAIT_S)["output_ids"] for f in submit_in_one_step(engine, reqs)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_served_greedy_tokens_are_the_same_with_the_screen_on_and_off(
        dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's default model (the embedded Llama) on the linear kernel: greedy tokens of
    several prompts, decoded in one batch, the same with the screen on and off; with it on,
    decode rows went through it, and a request that asks for logprobs got the whole row."""
    from conftest import small_engine

    gen = torch.Generator().manual_seed(SEED)
    prompts = [torch.randint(5, 200, (n,), generator=gen).tolist() for n in (9, 30, 64)]
    # the embedded model's random head spreads its logits thin over a small vocabulary:
    # let every screen through, however many panels it keeps (still exact), at every batch
    # size (no timing at load, which could give its small head to the whole head)
    monkeypatch.setattr(head_screen, "MAX_PANEL_SHARE", 1.0)
    monkeypatch.setattr(head_screen, "PROBE_ROWS", ())
    got = {}
    for choice in ("off", "on", "fma"):
        monkeypatch.setenv(HEAD_SCREEN_ENV, choice)
        for e in small_engine(**{"model.dtype": dtype}):
            screen = e.loaded.model._screen
            assert (screen is not None) == (choice != "off")
            if screen is not None:
                assert screen.path == ("fma" if choice == "fma" else screen.kernel.best_path)
            got[choice] = greedy_tokens(e, prompts)
            if screen is not None:
                assert screen.screened_rows > screen.exact_rows  # some rows screened
                before = screen.screened_rows
                with_lp = greedy_tokens(e, prompts[:1], return_logprob=True)
                assert screen.screened_rows == before  # logprobs: the whole row
                assert with_lp == got[choice][:1]
    assert got["on"] == got["off"] == got["fma"]
