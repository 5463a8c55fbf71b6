"""A tree's KV events (`tree.kv_events`): one per node operation, naming the node's pages by
their hashes (`node_hashes`). Splits change no hash, and send nothing. Each tree holds one
`TreeEvents`, made anew with its root at each reset; each node says which media hold its
pages (`TreeNode.media`). A hybrid model's events name their KV group: a node's full layers
move with the node; its window layers' KV is reported where it comes and goes on its own
(L1: `WindowKV` calls `window`; an L2 copy with it, `host_window`, goes with the node's L2
events; L3's window parts: `window` from the backup's ack).

Threading: scheduler thread only, like the tree.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

from hicache.events.recorder import EventRecorder
from hicache.events.schema import GROUP_FULL, GROUP_WINDOW, MEDIUM_CPU, MEDIUM_GPU
from hicache.tree.node import TreeNode, node_hashes


class TreeEvents:
    """KV events over the nodes below `root`; `recorder` None sends nothing and hashes no
    page."""

    def __init__(self, recorder: EventRecorder | None, root: TreeNode) -> None:
        self.recorder = recorder
        self.root = root

    def stored(self, node: TreeNode, medium: str) -> None:
        """`node`'s pages have landed on `medium` (an L2 copy with its window KV: both kinds)."""
        if self.recorder is not None:
            self._stored(node, medium, GROUP_FULL)
            if medium == MEDIUM_CPU and getattr(node, "host_window", False):
                self._stored(node, medium, GROUP_WINDOW)

    def removed(self, node: TreeNode, medium: str, reason: str) -> None:
        """`node`'s pages have left `medium` (call while `node` is still attached)."""
        if self.recorder is not None:
            hashes = node_hashes(node, self.root, self.recorder.hasher)
            self.recorder.removed(hashes, medium, reason)
            if medium == MEDIUM_CPU and getattr(node, "host_window", False):
                self.recorder.removed(hashes, medium, reason, GROUP_WINDOW)

    def window(self, node: TreeNode, medium: str, present: bool, reason: str = "",
               last_pages: int | None = None) -> None:
        """A hybrid model's window KV of `node` (its `last_pages`, or all) came to `medium`
        (`present`) or left it for `reason`."""
        if self.recorder is None:
            return
        if present:
            self._stored(node, medium, GROUP_WINDOW, last_pages)
        else:
            self.recorder.removed(node_hashes(node, self.root, self.recorder.hasher), medium,
                                  reason, GROUP_WINDOW)

    def _stored(self, node: TreeNode, medium: str, group: int,
                last_pages: int | None = None) -> None:
        hasher, parent = self.recorder.hasher, node.parent
        hashes = node_hashes(node, self.root, hasher)
        first = len(hashes) - (len(hashes) if last_pages is None else last_pages)
        if first:
            prev = hashes[first - 1]
        else:
            prev = None if parent is self.root else node_hashes(parent, self.root, hasher)[-1]
        self.recorder.stored(hashes[first:], prev,
                             node.key[first * self.recorder.page_size:], medium, group)

    def record_all(self, nodes: Iterable[TreeNode]) -> None:
        """Say again what `nodes` (parents first) hold, after an `AllBlocksCleared` some of
        them outlived (pinned pages a flush kept, L1 and L2 after L3 went). It follows only
        an emptied or detached L3, so L3's window parts (`window_stored`, cleared with it)
        are never left to say."""
        for node in nodes:
            for medium in node.media():
                self.stored(node, medium)
            if getattr(node, "has_window", False) and node.value is not None:
                self.window(node, MEDIUM_GPU, True)

    def flushing(self) -> AbstractContextManager[None]:
        """Removals inside are an operator's flush (`BlockRemoved.reason` "flushed")."""
        return self.recorder.flushing() if self.recorder is not None else nullcontext()
