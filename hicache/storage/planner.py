"""What to do with an L3 hit: fetch it whole, recompute it, or race (compute its head while its
tail is fetched), by what this engine and this backend have been measured to cost (`cost.py`).

    fetch      the hit's pages come from L3 into L2, then load back (k = 0)
    recompute  fetching would take longer than computing: nothing is fetched (k = n)
    race       pages from the front are computed while pages from the back are fetched
               (`race.py`), starting from the split k where both would end together
               (`choose_split`); taken only when that beats the better of the other two by
               SPLIT_MIN_GAIN

The estimates learn from every forward pass (`observe_forward`: its rows and wall time) and
every fetch (`observe_fetch`: bytes and wall time, however many workers shared it), and are
seeded at start (timed warm-up forwards, a timed read of stored pages). While either has too
few observations a hit is raced from a first target of a fixed share (`race.FIRST_SHARE`:
the race needs no estimate to cost at most about a recompute), or fetched whole without
`overlap` (or `cold_race`); with `cost_model` off it is always fetched whole (the storage
tier's threshold already chose which hits are worth asking about).

Threading: scheduler thread only, like the storage tier that owns it.
"""

from __future__ import annotations

from typing import NamedTuple

from hicache.storage.cost import FetchCost, PrefillCost, Split, choose_split

# A hit is split into a computed head and a fetched tail only when the estimate beats the
# better of fetching it all and recomputing it all by this share: a split costs a second
# admission and the head's copy to L2, so a gain within the estimates' noise is not taken.
SPLIT_MIN_GAIN = 0.2
# The prefix length at which /admin/tiers reports the prefill estimate (tokens/s of a
# prefill of this many tokens from scratch).
REPORT_PREFILL_TOKENS = 2048
# A race's estimate is scaled by how long the races planned so far took against their
# estimates (`observe_race`): a head computed while pages are fetched shares the machine
# with the fetch (its reads, copies and checksums) and pays a second admission, which the
# two models, fitted on forwards and fetches alone, do not see. Each race's actual over
# planned time moves the factor by this weight; the factor stays within the bounds.
RACE_FACTOR_WEIGHT = 0.5
RACE_FACTOR_BOUNDS = (0.5, 4.0)


class CostEstimates(NamedTuple):
    """What the cost model believes now (None until it has enough observations)."""

    prefill_tokens_per_s: float | None   # a prefill of REPORT_PREFILL_TOKENS from scratch
    fetch_bandwidth_bytes_per_s: float | None
    fetch_latency_s: float | None
    prefill_observations: int
    fetch_observations: int
    race_time_factor: float = 1.0  # planned races' actual over estimated time (running)
    race_observations: int = 0


class FetchPlan(NamedTuple):
    head_pages: int | None  # a race's first target (pages); 0: fetch it all; None: recompute
    split: Split | None     # the estimate it was chosen by (None: no estimate)
    race: bool = False      # race it (`race.py`), from `head_pages` (0: the default share)


class FetchPlanner:
    def __init__(self, page_size: int, page_bytes: int, cost_model: bool = True,
                 overlap: bool = True, cold_race: bool = True) -> None:
        self.page_size = page_size
        self.page_bytes = page_bytes  # one page's K and V in L2 (what a fetch moves)
        self.cost_model = cost_model  # decide by estimates once warm (else fetch it all)
        self.overlap = overlap        # may split a hit into a computed head and a fetched tail
        self.cold_race = cold_race    # race a hit before the estimates exist (else fetch it)
        self.prefill = PrefillCost()
        self.fetch = FetchCost()
        self.race_factor = 1.0  # `observe_race`
        self.race_observations = 0

    def plan(self, hit_pages: int, prefix_tokens: int) -> FetchPlan:
        """For an L3 hit of `hit_pages` pages after `prefix_tokens` cached ones."""
        split = (choose_split(hit_pages, self.page_size, self.page_bytes, prefix_tokens,
                              self.prefill, self.fetch) if self.cost_model else None)
        if split is None:
            return FetchPlan(0, None, race=self.cost_model and self.overlap and self.cold_race)
        best_whole = min(split.fetch_seconds, split.recompute_seconds)
        head = None if split.fetch_seconds > split.recompute_seconds else 0
        if (self.overlap and 0 < split.head_pages < hit_pages
                and split.seconds * self.race_factor <= (1 - SPLIT_MIN_GAIN) * best_whole):
            return FetchPlan(split.head_pages, split, race=True)
        return FetchPlan(head, split)

    def fetch_pages_per_s(self, pages: int) -> float | None:
        """The fetch model's rate for a fetch of `pages` pages (pages/s); None unfitted."""
        seconds = self.fetch.seconds(pages * self.page_bytes)
        return pages / seconds if seconds else None

    @property
    def fetch_fitted(self) -> bool:
        """Whether the fetch model has an estimate."""
        return self.fetch.seconds(self.page_bytes) is not None

    def observe_forward(self, rows: list[tuple[int, int]], seconds: float) -> None:
        """A forward pass of `rows` (prefix tokens, tokens computed) took `seconds`."""
        self.prefill.observe(rows, seconds)

    def observe_fetch(self, pages: int, seconds: float) -> None:
        """A fetch of `pages` pages took `seconds`, first batch start to last batch end."""
        self.fetch.observe(pages * self.page_bytes, seconds)

    def observe_race(self, planned_s: float, actual_s: float) -> None:
        """A race the model planned to take `planned_s` (its split's estimate) took
        `actual_s`, from its plan until its head and tail were both in the tree (or, given
        up, its head was the whole hit)."""
        if planned_s <= 0 or actual_s <= 0:
            return
        low, high = RACE_FACTOR_BOUNDS
        ratio = min(max(actual_s / planned_s, low), high)
        w = 1.0 if self.race_observations == 0 else RACE_FACTOR_WEIGHT
        self.race_factor = (1 - w) * self.race_factor + w * ratio
        self.race_observations += 1

    def estimates(self) -> CostEstimates:
        return CostEstimates(self.prefill.tokens_per_s(0, REPORT_PREFILL_TOKENS),
                             self.fetch.bandwidth_bytes_per_s, self.fetch.latency_s,
                             self.prefill.observations, self.fetch.observations,
                             self.race_factor, self.race_observations)
