"""What an L3 hit costs, and how to split it: compute the head, load the tail.

For an L3 hit of n pages that starts after `prefix` cached tokens, the first k pages are
recomputed on the device while pages [k, n) come from L3, k chosen so that both finish
together. This replaces a fixed `prefetch_threshold`: a short hit on a slow store ends with
k = n (recompute it all, fetch nothing), a long one on a fast store with k = 0.

    tokens  [0, prefix)                           already cached (L1/L2)
            [prefix, prefix + k*page)             head: recomputed      (PrefillCost)
            [prefix + k*page, prefix + n*page)    tail: fetched from L3 (FetchCost)

Both models are fitted online by exponentially weighted least squares with coefficients kept
non-negative (`_DecayedLeastSquares`): each observation scales the normal equations of the
older ones by `decay` and adds its own, so the fit follows a machine whose speed drifts.

Threading: everything here is called on the scheduler thread (it times the forwards, hears
of completed fetches and asks for splits); nothing is shared, so there are no locks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

# Forgetting factor per forward pass. The effective window is 1 / (1 - decay) = 100 forwards
# (weights halve every ~69), a few seconds of serving at 10-50 ms a step: long enough to span
# a mix of prefill and decode batches, so that all three coefficients stay identifiable,
# short enough to follow a clock, thermal or co-tenant change within seconds.
PREFILL_DECAY = 0.99
# Forgetting factor per completed fetch: an effective window of the last ~50 fetches (weights
# halve every ~34). Fetches are rarer than forwards (one per prefetched request), so a window
# in fetches rather than seconds; 50 spans enough fetch sizes to separate latency from
# bandwidth, and follows a store whose load changes within a few dozen requests.
FETCH_DECAY = 0.98
# Observations before a model answers: the prefill model has three coefficients, and three
# is the fewest that can pin them. The fetch model uses the same so that neither decides on a
# cold start from fewer than three measurements (with two, one outlier would be the line).
PREFILL_MIN_OBSERVATIONS = 3
FETCH_MIN_OBSERVATIONS = 3
# A fit solves the Gram matrix scaled to a unit diagonal, where a pivot is 1 - r^2 for the
# partial correlation r of a feature with the others. Below this the features are collinear
# to within rounding (the solve would amplify float64's 2.2e-16 by more than 1e9), so that
# subset is not identifiable from the data and a simpler fit is used instead.
SINGULAR_PIVOT = 1e-9
# Two fits whose weighted squared residuals differ by less than this share of the weighted
# sum of y^2 explain the data equally well (float64 rounding in `residual` is ~1e-16 of it);
# the one earlier in the preference order (more features, then the plainer ones) wins.
RESIDUAL_TIE = 1e-9

# Prefill features: a fixed cost per forward, a cost per token, a cost per query-key pair.
_FIXED, _TOKENS, _PAIRS = 0, 1, 2
# Subsets tried, in order of preference among equally good fits: the full model, then models
# that keep the per-token cost (every forward pays it), the fixed cost alone last.
_PREFILL_SUBSETS = ((_FIXED, _TOKENS, _PAIRS), (_FIXED, _TOKENS), (_TOKENS, _PAIRS),
                    (_FIXED, _PAIRS), (_TOKENS,), (_PAIRS,), (_FIXED,))
# Fetch features: latency, seconds per byte. Every subset keeps seconds per byte > 0, so the
# bandwidth is finite: a fit with latency alone would promise infinite bandwidth, the most
# optimistic answer where the data cannot tell (all fetches one size: a rate through 0).
_LATENCY, _PER_BYTE = 0, 1
_FETCH_SUBSETS = ((_LATENCY, _PER_BYTE), (_PER_BYTE,))


class PrefillCoefficients(NamedTuple):
    """A fitted forward-time model: seconds = fixed_s + per_token_s * tokens
    + per_pair_s * query-key pairs. All >= 0."""

    fixed_s: float
    per_token_s: float
    per_pair_s: float


class Split(NamedTuple):
    """How to serve an L3 hit: pages [0, head_pages) recomputed, [head_pages, hit) fetched."""

    head_pages: int           # recomputed on the device, from the start of the hit
    tail_pages: int           # fetched from L3 (head_pages + tail_pages == hit pages)
    seconds: float            # estimated time until both are done: max(head, tail)
    recompute_seconds: float  # estimate for recomputing the whole hit
    fetch_seconds: float      # estimate for fetching the whole hit


class _DecayedLeastSquares:
    """min over c of sum_i w_i (y_i - c . x_i)^2, w_i = decay^(observations after i), with c > 0
    on one of `subsets` of the features and 0 off it: the exact non-negative least squares
    fit, found by solving each subset and keeping the best feasible one (few features, so
    every active set is tried). Kept as the weighted normal equations X^T W X, X^T W y, plus
    y^T W y for residuals; O(features^2) memory whatever the number of observations."""

    def __init__(self, num_features: int, decay: float,
                 subsets: tuple[tuple[int, ...], ...]) -> None:
        self._decay = decay
        self._subsets = subsets
        self._gram = [[0.0] * num_features for _ in range(num_features)]  # X^T W X
        self._moment = [0.0] * num_features  # X^T W y
        self._energy = 0.0  # y^T W y

    def add(self, x: Sequence[float], y: float) -> bool:
        """Weigh the old observations by `decay` and add (x, y). False (and nothing changed)
        when the sums would overflow to a non-finite value."""
        d = self._decay
        gram = [[d * g + xi * xj for g, xj in zip(row, x)] for row, xi in zip(self._gram, x)]
        moment = [d * m + xi * y for m, xi in zip(self._moment, x)]
        energy = d * self._energy + y * y
        if not all(math.isfinite(v) for v in (energy, *moment, *(g for r in gram for g in r))):
            return False
        self._gram, self._moment, self._energy = gram, moment, energy
        return True

    def solve(self) -> tuple[float, ...] | None:
        """The coefficients of every feature (0 off the chosen subset), or None when no subset
        can be solved with all its coefficients > 0."""
        fits = []
        for subset in self._subsets:
            coef = self._solve_subset(subset)
            if coef is not None and min(coef) > 0:
                fits.append((self._residual(subset, coef), subset, coef))
        if not fits:
            return None
        lowest = min(residual for residual, _, _ in fits)
        tie = RESIDUAL_TIE * self._energy
        _, subset, coef = next(fit for fit in fits if fit[0] <= lowest + tie)
        full = [0.0] * len(self._moment)
        for j, c in zip(subset, coef):
            full[j] = c
        return tuple(full)

    def _solve_subset(self, subset: tuple[int, ...]) -> list[float] | None:
        """The least squares fit on `subset` alone; None where it is not identifiable."""
        scale = [math.sqrt(self._gram[j][j]) for j in subset]
        if min(scale) <= 0:
            return None
        matrix = [[self._gram[i][j] / (si * sj) for j, sj in zip(subset, scale)]
                  for i, si in zip(subset, scale)]
        rhs = [self._moment[j] / s for j, s in zip(subset, scale)]
        z = _solve_spd(matrix, rhs)
        if z is None:
            return None
        coef = [zj / s for zj, s in zip(z, scale)]
        return coef if all(math.isfinite(c) for c in coef) else None

    def _residual(self, subset: tuple[int, ...], coef: list[float]) -> float:
        """sum_i w_i (y_i - c . x_i)^2 = y'Wy - 2 c'X'Wy + c'X'WXc, for c on `subset`."""
        fitted = sum(ci * self._moment[i] for i, ci in zip(subset, coef))
        quadratic = sum(ci * cj * self._gram[i][j]
                        for i, ci in zip(subset, coef) for j, cj in zip(subset, coef))
        return self._energy - 2.0 * fitted + quadratic


def _solve_spd(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Solve a small symmetric positive semi-definite system with a unit diagonal by Gaussian
    elimination (no pivoting needed for SPD); None when a pivot is below SINGULAR_PIVOT."""
    n = len(rhs)
    a = [row[:] + [b] for row, b in zip(matrix, rhs)]  # augmented [A | b], n x (n + 1)
    for k in range(n):
        if a[k][k] < SINGULAR_PIVOT:
            return None
        for i in range(k + 1, n):
            factor = a[i][k] / a[k][k]
            for j in range(k, n + 1):
                a[i][j] -= factor * a[k][j]
    z = [0.0] * n
    for k in reversed(range(n)):
        z[k] = (a[k][n] - sum(a[k][j] * z[j] for j in range(k + 1, n))) / a[k][k]
    return z


def _check_decay(decay: float, min_observations: int) -> None:
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"decay must be in (0, 1] (1 = never forget), got {decay!r}")
    if min_observations < 1:
        raise ValueError(f"min_observations must be >= 1, got {min_observations!r}")


def _usable_seconds(seconds: float) -> bool:
    """A timing worth fitting: finite and > 0 (a clock that went backwards, or a NaN, is not)."""
    return math.isfinite(seconds) and seconds > 0


def _pairs(prefix: int, extend: int) -> int:
    """Query-key pairs of a row: `extend` queries over `prefix` cached keys and, causally,
    themselves: extend * (prefix + (extend + 1) / 2), exact in integers (the product is even)."""
    return extend * (2 * prefix + extend + 1) // 2


def _check_row(prefix: int, extend: int) -> None:
    if prefix < 0 or extend < 0:
        raise ValueError(f"a row is (prefix_tokens, extend_tokens), both >= 0, "
                         f"got ({prefix!r}, {extend!r})")


class PrefillCost:
    """Online estimate of this engine's forward time. A forward pass runs a batch of rows,
    each (prefix_tokens, extend_tokens): `extend` new tokens attending to `prefix` cached ones
    plus themselves (a decode row is (context, 1)). Model:
        seconds = c0 + c1 * tokens + c2 * attention
        tokens    = sum(extend)
        attention = sum(extend * (prefix + (extend + 1) / 2))   # query-key pairs
    fitted by exponentially weighted least squares (forgetting factor `decay` per forward,
    so it follows a machine whose speed drifts), with the coefficients kept >= 0.

    Threading: scheduler thread only (it times each forward and asks for estimates)."""

    def __init__(self, decay: float = PREFILL_DECAY,
                 min_observations: int = PREFILL_MIN_OBSERVATIONS) -> None:
        _check_decay(decay, min_observations)
        self._fit = _DecayedLeastSquares(3, decay, _PREFILL_SUBSETS)
        self._min_observations = min_observations
        self._observations = 0
        self._coefficients: PrefillCoefficients | None = None
        self._stale = False  # observations since `_coefficients` was solved

    def observe(self, rows: Sequence[tuple[int, int]], seconds: float) -> None:
        """One forward of `rows` took `seconds` (wall time, seconds). A timing that is not
        finite and > 0, or a batch with no tokens, is ignored."""
        for prefix, extend in rows:
            _check_row(prefix, extend)
        tokens = sum(extend for _, extend in rows)
        if tokens == 0 or not _usable_seconds(seconds):
            return
        pairs = sum(_pairs(prefix, extend) for prefix, extend in rows)
        if self._fit.add((1.0, float(tokens), float(pairs)), seconds):
            self._observations += 1
            self._stale = True

    @property
    def coefficients(self) -> PrefillCoefficients | None:
        """The fitted model; None before `min_observations` or while nothing fits."""
        if self._observations < self._min_observations:
            return None
        if self._stale:
            coef = self._fit.solve()
            self._coefficients = None if coef is None else PrefillCoefficients(*coef)
            self._stale = False
        return self._coefficients

    def seconds(self, prefix: int, extend: int) -> float | None:
        """Estimated seconds of a forward of one prefill row; 0.0 for no new tokens (no
        forward runs); None until fitted."""
        _check_row(prefix, extend)
        c = self.coefficients
        if c is None:
            return None
        if extend == 0:
            return 0.0
        return c.fixed_s + c.per_token_s * extend + c.per_pair_s * _pairs(prefix, extend)

    def tokens_per_s(self, prefix: int, extend: int) -> float | None:
        """Estimated prefill throughput of one row (extend tokens / its seconds, tokens/s);
        None until fitted."""
        if extend < 1:
            raise ValueError(f"extend_tokens must be >= 1 for a throughput, got {extend!r}")
        seconds = self.seconds(prefix, extend)
        return None if seconds is None or seconds <= 0 else extend / seconds

    @property
    def observations(self) -> int:
        """Forwards fitted so far (ignored timings not counted)."""
        return self._observations


class FetchCost:
    """Online estimate of one backend's fetch time: seconds = latency + bytes / bandwidth,
    from whole completed fetches (wall time from the first batch's start to the last one's
    end, with however many workers ran them, so the bandwidth is that of the workers
    together), exponentially weighted least squares (forgetting factor `decay` per fetch),
    latency >= 0, bandwidth > 0 and finite. When latency cannot be told apart (every fetch
    the same size, or a fit that would need a negative latency) it is 0 and the bandwidth
    is a rate through the origin.

    Threading: scheduler thread only (it hears of completed fetches and asks for splits)."""

    def __init__(self, decay: float = FETCH_DECAY,
                 min_observations: int = FETCH_MIN_OBSERVATIONS) -> None:
        _check_decay(decay, min_observations)
        self._fit = _DecayedLeastSquares(2, decay, _FETCH_SUBSETS)
        self._min_observations = min_observations
        self._observations = 0
        self._coef: tuple[float, float] | None = None  # (latency s, seconds per byte)
        self._stale = False  # observations since `_coef` was solved

    def observe(self, nbytes: int, seconds: float) -> None:
        """A fetch of `nbytes` bytes took `seconds` (wall time, seconds). A timing that is not
        finite and > 0 is ignored. Zero-byte fetches count toward the latency only."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
        if _usable_seconds(seconds) and self._fit.add((1.0, float(nbytes)), seconds):
            self._observations += 1
            self._stale = True

    def _coefficients(self) -> tuple[float, float] | None:
        if self._observations < self._min_observations:
            return None
        if self._stale:
            coef = self._fit.solve()
            self._coef = None if coef is None else (coef[_LATENCY], coef[_PER_BYTE])
            self._stale = False
        return self._coef

    def seconds(self, nbytes: int) -> float | None:
        """Estimated seconds to fetch `nbytes` bytes; 0.0 for none (no fetch is issued);
        None until fitted."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
        coef = self._coefficients()
        if coef is None:
            return None
        return 0.0 if nbytes == 0 else coef[0] + coef[1] * nbytes

    @property
    def bandwidth_bytes_per_s(self) -> float | None:
        """Fitted bandwidth (bytes/s, > 0); None until fitted."""
        coef = self._coefficients()
        return None if coef is None else 1.0 / coef[1]

    @property
    def latency_s(self) -> float | None:
        """Fitted fixed cost of a fetch (seconds, >= 0); None until fitted."""
        coef = self._coefficients()
        return None if coef is None else coef[0]

    @property
    def observations(self) -> int:
        """Fetches fitted so far (ignored timings not counted)."""
        return self._observations


class _HitCosts:
    """The two costs of one hit as functions of head_pages k in [0, hit_pages]: `head(k)`
    (recompute pages [0, k)) is non-decreasing and `tail(k)` (fetch [k, hit)) non-increasing,
    both 0 for no pages. Both models must be fitted."""

    def __init__(self, hit_pages: int, page_tokens: int, page_bytes: int, prefix_tokens: int,
                 prefill: PrefillCost, fetch: FetchCost) -> None:
        self.hit_pages = hit_pages
        self._page_tokens, self._page_bytes = page_tokens, page_bytes
        self._prefix_tokens = prefix_tokens
        self._prefill, self._fetch = prefill, fetch

    def head(self, k: int) -> float:
        if k == 0:
            return 0.0
        seconds = self._prefill.seconds(self._prefix_tokens, k * self._page_tokens)
        return math.inf if seconds is None else seconds

    def tail(self, k: int) -> float:
        if k == self.hit_pages:
            return 0.0
        seconds = self._fetch.seconds((self.hit_pages - k) * self._page_bytes)
        return math.inf if seconds is None else seconds


def _first_true(lo: int, hi: int, predicate: Callable[[int], bool]) -> int:
    """The smallest k in [lo, hi] with predicate(k), for a predicate that is False then True
    over the range and True at hi."""
    while lo < hi:
        mid = (lo + hi) // 2
        if predicate(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _check_split_args(hit_pages: int, page_tokens: int, page_bytes: int,
                      prefix_tokens: int) -> None:
    for name, value, least in (("hit_pages", hit_pages, 0), ("page_tokens", page_tokens, 1),
                               ("page_bytes", page_bytes, 1), ("prefix_tokens", prefix_tokens, 0)):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value!r}")


def choose_split(hit_pages: int, page_tokens: int, page_bytes: int, prefix_tokens: int,
                 prefill: PrefillCost, fetch: FetchCost) -> Split | None:
    """None while either model has no estimate. Otherwise the head/tail split of an L3 hit of
    `hit_pages` pages (`page_tokens` tokens, `page_bytes` bytes each) that starts after
    `prefix_tokens` cached tokens, minimising
        max(prefill.seconds(prefix_tokens, head_pages * page_tokens),
            fetch.seconds(tail_pages * page_bytes))
    over head_pages in [0, hit_pages] (no pages cost 0 seconds on either side, not the fixed
    cost), ties broken toward fetching more (fewer pages recomputed). Exact over the integers
    in O(log hit_pages) model evaluations: head cost rises and tail cost falls with
    head_pages, so the optimum sits at their crossing. Scheduler thread."""
    _check_split_args(hit_pages, page_tokens, page_bytes, prefix_tokens)
    if (prefill.seconds(prefix_tokens, hit_pages * page_tokens) is None
            or fetch.seconds(hit_pages * page_bytes) is None):
        return None
    costs = _HitCosts(hit_pages, page_tokens, page_bytes, prefix_tokens, prefill, fetch)
    head_pages, seconds = _best_head(costs)
    return Split(head_pages, hit_pages - head_pages, seconds, costs.head(hit_pages),
                 costs.tail(0))


def _best_head(costs: _HitCosts) -> tuple[int, float]:
    """(the smallest k minimising max(head(k), tail(k)), that maximum). At the crossing
    k* = first k with head >= tail, the cost is head(k*), and it only rises after; before it
    the cost is tail(k), which falls towards k* - 1, so the best there is the first k whose
    tail is down to tail(k* - 1)."""
    crossing = _first_true(0, costs.hit_pages, lambda k: costs.head(k) >= costs.tail(k))
    best, seconds = crossing, costs.head(crossing)
    if crossing > 0:
        before = costs.tail(crossing - 1)
        if before <= seconds:
            best = _first_true(0, crossing - 1, lambda k: costs.tail(k) <= before)
            seconds = before
    return best, seconds
