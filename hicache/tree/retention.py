"""What keeps a node cached past its policy's turn: the sessions that own it and the pins
that hold it (the retention classes of `eviction_order.py`). `RadixCache` is made of this;
the tables that decide who owns and pins what are `sessions.py` and `pins.py`.

Threading: scheduler thread only, like the tree.
"""

from __future__ import annotations

from hicache.tree.base import OwnedSizes
from hicache.tree.node import TreeNode


class Retention:
    """Session ownership and pins over the tree's nodes; the tree gives `root`, `_owned`
    (session -> nodes), `_pinned`, `_repush`, `_maybe_rebuild_heaps` and `_device_len`."""

    root: TreeNode
    _owned: dict[str, set[TreeNode]]
    _pinned: set[TreeNode]

    # ------------------------------------------------------------------------- sessions

    def own(self, node: TreeNode, session_id: str) -> None:
        """`session_id` owns `node` and its ancestors (a request of it used them): they are
        evicted after every unowned node until `disown`. Re-pushes the nodes whose eviction
        key changed (the heaps are lazy)."""
        changed = []
        while node is not self.root and session_id not in node.owners:
            node.owners = node.owners | {session_id}  # an owned node's ancestors are owned
            changed.append(node)
            node = node.parent
        if changed:
            self._owned.setdefault(session_id, set()).update(changed)
            for n in changed:
                self._repush(n)
            self._maybe_rebuild_heaps()

    def disown(self, session_id: str) -> int:
        """`session_id` (closed or timed out) owns nothing any more; its nodes go back to
        their policy's place among the unowned ones. Returns the tokens it owned."""
        nodes = self._owned.pop(session_id, set())
        for node in nodes:
            node.owners = node.owners - {session_id}
            self._repush(node)
        self._maybe_rebuild_heaps()
        return sum(len(n.key) for n in nodes)

    def owned_tokens(self) -> OwnedSizes:
        """Tokens some live session owns: on the device, and in L2 only."""
        nodes = set().union(*self._owned.values()) if self._owned else set()
        device = sum(self._device_len(n) for n in nodes)
        return OwnedSizes(device, sum(len(n.key) for n in nodes) - device)

    # ----------------------------------------------------------------------------- pins

    def pin(self, node: TreeNode) -> None:
        """Pin `node` and its ancestors until `unpin(node)`: evicted after everything else
        (this tree: never, without a lower tier to demote them to)."""
        while node is not self.root:
            node.pin_ref += 1
            self._pinned.add(node)
            self._repush(node)
            node = node.parent
        self._maybe_rebuild_heaps()

    def unpin(self, node: TreeNode) -> None:
        """End a `pin(node)`."""
        while node is not self.root:
            if node.pin_ref <= 0:
                raise AssertionError(f"unpin of unpinned {node!r}")
            node.pin_ref -= 1
            if node.pin_ref == 0:
                self._pinned.discard(node)
            self._repush(node)
            node = node.parent
        self._maybe_rebuild_heaps()

    def stuck_pinned_size(self, path_end: TreeNode | None = None) -> int:
        """Device tokens `evictable_size()` counts that eviction cannot free: unlocked pinned
        nodes that cannot leave L1 (`_pin_demotable`), except those on the path from the root
        to `path_end` (which `unlocked_on_path` already takes out). What admission must not
        count on."""
        if not self._pinned:  # asked at every admission attempt short of room
            return 0
        on_path = set()
        while path_end is not None and path_end is not self.root:
            on_path.add(path_end)
            path_end = path_end.parent
        return sum(self._device_len(n) for n in self._pinned
                   if n.lock_ref == 0 and n not in on_path and not self._pin_demotable(n))

    def _pin_demotable(self, node: TreeNode) -> bool:
        """Whether a pinned node may still leave L1 (this tree: never; with L2: by demotion)."""
        return False
