"""The page-aligned radix prefix tree that indexes the device (L1) KV cache.

Each edge holds a run of whole pages of token ids (`key`) and the device slot indices of
their KV (`value`, an int64 CPU tensor of the same length). A path from the root spells a
cached prefix; `match_prefix` finds the longest one, `insert` adds a finished sequence,
`evict` frees unlocked leaves in the eviction policy's order (`eviction_order.py`).

    root ──(A B C D)──> n1 ──(E F)──> n2          page_size = 2
                         └──(G H I J)──> n3        children keyed by first page: (E,F) / (G,H)

Threading: the tree belongs to the scheduler thread; nothing else may call into it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from hicache.events.recorder import EventRecorder
from hicache.events.schema import MEDIUM_GPU, REASON_EVICTED
from hicache.policies import DEFAULT_PRIORITY, EVICTION_POLICIES, check_choice
from hicache.tree.base import EMPTY, HostTier, MatchResult, PrefixCache, concat
from hicache.tree.eviction_order import eviction_key
from hicache.tree.host_tier import NoHostTier
from hicache.tree.integrity import check_node, check_tree
from hicache.tree.leaf_heap import LeafHeap
from hicache.tree.node import Key, TreeNode
from hicache.tree.retention import Retention
from hicache.tree.tree_events import TreeEvents
from hicache.tree.walk import aligned_end, as_key, child_key, descend
from hicache.tree.window_kv import WindowKV


class RadixCache(PrefixCache):
    """Page-aligned radix tree over token ids; see docs/architecture.md "Contracts".

    `allocator` (anything with `free(indices)`) receives the slots of evicted nodes. Sizes are
    in tokens. Invariant: `evictable_size() + protected_size() == total_size()`.
    """

    node_cls: type[TreeNode] = TreeNode

    def __init__(self, allocator: Any = None, page_size: int = 1, disable: bool = False,
                 eviction_policy: str = "lru", events: EventRecorder | None = None) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        check_choice("eviction_policy", eviction_policy, EVICTION_POLICIES)
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        self.eviction_policy = eviction_policy
        self._priority = eviction_key(eviction_policy)  # called per push
        self.events = events  # KV events: None = off, and no page is hashed for them
        self.host: HostTier = NoHostTier()  # no L2: its harmless answers
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = self.node_cls()
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable, self._protected, self._num_nodes = 0, 0, 1
        self.kv_events = TreeEvents(self.events, self.root)
        self._device_heap = LeafHeap(self._priority, self._is_device_leaf)
        self.windows = (WindowKV(self.allocator, self.root, self._priority, self.kv_events)
                        if getattr(self.allocator, "has_windows", False) else None)
        self.retention = Retention(self.root, self._repush, self._maybe_rebuild_heaps,
                                   self._device_len, self._pin_demotable)

    def reset(self) -> None:
        """Forget everything (the caller owns the pools and resets them)."""
        self._init_tree()
        if self.events is not None:
            self.events.cleared()

    # ----------------------------------------------------------------------------- keys

    def page_aligned(self, key: Sequence[int]) -> Key:
        """`key` as a tuple cut to whole pages (no copy for an aligned tuple)."""
        key = as_key(key)
        end = aligned_end(key, self.page_size)
        return key if end == len(key) else key[:end]

    def _touch(self, path: list[TreeNode], now: float, hits: int, priority: int | None
               ) -> None:
        """Mark the nodes a match or insert went through as used at `now`, `hits` times (0
        or 1), by a request of `priority` (None: unknown to the caller, priorities stay)."""
        for node in path:
            node.last_access_time = now
            node.hit_count += hits
        if priority is not None:
            for node in path:
                node.priority = max(node.priority, priority)

    # ---------------------------------------------------------------------------- match

    def match_prefix(self, key: Sequence[int], extra_key: str | None = None, *,
                     priority: int | None = None, count_hit: bool = True) -> MatchResult:
        """Longest cached page-aligned prefix of `key` under `extra_key`.

        A match ending inside an edge splits it, so the returned node spells exactly the hit;
        a mismatch inside an edge ends the walk (it never continues into a grandchild). The
        hit's nodes are touched (access time now; `priority`, the matching request's, raises
        theirs) and counted as one use unless `count_hit=False`: a scheduler that matches a
        waiting request at every admission attempt counts its use once, when it is released
        (`insert` or `count_use`).
        """
        if self.disable:
            return MatchResult(EMPTY, self.root, self.root, 0)
        path = self._match_path(key, extra_key, priority, count_hit)
        if self.windows is not None:  # never a window with a hole
            path = path[:self.windows.hit_nodes(path)]
        node = path[-1] if path else self.root
        return MatchResult(concat([n.value for n in path]), node, node, 0)

    def _match_path(self, key: Sequence[int], extra_key: str | None, priority: int | None,
                    count_hit: bool) -> list[TreeNode]:
        """The nodes spelling the longest prefix of `key`, root excluded (the last one split
        to the hit), each touched (and counted as one use when `count_hit`); then requeued
        and `_on_path`."""
        path = descend(self.root, as_key(key), extra_key, self.page_size, self._split).path
        now = time.monotonic()
        self.root.last_access_time = now
        self._touch(path, now, int(count_hit), priority)
        self._requeue(path)
        self._on_path(path)
        return path

    def _requeue(self, path: list[TreeNode]) -> None:
        """Re-enter the touched nodes whose eviction priority changed. Every node but the
        last has a child on the path, so only the last can be a candidate."""
        if path:
            self._device_heap.push(path[-1])
        if self.windows is not None:  # any node may lose its window KV: each re-enters
            self.windows.touched(path)
        self._maybe_rebuild_heaps()

    def peek_prefix(self, key: Sequence[int], extra_key: str | None = None) -> int:
        if self.disable:
            return 0
        return descend(self.root, as_key(key), extra_key, self.page_size).matched

    def peek_path(self, key: Sequence[int], extra_key: str | None = None) -> list[TreeNode]:
        """The nodes spelling `key`'s cached prefix in whole edges, root excluded, without
        touching, splitting or counting a hit (right after `insert(key)`: all of `key`)."""
        if self.disable:
            return []
        return descend(self.root, as_key(key), extra_key, self.page_size).path

    def reach_below(self, anchor: TreeNode, key: Sequence[int], extra_key: str | None = None
                    ) -> tuple[TreeNode, int]:
        """How far the tree spells `key` below `anchor`, touching nothing: the deepest node
        reached (the one the walk ends inside, if it ends inside an edge) and the tokens
        matched. `(anchor, 0)` when no child starts with `key`'s first page."""
        walk = descend(anchor, as_key(key), extra_key, self.page_size)
        if walk.inside is not None:
            return walk.inside, walk.matched
        return (walk.path[-1] if walk.path else anchor), walk.matched

    def node_at(self, anchor: TreeNode, key: Sequence[int], extra_key: str | None = None
                ) -> TreeNode | None:
        key = as_key(key)
        end = aligned_end(key, self.page_size)
        if end == 0:
            return anchor
        walk = descend(anchor, key, extra_key, self.page_size, self._split)
        return walk.path[-1] if walk.path and walk.matched == end else None

    def _on_path(self, path: list[TreeNode]) -> None:
        """Hook: called with the nodes a match or insert went through, root first."""

    # --------------------------------------------------------------------------- insert

    def insert(self, key: Sequence[int], value: torch.Tensor | None = None,
               extra_key: str | None = None, *, count_hit: bool = True,
               priority: int = DEFAULT_PRIORITY) -> int:
        """Add `key` -> `value`; return how many leading tokens were already present.

        The caller frees its own slots `value[:returned]`; the tree keeps the rest (a copy of
        `value[matched:end]` for the new leaf). `count_hit=False` (a request caching its
        prompt before it finishes, and inserting again then) leaves hit counts alone, so one
        request counts as one use. `priority` is the inserting request's: the new leaf's,
        and the floor of every node on the way.
        """
        key = as_key(key)
        end = aligned_end(key, self.page_size)
        if self.disable:
            return end
        if value is None:
            value = torch.tensor(key[:end], dtype=torch.int64)
        elif value.shape[0] < end:
            raise ValueError(f"insert: value has {value.shape[0]} slots, the key's whole "
                             f"pages need {end}")
        walk = descend(self.root, key, extra_key, self.page_size, self._split)
        path, pos = walk.path, walk.matched
        now = time.monotonic()
        self._touch(path, now, int(count_hit), priority)
        if self.windows is not None:  # its window KV where the tree has tombstones
            path = self.windows.revive(path, value, self._split)
        present = self._insert_hits(path, value, pos)
        if pos < end:
            leaf = self._add_leaf(path[-1] if path else self.root, key[pos:end],
                                  torch.narrow_copy(value, 0, pos, end - pos), extra_key, now,
                                  priority)
            leaf.hit_count -= not count_hit  # its first use is counted at the next insert
            path.append(leaf)
            if self.windows is not None:  # a tombstone where its window KV left already
                path[-1:] = self.windows.added(leaf, self._split)
        self._requeue(path)
        self._on_path(path)
        return present

    def _insert_hits(self, path: list[TreeNode], value: torch.Tensor, matched: int) -> int:
        """The inserted key's first `matched` tokens met the existing nodes of `path` (whose
        slots `value[:matched]` would duplicate); return how many the caller must free:
        here all of them, the tree keeps its own slots."""
        return matched

    def _add_leaf(self, parent: TreeNode, key: Key, value: torch.Tensor,
                  extra_key: str | None, now: float, priority: int) -> TreeNode:
        """A new device leaf, used once at `now` by a request of `priority` (its creation is
        its first use). Not pushed on the eviction heap: the caller's `_requeue` does that for
        the path's last node."""
        leaf = self._attach(parent, key, value, extra_key)
        leaf.last_access_time = now
        leaf.hit_count = 1
        leaf.priority = priority
        self._evictable += len(key)
        self.kv_events.stored(leaf, MEDIUM_GPU)
        return leaf

    def _attach(self, parent: TreeNode, key: Key, value: torch.Tensor | None,
                extra_key: str | None) -> TreeNode:
        """Link a new node under `parent` by its first page."""
        node = self.node_cls(parent, key, value, extra_key)
        parent.children[child_key(key, 0, extra_key, self.page_size)] = node
        self._num_nodes += 1
        return node

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child`'s edge after `n` tokens; return the new upper node.

            parent ──(key[:n])──> new ──(key[n:])──> child
        """
        new = self.node_cls(child.parent, child.key[:n], None, child.extra_key)
        new.value = child.value[:n] if child.value is not None else None
        new.lock_ref = child.lock_ref
        new.last_access_time = child.last_access_time
        new.hit_count = child.hit_count
        new.priority = child.priority
        new.owners, new.pin_ref = child.owners, child.pin_ref
        if self.windows is not None:
            self.windows.split(new, child)
        if child.hash_value is not None:
            pages = n // self.page_size
            new.hash_value, child.hash_value = child.hash_value[:pages], child.hash_value[pages:]
        self.retention.split(new, child)
        self._split_extra(new, child, n)
        ps = self.page_size
        child.parent.children[child_key(child.key, 0, child.extra_key, ps)] = new
        child.key = child.key[n:]
        child.value = child.value[n:] if child.value is not None else None
        child.parent = new
        new.children[child_key(child.key, 0, child.extra_key, ps)] = child
        self._num_nodes += 1
        return new

    def _split_extra(self, new: TreeNode, child: TreeNode, n: int) -> None:
        """Hook: split the subclass's per-node state (host values) the same way."""

    # ------------------------------------------------------------------------------ use

    def count_use(self, node: TreeNode, priority: int | None = None) -> None:
        """As `insert(count_hit=True)` of its key would count it; `node` must be alive (the
        caller holds it locked)."""
        if self.disable:
            return
        path = []
        while node is not self.root:
            path.append(node)
            node = node.parent
        path.reverse()
        now = time.monotonic()
        self.root.last_access_time = now
        self._touch(path, now, 1, priority)
        self._requeue(path)
        self._on_path(path)

    def _pin_demotable(self, node: TreeNode) -> bool:
        """Whether a pinned node may still leave L1 (this tree: never; with L2: by demotion)."""
        return False

    def _repush(self, node: TreeNode) -> None:
        """Re-enter `node` in the eviction heaps after its key changed."""
        self._device_heap.push(node)
        if self.windows is not None:
            self.windows.touched([node])

    # ---------------------------------------------------------------------------- evict

    def _is_device_leaf(self, node: TreeNode) -> bool:
        """An L1 eviction candidate: an unlocked, unpinned, still attached leaf."""
        return (node.lock_ref == 0 and node.pin_ref == 0 and node.parent is not None
                and not node.children)

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` (if possible) from unlocked leaves, in the eviction
        policy's order (LRU first under `lru`)."""
        freed = 0
        while freed < num_tokens:
            node = self._device_heap.pop()
            if node is None:
                break
            freed += self._evict_device_leaf(node)
        return freed

    def _evict_device_leaf(self, node: TreeNode) -> int:
        n = len(node.key)
        if self.windows is not None:
            self.windows.evicted(node)
        if self.allocator is not None:
            self.allocator.free(node.value)
        self._evictable -= n
        self.kv_events.removed(node, MEDIUM_GPU, REASON_EVICTED)
        self._delete_leaf(node)
        return n

    def _delete_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        del parent.children[child_key(node.key, 0, node.extra_key, self.page_size)]
        node.parent = None  # marks the node dead for stale heap entries
        self._num_nodes -= 1
        self.retention.deleted(node)
        self._device_heap.push(parent)

    def _maybe_rebuild_heaps(self) -> None:
        self._device_heap.rebuild_if_stale(self._num_nodes, self.iter_nodes)
        if self.windows is not None:
            self.windows.rebuild(self.iter_nodes, self._num_nodes)

    # ---------------------------------------------------------------------------- locks

    def inc_lock_ref(self, node: TreeNode) -> int:
        if self.windows is not None:
            self.windows.lock(node)
        delta = 0
        while node is not self.root:
            if node.lock_ref == 0:
                n = self._device_len(node)
                self._evictable -= n
                self._protected += n
                delta -= n
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        delta, start = 0, node
        while node is not self.root:
            if node.lock_ref <= 0:
                raise AssertionError(f"dec_lock_ref on unlocked {node!r}")
            if node.lock_ref == 1:
                n = self._device_len(node)
                self._evictable += n
                self._protected -= n
                delta += n
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._device_heap.push(node)
            node = node.parent
        if self.windows is not None:
            self.windows.unlock(start)
        return delta

    def unlocked_on_path(self, node: TreeNode) -> int:
        """Device tokens on the path from the root to `node` that no lock holds: what
        `inc_lock_ref(node)` would take out of `evictable_size()`. Changes nothing."""
        n = 0
        while node is not self.root and node.lock_ref == 0:  # a locked node's ancestors are
            n += self._device_len(node)                       # locked too
            node = node.parent
        return n

    def _device_len(self, node: TreeNode) -> int:
        return len(node.key) if node.value is not None else 0

    # ---------------------------------------------------------------------------- sizes

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def iter_nodes(self) -> Iterator[TreeNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_values(self) -> torch.Tensor:
        """Every device slot the tree owns (for leak checks)."""
        vals = [n.value for n in self.iter_nodes() if n.value is not None]
        return torch.cat(vals) if vals else EMPTY

    # ------------------------------------------------------------------------ integrity

    def check_integrity(self, held_host_tokens: int = 0) -> None:
        """Raise AssertionError when any structural invariant is broken (no host tier here:
        no host pages to count, `held_host_tokens` is for `HiRadixCache`)."""
        check_tree(self)

    def _check_node(self, node: TreeNode) -> None:
        check_node(node, self.root, self.page_size)
        self.retention.check_node(node)
