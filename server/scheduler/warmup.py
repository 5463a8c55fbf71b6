"""Timed forwards at start, so that the storage tier's cost model knows this engine's prefill
rate before the first request (`storage.prefill_warmup_s`): an L3 hit after a restart is
decided from the first request, not after three forwards.

    untimed   one forward of WARMUP_LENGTHS[0] tokens: first-call costs (weight packing,
              allocations, thread pools) out of the way
    timed     forwards of WARMUP_LENGTHS tokens from scratch, in order, each observed by the
              prefill model as a forward of one row (0, n): the first MIN_TIMED always;
              after them, the next is skipped when its estimate (the last one's seconds,
              scaled by its length) would pass the budget

Runs on the scheduler thread (its thread pool is the one that serves) before the loop takes
its first request; the engine's constructor returns once it is done, so no request is timed
behind it. The forwards borrow KV slots from the pool and give them back: the tree and the
tiers see nothing.
"""

from __future__ import annotations

import logging
import time

from hicache.door import CacheDoor
from hicache_server.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Lengths of the timed forwards: sizes 4x apart, so that the model's fixed, per-token and
# per-pair costs are told apart (a 512-token forward has 256x the pairs of a 32-token one).
WARMUP_LENGTHS = (32, 128, 512, 2048)
# The first forwards are timed whatever the budget (together ~1/3 of a 2k-token prefill):
# the prefill model has three coefficients and answers from three observations, and a
# budget spent by a loaded machine must not leave it without them.
MIN_TIMED = 3


def warm_up_prefill(runner: ModelRunner, cache: CacheDoor, budget_s: float,
                    max_tokens: int) -> list[tuple[int, float]]:
    """The timed forwards (tokens, seconds), observed by `cache`'s cost model; none without a
    storage tier, a budget, or room."""
    if budget_s <= 0 or "storage" not in cache.admin.tiers():
        return []
    try:
        return _timed_forwards(runner, cache, budget_s, max_tokens)
    except Exception as exc:  # noqa: BLE001 - a warm-up is an optimisation, never fatal
        logger.warning("prefill warm-up failed (%r); the cost model learns from the first "
                       "requests instead", exc)
        return []


def _timed_forwards(runner: ModelRunner, cache: CacheDoor, budget_s: float,
                    max_tokens: int) -> list[tuple[int, float]]:
    lengths = [n for n in WARMUP_LENGTHS if n <= max_tokens]
    if not lengths or runner.timed_prefill(lengths[0]) is None:
        return []
    started, timed = time.perf_counter(), []
    for n in lengths:
        left = budget_s - (time.perf_counter() - started)
        if len(timed) >= MIN_TIMED:
            last_n, last_s = timed[-1]
            if last_s * n / last_n > left:
                break
        seconds = runner.timed_prefill(n)
        if seconds is None:
            break
        timed.append((n, seconds))
        cache.l3.observe_forward([(0, n)], seconds)
    estimates = cache.l3.estimates()
    rate = None if estimates is None else estimates.prefill_tokens_per_s
    logger.info("prefill warm-up (storage.prefill_warmup_s %.1f): %s; estimate %s", budget_s,
                ", ".join(f"{n} tokens in {s * 1000:.0f} ms" for n, s in timed),
                "unknown (too few forwards)" if rate is None else f"{rate:.0f} tokens/s")
    return timed
