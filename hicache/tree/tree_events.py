"""A tree's KV events (`tree.kv_events`): one per node operation, naming the node's pages by
their hashes (`node_hashes`). Splits change no hash, and send nothing. Each tree holds one
`TreeEvents`, made anew with its root at each reset; each node says which media hold its
pages (`TreeNode.media`).

Threading: scheduler thread only, like the tree.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

from hicache.events.recorder import EventRecorder
from hicache.tree.node import TreeNode, node_hashes


class TreeEvents:
    """KV events over the nodes below `root`; `recorder` None sends nothing and hashes no
    page."""

    def __init__(self, recorder: EventRecorder | None, root: TreeNode) -> None:
        self.recorder = recorder
        self.root = root

    def stored(self, node: TreeNode, medium: str) -> None:
        """`node`'s pages have landed on `medium`."""
        if self.recorder is not None:
            hasher, parent = self.recorder.hasher, node.parent
            hashes = node_hashes(node, self.root, hasher)
            prev = None if parent is self.root else node_hashes(parent, self.root, hasher)[-1]
            self.recorder.stored(hashes, prev, node.key, medium)

    def removed(self, node: TreeNode, medium: str, reason: str) -> None:
        """`node`'s pages have left `medium` (call while `node` is still attached)."""
        if self.recorder is not None:
            self.recorder.removed(node_hashes(node, self.root, self.recorder.hasher), medium,
                                  reason)

    def record_all(self, nodes: Iterable[TreeNode]) -> None:
        """Say again what `nodes` (parents first) hold, after an `AllBlocksCleared` some of
        them outlived (a flush of L3, pinned pages a flush kept)."""
        for node in nodes:
            for medium in node.media():
                self.stored(node, medium)

    def flushing(self) -> AbstractContextManager[None]:
        """Removals inside are an operator's flush (`BlockRemoved.reason` "flushed")."""
        return self.recorder.flushing() if self.recorder is not None else nullcontext()
