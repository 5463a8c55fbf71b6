"""The cache's admin operations behind the Engine (and the admin HTTP routes): flush, pins,
sessions, stats and the load report. Each check runs on the caller's thread; each change
runs on the scheduler thread (`run`, which waits for the answer), between steps.

Threading: any thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from hicache.door import CacheDoor
from hicache.policies import TIERS
from hicache.stack import PinRefused
from hicache.stats import CacheStats
from hicache_server.input_checks import InputChecker, pin_ttl
from hicache_server.request import InvalidRequest, check_session_id
from hicache_server.scheduler import Scheduler

# Runs a function on the scheduler thread and returns its result (`Engine._call`).
Run = Callable[..., Any]
# Computes a prefix's whole pages when they are not cached (a one-token greedy generate).
Compute = Callable[[list[int], str | None], object]


class CacheAdmin:
    def __init__(self, cache: CacheDoor, scheduler: Scheduler, checker: InputChecker,
                 run: Run, compute: Compute) -> None:
        self.cache = cache
        self.scheduler = scheduler
        self.checker = checker
        self.run = run
        self.compute = compute

    def flush(self, tiers: Sequence[str] = TIERS, *, unpin: bool = False) -> dict:
        """See `Engine.flush_cache`."""
        tiers = tuple(tiers)
        bad = [t for t in tiers if t not in TIERS]
        if bad:
            raise InvalidRequest(f"unknown tier(s) {', '.join(map(str, bad))}; "
                                 f"allowed: {', '.join(TIERS)}")

        def flush() -> dict:
            if unpin:
                self.cache.retention.unpin_all()
            return self.cache.flush(tiers)

        return self.run(flush, when_idle=True)

    # ------------------------------------------------------------------------------ pins

    def pin(self, text: str | None, input_ids: list[int] | None, extra_key: str | None,
            ttl_seconds: object) -> dict:
        """See `Engine.pin`."""
        if not self.cache.enabled:
            raise InvalidRequest("pins need the radix cache, which this server was started "
                                 "without: restart it without --disable-radix-cache")
        ids, extra_key = self.checker.pin_prefix(text, input_ids, extra_key)
        ttl = pin_ttl(ttl_seconds)
        cap = self.cache.retention.max_pinned_tokens
        if len(ids) > cap:
            raise InvalidRequest(f"pinning {len(ids)} tokens exceeds the cap "
                                 f"(cache.max_pinned_tokens) of {cap}")
        for _ in range(2):  # once more if a busy L1 evicted it before it was pinned
            self.compute(ids, extra_key)
            done = self.run(lambda: self._pin_now(ids, extra_key, ttl))
            if done is not None:
                return done
        raise InvalidRequest("the prefix was evicted before it could be pinned twice in a "
                             "row (the cache is under heavy pressure); retry later")

    def _pin_now(self, ids: list[int], extra_key: str | None, ttl: float) -> dict | None:
        """Scheduler thread: pin the cached path spelling `ids` (None: not cached)."""
        try:
            total = self.cache.retention.pin(ids, extra_key, ttl, time.monotonic())
        except PinRefused as e:
            raise InvalidRequest(str(e)) from None
        if total is None:
            return None
        return {"success": True, "pinned_tokens": len(ids), "expires_in_s": ttl,
                "total_pinned_tokens": total,
                "max_pinned_tokens": self.cache.retention.max_pinned_tokens}

    def unpin(self, text: str | None, input_ids: list[int] | None,
              extra_key: str | None) -> bool:
        """See `Engine.unpin`."""
        ids, extra_key = self.checker.pin_prefix(text, input_ids, extra_key)
        return self.run(lambda: self.cache.retention.unpin(ids, extra_key))

    # ------------------------------------------------------------------- sessions, stats

    def close_session(self, session_id: str) -> bool:
        """See `Engine.close_session`."""
        session_id = check_session_id(session_id)
        if session_id is None:
            raise InvalidRequest("`session_id` is required: the session to close")
        return self.run(lambda: self.cache.retention.close_session(session_id))

    def stats(self) -> CacheStats:
        return self.run(lambda: self.cache.stats(self.scheduler.counters))

    def load(self) -> dict[str, int]:
        """See `Engine.load`."""
        def now() -> dict[str, int]:
            sched = self.scheduler
            return {"dp_rank": 0, "num_reqs": len(sched.running),
                    "num_waiting_reqs": len(sched.waiting),
                    "num_tokens": sum(r.seq_len for r in sched.running)
                    + sum(r.prompt_len for r in sched.waiting)}
        return self.run(now)
