"""Tree nodes: `TreeNode` (one edge of the L1 tree and the node it leads to) and
`HiTreeNode` (the same with host slots, host protection and L3 bookkeeping)."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from typing import Any

import torch

from hicache.events.schema import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU
from hicache.pages import PageHashes

# Key and value types: a key is a tuple of token ids, a child key identifies an edge by its
# namespace and first page (an int when page_size == 1, else a tuple of page_size ints).
Key = tuple[int, ...]
ChildKey = tuple[Any, Any]

# The priority of a node no request has used yet (pages an L3 prefetch hung in the tree):
# below every request's, so the first user's priority is what it gets.
UNUSED_PRIORITY = float("-inf")
NO_OWNERS: frozenset[str] = frozenset()  # a node no live session owns


class TreeNode:
    """One edge of the tree and the node it leads to.

    `lock_ref` counts requests using this node (a lock covers the node and its ancestors);
    `last_access_time` is `time.monotonic()` (a wall clock can go backwards, SGLang #6211);
    `hit_count` counts the requests that used it, each once; `priority` is the highest
    priority of those requests (an int; UNUSED_PRIORITY before the first). Every request
    that uses a node uses its ancestors, so a parent's priority is never below its child's.
    `owners` are the live sessions whose requests used it (an immutable set, replaced on
    change, so a split shares it); owned nodes are evicted after unowned ones. A parent's
    owners include its child's. `pin_ref` counts the pins (POST /admin/pin) covering it: a
    pin, like a lock, covers a node and its ancestors; pinned nodes go last of all.
    `hash_value` are the page hashes of `key` (one per page, `node_hashes`), computed only
    when something needs them (L3, KV events); a split cuts them with the key.
    `end` is the prefix length the node spells (its parent's `end` plus its key), and
    `has_window` whether its window layers' KV is on L1 (a hybrid model's tree only:
    `hicache.tree.window_kv`; False is a tombstone when `value` is set).
    """

    __slots__ = (
        "children",
        "end",
        "extra_key",
        "has_window",
        "hash_value",
        "hit_count",
        "id",
        "key",
        "last_access_time",
        "lock_ref",
        "owners",
        "parent",
        "pin_ref",
        "priority",
        "value",
        "window_locks",
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
        self.priority: float = UNUSED_PRIORITY
        self.owners: frozenset[str] = NO_OWNERS
        self.pin_ref = 0
        self.hash_value: list[bytes] | None = None
        self.end = len(key) if parent is None else parent.end + len(key)
        self.has_window = False
        self.window_locks: Counter[int] | None = None  # lock end -> count (`window_kv`)

    def __len__(self) -> int:
        return len(self.key)

    def media(self) -> tuple[str, ...]:
        """The KV-event media holding this node's pages (L1 only for this node)."""
        return (MEDIUM_GPU,) if self.value is not None else ()

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, "
                f"children={len(self.children)})")


class HiTreeNode(TreeNode):
    __slots__ = ("host_ref_counter", "host_value", "host_window", "storage_backed",
                 "window_stored")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.host_value: torch.Tensor | None = None
        self.host_ref_counter = 0
        self.storage_backed = False  # known to be in L3
        self.host_window = False  # its host copy holds its window layers' KV (hybrid models)
        # L3 holds the window parts its end reads (known like storage_backed; a split's
        # upper half, a new end, starts without)
        self.window_stored = False

    def media(self) -> tuple[str, ...]:
        """L1, L2 and L3 (as far as the tree knows), each where it holds the pages."""
        return (super().media() + (MEDIUM_CPU,) * (self.host_value is not None)
                + (MEDIUM_DISK,) * self.storage_backed)

    @property
    def evicted(self) -> bool:
        """Not on the device (the root never is)."""
        return self.value is None

    @property
    def backuped(self) -> bool:
        """Has a copy in L2 (the root always counts as backed up)."""
        return self.host_value is not None

    def protect_host(self) -> None:
        """Keep this node's and its ancestors' host pages until `release_host`."""
        node: HiTreeNode | None = self
        while node is not None:
            node.host_ref_counter += 1
            node = node.parent

    def release_host(self) -> None:
        node: HiTreeNode | None = self
        if self.host_ref_counter <= 0:
            raise AssertionError(f"release_host on unprotected {self!r}")
        while node is not None:
            node.host_ref_counter -= 1
            node = node.parent


def node_hashes(node: TreeNode, root: TreeNode, hasher: PageHashes) -> list[bytes]:
    """The page hashes of `node`'s key, computed once down the chain from `root` (each
    ancestor's cached in its `hash_value` on the way). The L3 keys and the KV events' block
    hashes both come from here."""
    chain = []
    while node is not root and node.hash_value is None:
        chain.append(node)
        node = node.parent
    prev = None if node is root else node.hash_value[-1]
    for n in reversed(chain):
        n.hash_value = hasher.hash_pages(n.key, prev, n.extra_key)
        prev = n.hash_value[-1]
    return chain[0].hash_value if chain else node.hash_value

