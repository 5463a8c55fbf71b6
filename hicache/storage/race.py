"""Compute the head, load the tail, and move the line between them as both go (the Cake
scheme): an L3 hit of n pages is computed from its front on the device while its pages are
fetched from its back, until the two meet.

    page   0 ........ computed | target | gap ......... | fetched ........ n
                               ^ the compute side's next stop
                                                        ^ front: the fetched suffix starts

The compute side runs to `target` (one admission, in as many forwards as the scheduler's token
budget takes) and, there, asks for the next one (`next_target`): the pages neither side has
yet, split by the two sides' rates measured in this race, so that both reach the same page
together. The fetch never fetches below the target (`StorageController.limit`). When the
fetch runs ahead of the plan the gap it leaves is smaller and the next target nearer; when it
falls behind, the compute side takes more. It ends when the fetched suffix reaches the
computed head (the request waits for what is in flight, then is admitted with head and tail),
or when the compute side reaches the end of the hit with nothing fetched (the race is
abandoned: the request goes on as any prompt).

No estimate is needed for the bound: the compute side never stops while the fetch has pages
to bring that it would not bring within one page's compute, so a hit costs at most about its
recompute time (plus a forward's fixed cost per target), and as little as its fetch time. The
cost model (`planner.py`), once it has estimates, picks the first target, and until the
first batch arrives it tells when that is due, where the compute side stops to look again.

Threading: scheduler thread only (`StorageTier` owns the races).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

# The first target of a race with no fetch estimate: this share of the hit. Small, because
# where the store is fast the fetch brings the rest while this is computed and what is
# computed beyond the meeting page is lost; large enough that its forward's fixed cost is a
# small part of it. A 2,048-token hit computes 256 tokens before the first measured split.
FIRST_SHARE = 1 / 8
# A raced fetch comes in at least this many calls: its pages arrive, and its rate is
# measured, while the compute side still has work to size by them. Fetched in the batches of
# a whole fetch (32 pages), a race's tail of 24 pages over a slow link arrives in one call
# at its very end, so the compute side reaching its target sees nothing yet, computes on
# into pages the call brings, and the race costs more than a recompute.
RACE_BATCHES = 8


@dataclass(eq=False)
class Race:
    """One hit's race. Pages are pages of the hit (0: its first, `hit_pages`: its end)."""

    hit_pages: int
    target: int                        # the compute side stops here next
    computed: int = 0                  # pages the compute side has computed
    chunk_from: tuple[int, float] | None = None  # (pages, monotonic s) its current chunk began at
    compute_rate: float | None = None  # pages/s of its last chunk
    final: bool = False                # the head ends at `target`: the tail joins it
    planned_s: float | None = None     # the cost model's estimate of it (None: unplanned)
    started_s: float | None = None     # monotonic s of its plan

    def start_chunk(self, now: float) -> None:
        """The compute side starts toward `target` (its first admission, or a new target)."""
        self.chunk_from = (self.computed, now)

    def reached(self, pages: int, now: float) -> None:
        """The compute side has computed `pages` pages: its last chunk's rate is measured."""
        if self.chunk_from is not None:
            start, at = self.chunk_from
            if pages > start and now > at:
                self.compute_rate = (pages - start) / (now - at)
        self.computed = pages


def first_target(hit_pages: int, planned: int | None) -> int:
    """A race's first target: `planned` by the cost model, else FIRST_SHARE of the hit; at
    least 1 page and short of the hit's end (0: the hit is too short to race over)."""
    if hit_pages < 2:
        return 0
    head = planned if planned else math.ceil(hit_pages * FIRST_SHARE)
    return min(max(1, head), hit_pages - 1)


def race_batch_pages(fetch_pages: int, largest: int) -> int:
    """Pages per call of a raced fetch of `fetch_pages` pages: RACE_BATCHES calls at
    least, each no larger than `largest` (a whole fetch's batch) nor smaller than a page."""
    return min(largest, max(1, math.ceil(fetch_pages / RACE_BATCHES)))


class FetchRate(NamedTuple):
    """The fetch side's rate in pages/s, and whether pages arrived to measure it by (else an
    upper bound: nothing came in the time it has run); with nothing come yet, the seconds
    until the cost model expects what was handed out to arrive (None: no estimate, or
    overdue)."""

    pages_per_s: float | None
    measured: bool
    due_s: float | None = None


def next_target(race: Race, front: int, fetch_can_grow: bool, rate: FetchRate) -> int:
    """Where the compute side, at `race.computed`, goes next, for a fetched suffix starting at
    page `front` that grows on at `rate` while `fetch_can_grow`. `race.computed`: it stops
    (the tail joins the head); `race.hit_pages` or more: the race is abandoned (the rest is
    computed, nothing fetched is used). It stops only on a measured rate: a bound (nothing
    arrived yet) sizes the next chunk, smaller the faster the fetch could still be, and no
    longer than until what is in flight is due by the cost model (`FetchRate.due_s`): a
    batch arrives whole, so a chunk that runs past it computes pages it brings."""
    c = race.computed
    gap = front - c
    if gap <= 0:
        return c
    if not fetch_can_grow:
        return front  # nothing more will come: compute up to what did
    rc, rf = race.compute_rate, rate.pages_per_s
    if rc is None or rf is None:
        return c + max(1, math.ceil(gap * FIRST_SHARE))
    if rf <= 0:
        return front
    if rate.measured and gap / rf <= 1 / rc:
        return c  # the fetch brings the gap before one more page could be computed
    chunk = math.ceil(gap * rc / (rc + rf))  # both sides reach c + chunk together
    if not rate.measured and rate.due_s is not None:  # in flight, due then: compute till
        chunk = min(chunk, math.ceil(rate.due_s * rc))
    return c + min(max(1, chunk), gap)


def fetch_rate(completed: int, handed_out: int, elapsed_s: float | None,
               estimate: float | None) -> FetchRate:
    """The fetch's rate in pages/s: what arrived over the time since it started; before
    anything arrived, at most what was handed out over that time (an upper bound that
    falls the longer nothing comes), and at most the cost model's `estimate` if it has one,
    by which what was handed out is due (`FetchRate.due_s`). Once it is late, nothing having
    come, the estimate is not believed (no `due_s`): the compute side is sized by the bound
    alone, so a late fetch costs chunks as long as before, not a short forward per page."""
    if elapsed_s is None or elapsed_s <= 0:
        return FetchRate(estimate, False)
    if completed > 0:
        return FetchRate(completed / elapsed_s, True)
    bound = handed_out / elapsed_s
    if estimate is None or estimate <= 0:
        return FetchRate(bound, False)
    expected = handed_out / estimate  # seconds from the fetch's start
    due = expected - elapsed_s if handed_out > 0 and elapsed_s < expected else None
    return FetchRate(min(bound, estimate), False, due)
