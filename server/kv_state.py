"""A request's place in the KV cache: the part of a `Request` the scheduler's KV code
(`hicache_server.scheduler.kv`, admission, retraction, the model runner) reads and writes.

Its device slots, from admission to finish (`slots`, token positions):

    [0, tree_len)              the tree's slots, locked through `lease`; the tree frees them
                               (on eviction), never the request
    [tree_len, num_computed)   KV this request computed; at its prefill's end
                               (`cache_prompt`) and at finish they go to the tree, which
                               hands back the duplicates of pages it already had
    [num_computed, len)        allocated for the step in flight; the request frees them
    + `reserved` tokens        promised by admission for the rest of its fill, not yet
                               allocated; the tokens it generates are allocated as they
                               come, from what no one was promised

A retracted request (L1 ran out while it decoded) gave all of this back, its computed pages
to the tree, and waits with its output kept; readmitted, it matches its prompt and output
from the tree and fills the rest. `tree_len` grows when the prompt is cached; `admit_hit` is
what this admission took from the cache; `cached_details` (per tier) is fixed at the first
admission: prompt tokens served from the cache, not computed.

Threading: scheduler thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hicache.handles import Lease


def _no_tiers() -> dict[str, int]:
    return {"device": 0, "host": 0, "storage": 0}


@dataclass(eq=False)
class KVState:
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    num_computed: int = 0      # tokens whose K/V are in slots
    tree_len: int = 0          # leading slots owned by the tree (locked), not by the request
    lease: Lease | None = None  # the cache's lock on `[0, tree_len)`
    reserved: int = 0          # L1 tokens set aside for the rest of this request's fill
    admit_hit: int = 0         # tokens this admission found cached (not computed by it)
    retractions: int = 0       # times it was put back in the queue for lack of L1 slots
    from_storage: int = 0      # tokens its prefetch brought from L3 into L2
    head_stop: int = 0         # > 0: this admission computes up to here only; the rest of
                               # its L3 hit (the tail) is fetched meanwhile (storage tier)
    tail_pending: bool = False  # it computed its head; its next admission takes the tail
    cached_details: dict[str, int] = field(default_factory=_no_tiers)

    @property
    def cache_hit_tokens(self) -> int:
        """Prompt tokens served from the cache, not computed (all tiers)."""
        return sum(self.cached_details.values())
