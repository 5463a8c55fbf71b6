"""The tree's KV events: one per node operation, naming the node's pages by their hashes
(`node_hashes`). Splits change no hash, and send nothing. `RadixCache` is made of this.

Threading: scheduler thread only, like the tree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext

from hicache.events.recorder import EventRecorder
from hicache.events.schema import MEDIUM_GPU
from hicache.tree.node import TreeNode, node_hashes


class TreeEvents:
    """KV events over the tree's nodes (given by `RadixCache`: its recorder, root and
    walk); `events` None sends nothing and hashes no page."""

    events: EventRecorder | None
    root: TreeNode
    iter_nodes: Callable[[], Iterator[TreeNode]]

    def record_stored(self, node: TreeNode, medium: str) -> None:
        """`node`'s pages have landed on `medium`."""
        if self.events is not None:
            hasher, parent = self.events.hasher, node.parent
            hashes = node_hashes(node, self.root, hasher)
            prev = None if parent is self.root else node_hashes(parent, self.root, hasher)[-1]
            self.events.stored(hashes, prev, node.key, medium)

    def record_all(self) -> None:
        """Say again what every node holds (after an `AllBlocksCleared` that some nodes
        outlived: a flush of L3, pinned pages a flush kept), parents first."""
        for node in self.iter_nodes():
            if node.value is not None:
                self.record_stored(node, MEDIUM_GPU)

    def record_removed(self, node: TreeNode, medium: str, reason: str) -> None:
        """`node`'s pages have left `medium` (call while `node` is still attached)."""
        if self.events is not None:
            self.events.removed(node_hashes(node, self.root, self.events.hasher), medium,
                                reason)

    def flushing(self) -> AbstractContextManager[None]:
        """KV events: removals inside are an operator's flush (`BlockRemoved.reason`
        "flushed")."""
        return self.events.flushing() if self.events is not None else nullcontext()
