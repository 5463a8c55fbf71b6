"""The stack's link to the storage tier (L3), held by `hicache.stack.CacheStack` and read by
its parts: the tier when one is attached (`tier`, None otherwise), the backups of the nodes
that reach L2, the tier's acks, its stats, its clear, attach and detach. Not a part of the
door: the server reaches L3 through `cache.l3` (`hicache.stack_l3.L3Calls`).

    each step   backup(the nodes that reached L2), check() the tier's acks (`cache.steps`)
    admin       attach(tier) / detach() (`cache.admin`), clear() (`flush`), stats()

Threading: scheduler thread only, like the stack.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

from hicache.stats import StorageStats
from hicache.storage.page_format import HEADER_BYTES
from hicache.storage.tier import StorageTier
from hicache.tree.base import PrefixCache
from hicache.tree.node import TreeNode

logger = logging.getLogger("hicache.stack")


class StorageLink:
    """The L3 tier as the stack sees it: `tier` None until (unless) one is attached."""

    def __init__(self, tree: PrefixCache, tier: StorageTier | None = None) -> None:
        self.tree = tree
        self.tier = tier
        # the metrics hook (`cache.admin.set_observer`), kept for a tier attached later
        self.observer: Callable[[str, float], None] | None = None

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

    def detach(self, tier: StorageTier) -> None:
        """Close the attached `tier` (its prefetches and backups finish first) and forget
        which nodes it held. The caller has quiesced the copies."""
        self.tier = None
        try:
            tier.close()
        except Exception:  # the tier is gone either way: the detach stands
            logger.exception("closing L3 at its detach failed; the server goes on without it")
        finally:
            self.tree.host.forget_stored()

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
