"""The window layers' side of a hybrid model's tree: which nodes still hold their
window-layer KV on L1, the tombstones, and the hit rule (docs/architecture.md "Hybrid
attention").

    node.value       full-layer slots: every cached token keeps them (as in any tree)
    node.has_window  True: its window-layer KV is on L1 too (`WindowedKVPool`'s page map);
                     False: a tombstone, full layers only

A prefix of P tokens is a hit when the full layers hold [0, P) and the window layers hold
what a query at P reads, [needed_from(P), P): the hit is the end of the deepest run of
window-holding nodes that is long enough (or starts at 0).

Tombstoning drops a node's window pages, least valuable first in the tree's own eviction
order, before any full eviction. A lock ending at L (a request's lease, a copy in flight)
keeps the window KV of the nodes reaching into [needed_from(L), L), what its queries read;
the nodes above keep their full layers only (SGLang's SWA locks do the same). Each node
counts the lock ends keeping it (`window_locks`), so a split knows which locks keep each
half. A request's own tokens that left every window were dropped while it ran
(`WindowedKVPool.drop_window`), so they join the tree as tombstones.

What stays true (`check`): `has_window` only with `value`; a node's pages all mapped to window
pages when `has_window`, none when not; `live` and `tombstonable` count the window-holding
tokens, all and those no lock keeps.

Threading: scheduler thread only, like the tree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

import torch

from hicache.events.schema import MEDIUM_GPU, REASON_DEMOTED, REASON_EVICTED
from hicache.memory.device import PADDING_PAGE
from hicache.memory.windowed import WindowedKVPool
from hicache.pages import window_start
from hicache.tree.leaf_heap import LeafHeap
from hicache.tree.node import TreeNode
from hicache.tree.tree_events import TreeEvents


class WindowKV:
    """Window-layer state of one tree over a `WindowedKVPool` (see the module docstring)."""

    def __init__(self, pool: WindowedKVPool, root: TreeNode,
                 priority: Callable[[TreeNode], tuple], events: TreeEvents) -> None:
        self.pool, self.root, self.events = pool, root, events
        self.window = pool.max_window
        self.page_size = pool.page_size
        self.live = 0               # tree tokens whose window-layer KV is on L1
        self.tombstonable = 0       # of those, on nodes no lock keeps
        self.tombstoned_tokens = 0  # since start: window KV the tree dropped
        self._heap = LeafHeap(priority, self._candidate)

    def needed_from(self, end: int) -> int:
        """The first token (page-aligned down) a window layer's query at `end` reads."""
        return window_start(end, self.window, self.page_size)

    # -------------------------------------------------------------------------- hits

    def hit_nodes(self, path: list[TreeNode], l1_only: bool = False) -> int:
        """How many of `path`'s nodes (top down; full layers on L1, or on L2 past the L1
        ones) make the hit: up to the deepest window-holding node whose run of
        window-holding nodes reaches back to what a query at its end reads. A node holds
        its window KV on L1, or in its L2 copy (`host_window`: loaded back with it, or on
        its own for a tombstone, `HostLoads.reload_windows`) unless `l1_only`."""
        run_start, best = 0, 0
        for i, node in enumerate(path):
            in_l2 = not l1_only and getattr(node, "host_window", False)
            if not (node.has_window or in_l2 and node.host_value is not None):
                run_start = node.end
            elif run_start <= self.needed_from(node.end):
                best = i + 1
        return best

    # ---------------------------------------------------------------------- new nodes

    def added(self, node: TreeNode, split: Callable[[TreeNode, int], TreeNode]
              ) -> list[TreeNode]:
        """A new unlocked L1 node: mark which of its pages hold window KV (the pool's map),
        splitting it where that changes; the node and its upper halves, top down."""
        self.pool.claim(node.value)  # a request's spare window pages are the tree's now
        live = (self.pool.window_pages_of(node.value) != PADDING_PAGE).tolist()
        nodes, start = [], 0
        for i in range(1, len(live)):
            if live[i] != live[i - 1]:
                nodes.append(split(node, i * self.page_size - start))
                start = i * self.page_size
        nodes.append(node)
        page = 0
        for n in nodes:
            if live[page]:
                self.gained(n)
            page += len(n.key) // self.page_size
        return nodes

    def revive(self, path: list[TreeNode], value: torch.Tensor,
               split: Callable[[TreeNode, int], TreeNode]) -> list[TreeNode]:
        """An insert met the tree's nodes `path` (top down) with its own slots `value`: a
        tombstone whose pages the inserting request computed again, with window KV, takes
        that window KV (from its first such page on, split there). The new path."""
        out, pos = [], 0
        for node in path:
            n = len(node.key)
            own = value[pos:pos + n]
            pos += n
            live = ([] if node.has_window or node.value is None or torch.equal(own, node.value)
                    else (self.pool.window_pages_of(own) != PADDING_PAGE).tolist())
            if True in live and all(live[live.index(True):]):  # a suffix of its pages
                first = live.index(True) * self.page_size
                if first:
                    out.append(split(node, first))
                self.pool.move_window(own[first:], node.value)
                self.gained(node)
            out.append(node)
        return out

    def gained(self, node: TreeNode) -> None:
        """`node` holds its window KV on L1 now (a new node's, a recomputed tombstone's, or
        one loaded from its L2 copy)."""
        node.has_window = True
        self.events.window(node, MEDIUM_GPU, True)
        self.live += len(node.key)
        self.tombstonable += len(node.key) * (node.window_locks is None)
        self._heap.push(node)

    def split(self, new: TreeNode, child: TreeNode) -> None:
        """`new` was cut off above `child` (whose key is still whole): it keeps the window
        KV and the locks that reach into it."""
        new.has_window = child.has_window
        if child.window_locks:
            kept = Counter({end: n for end, n in child.window_locks.items()
                            if new.end > self.needed_from(end)})
            new.window_locks = kept or None
            if new.has_window and not kept:  # its tokens were kept, now only the lower half's
                self.tombstonable += len(new.key)
        self._heap.push(new)  # a node of its own in the eviction order

    # ------------------------------------------------------------------------ locks

    def lock(self, node: TreeNode) -> None:
        """A lock ending at `node`: keep the window KV its queries read."""
        cut = self.needed_from(node.end)
        end = node.end
        while node is not self.root and node.end > cut:
            if node.window_locks is None:
                node.window_locks = Counter()
                self.tombstonable -= len(node.key) * node.has_window
            node.window_locks[end] += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """End a `lock` of the same node."""
        cut = self.needed_from(node.end)
        end = node.end
        while node is not self.root and node.end > cut:
            locks = node.window_locks
            locks[end] -= 1
            if not locks[end]:
                del locks[end]
            if not locks:
                node.window_locks = None
                self.tombstonable += len(node.key) * node.has_window
                self._heap.push(node)
            node = node.parent

    def touched(self, path: list[TreeNode]) -> None:
        """The eviction priorities of `path`'s nodes may have changed."""
        for node in path:
            self._heap.push(node)

    # ----------------------------------------------------------------------- drops

    def _candidate(self, node: TreeNode) -> bool:
        return node.has_window and node.window_locks is None and node.parent is not None

    def tombstone_until(self, tokens: int) -> int:
        """Drop the window KV of nodes no lock keeps, least valuable first, until `tokens`
        window tokens are free in the pool (or none is left to drop); the tokens dropped.
        `before_tombstone(node)` may keep a node this time (False): its L2 copy starts."""
        dropped, kept = 0, []
        while self.pool.window_available() < tokens:
            node = self._heap.pop()
            if node is None:
                break
            if self.before_tombstone(node):
                dropped += self.tombstone(node)
            else:
                kept.append(node)
        for node in kept:  # candidates again next time
            self._heap.push(node)
        return dropped

    @staticmethod
    def before_tombstone(node: TreeNode) -> bool:
        """Whether `node`'s window KV may go now (the two-tier tree backs it up first)."""
        return True

    def make_room(self, tokens: int) -> bool:
        """Whether `tokens` window tokens are free in the pool, tombstoning to free them."""
        self.tombstone_until(tokens)
        return self.pool.window_available() >= tokens

    def tombstone(self, node: TreeNode) -> int:
        """Drop `node`'s window KV (held, no lock keeping it); its tokens."""
        self.pool.drop_window(node.value)
        self.evicted(node)
        self.tombstoned_tokens += len(node.key)
        return len(node.key)

    def evicted(self, node: TreeNode) -> None:
        """`node` (unlocked, no lock keeping its window KV) lost its window KV: tombstoned,
        or left L1 whole (the pool freed its window pages with its slots)."""
        if node.has_window:
            node.has_window = False
            in_l2 = getattr(node, "host_window", False) and node.host_value is not None
            self.events.window(node, MEDIUM_GPU, False, REASON_DEMOTED if in_l2
                               else REASON_EVICTED)
            self.live -= len(node.key)
            self.tombstonable -= len(node.key)

    def rebuild(self, nodes: Callable[[], Iterator[TreeNode]], num_nodes: int) -> None:
        """Drop the stale heap entries once they pass the slack for `num_nodes`."""
        self._heap.rebuild_if_stale(num_nodes, nodes)

    # -------------------------------------------------------------------- integrity

    def check(self, nodes: list[TreeNode]) -> None:
        live = tombstonable = 0
        for node in nodes:
            if node.value is None:
                assert not node.has_window, f"{node!r} holds window KV without full KV"
                continue
            mapped = self.pool.window_pages_of(node.value) != PADDING_PAGE
            if node.has_window:
                assert bool(mapped.all()), f"{node!r} lost window pages it claims"
                live += len(node.key)
                tombstonable += len(node.key) * (node.window_locks is None)
            else:
                assert not bool(mapped.any()), f"tombstone {node!r} still maps window pages"
        assert live == self.live, f"window tokens {live} != {self.live}"
        assert tombstonable == self.tombstonable, (
            f"tombstonable window tokens {tombstonable} != {self.tombstonable}")

    def valid_end(self, node: TreeNode) -> TreeNode:
        """The deepest node on the L1 path to `node` a hit may end at on its own (a hit
        that counted on an L2 load-back which did not happen)."""
        path = []
        while node is not self.root:
            path.append(node)
            node = node.parent
        path.reverse()
        keep = self.hit_nodes(path, l1_only=True)
        return path[keep - 1] if keep else self.root

    def unlocked_live_on_path(self, node: TreeNode) -> int:
        """Window-holding tokens a lock ending at `node` would keep that none keeps now."""
        cut, n = self.needed_from(node.end), 0
        while node is not self.root and node.end > cut:
            n += len(node.key) * (node.has_window and node.window_locks is None)
            node = node.parent
        return n
