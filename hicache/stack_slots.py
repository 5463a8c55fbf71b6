"""The L1 slots part of the one door (`cache.slots`, held by `hicache.stack.CacheStack`):
the device pool's free slots as a request's new tokens take them, and the tree's unlocked
pages that eviction can turn back into free ones. Sizes are in tokens (whole pages).

    a request's new tokens   alloc(tokens); free_slots()  (evict(tokens) first when short)
    admission, asked         room_beyond(hit): what eviction could free with its path held;
                             window_fits(tokens): whether the window layers can take a step
    the model runner         device_kv(): the L1 buffers a forward reads and writes by slot
    a step's end             leave_window(slots, shared, start, upto): a hybrid model's
                             window layers give back what no later query of it reads

A hybrid model's L1 has two kinds of slot (`WindowedKVPool`): every token takes a full one,
a token in some window a window one too. The full slots are counted, promised and reserved
as for any model; the window slots are taken a step at a time and given back as requests
move on, so they are not promised: `alloc` tombstones the tree's window KV (`WindowKV`) when
the window pool is short, and may still return None (the scheduler then runs the request a
step later, or retracts one, as for a decode without room); admission waits while
`window_fits` says the window pool cannot take the request's first step.

Threading: scheduler thread only, like the tree and the pool it reads.
"""

from __future__ import annotations

import torch

from hicache.handles import Hit
from hicache.memory.device import DeviceKVPool
from hicache.memory.windowed import STEP_TOKENS
from hicache.pages import pages_down
from hicache.tree.base import PrefixCache


class SlotCalls:
    """L1 as requests use it: the device pool's slots (free, or a request's) and the tree's
    unlocked pages (evictable)."""

    has_windows: bool = False  # a hybrid model's split L1 (`WindowedKVPool`)

    def __init__(self, tree: PrefixCache, device_pool: DeviceKVPool) -> None:
        self._tree = tree
        self._pool = device_pool
        self._windows = tree.windows  # None: every layer by the same slots
        self.has_windows = self._windows is not None

    def device_kv(self) -> DeviceKVPool:
        """The L1 buffers a forward pass writes and reads by slot: the model runner's data
        plane. Every slot it touches comes from a lease or `alloc`."""
        return self._pool

    def alloc(self, tokens: int) -> torch.Tensor | None:
        """`tokens` free L1 slots (whole pages) for a request's new tokens; None when fewer
        are free (`evict` first), or, for a hybrid model, when the window pool cannot give
        them even after tombstoning and letting the L2 copies in flight land."""
        if self._windows is None:
            return self._pool.alloc(tokens)
        self._windows.make_room(tokens)
        slots = self._pool.alloc(tokens)
        if slots is None and self._tree.host.copies_pending():
            # a node being copied to L2 keeps its window KV until the copy lands (its L3
            # backup follows at the next poll)
            self._tree.host.writing_check(wait=True, claim=False)
            self._windows.make_room(tokens)
            slots = self._pool.alloc(tokens)
        return slots

    def free_slots(self) -> int:
        """L1 tokens free now (not the tree's, not a request's): full slots."""
        return self._pool.available_size()

    def window_fits(self, tokens: int) -> bool:
        """Whether a request filling `tokens` more can take its next step's window-layer
        slots now (always, without window layers): a step's tokens at most, and what its
        next query reads, which its lease keeps (at most the window pool), against the free
        window slots and the window KV the tree may tombstone."""
        if self._windows is None:
            return True
        need = min(min(tokens, STEP_TOKENS) + self._windows.window + self._pool.page_size,
                   self._pool.window_capacity())
        return self._pool.window_available() + self._windows.tombstonable >= need

    def leave_window(self, slots: torch.Tensor, shared: int, start: int, upto: int) -> None:
        """A request computed its tokens from `start` up to `upto`: its own window slots
        (past the first `shared`, the tree's) before what a query at its last page boundary
        short of `upto` reads are spare: the pool takes them back first when short
        (`WindowedKVPool.spare_window`; those before the same cut at `start` went at its
        previous step). That boundary is where the tree can reuse them: a hit ends on a page,
        and the same prompt again computes at least its last token."""
        if self._windows is not None:
            ps = self._tree.page_size
            first = max(shared, self._windows.needed_from(pages_down(start - 1, ps)))
            cut = self._windows.needed_from(pages_down(upto - 1, ps))
            if cut > first:
                self._pool.spare_window(slots[first:cut])

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
