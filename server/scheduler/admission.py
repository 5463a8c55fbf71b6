"""Admission: which waiting request goes next, and whether it fits, asked and then committed.

    order    the schedule policy's (`policy.py`: lpm, the default, is longest cached
             prefix first, a peek that touches nothing; fcfs; random; dfs-weight); with a
             cache-aware one, a request whose uncached prefix a prefill in flight computes
             waits a step or a few to hit it (`sharing`: delay scheduling)
    ask      `plan(req)`: the prefetch policy lets it in (its prefetch then ends, the pages it
             fetched join the tree); its match (of `cache_key`: a request that wants prompt
             logprobs from position k matches its first k tokens only; a retracted one its
             prompt and output); whether L1 has room for its fill and its estimated new
             tokens beside the running requests' estimated new tokens (`NewTokenRatio`),
             from free slots plus what eviction can free beyond its own hit. Changes no room.
    commit   `commit(req, plan)`: lock the hit, evict what its fill needs now, load the L2
             hit back, reserve the fill. Nothing here fails for lack of room, so nothing is
             undone; an exception (a bug) fails the request alone, and the cache lets go
             of the lock it took (`CacheDoor.admit`; `req.kv.lease` is set once it returns).

Only the fill is reserved: the tokens a request generates are allocated step by step from
what is free, as SGLang does. When the estimate was too low and a decode finds no slot, the
scheduler retracts running requests (`retraction.py`) and the ratio goes back up.

Arrival also starts the request's L3 prefetch (`start_prefetch`), so its pages travel while
it waits. When the storage tier split its hit (compute the head, load the tail), the first
admission fills only up to `head_stop`, the prefetch running on; the scheduler then puts the
request back (`Scheduler._wait_for_tail`), and its next admission ends the prefetch, which
hangs the tail below the head, and matches both.

Threading: scheduler thread.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from hicache.door import CacheDoor
from hicache.handles import Hit, Resume
from hicache.pages import pages_up
from hicache_server.request import Request
from hicache_server.scheduler.kv import RequestKV, cache_key
from hicache_server.scheduler.policy import InBatchSharing, filling, make_policy

# The new-token estimate, SGLang's defaults (global_config / ServerArgs with
# schedule_conservativeness 1): start at 0.7 of every request's remaining max_new_tokens, fall
# linearly to 0.7 * 0.14 over 600 decode steps, and after a retraction jump to what the
# requests left running have decoded plus RETRACT_DECODE_STEPS tokens each, over their
# max_new_tokens. The estimate of one request counts at most CLIP_MAX_NEW_TOKENS of its
# remaining tokens (SGLang's SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION default).
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20
CLIP_MAX_NEW_TOKENS = 4096


class NewTokenRatio:
    """The share of its remaining `max_new_tokens` a request is expected to still generate:
    what admission keeps room for, for each running request and the one it asks about."""

    def __init__(self, init: float = INIT_NEW_TOKEN_RATIO,
                 min_factor: float = MIN_NEW_TOKEN_RATIO_FACTOR,
                 decay_steps: int = NEW_TOKEN_RATIO_DECAY_STEPS) -> None:
        self.init = init
        self.min = init * min_factor
        self.decay_per_step = (init - self.min) / decay_steps
        self.value = init

    def estimate(self, req: Request) -> int:
        """Tokens `req` is expected to generate still, rounded up."""
        left = min(req.input.params.max_new_tokens - len(req.output.ids), CLIP_MAX_NEW_TOKENS)
        return math.ceil(self.value * max(left, 0))

    def decayed(self) -> None:
        """A decode step went by with room for every request: expect a little less."""
        self.value = max(self.value - self.decay_per_step, self.min)

    def retracted(self, running: Sequence[Request]) -> None:
        """A decode ran out of room: expect what the requests still running need, judging by
        what they have decoded and RETRACT_DECODE_STEPS tokens more each (SGLang's rule)."""
        decoded = sum(len(r.output.ids) for r in running)
        budget = sum(r.input.params.max_new_tokens for r in running)
        self.value = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(running)) / max(budget, 1))

    def reset(self) -> None:
        """Nothing runs: start again from the initial estimate (SGLang does so when idle)."""
        self.value = self.init


class AdmitPlan(NamedTuple):
    match: Hit
    need_tokens: int   # L1 tokens to promise now: the L2 hit's load-back and the rest of
                       # the fill (prompt, and output of a retracted request), whole pages
    evict_tokens: int  # of those, what eviction must free first (0: free slots suffice)
    stop: int = 0      # > 0: fill only up to here (its L3 tail comes meanwhile)


class Admission:
    def __init__(self, cache: CacheDoor, kv: RequestKV, schedule_policy: str = "lpm") -> None:
        self.cache = cache
        self.page_size = cache.page_size
        self.kv = kv  # its running list: their reservations and estimates are spoken for
        self.ratio = NewTokenRatio()
        self.policy = make_policy(schedule_policy, cache)
        self.delays: dict[Request, int] = {}  # waiting request -> steps delayed (sharing)

    def order(self, waiting: list[Request]) -> list[Request]:
        """The waiting requests in the order to ask them in (`SchedulePolicy.order`)."""
        return self.policy.order(waiting)

    def sharing(self, waiting: list[Request]) -> InBatchSharing:
        """This step's delay scheduling, over the running requests still filling; the
        caller tells it each request it admits (`InBatchSharing.admitted`). The delay counts
        of requests no longer waiting are dropped."""
        if self.delays:
            still = set(waiting)
            self.delays = {req: n for req, n in self.delays.items() if req in still}
        return InBatchSharing(self.cache, filter(filling, self.kv.running), self.delays,
                              self.policy.cache_aware and bool(waiting))

    def start_prefetch(self, req: Request, resume: Resume | None = None) -> None:
        """Start the request's L3 prefetch, if there is L3 and something worth fetching."""
        self.cache.l3.prefetch(req.rid, cache_key(req), req.input.extra_key, resume)

    # ------------------------------------------------------------------------ ask

    def plan(self, req: Request) -> AdmitPlan | None:
        """Whether `req` may be admitted now, and what it needs; None leaves it waiting."""
        if not self.cache.l3.ready(req.rid):
            return None
        stop = self.cache.l3.head_stop(req.rid)
        if not stop:
            req.kv.from_storage += self.cache.l3.end(req.rid)  # kept: it may wait on
        # the request's use is counted once, when it releases its path (`RequestKV.release`)
        m = self.cache.match(cache_key(req), req.input)
        if stop and m.tokens >= stop:
            # the head is cached already (another request computed it): take the tail now
            req.kv.from_storage += self.cache.l3.end(req.rid)
            m = self.cache.match(cache_key(req), req.input)
            stop = 0
        # The L2 hit needs device slots for its load-back; the rest of the fill in whole
        # pages; both are promised now. Its new tokens, and the running requests', are
        # estimated: room for them is asked, nothing is promised.
        fill = m.host_tokens + pages_up((stop or req.seq_len) - m.tokens, self.page_size)
        if not self.cache.slots.window_fits(fill):
            return None  # a hybrid model's window layers cannot take its first step yet
        free = self.kv.free_tokens()
        short = fill + self.ratio.estimate(req) + self.running_estimate() - free
        if short > 0 and self.cache.slots.room_beyond(m) < short:
            return None
        return AdmitPlan(m, fill, max(0, fill - free), stop)

    def running_estimate(self) -> int:
        """Tokens the running requests are expected to generate still (`NewTokenRatio`)."""
        return sum(self.ratio.estimate(r) for r in self.kv.running)

    # --------------------------------------------------------------------- commit

    def commit(self, req: Request, plan: AdmitPlan) -> dict[str, int] | None:
        """Lock, evict, load back, reserve (see the module docstring). Returns the cached
        tokens per tier to count for this admission (None: counted before)."""
        m = plan.match
        req.kv.lease, prefix, loaded = self.cache.admit(m, plan.evict_tokens)
        # Not loaded back (too short to pay, or no room): recomputed, in the reservation.
        need = pages_up((plan.stop or req.seq_len) - len(prefix), self.page_size)
        if need > self.kv.free_tokens() and self.cache.slots.has_windows:
            # a hybrid model's pool shares its pages: the load-back's window pages came
            # out of those the plan counted free; its fill waits for room as a step's
            # window pages do (`RequestKV.ensure_slots`)
            self.cache.slots.evict(need - self.kv.free_tokens())
        assert need <= self.kv.free_tokens() or self.cache.slots.has_windows, (
            f"admission promised {plan.need_tokens} tokens, {self.kv.free_tokens()} are free")
        req.kv.slots, req.kv.reserved = prefix, need
        req.kv.num_computed = req.kv.tree_len = req.kv.admit_hit = len(prefix)
        req.kv.head_stop = plan.stop
        storage = min(req.kv.from_storage, loaded)
        if req.kv.tail_pending:  # after its head: the tail it fetched joins the first count
            req.kv.tail_pending = False
            req.kv.cached_details["storage"] += storage
            return {"device": 0, "host": 0, "storage": storage}
        if req.kv.retractions:  # a retracted request's prompt was counted once
            return None
        # what its client is told: the prompt's first admission
        # the admitted prefix: L1's hit (shorter than the match's where a hybrid model's
        # window KV could not be had) and what was loaded
        req.kv.cached_details = {"device": len(prefix) - loaded,
                              "host": loaded - storage, "storage": storage}
        return dict(req.kv.cached_details)
