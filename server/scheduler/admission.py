"""Admission: which waiting request goes next, and whether it fits, asked and then committed.

    order    longest cached prefix first (LPM: a peek that touches nothing), first come
             first served among equals and past MAX_LPM_SCAN waiting requests
    ask      `plan(req)`: the prefetch policy lets it in (its prefetch then ends, the pages it
             fetched join the tree); its match (of `cache_key`: a request that wants prompt
             logprobs from position k matches its first k tokens only); whether L1 can
             promise what it needs from free slots plus what eviction can free beyond its
             own hit. Changes no room.
    commit   `commit(req, plan)`: lock the hit, evict what the plan counted on, load the L2
             hit back, reserve the rest. Nothing here fails for lack of room, so nothing is
             undone; an exception (a bug) fails the request alone, and `RequestKV.release`
             lets go of the lock it took (`req.last_node` is set the moment it is held).

Arrival also starts the request's L3 prefetch (`start_prefetch`), so its pages travel while
it waits.

Threading: scheduler thread.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hicache.stack import CacheStack
from hicache.storage.tier import Resume
from hicache.tree.base import MatchResult
from server.request import Request
from server.scheduler.kv import cache_key, pages_up

# Waiting requests ranked by cached prefix each step; past this many, first come first served
# (matching every request every step would cost more than it saves; SGLang does the same).
MAX_LPM_SCAN = 128


class AdmitPlan(NamedTuple):
    match: MatchResult
    need_tokens: int   # L1 tokens to promise: slots for the L2 hit's load-back and the rest
    evict_tokens: int  # of those, what eviction must free first (0: free slots suffice)


class Admission:
    def __init__(self, cache: CacheStack, running: list[Request]) -> None:
        self.cache = cache
        self.tree = cache.tree
        self.pool = cache.device_pool
        self.page_size = cache.page_size
        self.running = running  # the scheduler's list: their reservations are spoken for

    def order(self, waiting: list[Request]) -> list[Request]:
        if len(waiting) > MAX_LPM_SCAN:
            return list(waiting)

        def hit(req: Request) -> int:
            return self.tree.peek_prefix(cache_key(req), req.extra_key)
        return sorted(waiting, key=hit, reverse=True)  # stable: FCFS among equals

    def start_prefetch(self, req: Request, resume: Resume | None = None) -> None:
        """Start the request's L3 prefetch, if there is L3 and something worth fetching."""
        self.cache.prefetch(req.rid, cache_key(req), req.extra_key, resume)

    # ------------------------------------------------------------------------ ask

    def plan(self, req: Request) -> AdmitPlan | None:
        """Whether `req` may be admitted now, and what it needs; None leaves it waiting."""
        if not self.cache.prefetch_ready(req.rid):
            return None
        req.from_storage += self.cache.end_prefetch(req.rid)  # kept: it may wait on
        m = self.tree.match_prefix(cache_key(req), req.extra_key)
        # The L2 hit needs device slots for its load-back; the rest (prompt beyond both
        # hits, and every token it may generate) in whole pages. Both are whole pages.
        need = m.host_hit_length + pages_up(
            req.prompt_len - m.device_indices.numel() - m.host_hit_length
            + req.params.max_new_tokens, self.page_size)
        short = need - self._free_tokens()
        if short <= 0:
            return AdmitPlan(m, need, 0)
        evictable = self.tree.evictable_size() - self.tree.unlocked_on_path(m.last_device_node)
        return AdmitPlan(m, need, short) if evictable >= short else None

    def _free_tokens(self) -> int:
        """Free L1 slots not promised to a running request."""
        return self.pool.available_size() - sum(r.reserved for r in self.running)

    # --------------------------------------------------------------------- commit

    def commit(self, req: Request, plan: AdmitPlan) -> None:
        """Lock, evict, load back, reserve (see the module docstring)."""
        m = plan.match
        self.tree.inc_lock_ref(m.last_device_node)
        req.last_node = m.last_device_node
        if plan.evict_tokens:
            self._evict_keeping(m, plan.evict_tokens)
        prefix, loaded = m.device_indices, 0
        if m.host_hit_length:
            lb = self.tree.init_load_back(m.last_host_node)
            if lb.device_indices.numel():
                prefix = torch.cat([prefix, lb.device_indices])
                loaded = lb.device_indices.numel()
                self.tree.inc_lock_ref(lb.last_node)
                self.tree.dec_lock_ref(req.last_node)
                req.last_node = lb.last_node
        # Not loaded back (too short to pay, or no room): recomputed, in the reservation.
        need = pages_up(req.prompt_len - len(prefix) + req.params.max_new_tokens,
                        self.page_size)
        assert need <= self._free_tokens(), (
            f"admission promised {plan.need_tokens} tokens, {self._free_tokens()} are free")
        req.kv_slots, req.reserved = prefix, need
        req.num_computed = req.tree_len = len(prefix)
        storage = min(req.from_storage, loaded)
        req.cached_details = {"device": m.device_indices.numel(), "host": loaded - storage,
                              "storage": storage}

    def _evict_keeping(self, m: MatchResult, tokens: int) -> None:
        """Evict L1 `tokens` while the match's L2 pages are kept (an L1 eviction may make
        room in L2 for its write-back)."""
        if not m.host_hit_length:
            self.tree.evict(tokens)
            return
        self.tree.protect_host(m.last_host_node)
        try:
            self.tree.evict(tokens)
        finally:
            self.tree.release_host(m.last_host_node)
