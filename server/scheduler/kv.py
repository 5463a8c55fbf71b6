"""A request's device slots: allocated ahead of each step, handed to the tree when its prompt
is prefilled and when it finishes (or is retracted), released on the way out. The regions and
who frees each are drawn on `hicache_server.request.Request`.

    fill      the prompt's rest (after a retraction: prompt and output beyond the tree's hit)
              comes from the request's `reserved` tokens, promised at admission: never fails
    decode    each new token's page comes from the free slots no one was promised, evicting
              the tree's unlocked pages when they fall short; this can fail (admission only
              estimated it), and then the scheduler retracts a request

One request is one use of each node it uses (`hit_count`: lfu, write_through_selective):
its matches (at arrival, at each admission attempt) and its prompt's insert after prefill
count nothing; `release` counts it once, at its end (a retraction is no end). Every match
and insert raises the nodes' priority to the request's (the `priority` eviction policy).

Threading: scheduler thread (it owns the tree and the pools).
"""

from __future__ import annotations

import torch

from hicache.door import CacheDoor
from hicache.pages import pages_down, pages_up
from hicache_server.request import Request


def cache_key(req: Request) -> list[int]:
    """What the tree is asked for (match, prefetch, LPM rank): at least one token is
    computed, for its logits; a request that wants prompt logprobs from position k asks for
    its first k tokens only (`Request.cacheable_len`). A longer cached prefix stays the
    tree's: the request computes its own copies, which the cache frees as duplicates. A
    retracted request asks for its prompt and output."""
    return req.all_ids[:req.cacheable_len]


class RequestKV:
    def __init__(self, cache: CacheDoor, running: list[Request]) -> None:
        self.cache = cache
        self.page_size = cache.page_size
        self.running = running  # the scheduler's list: their reservations are spoken for
        self.windowed = cache.slots.has_windows  # a hybrid model's shared L1

    def free_tokens(self) -> int:
        """Free L1 slots not promised to a running request."""
        return self.cache.slots.free_slots() - sum(r.kv.reserved for r in self.running)

    def ensure_slots(self, req: Request, upto: int) -> bool:
        """Allocate `req`'s slots up to position `upto` (whole pages): from its reservation
        first, the rest from the free slots no one was promised, evicting the tree's unlocked
        pages when those fall short. False, with nothing allocated, when L1 cannot give them
        (possible only beyond the reservation, a decode; or for a hybrid model's window
        slots, which are taken a step at a time and never promised)."""
        missing = pages_up(upto - len(req.kv.slots), self.page_size)
        if missing <= 0:
            return True
        extra = missing - min(missing, req.kv.reserved)
        if extra > self.free_tokens():
            self.cache.slots.evict(extra - self.free_tokens())
            if extra > self.free_tokens():
                return False
        slots = self.cache.slots.alloc(missing)  # reserved or free and unpromised: full slots
        if slots is None:  # cannot fail but for a hybrid model's window slots (never promised)
            assert self.cache.slots.has_windows, (
                f"L1 has {self.cache.slots.free_slots()} free, {missing} asked")
            return False
        req.kv.reserved -= missing - extra
        req.kv.slots = torch.cat([req.kv.slots, slots])
        return True

    def leave_window(self, req: Request, computed: int) -> None:
        """After a forward that computed `computed` more of `req`'s tokens: a hybrid model's
        window layers give back the request's own slots that no later query of it reads."""
        if self.windowed:
            end = req.kv.num_computed
            self.cache.slots.leave_window(req.kv.slots, req.kv.tree_len, end - computed, end)

    def cache_prompt(self, req: Request) -> None:
        """Give the prompt's KV to the tree as soon as its prefill is done, not when the
        request finishes: requests sharing the prompt hit it in L1 while this one decodes,
        and its pages start down to L2 and L3 (where another server may look for them)
        before the answer is out. The request keeps the path locked and reads the tree's
        slots from here on (where the tree already had some, its own copies are freed)."""
        aligned = pages_down(req.kv.num_computed, self.page_size)
        if not self.cache.enabled or aligned <= req.kv.tree_len:
            return
        req.kv.lease, slots = self.cache.cache_prefix(req.kv.lease, req.all_ids[:aligned],
                                                   req.kv.slots, req.input, req.kv.tree_len)
        req.kv.slots = torch.cat([slots, req.kv.slots[aligned:]])
        req.kv.tree_len = aligned

    def release(self, req: Request, keep_cache: bool, *, count_use: bool = True) -> None:
        """Give the request's KV to the tree (keep_cache) or back to the pool; unlock. Counts
        the request's one use of the nodes it holds and gives them (`count_use`: not when
        it only steps aside, `retract`)."""
        if req.kv.lease is None:
            return
        aligned = pages_down(req.kv.num_computed, self.page_size) if keep_cache else 0
        self.cache.release(req.kv.lease, req.all_ids[:aligned], req.kv.slots, req.input,
                           req.kv.tree_len, req.kv.admit_hit, count_use=count_use)
        req.kv.lease, req.kv.reserved = None, 0
        req.kv.slots = req.kv.slots[:0]

    def retract(self, req: Request) -> None:
        """Give back all `req` holds so it can wait and resume: its computed KV in whole pages
        (prompt and output so far) to the tree, unlocked, the rest (the unaligned tail and the
        slots of the step it will not run) to the pool, its reservation dropped. Readmitted,
        it matches that prefix back (from L1, or L2 if it was evicted meanwhile)."""
        self.release(req, keep_cache=True, count_use=False)  # counted when it finishes
        req.kv.num_computed = req.kv.tree_len = req.kv.admit_hit = 0
