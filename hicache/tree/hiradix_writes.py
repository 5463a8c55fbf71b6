"""Pages going down the two-tier tree: the write policy's L1 -> L2 backups (`on_path`,
`back_up_path`), acked in `writing_check`, and a failed copy's cleanup. `HiRadixCache` holds
one `HostWrites` (a new one at each reset), which owns the writes in flight; see
`hiradix.py` for the node states and invariants.

Threading: scheduler thread only, like the tree.
"""

from __future__ import annotations

import logging
from typing import Protocol

from hicache.events.recorder import EventRecorder
from hicache.events.schema import MEDIUM_CPU
from hicache.transfer.controller import HiCacheController
from hicache.tree.base import HostCounters
from hicache.tree.node import HiTreeNode, TreeNode
from hicache.tree.tree_events import TreeEvents
from hicache.tree.window_kv import WindowKV

logger = logging.getLogger("hicache.tree.hiradix")  # the tree's own logger, as before


def _depth(node: TreeNode) -> int:
    depth = 0
    while node.parent is not None:
        depth, node = depth + 1, node.parent
    return depth


class WritingTree(Protocol):
    """What `HostWrites` uses of its tree (`HiRadixCache`)."""

    controller: HiCacheController
    counters: HostCounters
    write_policy: str
    write_through_threshold: int
    events: EventRecorder | None
    kv_events: TreeEvents
    windows: WindowKV | None

    def inc_lock_ref(self, node: TreeNode) -> int: ...
    def dec_lock_ref(self, node: TreeNode) -> int: ...
    def evict_host(self, num_tokens: int, writing: HiTreeNode | None = None) -> int: ...
    def copy_changed(self, node: HiTreeNode) -> None: ...


class HostWrites:
    """The D->H copies in flight over one tree (its controller, counters, write policy,
    locks and L2 eviction): by node id, and (KV events only) the upper halves split off a
    node while its copy runs, which the same ack lands in L2."""

    def __init__(self, tree: WritingTree) -> None:
        self.tree = tree
        self.controller = tree.controller
        self.counters = tree.counters
        self.ongoing: dict[int, HiTreeNode] = {}
        self._landed: list[HiTreeNode] = []  # reached L2, not claimed for L3 yet
        self._split_writes: dict[int, list[HiTreeNode]] = {}  # write's node id -> halves
        self._write_of: dict[int, int] = {}                     # half's id -> write's id
        # the halves matter to KV events (each lands in L2) and to a hybrid model's window
        # KV (a half's copy reads its window pages: `before_tombstone` keeps them)
        self._track_halves = tree.events is not None or tree.windows is not None

    def writing(self, node_id: int) -> bool:
        """Whether `node_id`'s host pages are being written (a half split off one counts)."""
        return node_id in self.ongoing or node_id in self._write_of

    def split(self, new: HiTreeNode, child: HiTreeNode) -> None:
        """`new` was split off above `child`: if `child`'s copy runs, it lands `new` too. A
        hybrid model's new boundary in L3 pages whose L2 copy holds window KV is handed on
        with the nodes that reached L2 (`writing_check`): L3 gets its window parts."""
        if (new.storage_backed and new.host_window and new.host_value is not None
                and not self.writing(child.id)):  # else with the copy's ack
            self._landed.append(new)
        if self._track_halves:
            write = self._write_of.get(child.id, child.id)
            if write in self.ongoing:
                self._split_writes.setdefault(write, []).append(new)
                self._write_of[new.id] = write

    def on_path(self, path: list[TreeNode]) -> None:
        """Back up the nodes the policy wants copied, parents first: write_through all of
        them, write_through_selective those used by `write_through_threshold` requests
        (`hit_count`: one per request when the scheduler counts its use once)."""
        policy = self.tree.write_policy
        if policy == "write_back":
            return
        for node in path:
            if node.backuped or node.evicted:
                continue
            if (policy == "write_through_selective"
                    and node.hit_count < self.tree.write_through_threshold):
                break
            if not node.parent.backuped or not self._write_backup(node):
                break

    def _write_backup(self, node: HiTreeNode) -> bool:
        """Queue node's D->H copy (making room in L2 if needed); False when dropped."""
        host = self.controller.write(node.value, node.id)
        if host is None:
            self.tree.evict_host(len(node.key), writing=node)
            host = self.controller.write(node.value, node.id)
        if host is None:
            self.counters.write_dropped_tokens += len(node.key)
            return False
        node.host_value = host
        node.host_window = node.has_window  # what the copy holds of the window layers
        self.tree.inc_lock_ref(node)  # device slots stay until the copy is acknowledged
        self.ongoing[node.id] = node
        return True

    def before_tombstone(self, node: HiTreeNode) -> bool:
        """In-window KV reaches L2 before L1 drops it (`WindowKV.tombstone_until`): a node
        whose copy runs keeps it until the ack (a split may have left its upper half
        without the copy's lock); under write_back, a node not backed up yet starts its
        copy and keeps it this time; otherwise (write_through backed it up when inserted,
        unless L2 was full) it may go."""
        if self.writing(node.id):  # its copy reads the window pages it had when it started
            return False
        if node.backuped or self.tree.write_policy != "write_back":
            return True
        self.back_up_path(node)
        return False

    def back_up_path(self, node: HiTreeNode) -> bool:
        """Queue the D->H copy of `node` and of its ancestors not in L2 yet, top down,
        whatever the write policy (write_back eviction; the storage tier hangs a fetched
        tail below a computed head); False when L2 has no room for one of them."""
        chain = []
        while not node.backuped:
            chain.append(node)
            node = node.parent
        return all(self._write_backup(n) for n in reversed(chain))

    def writing_check(self, wait: bool = False, claim: bool = True) -> list[HiTreeNode]:
        """Apply finished D->H acks: release the locks. Returns the nodes that reached L2
        since the last claim (the tier owner backs them up to L3); `claim=False` (an
        eviction waiting on its copies) keeps them for the next."""
        if wait:
            self.controller.wait_writes()
        written = []
        for ack in self.controller.poll_writes():
            node = self.ongoing.pop(ack.node_id)
            halves = self._split_halves(node)
            self.tree.dec_lock_ref(node)
            if not ack.ok:
                self._drop_backup(node)
                continue
            if node.host_value is None:  # dropped with a failed ancestor's copy (FIFO)
                continue
            self.counters.written_tokens += len(node.key)
            self.tree.copy_changed(node)
            for half in halves:
                self.tree.kv_events.stored(half, MEDIUM_CPU)
            # a boundary split off in stored pages while the copy ran: its window parts now
            written += [h for h in halves[:-1] if h.storage_backed and h.host_window]
            written.append(node)
        self._landed.extend(written)
        if not claim:
            return []
        landed, self._landed = self._landed, []
        return landed

    def _split_halves(self, node: HiTreeNode) -> list[HiTreeNode]:
        """The nodes the D->H copy of `node` lands in L2, parents first: `node` and the
        upper halves split off it meanwhile (KV events and a window tree only: otherwise
        nobody asks)."""
        if not self._track_halves:
            return []
        halves = self._split_writes.pop(node.id, [])
        for half in halves:
            del self._write_of[half.id]
        return sorted(halves, key=_depth) + [node]

    def _drop_backup(self, node: HiTreeNode) -> None:
        """A failed write: forget the (garbage) host copies of `node` and its descendants.

        Copies run in FIFO order, so the descendants' writes (queued after this one) are
        not acked yet: they are all still locked on the device and nothing is lost.
        """
        self.counters.transfer_failures += 1
        logger.error("D->H copy of %d tokens failed; the subtree stays on L1 only",
                     len(node.key))
        stack = [node]
        while stack:
            n = stack.pop()
            if n.host_value is not None:
                self.controller.host_pool.free(n.host_value)
                n.host_value = None
            stack.extend(n.children.values())
        self.tree.copy_changed(node.parent)
