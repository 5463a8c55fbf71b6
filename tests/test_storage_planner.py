"""FetchPlanner: fetch, recompute or split an L3 hit by the cost model's estimates."""

from __future__ import annotations

import pytest

from hicache.storage.planner import RACE_FACTOR_BOUNDS, SPLIT_MIN_GAIN, FetchPlanner

PS, PAGE_BYTES = 16, 1 << 20


def warm(planner: FetchPlanner, per_token_s: float, bytes_per_s: float) -> FetchPlanner:
    """Feed both models noise-free observations of a linear prefill and a pure-bandwidth link."""
    for extend in (64, 256, 1024, 2048):
        planner.observe_forward([(0, extend)], extend * per_token_s)
    for pages in (8, 32, 128, 256):
        planner.observe_fetch(pages, pages * PAGE_BYTES / bytes_per_s)
    return planner


def test_cold_without_a_race_or_off_fetches_the_hit_whole() -> None:
    assert FetchPlanner(PS, PAGE_BYTES, cold_race=False).plan(100, 0) == (0, None, False)
    off = warm(FetchPlanner(PS, PAGE_BYTES, cost_model=False), 1e-3, 1e3)  # fetch is awful
    assert off.plan(100, 0) == (0, None, False)


def test_a_cold_hit_is_raced_by_default() -> None:
    assert FetchPlanner(PS, PAGE_BYTES).plan(100, 0) == (0, None, True)
    half = FetchPlanner(PS, PAGE_BYTES)
    for extend in (64, 256, 1024):  # a fitted prefill model, no fetch model yet
        half.observe_forward([(0, extend)], extend * 1e-3)
    assert half.plan(100, 0) == (0, None, True)
    no_overlap = FetchPlanner(PS, PAGE_BYTES, overlap=False)
    assert no_overlap.plan(100, 0) == (0, None, False)


@pytest.mark.parametrize(("fetch_speedup", "overlap", "head"), [
    (100.0, True, 0),       # fetching is much faster: fetch it all
    (0.01, True, None),     # much slower: recompute it all
    (1.0, True, 50),        # as fast: half and half
    (1.0, False, 0),        # no overlap: the better whole (a tie fetches)
    (0.5, False, None),
])
def test_plans_by_the_estimates(fetch_speedup, overlap, head) -> None:
    per_token_s = 1e-3
    bytes_per_s = fetch_speedup * PAGE_BYTES / PS / per_token_s
    planner = warm(FetchPlanner(PS, PAGE_BYTES, overlap=overlap), per_token_s, bytes_per_s)
    plan = planner.plan(100, 0)
    assert plan.split is not None
    if head:
        assert abs(plan.head_pages - head) <= 1
    else:
        assert plan.head_pages == head


def test_a_split_that_gains_little_is_not_taken() -> None:
    """Fetching 3x faster than computing: the best split gains ~25% over fetching it all,
    above SPLIT_MIN_GAIN; 10x faster it gains ~9%, below: fetch it all."""
    per_token_s = 1e-3
    for speedup, split in ((3.0, True), (10.0, False)):
        bytes_per_s = speedup * PAGE_BYTES / PS / per_token_s
        plan = warm(FetchPlanner(PS, PAGE_BYTES), per_token_s, bytes_per_s).plan(100, 0)
        gain = 1 - plan.split.seconds / min(plan.split.fetch_seconds,
                                            plan.split.recompute_seconds)
        assert (gain >= SPLIT_MIN_GAIN) == split
        assert (plan.head_pages > 0) == split


def test_estimates_report_what_was_learned() -> None:
    planner = warm(FetchPlanner(PS, PAGE_BYTES), 1e-3, 5e8)
    e = planner.estimates()
    assert e.prefill_tokens_per_s == pytest.approx(1000, rel=1e-3)
    assert e.fetch_bandwidth_bytes_per_s == pytest.approx(5e8, rel=1e-3)
    assert e.fetch_latency_s == pytest.approx(0, abs=1e-6)
    assert (e.prefill_observations, e.fetch_observations) == (4, 4)


def test_races_slower_than_planned_make_a_marginal_split_a_whole_fetch() -> None:
    """Fetching 3x faster than computing, the split gains ~25%: taken while races take their
    estimate, not once they have taken 1.5x it (a whole fetch beats a race that slow)."""
    per_token_s = 1e-3
    planner = warm(FetchPlanner(PS, PAGE_BYTES), per_token_s, 3.0 * PAGE_BYTES / PS / per_token_s)
    first = planner.plan(100, 0)
    assert first.race and first.head_pages > 0
    planner.observe_race(first.split.seconds, first.split.seconds)  # as planned
    assert planner.plan(100, 0).race
    planner.observe_race(first.split.seconds, 2.0 * first.split.seconds)
    assert planner.race_factor == pytest.approx(1.5)
    plan = planner.plan(100, 0)
    assert not plan.race and plan.head_pages == 0
    assert planner.estimates()[-2:] == (pytest.approx(1.5), 2)


def test_the_race_factor_starts_at_the_first_race_and_stays_bounded() -> None:
    planner = FetchPlanner(PS, PAGE_BYTES)
    planner.observe_race(1.0, 0.8)
    assert planner.race_factor == pytest.approx(0.8)  # the first race sets it
    planner.observe_race(1.0, 100.0)
    assert planner.race_factor == pytest.approx((0.8 + RACE_FACTOR_BOUNDS[1]) / 2)
    planner.observe_race(0.0, 1.0)  # no estimate: nothing learned
    planner.observe_race(1.0, 0.0)
    assert planner.race_observations == 2
