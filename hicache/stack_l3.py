"""The L3 part of the one door (`cache.l3`, held by `hicache.stack.CacheStack`): a request's
prefetch from the storage tier and the race of its computed head against its fetched tail,
keyed by the request's id; the cost model and the prefetch policy. Without L3 (none
configured, or detached) every call has a harmless answer: nothing to prefetch, every
request ready, no head stop, nothing to restart. Callers never ask which they have.

    arrival       prefetch(rid, key, extra_key)
    admission     ready(rid); head_stop(rid); end(rid) (idempotent)
    a raced head  continue_head(rid, computed); head_computed(rid, lease)
                  (`hicache.storage.race`)
    each step     take_restarts(): prefetches to start again after a fresh match
    the model     observe_forward(rows, seconds): the prefill rate the cost model learns;
                  estimates()
    admin         set_policy(policy)

Threading: scheduler thread only, like the stack.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.handles import Lease, Resume
from hicache.policies import PREFETCH_POLICIES, check_choice
from hicache.stack_storage import StorageLink
from hicache.storage.planner import CostEstimates
from hicache.tree.base import PrefixCache


class L3Calls:
    """What a request and the model ask of L3, through the stack's link to it (`link.tier`
    None while none is attached)."""

    def __init__(self, tree: PrefixCache, link: StorageLink) -> None:
        self._tree = tree
        self._link = link

    def prefetch(self, req_id: str, key: Sequence[int], extra_key: str | None,
                 resume: Resume | None = None) -> bool:
        """Match `key` and start fetching from L3 what it has beyond its L1+L2 hit; False
        without L3 (then nothing is matched: the match would count a use) or when nothing
        is worth fetching."""
        tier = self._link.tier
        if tier is None:
            return False
        m = self._tree.match_prefix(key, extra_key, count_hit=False)  # counted at its end
        hit = m.device_indices.numel() + m.host_hit_length
        return tier.prefetch(req_id, m.last_host_node, key[hit:], extra_key, resume,
                             prefix_tokens=hit)

    def ready(self, req_id: str) -> bool:
        """Whether the prefetch policy lets the request be admitted now."""
        return self._link.tier is None or self._link.tier.ready(req_id)

    def head_stop(self, req_id: str) -> int:
        """Where the request stops computing next so that its L3 tail joins it; 0: none."""
        return 0 if self._link.tier is None else self._link.tier.head_stop(req_id)

    def continue_head(self, req_id: str, computed: int) -> int:
        """Its next stop past `computed`, `computed` (its head is final), or 0 (no more
        stops). See `hicache.storage.race`."""
        tier = self._link.tier
        return 0 if tier is None else tier.continue_head(req_id, computed)

    def head_computed(self, req_id: str, lease: Lease) -> None:
        """The request computed its head, whose last page ends its `lease`'s path."""
        if self._link.tier is not None:
            self._link.tier.head_computed(req_id, lease._end)

    def end(self, req_id: str) -> int:
        """End the request's prefetch (idempotent); the tokens it brought into L2."""
        return 0 if self._link.tier is None else self._link.tier.terminate(req_id)

    def take_restarts(self) -> list[tuple[str, Resume]]:
        """Prefetches to start again after a fresh match, with the clock each keeps."""
        tier = self._link.tier
        if tier is None:
            return []
        out = []
        for rid in tier.take_restarts():
            resume = tier.restart(rid)
            if resume is not None:
                out.append((rid, resume))
        return out

    def observe_forward(self, rows: list[tuple[int, int]], seconds: float) -> None:
        """A forward pass of `rows` (prefix tokens, tokens computed) took `seconds`: what the
        storage tier's cost model learns this engine's prefill rate from."""
        if self._link.tier is not None:
            self._link.tier.observe_forward(rows, seconds)

    def estimates(self) -> CostEstimates | None:
        """What the storage tier's cost model estimates now; None without L3."""
        return None if self._link.tier is None else self._link.tier.estimates()

    def set_policy(self, policy: str) -> None:
        """The attached L3's prefetch policy from now on (SGLang's re-attach of the same
        backend updates it); admissions read it at each check."""
        check_choice("storage.prefetch_policy", policy, PREFETCH_POLICIES)
        if self._link.tier is not None:
            self._link.tier.set_policy(policy)
