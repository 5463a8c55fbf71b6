"""The race's decisions (`hicache.storage.race`): where the compute side stops next for each
state of the fetch, measured or bounded."""

from __future__ import annotations

import pytest

from hicache.storage.race import (
    FIRST_SHARE,
    RACE_BATCHES,
    FetchRate,
    Race,
    fetch_rate,
    first_target,
    next_target,
    race_batch_pages,
)

HIT = 128


def race_at(computed: int, compute_rate: float | None) -> Race:
    race = Race(HIT, target=computed, computed=computed)
    race.compute_rate = compute_rate
    return race


def test_the_first_target_is_the_plan_or_a_share_and_short_of_the_end() -> None:
    assert first_target(HIT, None) == HIT * FIRST_SHARE
    assert first_target(HIT, 40) == 40
    assert first_target(HIT, HIT) == HIT - 1
    assert first_target(3, None) == 1
    assert first_target(1, None) == 0  # one page: nothing to race over


def test_a_raced_fetch_comes_in_several_calls_of_at_most_a_whole_fetchs_batch() -> None:
    assert race_batch_pages(24, 32) == 3  # 8 calls: the first arrives an eighth of the way
    assert race_batch_pages(RACE_BATCHES * 100, 32) == 32
    assert race_batch_pages(3, 32) == 1
    assert race_batch_pages(0, 32) == 1


def test_the_head_is_final_where_the_fetched_suffix_reaches_it() -> None:
    assert next_target(race_at(50, 10.0), 50, True, FetchRate(10.0, True)) == 50
    assert next_target(race_at(50, 10.0), 40, True, FetchRate(10.0, True)) == 50


def test_a_fetch_that_can_bring_no_more_leaves_the_rest_to_compute() -> None:
    assert next_target(race_at(10, 10.0), 100, False, FetchRate(1.0, True)) == 100
    assert next_target(race_at(10, 10.0), HIT, False, FetchRate(None, False)) == HIT


@pytest.mark.parametrize(("compute", "fetch", "chunk"), [
    (10.0, 10.0, 50),   # as fast: they meet halfway
    (30.0, 10.0, 75),   # compute 3x faster: it takes three quarters
    (10.0, 90.0, 10),   # fetch 9x faster: a tenth
])
def test_a_measured_gap_is_split_so_both_sides_meet(compute, fetch, chunk) -> None:
    assert next_target(race_at(0, compute), 100, True, FetchRate(fetch, True)) == chunk


def test_a_fetch_about_to_close_the_gap_stops_the_compute_side() -> None:
    # 4 pages at 100 pages/s: 40 ms, less than one page's compute at 20 pages/s (50 ms)
    assert next_target(race_at(60, 20.0), 64, True, FetchRate(100.0, True)) == 60


def test_a_bound_never_stops_the_compute_side() -> None:
    """Nothing arrived: however fast the fetch might be, the compute side takes a page."""
    assert next_target(race_at(60, 20.0), 64, True, FetchRate(1e6, False)) == 61


def test_without_rates_the_compute_side_takes_a_share_of_the_gap() -> None:
    assert next_target(race_at(0, None), 100, True, FetchRate(5.0, True)) == 13  # ceil(100 * FIRST_SHARE)
    assert next_target(race_at(0, 5.0), 100, True, FetchRate(None, False)) == 13


def test_the_fetch_rate_is_measured_or_bounded() -> None:
    assert fetch_rate(20, 64, 2.0, None) == FetchRate(10.0, True)
    assert fetch_rate(0, 64, 2.0, None) == FetchRate(32.0, False)
    assert fetch_rate(0, 64, 2.0, 8.0) == FetchRate(8.0, False, 6.0)  # due at 64 / 8 s
    assert fetch_rate(0, 0, None, 8.0) == FetchRate(8.0, False)
    assert fetch_rate(0, 0, None, None) == FetchRate(None, False)


def test_what_the_estimate_says_is_due_soon_bounds_the_chunk_until_it_is_late() -> None:
    """A fetch of 64 pages that the model says takes 8 s, nothing arrived yet."""
    assert fetch_rate(0, 64, 7.9, 8.0).due_s == pytest.approx(0.1)
    assert fetch_rate(0, 64, 8.1, 8.0).due_s is None  # late: not believed
    assert fetch_rate(0, 0, 1.0, 8.0).due_s is None  # nothing handed out: nothing due
    # 25 pages in flight, due in 10 ms; computing 200 pages/s the compute side takes 2
    # pages, not the 20 of the bound's even split (after which the tail would be wasted)
    due = FetchRate(50.0, False, 0.01)
    assert next_target(race_at(100, 200.0), HIT, True, due) == 102
    assert next_target(race_at(100, 200.0), HIT, True, FetchRate(50.0, False)) == 123
    assert next_target(race_at(100, 200.0), HIT, True, FetchRate(50.0, True, 0.01)) == 123


def test_a_race_measures_its_compute_side_per_chunk() -> None:
    race = Race(HIT, target=16)
    race.start_chunk(100.0)
    race.reached(16, 102.0)
    assert race.computed == 16 and race.compute_rate == 8.0
    race.start_chunk(102.0)
    race.reached(20, 103.0)
    assert race.compute_rate == 4.0
