"""The L1 slots part of the one door (`cache.slots`, held by `hicache.stack.CacheStack`):
the device pool's free slots as a request's new tokens take them, and the tree's unlocked
pages that eviction can turn back into free ones. Sizes are in tokens (whole pages).

    a request's new tokens   alloc(tokens); free_slots()  (evict(tokens) first when short)
    admission, asked         room_beyond(hit): what eviction could free with its path held
    the model runner         device_kv(): the L1 buffers a forward reads and writes by slot

Threading: scheduler thread only, like the tree and the pool it reads.
"""

from __future__ import annotations

import torch

from hicache.handles import Hit
from hicache.memory.device import DeviceKVPool
from hicache.tree.base import PrefixCache


class SlotCalls:
    """L1 as requests use it: the device pool's slots (free, or a request's) and the tree's
    unlocked pages (evictable)."""

    def __init__(self, tree: PrefixCache, device_pool: DeviceKVPool) -> None:
        self._tree = tree
        self._pool = device_pool

    def device_kv(self) -> DeviceKVPool:
        """The L1 buffers a forward pass writes and reads by slot: the model runner's data
        plane. Every slot it touches comes from a lease or `alloc`."""
        return self._pool

    def alloc(self, tokens: int) -> torch.Tensor | None:
        """`tokens` free L1 slots (whole pages) for a request's new tokens; None when fewer
        are free (`evict` first)."""
        return self._pool.alloc(tokens)

    def free_slots(self) -> int:
        """L1 tokens free now (not the tree's, not a request's)."""
        return self._pool.available_size()

    def device_capacity(self) -> int:
        """L1 tokens in all (free, the tree's and the requests')."""
        return self._pool.allocator.total_size()

    def evict(self, tokens: int) -> int:
        """Free at least `tokens` L1 tokens of unlocked pages if possible; the tokens freed."""
        return self._tree.evict(tokens)

    def evictable_size(self) -> int:
        """L1 tokens of the tree's unlocked pages (what `evict` could free)."""
        return self._tree.evictable_size()

    def room_beyond(self, hit: Hit) -> int:
        """L1 tokens eviction could free with `hit`'s path held: the evictable ones off its
        path, less the pinned ones that cannot leave L1."""
        end = hit._device_end
        return (self._tree.evictable_size() - self._tree.unlocked_on_path(end)
                - self._tree.retention.stuck_pinned_size(end))
