"""What keeps a node cached past its policy's turn: the sessions that own it and the pins
that hold it (the retention classes of `eviction_order.py`). `RadixCache` holds one
`Retention` (a new one at each reset) and answers its contract's `own` / `pin` calls through
it; the tables that decide who owns and pins what are `sessions.py` and `pins.py`.

Threading: scheduler thread only, like the tree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from hicache.tree.node import TreeNode

NodeFn = Callable[[TreeNode], object]


class OwnedSizes(NamedTuple):
    """Tokens live sessions own (`Retention.own`), each node counted once."""

    device: int = 0      # on L1
    host_only: int = 0   # evicted from L1, on L2


class Retention:
    """Who owns and who pins the nodes under `root`: session -> the live nodes it owns
    (each node's `owners` names it back), and the nodes with `pin_ref > 0`. The tree gives
    `repush` (a node's eviction key changed), `rebuild` (its heaps may be stale),
    `device_len` (a node's tokens on L1) and `pin_demotable` (whether a pinned node may
    still leave L1: by demotion to L2)."""

    def __init__(self, root: TreeNode, repush: NodeFn, rebuild: Callable[[], None],
                 device_len: Callable[[TreeNode], int],
                 pin_demotable: Callable[[TreeNode], bool]) -> None:
        self.root = root
        self._repush, self._maybe_rebuild_heaps = repush, rebuild
        self._device_len, self._pin_demotable = device_len, pin_demotable
        self._owned: dict[str, set[TreeNode]] = {}
        self._pinned: set[TreeNode] = set()

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

    # ------------------------------------------------------------------ the tree's moves

    def split(self, new: TreeNode, child: TreeNode) -> None:
        """`new` was split off above `child`, with its pins and owners."""
        if new.pin_ref:
            self._pinned.add(new)
        for session in child.owners:
            self._owned[session].add(new)

    def deleted(self, node: TreeNode) -> None:
        self._pinned.discard(node)
        for session in node.owners:
            self._owned[session].discard(node)

    def check(self) -> None:
        """Every owned node is alive and names its owner back."""
        for session, owned in self._owned.items():
            for node in owned:
                assert node.parent is not None, f"session {session} owns a deleted {node!r}"
                assert session in node.owners, f"{node!r} lost its owner {session}"

    def check_node(self, node: TreeNode) -> None:
        for session in node.owners:
            assert node in self._owned.get(session, ()), f"{node!r} not listed by {session}"
