"""The page-aligned radix prefix tree that indexes the device (L1) KV cache.

Each edge holds a run of whole pages of token ids (`key`) and the device slot indices of
their KV (`value`, an int64 CPU tensor of the same length). A path from the root spells a
cached prefix; `match_prefix` finds the longest one, `insert` adds a finished sequence,
`evict` frees least recently used unlocked leaves.

    root ──(A B C D)──> n1 ──(E F)──> n2          page_size = 2
                         └──(G H I J)──> n3        children keyed by first page: (E,F) / (G,H)

Threading: the tree belongs to the scheduler thread; nothing else may call into it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch

from hicache.leaf_heap import LeafHeap

# Key and value types: a key is a tuple of token ids, a child key identifies an edge by its
# namespace and first page (an int when page_size == 1, else a tuple of page_size ints).
Key = tuple[int, ...]
ChildKey = tuple[Any, Any]

# Stale entries accumulate in the lazy eviction heap; rebuild it once it holds more than
# this many times the number of nodes (amortised O(1) per push).
_HEAP_SLACK = 4
_EMPTY = torch.empty(0, dtype=torch.int64)


def _concat(values: list[torch.Tensor]) -> torch.Tensor:
    if len(values) == 1:
        return values[0]
    return torch.cat(values) if values else _EMPTY


class TreeNode:
    """One edge of the tree and the node it leads to.

    `lock_ref` counts requests using this node (a lock covers the node and its ancestors);
    `last_access_time` is `time.monotonic()` (a wall clock can go backwards, SGLang #6211).
    """

    __slots__ = (
        "children",
        "extra_key",
        "hit_count",
        "id",
        "key",
        "last_access_time",
        "lock_ref",
        "parent",
        "value",
    )
    _ids = itertools.count()

    def __init__(self, parent: TreeNode | None = None, key: Key = (),
                 value: torch.Tensor | None = None, extra_key: str | None = None) -> None:
        self.id = next(TreeNode._ids)
        self.parent = parent
        self.children: dict[ChildKey, TreeNode] = {}
        self.key = key
        self.value = value
        self.extra_key = extra_key
        self.lock_ref = 0
        self.last_access_time = time.monotonic()
        self.hit_count = 0

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, "
                f"children={len(self.children)})")


class MatchResult(NamedTuple):
    device_indices: torch.Tensor  # int64 slot indices of the L1 hit, page-aligned, maybe empty
    last_device_node: TreeNode    # deepest node whose pages are on the device (root if none)
    last_host_node: TreeNode      # deepest node of the whole hit (== last_device_node without L2)
    host_hit_length: int = 0      # tokens hit in L2 beyond the device hit


class RadixCache:
    """Page-aligned radix tree over token ids; see DESIGN.md "Contracts".

    `allocator` (anything with `free(indices)`) receives the slots of evicted nodes. Sizes are
    in tokens. Invariant: `evictable_size() + protected_size() == total_size()`.
    """

    node_cls: type[TreeNode] = TreeNode

    def __init__(self, allocator: Any = None, page_size: int = 1, disable: bool = False,
                 eviction_policy: str = "lru") -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if eviction_policy not in ("lru", "lfu"):
            raise ValueError(f"eviction_policy {eviction_policy!r} is not one of lru, lfu")
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        self.eviction_policy = eviction_policy
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = self.node_cls()
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 1
        self._device_heap = LeafHeap(self._priority, self._is_device_leaf)

    def reset(self) -> None:
        """Forget everything (the caller owns the pools and resets them)."""
        self._init_tree()

    # ----------------------------------------------------------------------------- keys

    def _page_aligned(self, key: Sequence[int]) -> Key:
        if isinstance(key, torch.Tensor):
            key = key.tolist()
        n = len(key) // self.page_size * self.page_size
        if isinstance(key, tuple):
            return key if n == len(key) else key[:n]  # no copy for an aligned tuple
        return tuple(key[:n])

    def _child_key(self, key: Key, pos: int, extra_key: str | None) -> ChildKey:
        if self.page_size == 1:
            return (extra_key, key[pos])
        return (extra_key, key[pos:pos + self.page_size])

    def _common_pages(self, edge: Key, key: Key, pos: int) -> int:
        """Tokens of `edge` equal to `key[pos:]`, in whole pages.

        Compared at C speed: one tuple comparison when the whole edge matches, else a binary
        search over page counts (log2(pages) slice comparisons, no per-token loop).
        """
        n = min(len(edge), len(key) - pos)
        if key[pos:pos + n] == edge[:n]:
            return n
        lo, hi = 1, n // self.page_size  # the first page always matches (child lookup)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            m = mid * self.page_size
            if key[pos:pos + m] == edge[:m]:
                lo = mid
            else:
                hi = mid - 1
        return lo * self.page_size

    # ---------------------------------------------------------------------------- match

    def match_prefix(self, key: Sequence[int], extra_key: str | None = None) -> MatchResult:
        """Longest cached page-aligned prefix of `key` under `extra_key`.

        A match ending inside an edge splits it, so the returned node spells exactly the hit;
        a mismatch inside an edge ends the walk (it never continues into a grandchild).
        """
        if self.disable:
            return MatchResult(_EMPTY, self.root, self.root, 0)
        path = self._walk(self._page_aligned(key), extra_key)
        self._on_path(path)
        node = path[-1] if path else self.root
        indices = _concat([n.value for n in path])
        return MatchResult(indices, node, node, 0)

    def _walk(self, key: Key, extra_key: str | None) -> list[TreeNode]:
        """The nodes spelling the longest prefix of `key`, root excluded (splits the last)."""
        now = time.monotonic()
        node, pos, path = self.root, 0, []
        node.last_access_time = now
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos, extra_key))
            if child is None:
                break
            n = self._common_pages(child.key, key, pos)
            partial = n < len(child.key)
            if partial:
                child = self._split(child, n)
            child.last_access_time = now
            child.hit_count += 1
            path.append(child)
            node, pos = child, pos + n
            if partial:
                break
        self._requeue(path)
        return path

    def _requeue(self, path: list[TreeNode]) -> None:
        """Re-enter the touched nodes whose eviction priority changed. Every node but the
        last has a child on the path, so only the last can be a candidate."""
        if path:
            self._device_heap.push(path[-1])
        self._maybe_rebuild_heaps()

    def peek_prefix(self, key: Sequence[int], extra_key: str | None = None) -> int:
        """Tokens of `key` cached in any tier, without touching, splitting or counting a hit
        (for ranking waiting requests)."""
        return self._peek(key, extra_key)[1]

    def peek_path(self, key: Sequence[int], extra_key: str | None = None) -> list[TreeNode]:
        """The nodes spelling `key`'s cached prefix in whole edges, root excluded, without
        touching, splitting or counting a hit (right after `insert(key)`: all of `key`)."""
        return self._peek(key, extra_key)[0]

    def _peek(self, key: Sequence[int], extra_key: str | None) -> tuple[list[TreeNode], int]:
        """(whole nodes of the cached prefix, tokens cached including a partial last edge)."""
        if self.disable:
            return [], 0
        key = self._page_aligned(key)
        node, pos, path = self.root, 0, []
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos, extra_key))
            if child is None:
                break
            n = self._common_pages(child.key, key, pos)
            pos += n
            if n < len(child.key):
                break
            node = child
            path.append(node)
        return path, pos

    def _on_path(self, path: list[TreeNode]) -> None:
        """Hook: called with the nodes a match or insert went through, root first."""

    # --------------------------------------------------------------------------- insert

    def insert(self, key: Sequence[int], value: torch.Tensor | None = None,
               extra_key: str | None = None, *, count_hit: bool = True) -> int:
        """Add `key` -> `value`; return how many leading tokens were already present.

        The caller frees its own slots `value[:returned]`; the tree keeps the rest.
        `count_hit=False` (a request caching its prompt before it finishes, and inserting
        again then) leaves hit counts alone, so one request counts as one use.
        """
        key = self._page_aligned(key)
        if self.disable:
            return len(key)
        if value is None:
            value = torch.tensor(key, dtype=torch.int64)
        value = value[:len(key)]
        now = time.monotonic()
        node, pos, present, path = self.root, 0, 0, []
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos, extra_key))
            if child is None:
                break
            n = self._common_pages(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            present += self._insert_hit(child, value, pos)
            child.last_access_time = now
            child.hit_count += count_hit
            path.append(child)
            node, pos = child, pos + n
        if pos < len(key):
            path.append(self._add_leaf(node, key[pos:], value[pos:].clone(), extra_key, now))
            path[-1].hit_count -= not count_hit  # its first use is counted at the next insert
        self._requeue(path)
        self._on_path(path)
        return present

    def _insert_hit(self, node: TreeNode, value: torch.Tensor, pos: int) -> int:
        """The inserted `value[pos:pos + len(node)]` met an existing node; return the tokens
        the caller must free (the tree keeps its own slots)."""
        return len(node.key)

    def _add_leaf(self, parent: TreeNode, key: Key, value: torch.Tensor,
                  extra_key: str | None, now: float) -> TreeNode:
        leaf = self.node_cls(parent, key, value, extra_key)
        leaf.last_access_time = now
        leaf.hit_count = 1  # its creation is its first use
        parent.children[self._child_key(key, 0, extra_key)] = leaf
        self._num_nodes += 1
        self._evictable += len(key)
        self._device_heap.push(leaf)
        return leaf

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child`'s edge after `n` tokens; return the new upper node.

            parent ──(key[:n])──> new ──(key[n:])──> child
        """
        new = self.node_cls(child.parent, child.key[:n], None, child.extra_key)
        new.value = child.value[:n] if child.value is not None else None
        new.lock_ref = child.lock_ref
        new.last_access_time = child.last_access_time
        new.hit_count = child.hit_count
        self._split_extra(new, child, n)
        child.parent.children[self._child_key(child.key, 0, child.extra_key)] = new
        child.key = child.key[n:]
        child.value = child.value[n:] if child.value is not None else None
        child.parent = new
        new.children[self._child_key(child.key, 0, child.extra_key)] = child
        self._num_nodes += 1
        return new

    def _split_extra(self, new: TreeNode, child: TreeNode, n: int) -> None:
        """Hook: split the subclass's per-node state (host values) the same way."""

    # ---------------------------------------------------------------------------- evict

    def _priority(self, node: TreeNode) -> tuple:
        if self.eviction_policy == "lfu":
            return (node.hit_count, node.last_access_time)
        return (node.last_access_time,)

    def _is_device_leaf(self, node: TreeNode) -> bool:
        """An L1 eviction candidate: an unlocked, still attached leaf."""
        return node.lock_ref == 0 and node.parent is not None and not node.children

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` (if possible) from unlocked leaves, LRU first."""
        freed = 0
        while freed < num_tokens:
            node = self._device_heap.pop()
            if node is None:
                break
            freed += self._evict_device_leaf(node)
        return freed

    def _evict_device_leaf(self, node: TreeNode) -> int:
        n = len(node.key)
        if self.allocator is not None:
            self.allocator.free(node.value)
        self._evictable -= n
        self._delete_leaf(node)
        return n

    def _delete_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        del parent.children[self._child_key(node.key, 0, node.extra_key)]
        node.parent = None  # marks the node dead for stale heap entries
        self._num_nodes -= 1
        self._device_heap.push(parent)

    def _maybe_rebuild_heaps(self) -> None:
        if len(self._device_heap) > _HEAP_SLACK * self._num_nodes + 64:
            self._device_heap.rebuild(self._iter_nodes())

    # ---------------------------------------------------------------------------- locks

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock `node` and its ancestors; return the change of evictable size (<= 0)."""
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
        """Release a lock taken by `inc_lock_ref`; return the change of evictable size (>= 0)."""
        delta = 0
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
        return delta

    def _device_len(self, node: TreeNode) -> int:
        return len(node.key) if node.value is not None else 0

    # ---------------------------------------------------------------------------- sizes

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def _iter_nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_values(self) -> torch.Tensor:
        """Every device slot the tree owns (for leak checks)."""
        vals = [n.value for n in self._iter_nodes() if n.value is not None]
        return torch.cat(vals) if vals else _EMPTY

    # ------------------------------------------------------------------------ integrity

    def check_integrity(self) -> None:
        """Raise AssertionError when any structural invariant is broken."""
        evictable = protected = nodes = 0
        for node in self._iter_nodes():
            nodes += 1
            self._check_node(node)
            n = self._device_len(node)
            if node.lock_ref > 0:
                protected += n
            else:
                evictable += n
        assert nodes + 1 == self._num_nodes, f"node count {nodes + 1} != {self._num_nodes}"
        assert evictable == self._evictable, f"evictable {evictable} != {self._evictable}"
        assert protected == self._protected, f"protected {protected} != {self._protected}"
        assert self.root.lock_ref >= 1, "the root lost its lock"

    def _check_node(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None, f"{node!r} has no parent"
        ck = self._child_key(node.key, 0, node.extra_key)
        assert parent.children.get(ck) is node, f"{node!r} not linked under its first page"
        assert len(node.key) > 0, f"empty non-root node {node!r}"
        assert len(node.key) % self.page_size == 0, f"{node!r} not page-aligned"
        assert node.lock_ref >= 0, f"negative lock_ref on {node!r}"
        assert node.lock_ref <= parent.lock_ref or parent is self.root, (
            f"{node!r} locked more than its parent")
        if parent is not self.root:
            assert node.extra_key == parent.extra_key, f"{node!r} crosses a namespace"
        if node.value is not None:
            assert len(node.value) == len(node.key), f"{node!r} value/key length mismatch"
