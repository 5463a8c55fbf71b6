"""The L3 cost model: online fits of forward and fetch time, and the head/tail split of a hit."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache.storage.cost import (
    FETCH_MIN_OBSERVATIONS,
    PREFILL_MIN_OBSERVATIONS,
    FetchCost,
    PrefillCoefficients,
    PrefillCost,
    Split,
    choose_split,
)

# A forward model of the order of a small GPU model: 4 ms fixed, 20 us a token, 1 ns a
# query-key pair, so each term is a sizeable share of a long prefill.
FORWARD = PrefillCoefficients(fixed_s=4e-3, per_token_s=2e-5, per_pair_s=1e-9)
# A fetch model: 0.5 ms a fetch, 2 GB/s.
LATENCY_S, BANDWIDTH = 5e-4, 2e9
PAGE_TOKENS, PAGE_BYTES = 16, 1 << 20
MIB = 1 << 20


Row = tuple[int, int]


def forward_seconds(rows: Sequence[Row], c: PrefillCoefficients = FORWARD) -> float:
    tokens = sum(extend for _, extend in rows)
    pairs = sum(extend * (prefix + (extend + 1) / 2) for prefix, extend in rows)
    return c.fixed_s + c.per_token_s * tokens + c.per_pair_s * pairs


def random_batch(rng: random.Random) -> list[Row]:
    """A mixed batch: decode rows (context, 1) and prefill rows (prefix, extend)."""
    return [(rng.randint(0, 8192), 1) if rng.random() < 0.5
            else (rng.randint(0, 8192), rng.randint(1, 4096))
            for _ in range(rng.randint(1, 8))]


def noise(i: int) -> float:
    """A deterministic relative error within +-1%."""
    return 1.0 + 0.01 * math.sin(1.7 * i)


def fitted_prefill(c: PrefillCoefficients = FORWARD, n: int = 300, seed: int = 1,
                   model: PrefillCost | None = None) -> PrefillCost:
    model = model if model is not None else PrefillCost()
    rng = random.Random(seed)
    for _ in range(n):
        rows = random_batch(rng)
        model.observe(rows, forward_seconds(rows, c))
    return model


def fitted_fetch(latency_s: float = LATENCY_S, bandwidth: float = BANDWIDTH, n: int = 100,
                 seed: int = 1, model: FetchCost | None = None) -> FetchCost:
    model = model if model is not None else FetchCost()
    rng = random.Random(seed)
    for _ in range(n):
        nbytes = rng.randint(1, 64) * MIB
        model.observe(nbytes, latency_s + nbytes / bandwidth)
    return model


def assert_coefficients(got: PrefillCoefficients | None, want: PrefillCoefficients,
                        rel: Sequence[float]) -> None:
    assert got is not None
    for g, w, r in zip(got, want, rel):
        assert g == pytest.approx(w, rel=r)


# --- PrefillCost ---------------------------------------------------------------------------

def test_prefill_recovers_coefficients_noise_free() -> None:
    model = fitted_prefill()
    assert_coefficients(model.coefficients, FORWARD, (1e-6, 1e-6, 1e-6))
    assert model.observations == 300
    assert model.seconds(1000, 2000) == pytest.approx(forward_seconds([(1000, 2000)]), rel=1e-6)


def test_prefill_recovers_coefficients_with_noise() -> None:
    model, rng = PrefillCost(), random.Random(2)
    for i in range(300):
        rows = random_batch(rng)
        model.observe(rows, forward_seconds(rows) * noise(i))
    assert_coefficients(model.coefficients, FORWARD, (0.15, 0.03, 0.03))


def test_prefill_zero_coefficient_is_zero_not_negative() -> None:
    """Data with no fixed cost: the fit drops it (0.0) instead of going slightly negative."""
    truth = PrefillCoefficients(0.0, 2e-5, 1e-9)
    model, rng = PrefillCost(), random.Random(3)
    for i in range(200):
        rows = random_batch(rng)
        model.observe(rows, forward_seconds(rows, truth) * noise(i))
    c = model.coefficients
    assert c is not None and min(c) >= 0
    assert c.per_token_s == pytest.approx(2e-5, rel=0.05)
    assert c.fixed_s < 1e-3  # small against a 4 ms fixed cost it could have invented


def test_prefill_follows_a_change_of_speed() -> None:
    slower = PrefillCoefficients(*(2 * c for c in FORWARD))
    model = fitted_prefill()
    never_forgets = fitted_prefill(model=PrefillCost(decay=1.0))
    fitted_prefill(slower, n=600, seed=5, model=model)
    fitted_prefill(slower, n=600, seed=5, model=never_forgets)
    assert_coefficients(model.coefficients, slower, (0.01, 0.01, 0.01))
    # Without forgetting, the old third of the data still holds the fit back.
    stale = never_forgets.seconds(0, 2048)
    assert stale is not None
    assert stale < 0.95 * forward_seconds([(0, 2048)], slower)


def test_prefill_none_before_min_observations() -> None:
    model, rng = PrefillCost(), random.Random(4)
    for _ in range(PREFILL_MIN_OBSERVATIONS - 1):
        rows = random_batch(rng)
        model.observe(rows, forward_seconds(rows))
        assert model.seconds(0, 100) is None
        assert model.tokens_per_s(0, 100) is None
        assert model.coefficients is None
    rows = random_batch(rng)
    model.observe(rows, forward_seconds(rows))
    assert model.seconds(0, 100) is not None


def test_prefill_repeated_observation_is_a_rate() -> None:
    """One batch shape over and over: only one coefficient is identifiable; the fit is the
    per-token rate, and it reproduces the one timing it was shown."""
    model = PrefillCost()
    for _ in range(10):
        model.observe([(512, 256)], 0.02)
    assert model.coefficients == PrefillCoefficients(0.0, pytest.approx(0.02 / 256), 0.0)
    assert model.seconds(512, 256) == pytest.approx(0.02)
    assert model.tokens_per_s(512, 256) == pytest.approx(256 / 0.02)


def test_prefill_ignores_bad_timings_and_empty_batches() -> None:
    model = PrefillCost()
    for seconds in (0.0, -1.0, math.nan, math.inf):
        model.observe([(0, 100)], seconds)
    model.observe([], 0.01)
    model.observe([(100, 0)], 0.01)
    assert model.observations == 0


def test_prefill_huge_numbers_stay_finite() -> None:
    model = PrefillCost()
    for i in range(1, 6):
        model.observe([(10**9 * i, 10**6 * i)], 1e5 * i)
    for prefix, extend in ((10**9, 10**6), (0, 1), (10**12, 10**7)):
        seconds = model.seconds(prefix, extend)
        assert seconds is not None and math.isfinite(seconds) and seconds > 0


def test_prefill_zero_tokens_cost_nothing_and_bad_rows_raise() -> None:
    model = fitted_prefill(n=10)
    assert model.seconds(1000, 0) == 0.0
    with pytest.raises(ValueError, match="got \\(-1, 5\\)"):
        model.observe([(-1, 5)], 0.01)
    with pytest.raises(ValueError, match="extend_tokens must be >= 1"):
        model.tokens_per_s(0, 0)
    with pytest.raises(ValueError, match="decay must be in"):
        PrefillCost(decay=0.0)


rows_strategy = st.lists(st.tuples(st.integers(0, 100_000), st.integers(0, 10_000)),
                         min_size=1, max_size=6)
seconds_strategy = st.floats(1e-6, 1e3, allow_nan=False)


@given(st.lists(st.tuples(rows_strategy, seconds_strategy), min_size=1, max_size=40))
def test_prefill_coefficients_never_negative(observations: list[tuple[list[Row], float]]) -> None:
    model = PrefillCost()
    for rows, seconds in observations:
        model.observe(rows, seconds)
    c = model.coefficients
    if c is None:
        assert model.observations < PREFILL_MIN_OBSERVATIONS
        return
    assert all(math.isfinite(v) and v >= 0 for v in c)
    assert max(c) > 0
    for prefix, extend in ((0, 1), (4096, 512), (100_000, 10_000)):
        seconds = model.seconds(prefix, extend)
        assert seconds is not None and math.isfinite(seconds) and seconds > 0


# --- FetchCost -----------------------------------------------------------------------------

def test_fetch_recovers_latency_and_bandwidth_noise_free() -> None:
    model = fitted_fetch()
    assert model.latency_s == pytest.approx(LATENCY_S, rel=1e-6)
    assert model.bandwidth_bytes_per_s == pytest.approx(BANDWIDTH, rel=1e-6)
    assert model.seconds(8 * MIB) == pytest.approx(LATENCY_S + 8 * MIB / BANDWIDTH, rel=1e-6)


def test_fetch_recovers_latency_and_bandwidth_with_noise() -> None:
    model, rng = FetchCost(), random.Random(2)
    for i in range(100):
        nbytes = rng.randint(1, 64) * MIB
        model.observe(nbytes, (LATENCY_S + nbytes / BANDWIDTH) * noise(i))
    assert model.latency_s == pytest.approx(LATENCY_S, rel=0.15)
    assert model.bandwidth_bytes_per_s == pytest.approx(BANDWIDTH, rel=0.02)


def test_fetch_follows_a_change_of_speed() -> None:
    model = fitted_fetch()
    fitted_fetch(latency_s=2e-3, bandwidth=BANDWIDTH / 4, n=400, seed=5, model=model)
    assert model.latency_s == pytest.approx(2e-3, rel=0.01)
    assert model.bandwidth_bytes_per_s == pytest.approx(BANDWIDTH / 4, rel=0.01)


def test_fetch_none_before_min_observations() -> None:
    model = FetchCost()
    for _ in range(FETCH_MIN_OBSERVATIONS - 1):
        model.observe(MIB, 1e-3)
        assert model.seconds(MIB) is None
        assert model.bandwidth_bytes_per_s is None and model.latency_s is None
    model.observe(2 * MIB, 2e-3)
    assert model.seconds(MIB) is not None


def test_fetch_one_size_is_a_rate_through_the_origin() -> None:
    model = FetchCost()
    for _ in range(10):
        model.observe(4 * MIB, 0.01)
    assert model.latency_s == 0.0
    assert model.bandwidth_bytes_per_s == pytest.approx(4 * MIB / 0.01)


def test_fetch_negative_slope_keeps_bandwidth_finite() -> None:
    """Bigger fetches that took less time (a warm cache): no negative or infinite answer."""
    model = FetchCost()
    for nbytes, seconds in ((MIB, 0.05), (8 * MIB, 0.04), (64 * MIB, 0.03)):
        model.observe(nbytes, seconds)
    bandwidth, latency = model.bandwidth_bytes_per_s, model.latency_s
    assert bandwidth is not None and math.isfinite(bandwidth) and bandwidth > 0
    assert latency == 0.0


def test_fetch_zero_bytes() -> None:
    only_empty = FetchCost()
    for _ in range(5):
        only_empty.observe(0, 1e-3)
    assert only_empty.observations == 5
    assert only_empty.seconds(MIB) is None  # no bandwidth can be told from empty fetches
    mixed = fitted_fetch(n=20)
    for _ in range(5):
        mixed.observe(0, LATENCY_S)
    assert mixed.latency_s == pytest.approx(LATENCY_S, rel=1e-6)
    assert mixed.seconds(0) == 0.0  # nothing to fetch issues no fetch


def test_fetch_huge_numbers_and_bad_input() -> None:
    model = FetchCost()
    for i in range(1, 6):
        model.observe(10**15 * i, 1e5 * i + 1.0)
    for nbytes in (1, 10**15, 10**18):
        seconds = model.seconds(nbytes)
        assert seconds is not None and math.isfinite(seconds) and seconds > 0
    model.observe(MIB, math.nan)
    model.observe(MIB, -1.0)
    assert model.observations == 5
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -1"):
        model.observe(-1, 1.0)


@given(st.lists(st.tuples(st.integers(0, 10**12), seconds_strategy), min_size=1, max_size=40))
def test_fetch_coefficients_never_negative(observations: list[tuple[int, float]]) -> None:
    model = FetchCost()
    for nbytes, seconds in observations:
        model.observe(nbytes, seconds)
    latency, bandwidth = model.latency_s, model.bandwidth_bytes_per_s
    if bandwidth is None:
        assert latency is None
        assert (model.observations < FETCH_MIN_OBSERVATIONS
                or all(nbytes == 0 for nbytes, _ in observations))
        return
    assert latency is not None and math.isfinite(latency) and latency >= 0
    assert math.isfinite(bandwidth) and bandwidth > 0
    seconds = model.seconds(PAGE_BYTES)
    assert seconds is not None and math.isfinite(seconds) and seconds > 0


# --- choose_split --------------------------------------------------------------------------

def brute_force(hit_pages: int, page_tokens: int, page_bytes: int, prefix_tokens: int,
                prefill: PrefillCost, fetch: FetchCost) -> tuple[int, float]:
    """(head_pages, seconds) by trying every head_pages, the fewest recomputed on a tie."""
    def cost(k: int) -> float:
        head = prefill.seconds(prefix_tokens, k * page_tokens) if k else 0.0
        tail = fetch.seconds((hit_pages - k) * page_bytes) if k < hit_pages else 0.0
        assert head is not None and tail is not None
        return max(head, tail)
    return min(((k, cost(k)) for k in range(hit_pages + 1)), key=lambda kc: (kc[1], kc[0]))


class TablePrefill(PrefillCost):
    """A monotone stand-in: seconds of k pages is table[k] (ties are common)."""

    def __init__(self, table: list[float]) -> None:
        super().__init__()
        self.table = table

    def seconds(self, prefix: int, extend: int) -> float | None:
        return self.table[extend // PAGE_TOKENS]


class TableFetch(FetchCost):
    """A monotone stand-in: seconds of k pages is table[k]."""

    def __init__(self, table: list[float]) -> None:
        super().__init__()
        self.table = table

    def seconds(self, nbytes: int) -> float | None:
        return self.table[nbytes // PAGE_BYTES]


def cumulative(steps: list[int]) -> list[float]:
    out, total = [], 0.0
    for step in steps:
        total += step
        out.append(total)
    return out


@given(st.integers(0, 60).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, 3), min_size=n + 1, max_size=n + 1),
    st.lists(st.integers(0, 3), min_size=n + 1, max_size=n + 1))))
def test_split_equals_brute_force_on_step_tables(steps: tuple[list[int], list[int]]) -> None:
    prefill, fetch = TablePrefill(cumulative(steps[0])), TableFetch(cumulative(steps[1]))
    hit = len(steps[0]) - 1
    split = choose_split(hit, PAGE_TOKENS, PAGE_BYTES, 0, prefill, fetch)
    assert split is not None
    assert (split.head_pages, split.seconds) == brute_force(hit, PAGE_TOKENS, PAGE_BYTES, 0,
                                                            prefill, fetch)
    assert split.head_pages + split.tail_pages == hit


positive = st.floats(1e-12, 1.0, allow_nan=False)


@given(st.tuples(st.floats(0.0, 1e-2), positive, positive), st.floats(0.0, 1e-2),
       st.floats(1e6, 1e11), st.integers(0, 300), st.integers(0, 50_000))
def test_split_equals_brute_force_on_fitted_models(
        forward: tuple[float, float, float], latency_s: float, bandwidth: float, hit: int,
        prefix: int) -> None:
    prefill = fitted_prefill(PrefillCoefficients(*forward), n=20)
    fetch = fitted_fetch(latency_s, bandwidth, n=20)
    split = choose_split(hit, PAGE_TOKENS, PAGE_BYTES, prefix, prefill, fetch)
    assert split is not None
    assert (split.head_pages, split.seconds) == brute_force(hit, PAGE_TOKENS, PAGE_BYTES,
                                                            prefix, prefill, fetch)
    assert split.recompute_seconds == prefill.seconds(prefix, hit * PAGE_TOKENS)
    assert split.fetch_seconds == (fetch.seconds(hit * PAGE_BYTES) if hit else 0.0)


def linear_models(tokens_per_s: float, bytes_per_s: float) -> tuple[PrefillCost, FetchCost]:
    """A forward of pure per-token cost and a fetch of pure bandwidth, fitted exactly."""
    prefill, fetch = PrefillCost(), FetchCost()
    for extend in (64, 256, 1024, 4096):
        prefill.observe([(0, extend)], extend / tokens_per_s)
        fetch.observe(extend * MIB, extend * MIB / bytes_per_s)
    return prefill, fetch


def test_split_fast_fetch_recomputes_nothing() -> None:
    prefill, fetch = linear_models(tokens_per_s=1e4, bytes_per_s=1e12)
    split = choose_split(1000, PAGE_TOKENS, PAGE_BYTES, 0, prefill, fetch)
    assert split is not None
    assert (split.head_pages, split.tail_pages) == (0, 1000)
    assert split.seconds == split.fetch_seconds < split.recompute_seconds


def test_split_slow_fetch_recomputes_everything() -> None:
    prefill, fetch = linear_models(tokens_per_s=1e7, bytes_per_s=1e6)
    split = choose_split(1000, PAGE_TOKENS, PAGE_BYTES, 0, prefill, fetch)
    assert split is not None
    assert (split.head_pages, split.tail_pages) == (1000, 0)
    assert split.seconds == split.recompute_seconds < split.fetch_seconds


def test_split_balanced_meets_in_the_middle() -> None:
    # 1e4 tokens/s is 16 / 1e4 s a page; a fetch at that bandwidth takes the same per page.
    prefill, fetch = linear_models(tokens_per_s=1e4, bytes_per_s=PAGE_BYTES * 1e4 / 16)
    split = choose_split(1000, PAGE_TOKENS, PAGE_BYTES, 0, prefill, fetch)
    assert split is not None
    assert abs(split.head_pages - 500) <= 1
    assert split.recompute_seconds == pytest.approx(split.fetch_seconds, rel=1e-6)
    assert split.seconds == pytest.approx(split.recompute_seconds / 2, rel=1e-2)


def test_split_tie_prefers_fetching() -> None:
    # head k costs 2k, tail of 5 - k pages costs 5 - k: k = 1 and k = 2 both finish at 4.
    prefill = TablePrefill([2.0 * k for k in range(6)])
    fetch = TableFetch([float(k) for k in range(6)])
    assert choose_split(5, PAGE_TOKENS, PAGE_BYTES, 0, prefill, fetch) == Split(1, 4, 4.0,
                                                                               10.0, 5.0)


def test_split_none_without_estimates_and_bad_args() -> None:
    prefill, fetch = linear_models(1e4, 1e9)
    assert choose_split(10, PAGE_TOKENS, PAGE_BYTES, 0, PrefillCost(), fetch) is None
    assert choose_split(10, PAGE_TOKENS, PAGE_BYTES, 0, prefill, FetchCost()) is None
    assert choose_split(0, PAGE_TOKENS, PAGE_BYTES, 0, prefill, fetch) == Split(0, 0, 0.0,
                                                                               0.0, 0.0)
    with pytest.raises(ValueError, match="page_tokens must be >= 1, got 0"):
        choose_split(10, 0, PAGE_BYTES, 0, prefill, fetch)
