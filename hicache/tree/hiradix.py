"""HiRadixCache: the radix tree over two tiers, device (L1) and host (L2).

Every node may hold device slots (`value`) and host slots (`host_value`):

    value  host_value   state
    set    None         on L1 only (not backed up yet, or its write was dropped)
    set    set          on L1 and L2 ("backed up")
    None   set          evicted from L1, on L2 only; a match counts it in host_hit_length

Invariants (`check_integrity` checks them all):
- device nodes form a prefix-closed set: an evicted node's descendants are all evicted;
- backups form a prefix-closed set: a node is backed up only when its parent is;
- a locked node is on the device (loads and in-flight writes hold a lock until their ack);
- a node with `host_ref_counter > 0` (and its ancestors) keeps its host pages.

Threading: scheduler thread only, like the base tree. Copies are queued on the
`HiCacheController`; their acks are applied in `writing_check` / `loading_check`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from hicache.events.recorder import EventRecorder
from hicache.events.schema import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    REASON_DEMOTED,
    REASON_EVICTED,
)
from hicache.policies import WRITE_POLICIES, check_choice
from hicache.transfer.controller import HiCacheController
from hicache.transfer.engines import TransferHandle
from hicache.tree.base import EMPTY, HostCounters, HostSizes, LoadBack, MatchResult, concat
from hicache.tree.hiradix_loads import HostLoads
from hicache.tree.hiradix_writes import HostWrites
from hicache.tree.integrity import check_hi_node
from hicache.tree.leaf_heap import LeafHeap
from hicache.tree.node import HiTreeNode, TreeNode
from hicache.tree.radix import RadixCache

logger = logging.getLogger(__name__)

# Loading fewer tokens than this back from L2 costs more in launch and bookkeeping than
# recomputing them (SGLang uses the same default for its load_back_threshold).
LOAD_BACK_THRESHOLD = 10


class HiRadixCache(RadixCache):
    """The L1 radix tree plus the L2 host tier; see the module docstring. Its parts own
    the copies in flight: `writes` (D->H, `hiradix_writes`) and `loads` (H->D and fetched
    pages, `hiradix_loads`)."""

    node_cls = HiTreeNode

    def __init__(self, controller: HiCacheController, page_size: int = 1,
                 write_policy: str = "write_through", write_through_threshold: int = 2,
                 eviction_policy: str = "lru", load_back_threshold: int = LOAD_BACK_THRESHOLD,
                 events: EventRecorder | None = None) -> None:
        check_choice("write_policy", write_policy, WRITE_POLICIES)
        self.controller = controller
        self.write_policy = write_policy
        self.write_through_threshold = write_through_threshold
        self.load_back_threshold = load_back_threshold
        self.counters = HostCounters()
        # observer(name, seconds): latency hook for metrics ("load_back_seconds")
        self.observer: Callable[[str, float], None] | None = None
        super().__init__(controller.device_pool, page_size, False, eviction_policy, events)
        self.host = self  # this tree is its own L2 side (`host_tier.HostTier`)

    def _init_tree(self) -> None:
        super()._init_tree()
        self.root.value = EMPTY
        self.root.host_value = EMPTY
        self._host_heap = LeafHeap(self._priority, self._is_host_leaf)
        # L2 copies of pages L1 holds too, deepest first (`_reclaim_copies`)
        self._copy_heap = LeafHeap(self._priority, self._copy_reclaimable)
        self.writes = HostWrites(self)
        self.loads = HostLoads(self, self._split, self._attach)
        if self.windows is not None:
            self.windows.before_tombstone = self.writes.before_tombstone

    def reset(self) -> None:
        """Wait for copies in flight, then forget everything (the caller resets the pools and
        has let every L3 backup and prefetch go first: they hold host pages)."""
        self.controller.wait_all()
        self.controller.poll_writes()
        self.controller.poll_loads()
        super().reset()

    # ---------------------------------------------------------------------------- match

    def match_prefix(self, key: Sequence[int], extra_key: str | None = None, *,
                     priority: int | None = None, count_hit: bool = True) -> MatchResult:
        """The device hit, plus the L2-only nodes below it (`host_hit_length` tokens);
        touching and counting as the base tree's."""
        path = self._match_path(key, extra_key, priority, count_hit)
        if self.windows is not None:  # never a window with a hole, on L1 or L2
            path = path[:self.windows.hit_nodes(path)]
        on_device = 0
        while on_device < len(path) and not path[on_device].evicted:
            on_device += 1
        device = path[:on_device]
        indices = concat([n.value for n in device])
        last_device = device[-1] if device else self.root
        last_host = path[-1] if path else self.root
        host_hit = sum(len(n.key) for n in path[on_device:])
        return MatchResult(indices, last_device, last_host, host_hit)

    def _requeue(self, path: list[TreeNode]) -> None:
        """Only the last device node and the last node can be candidates (see base)."""
        for node in reversed(path):
            if not node.evicted:
                self._device_heap.push(node)
                break
        if path:
            self._host_heap.push(path[-1])
        for node in reversed(path):  # the deepest copy on the path (the others have a child's)
            if node.host_value is not None:
                self._copy_heap.push(node)
                break
        if self.windows is not None:  # any node may lose its window KV: each re-enters
            self.windows.touched(path)
        self._maybe_rebuild_heaps()

    def _repush(self, node: TreeNode) -> None:
        super()._repush(node)
        self._host_heap.push(node)
        self._copy_heap.push(node)

    def _insert_hits(self, path: list[HiTreeNode], value: torch.Tensor, matched: int) -> int:
        """Like the base tree, except that an L2-only node on the path adopts the caller's
        slots `value[pos:pos + n]` for its recomputed KV: those are not the caller's to free."""
        present = pos = 0
        for node in path:
            n = len(node.key)
            if node.evicted:
                node.value = torch.narrow_copy(value, 0, pos, n)
                self._evictable += n
                self.kv_events.stored(node, MEDIUM_GPU)
                if self.windows is not None:  # with what it holds of the window layers
                    self.windows.added(node, self._split)
            else:
                present += n
            pos += n
        return present

    def _split_extra(self, new: HiTreeNode, child: HiTreeNode, n: int) -> None:
        if child.host_value is not None:
            new.host_value = child.host_value[:n]
            child.host_value = child.host_value[n:]
        new.host_ref_counter = child.host_ref_counter
        new.storage_backed, new.host_window = child.storage_backed, child.host_window
        self.writes.split(new, child)

    def _on_path(self, path: list[TreeNode]) -> None:
        self.writes.on_path(path)

    # --------------------------------------------------------------------------- evict

    def _is_device_leaf(self, node: TreeNode) -> bool:
        """Unlocked, on the device, and every child already evicted; a pinned node only
        when it can be demoted (backed up in L2): a pin never deletes."""
        return (node.lock_ref == 0 and node.parent is not None and not node.evicted
                and (node.pin_ref == 0 or node.backuped)
                and all(c.evicted for c in node.children.values()))

    def _pin_demotable(self, node: TreeNode) -> bool:
        return node.backuped  # a pinned node leaves L1 only for L2

    def _is_host_leaf(self, node: TreeNode) -> bool:
        """Evicted from L1, no children, its host pages not protected nor pinned."""
        return (node.parent is not None and node.evicted and not node.children
                and node.host_ref_counter == 0 and node.pin_ref == 0)

    def evict(self, num_tokens: int) -> int:
        """Free device tokens: demote backed-up leaves, delete (or write back) the others.

        Under write_back a pass waits for its copies before demoting, and parents become
        candidates only after their children are gone: passes repeat until done or stuck.
        """
        freed = 0
        while freed < num_tokens:
            got = self._evict_pass(num_tokens - freed)
            if got == 0:
                break
            freed += got
        return freed

    def _evict_pass(self, num_tokens: int) -> int:
        freed, written_back = 0, []
        while freed < num_tokens and (node := self._device_heap.pop()) is not None:
            if node.backuped:
                freed += self._demote(node)
            elif self.write_policy == "write_back" and self.back_up_path(node):
                written_back.append(node)
                freed += len(node.key)
            else:
                assert not node.children, "an un-backed node cannot have evicted children"
                freed += self._evict_device_leaf(node)
                self.counters.device_evicted_tokens += len(node.key)
        if written_back:
            self.writing_check(wait=True, claim=False)  # their L3 backups come at the poll
            for node in written_back:
                self._demote(node)
        return freed

    def _demote(self, node: HiTreeNode) -> int:
        """Free a backed-up node's device slots; it stays in the tree on L2."""
        n = len(node.key)
        self.kv_events.removed(node, MEDIUM_GPU, REASON_DEMOTED)
        if self.windows is not None:
            self.windows.evicted(node)
        self.allocator.free(node.value)
        node.value = None
        self._evictable -= n
        self.counters.device_evicted_tokens += n
        self._device_heap.push(node.parent)
        self._host_heap.push(node)
        return n

    def _delete_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        super()._delete_leaf(node)
        self._host_heap.push(parent)
        self._copy_heap.push(parent)

    def protect_host(self, node: HiTreeNode) -> None:
        """Keep `node`'s and its ancestors' host pages (an L3 backup or prefetch reads them)."""
        node.protect_host()

    def release_host(self, node: HiTreeNode) -> None:
        """End a `protect_host`; the node becomes an L2 eviction candidate again."""
        node.release_host()
        self._host_heap.push(node)
        self._copy_heap.push(node)

    def evict_host(self, num_tokens: int, writing: HiTreeNode | None = None) -> int:
        """Free host tokens from unprotected L2-only leaves, in the eviction policy's order
        (the L1 heap's key: least recently used first under `lru`); when those fall short,
        the host copies of nodes that are on L1 too (`_reclaim_copies`), except those of the
        ancestors of `writing` (the node whose D->H copy needs the room)."""
        freed = 0
        while freed < num_tokens and (node := self._host_heap.pop()) is not None:
            self.kv_events.removed(node, MEDIUM_CPU, REASON_EVICTED)
            self.controller.host_pool.free(node.host_value)
            freed += len(node.key)
            self._delete_leaf(node)
        if freed < num_tokens:
            freed += self._reclaim_copies(num_tokens - freed, writing)
        self.counters.host_evicted_tokens += freed
        return freed

    def _reclaim_copies(self, num_tokens: int, writing: HiTreeNode | None) -> int:
        """Free the host copies of nodes that L1 holds too (their KV stays on the device), in
        the eviction order, deepest first: an L2 smaller than L1 (or one full of copies under
        write_through) makes room for new writes instead of dropping them (SGLang #33862).

        A copy is kept while it is protected or pinned, being written or loaded, while a
        child has one, or when it is an ancestor of `writing`: no node is ever in L2 without
        its parent. A node whose copy went, evicted from L1 later, is deleted rather than
        demoted (or written back first, under write_back); write_through copies it again
        the next time a request uses it."""
        # Of `writing`'s ancestors only its parent can be a candidate (the others have a
        # child with a copy); pages being loaded are read from their copies
        loading = self.loads.loading()
        freed, kept = 0, []
        while freed < num_tokens and (node := self._copy_heap.pop()) is not None:
            if (writing is not None and node is writing.parent
                    or node.id in self.writes.ongoing or node.id in loading):
                kept.append(node)
                continue
            self.kv_events.removed(node, MEDIUM_CPU, REASON_EVICTED)
            self.controller.host_pool.free(node.host_value)
            node.host_value = None
            freed += len(node.key)
            self._copy_heap.push(node.parent)  # its copy may be the deepest now
        for node in kept:
            self._copy_heap.push(node)
        self.counters.reclaimed_copy_tokens += freed
        return freed

    @staticmethod
    def _copy_reclaimable(node: HiTreeNode) -> bool:
        return (node.parent is not None and node.host_value is not None and not node.evicted
                and node.host_ref_counter == 0 and node.pin_ref == 0
                and not any(c.host_value is not None for c in node.children.values()))

    def flush_host(self) -> int:
        """Empty L2 of everything unprotected and unpinned: L2-only nodes, then the host
        copies of nodes still on L1. Call with no write in flight. Returns the host tokens freed."""
        assert not self.writes.ongoing, "flush_host with D->H copies in flight"
        with self.kv_events.flushing():
            freed = self.evict_host(self.controller.host_pool.total_size())
            for node in self.iter_nodes():  # parents first: a kept copy's parent is kept too
                if (node.host_value is not None and node.host_ref_counter == 0
                        and node.pin_ref == 0):
                    self.kv_events.removed(node, MEDIUM_CPU, REASON_EVICTED)
                    self.controller.host_pool.free(node.host_value)
                    freed += len(node.key)
                    node.host_value = None
        return freed

    def _maybe_rebuild_heaps(self) -> None:
        super()._maybe_rebuild_heaps()
        self._host_heap.rebuild_if_stale(self._num_nodes, self.iter_nodes)
        self._copy_heap.rebuild_if_stale(self._num_nodes, self.iter_nodes)

    # ------------------------------------------- copies: the `writes` and `loads` parts

    def back_up_path(self, node: HiTreeNode) -> bool:
        return self.writes.back_up_path(node)

    def writing_check(self, wait: bool = False, claim: bool = True) -> list[HiTreeNode]:
        return self.writes.writing_check(wait, claim)

    def init_load_back(self, last_host_node: HiTreeNode) -> LoadBack:
        return self.loads.init_load_back(last_host_node)

    def reload_windows(self, last: HiTreeNode) -> bool:
        return self.loads.reload_windows(last)

    def loading_check(self, wait: bool = False) -> int:
        return self.loads.loading_check(wait)

    def insert_host_pages(self, anchor: HiTreeNode, tokens: tuple[int, ...],
                          host_indices: torch.Tensor, hashes: list[bytes],
                          extra_key: str | None = None, window_from: int | None = None) -> int:
        return self.loads.insert_host_pages(anchor, tokens, host_indices, hashes, extra_key,
                                            window_from)

    def place_on_device(self, nodes: list[HiTreeNode], device: torch.Tensor) -> int:
        """L2-only `nodes` (a path, top down) get a load's `device` slots; tokens placed."""
        offset = 0
        for n in nodes:
            n.value = device[offset:offset + len(n.key)]
            offset += len(n.key)
            self.kv_events.stored(n, MEDIUM_GPU)
            if self.windows is not None:  # the window pages the load got (`loads`)
                self.windows.added(n, self._split)
        self._evictable += offset
        return offset

    def demote_unused(self, nodes: list[HiTreeNode]) -> None:
        """A failed load left garbage on the device: demote what nothing uses, deepest first."""
        for n in reversed(nodes):
            if self._is_device_leaf(n):
                self._demote(n)

    def copy_changed(self, node: HiTreeNode) -> None:
        """`node`'s host copy may have become reclaimable (`_reclaim_copies`)."""
        self._copy_heap.push(node)

    def host_leaf_changed(self, node: HiTreeNode) -> None:
        """`node` may have become an L2 eviction candidate."""
        self._host_heap.push(node)

    # ------------------------------------------------------------------ L3 and copies

    def host_counters(self) -> HostCounters:
        return replace(self.counters)

    def mark_stored(self, node: HiTreeNode, window: bool = False) -> None:
        """`node` is in L3 now (a backup or query said so); `window`: its end's window parts too."""
        node.storage_backed, node.window_stored = True, node.window_stored or window

    def forget_stored(self) -> None:
        for node in self.iter_nodes():
            node.storage_backed = node.window_stored = False

    def copies_pending(self) -> bool:
        return self.controller.has_pending()

    def start_loading(self) -> TransferHandle | None:
        return self.controller.start_loading()

    def wait_copies(self) -> None:
        self.controller.wait_all()

    # -------------------------------------------------------------------------- sizes

    def host_sizes(self) -> HostSizes:
        """L2 tokens held by the tree: total, evictable (L2-only leaves), protected."""
        total = evictable = protected = 0
        for node in self.iter_nodes():
            if node.host_value is None:
                continue
            total += len(node.key)
            if node.host_ref_counter > 0 or node.lock_ref > 0:
                protected += len(node.key)
            elif self._is_host_leaf(node):
                evictable += len(node.key)
        return HostSizes(total, evictable, protected)

    def all_host_values(self) -> torch.Tensor:
        vals = [n.host_value for n in self.iter_nodes() if n.host_value is not None]
        return torch.cat(vals) if vals else EMPTY

    # ---------------------------------------------------------------------- integrity
    def _check_node(self, node: HiTreeNode) -> None:
        super()._check_node(node)
        check_hi_node(node)

    def check_integrity(self, held_host_tokens: int = 0) -> None:
        """The base invariants, the tiers' invariants, and the host pool's count: the tree's
        host slots plus `held_host_tokens` (what in-flight L3 prefetches hold)."""
        super().check_integrity()
        dev = self.all_values().tolist()
        host = self.all_host_values().tolist()
        assert len(set(dev)) == len(dev), "a device slot is owned twice"
        assert len(set(host)) == len(host), "a host slot is owned twice"
        pool = self.controller.host_pool
        used = pool.total_size() - pool.available_size()
        assert used == len(host) + held_host_tokens, (
            f"host pool uses {used} slots, the tree owns {len(host)} and prefetches hold "
            f"{held_host_tokens}")
