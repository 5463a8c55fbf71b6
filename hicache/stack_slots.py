"""The L1 slots part of the one door (`cache.slots`, held by `hicache.stack.CacheStack`):
the device pool's free slots as a request's new tokens take them, and the tree's unlocked
pages that eviction can turn back into free ones. Sizes are in tokens (whole pages).

    a request's new tokens   alloc(tokens); free_slots()  (evict(tokens) first when short)
    admission, asked         room_beyond(hit): what eviction could free with its path held;
                             window_fits(tokens): whether the window layers can take a step
    the model runner         device_kv(): the L1 buffers a forward reads and writes by slot
    a step's end             leave_window(slots, shared, start, upto): a hybrid model's
                             window layers give back what no later query of it reads

A hybrid model's L1 has two kinds of slot in one pool of pages (`WindowedKVPool`): every
token takes a full one, a token in some window a page of each window group too. The
scheduler counts, promises and reserves tokens as for any model, each at the pages it takes
at most, its full page and a page of every group (`_units`), so what admission promises a
step can take; window slots are given back as requests move on (spare, then free). `alloc`
tombstones the tree's window KV (`WindowKV`) when the pool is short, evicts the tree's
unlocked pages when it still is, and may still return None (the scheduler then runs the
request a step later, or retracts one, as for a decode without room); admission waits
while `window_fits` says the window layers cannot take the request's first step.

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

    has_windows: bool = False  # a hybrid model's shared L1 (`WindowedKVPool`)

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
        are free (`evict` first), or, for a hybrid model, when the pool cannot give them
        their window pages too even after tombstoning, letting the L2 copies in flight land
        and evicting the tree's unlocked pages."""
        if self._windows is None:
            return self._pool.alloc(tokens)
        pool = self._pool
        if pool.pages_short(tokens):
            self._tombstone_for(pool.pages_short(tokens))
        if pool.pages_short(tokens) and self._tree.host.copies_pending():
            # a node being copied to L2 keeps its window KV until the copy lands (its L3
            # backup follows at the next poll)
            self._tree.host.writing_check(wait=True, claim=False)
            self._tombstone_for(pool.pages_short(tokens))
        if pool.pages_short(tokens):  # full and window KV share the pool: whole nodes go
            self._tree.evict(pool.pages_short(tokens) * pool.page_size)
        return pool.alloc(tokens)

    def _tombstone_for(self, pages: int) -> int:
        """Drop the tree's window KV, in its eviction order, until `pages` more pages are
        free (or none is left to drop); the tokens of the pages freed."""
        pool = self._pool
        before = pool.free_pages()
        # tombstone_until counts free pages by the group (rounded down) and spare pages
        want = -(-(before + pages) // pool.groups) + pool.spare_pages()
        self._windows.tombstone_until(want * pool.page_size)
        return (pool.free_pages() - before) * pool.page_size

    def free_slots(self) -> int:
        """L1 tokens free now (not the tree's, not a request's): full slots; for a hybrid
        model, tokens that can take their full page and a page of every window group (see
        `_units`)."""
        if self._windows is None:
            return self._pool.available_size()
        pool = self._pool
        return self._units(pool.free_pages() + pool.spare_pages() * pool.groups)

    def _units(self, pages: int) -> int:
        """A hybrid model's pages as the tokens the scheduler counts, promises and evicts:
        each with its full page and a page of every window group. Its own accounting never
        promises a page a window takes (a prompt's early tokens give theirs back as it
        runs, so this is the most a step can take); the tree's pages without window KV
        count for less than they hold, never more."""
        return pages // (1 + self._pool.groups) * self._pool.page_size

    def window_fits(self, tokens: int) -> bool:
        """Whether a request filling `tokens` more can take its next step's window-layer
        slots now (always, without window layers): a step's tokens at most, and what its
        next query reads, which its lease keeps (at most what the pool holds with window
        KV), against the free pages, the window KV the tree may tombstone and the pages
        its unlocked nodes would give back."""
        if self._windows is None:
            return True
        pool = self._pool
        need = min(min(tokens, STEP_TOKENS) + self._windows.window + pool.page_size,
                   pool.window_capacity())
        # full-layer KV of the tree's unlocked nodes holds pages eviction gives back too
        evictable = self._tree.evictable_size() // pool.groups
        return pool.window_available() + self._windows.tombstonable + evictable >= need

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
        """L1 tokens in all (free, the tree's and the requests'); for a hybrid model, the
        most one request can hold: the pool less its window pages for a window and a step."""
        if self._windows is None:
            return self._pool.allocator.total_size()
        return self._pool.request_capacity()

    def evict(self, tokens: int) -> int:
        """Free at least `tokens` L1 tokens of unlocked pages if possible; the tokens freed.
        A hybrid model's (`_units`) come from dropping the tree's window KV first
        (tombstones, in the tree's eviction order: the full layers' KV stays, a hit there
        ends at an earlier window), then from evicting whole nodes."""
        if self._windows is None:
            return self._tree.evict(tokens)
        pool = self._pool
        before, pages = pool.free_pages(), -(-tokens // pool.page_size) * (1 + pool.groups)
        self._tombstone_for(pages)
        short = pages - (pool.free_pages() - before)
        if short > 0:  # each full token evicted gives back its page at least
            self._tree.evict(short * pool.page_size)
        return self._units(pool.free_pages() - before)

    def evictable_size(self) -> int:
        """L1 tokens of the tree's unlocked pages (what `evict` could free; a hybrid
        model's in `_units`, of their full pages)."""
        return self._count(self._tree.evictable_size())

    def room_beyond(self, hit: Hit) -> int:
        """L1 tokens eviction could free with `hit`'s path held: the evictable ones off its
        path, less the pinned ones that cannot leave L1."""
        end = hit._device_end
        return self._count(self._tree.evictable_size() - self._tree.unlocked_on_path(end)
                           - self._tree.retention.stuck_pinned_size(end))

    def _count(self, tokens: int) -> int:
        """The tree's evictable full-layer tokens as the scheduler counts them (`_units`):
        their pages and the window pages of the unlocked nodes that have them."""
        if self._windows is None:
            return tokens
        pool = self._pool
        pages = (max(0, tokens) + self._windows.tombstonable * pool.groups) // pool.page_size
        return self._units(pages)
