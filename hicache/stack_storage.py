"""The L3 part of the one door (`cache.l3`, held by `hicache.stack.CacheStack`): the storage
tier when one is attached, and the harmless answers of a stack without one (nothing to
prefetch, every request ready, no head stop, nothing to restart, nothing in flight). Its
callers never ask which they have. A prefetch is keyed by the request's id.

    a request   prefetch at arrival; ready / head_stop / end at admission; continue_head
                and head_computed while a raced head computes (`hicache.storage.race`);
                take_restarts() each step
    the model   observe_forward (the cost model's prefill rate), estimates()
    admin       set_policy(); the stack's other parts: attach(tier) / detach(), clear(),
                backup / check / settle / busy / wait_idle (`cache.steps`), stats

Threading: scheduler thread only, like the stack.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

from hicache.handles import Lease, Resume
from hicache.policies import PREFETCH_POLICIES, check_choice
from hicache.stats import StorageStats
from hicache.storage.page_format import HEADER_BYTES
from hicache.storage.planner import CostEstimates
from hicache.storage.tier import StorageTier
from hicache.tree.base import PrefixCache
from hicache.tree.node import TreeNode

logger = logging.getLogger("hicache.stack")


class StorageCalls:
    """The L3 tier as the stack sees it: `tier` None until (unless) one is attached."""

    def __init__(self, tree: PrefixCache, tier: StorageTier | None = None) -> None:
        self.tree = tree
        self.tier = tier
        # the metrics hook (`cache.admin.set_observer`), kept for a tier attached later
        self.observer: Callable[[str, float], None] | None = None

    # ---------------------------------------------------------------------- a request

    def prefetch(self, req_id: str, key: Sequence[int], extra_key: str | None,
                 resume: Resume | None = None) -> bool:
        """Match `key` and start fetching from L3 what it has beyond its L1+L2 hit; False
        without L3 (then nothing is matched: the match would count a use) or when nothing
        is worth fetching."""
        if self.tier is None:
            return False
        m = self.tree.match_prefix(key, extra_key, count_hit=False)  # counted at its end
        hit = m.device_indices.numel() + m.host_hit_length
        return self.tier.prefetch(req_id, m.last_host_node, key[hit:], extra_key, resume,
                                  prefix_tokens=hit)

    def ready(self, req_id: str) -> bool:
        """Whether the prefetch policy lets the request be admitted now."""
        return self.tier is None or self.tier.ready(req_id)

    def head_stop(self, req_id: str) -> int:
        """Where the request stops computing next so that its L3 tail joins it; 0: none."""
        return 0 if self.tier is None else self.tier.head_stop(req_id)

    def continue_head(self, req_id: str, computed: int) -> int:
        """Its next stop past `computed`, `computed` (its head is final), or 0 (no more
        stops). See `hicache.storage.race`."""
        return 0 if self.tier is None else self.tier.continue_head(req_id, computed)

    def head_computed(self, req_id: str, lease: Lease) -> None:
        """The request computed its head, whose last page ends its `lease`'s path."""
        if self.tier is not None:
            self.tier.head_computed(req_id, lease._end)

    def end(self, req_id: str) -> int:
        """End the request's prefetch (idempotent); the tokens it brought into L2."""
        return 0 if self.tier is None else self.tier.terminate(req_id)

    def take_restarts(self) -> list[tuple[str, Resume]]:
        """Prefetches to start again after a fresh match, with the clock each keeps."""
        if self.tier is None:
            return []
        out = []
        for rid in self.tier.take_restarts():
            resume = self.tier.restart(rid)
            if resume is not None:
                out.append((rid, resume))
        return out

    # ----------------------------------------------------------------------- the model

    def observe_forward(self, rows: list[tuple[int, int]], seconds: float) -> None:
        """A forward pass of `rows` (prefix tokens, tokens computed) took `seconds`."""
        if self.tier is not None:
            self.tier.observe_forward(rows, seconds)

    def estimates(self) -> CostEstimates | None:
        return None if self.tier is None else self.tier.estimates()

    def set_policy(self, policy: str) -> None:
        check_choice("storage.prefetch_policy", policy, PREFETCH_POLICIES)
        if self.tier is not None:
            self.tier.set_policy(policy)

    # ---------------------------------------------------------------------- each step

    def backup(self, written: Sequence[TreeNode]) -> None:
        """Back up to L3 the nodes whose D->H copies were acked, parents first."""
        if self.tier is not None:
            for node in written:
                self.tier.backups.backup(node)

    def check(self) -> None:
        if self.tier is not None:
            self.tier.check()

    def settle(self, timeout_s: float) -> None:
        """Give fresh L3 queries up to `timeout_s` to answer (see `StorageTier.settle`)."""
        if self.tier is not None:
            self.tier.settle(timeout_s)

    def busy(self) -> bool:
        return self.tier is not None and self.tier.busy()

    def wait_idle(self) -> None:
        if self.tier is not None:
            self.tier.wait_idle()

    def held_host_tokens(self) -> int:
        return 0 if self.tier is None else self.tier.held_host_tokens()

    def stats(self, hit_tokens: int) -> StorageStats | None:
        if self.tier is None:
            return None
        io = self.tier.io
        return StorageStats.read(io.backend.stats(), io.errors, hit_tokens,
                                 replace(self.tier.counters), self.tier.estimates(),
                                 page_tokens=self.tier.page_size,
                                 page_bytes=HEADER_BYTES + self.tier.host_pool.page_bytes)

    # -------------------------------------------------------------------------- admin

    def clear(self) -> int:
        """Empty L3; the pages removed (0 without L3)."""
        return 0 if self.tier is None else self.tier.clear()

    def attach(self, tier: StorageTier) -> None:
        """Serve through `tier` from now on, backing up to it what L2 holds (parents
        first; a chain L3 holds already is skipped). The caller has quiesced the copies."""
        tier.observer = self.observer
        self.tier = tier
        for node in self.tree.iter_nodes():
            if node.host_value is not None:
                tier.backups.backup(node)

    def detach(self) -> bool:
        """Close L3 (its prefetches and backups finish first) and forget which nodes it
        held; False when none was attached. The caller has quiesced the copies."""
        if self.tier is None:
            return False
        tier, self.tier = self.tier, None
        try:
            tier.close()
        except Exception:  # the tier is gone either way: the detach stands
            logger.exception("closing L3 at its detach failed; the server goes on without it")
        finally:
            self.tree.host.forget_stored()
        return True

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
