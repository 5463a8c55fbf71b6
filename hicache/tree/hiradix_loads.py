"""Pages coming up into the two-tier tree: L2 -> L1 load-backs (`init_load_back`, acked in
`loading_check`) and L3 -> L2 pages a prefetch fetched (`insert_host_pages`).
`HiRadixCache` holds one `HostLoads` (a new one at each reset), which owns the loads in
flight; see `hiradix.py` for the node states and invariants.

Threading: scheduler thread only, like the tree.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from hicache.events.schema import MEDIUM_CPU
from hicache.transfer.controller import HiCacheController
from hicache.tree.base import EMPTY, HostCounters, LoadBack
from hicache.tree.node import HiTreeNode, Key, TreeNode
from hicache.tree.tree_events import TreeEvents
from hicache.tree.walk import as_key, descend
from hicache.tree.window_kv import WindowKV

if TYPE_CHECKING:
    from hicache.tree.hiradix_writes import HostWrites

logger = logging.getLogger(__name__)


class LoadingTree(Protocol):
    """What `HostLoads` uses of its tree (`HiRadixCache`)."""

    controller: HiCacheController
    counters: HostCounters
    page_size: int
    load_back_threshold: int
    observer: Callable[[str, float], None] | None
    kv_events: TreeEvents
    windows: WindowKV | None
    writes: HostWrites

    def inc_lock_ref(self, node: TreeNode) -> int: ...
    def dec_lock_ref(self, node: TreeNode) -> int: ...
    def protect_host(self, node: HiTreeNode) -> None: ...
    def release_host(self, node: HiTreeNode) -> None: ...
    def evict(self, num_tokens: int) -> int: ...
    def place_on_device(self, nodes: list[HiTreeNode], device: torch.Tensor) -> int: ...
    def demote_unused(self, nodes: list[HiTreeNode]) -> None: ...
    def copy_changed(self, node: HiTreeNode) -> None: ...
    def host_leaf_changed(self, node: HiTreeNode) -> None: ...


class HostLoads:
    """The H->D loads in flight over one tree (its controller, counters, locks and L1
    eviction), by the id of each load's last node: (its nodes, when it started). The tree
    grants the two edge operations fetched pages need: `split` and `attach`."""

    def __init__(self, tree: LoadingTree, split: Callable[[HiTreeNode, int], HiTreeNode],
                 attach: Callable[[HiTreeNode, Key, None, str | None], HiTreeNode]) -> None:
        self.tree = tree
        self.controller = tree.controller
        self.counters = tree.counters
        self.page_size = tree.page_size
        self._split, self._attach = split, attach
        self.ongoing: dict[int, tuple[list[HiTreeNode], float]] = {}

    def loading(self) -> set[int]:
        """The ids of the nodes being loaded (their copies are read)."""
        return {n.id for nodes, _ in self.ongoing.values() for n in nodes}

    def init_load_back(self, last_host_node: HiTreeNode) -> LoadBack:
        """Allocate device slots for the L2-only path ending at `last_host_node` and queue
        its H->D copy (launched by `controller.start_loading()`).

        The loaded nodes get their `value` now and stay locked until the load is acked.
        When L1 has no room even after one eviction, nothing is loaded: the caller
        recomputes from the returned `last_node`.
        """
        nodes, node = [], last_host_node
        while node.evicted:
            nodes.append(node)
            node = node.parent
        if not nodes:
            return LoadBack(EMPTY, last_host_node)
        nodes.reverse()
        host_indices = torch.cat([n.host_value for n in nodes])
        if len(host_indices) < self.tree.load_back_threshold:
            return LoadBack(EMPTY, node)
        windowed = self._windowed(nodes, last_host_node)
        device = (self._alloc_for_load(node, last_host_node, host_indices, windowed)
                  if windowed >= 0 else None)
        if device is None:
            return LoadBack(EMPTY, node)
        if windowed:  # room made by `_windowed` and `_alloc_for_load`
            given = self.controller.device_pool.give_window(device[-windowed:])
            assert given, "the pool lost the room `_windowed` made"
        offset = self.tree.place_on_device(nodes, device)
        self.tree.inc_lock_ref(last_host_node)
        self.ongoing[last_host_node.id] = (nodes, time.monotonic())
        self.counters.load_back_tokens += offset
        return LoadBack(device, last_host_node)

    def reload_windows(self, last: HiTreeNode) -> bool:
        """The tombstones on L1 in the window of a hit ending at `last` get their window KV
        back from their L2 copies, now (a hit counts on them: `WindowKV.hit_nodes`); the
        caller's lock keeps them. False, with nothing changed, when one has no finished
        copy or the pool has no room: the hit then falls back to L1's own."""
        windows, pool = self.tree.windows, self.controller.device_pool
        cut, nodes, node = windows.needed_from(last.end), [], last
        while node.parent is not None and node.end > cut:
            if node.value is not None and not node.has_window:
                nodes.append(node)
            node = node.parent
        if any(not n.host_window or n.host_value is None or self.tree.writes.writing(n.id)
               for n in nodes):
            return False
        if not windows.make_room(sum(len(n.key) for n in nodes)):
            return False
        for n in nodes:
            given = pool.give_window(n.value)
            assert given, "the pool lost the room just made"
            self.controller.load_windows_now(n.host_value, n.value)
            windows.gained(n)
        return True

    def _windowed(self, nodes: list[HiTreeNode], last: HiTreeNode) -> int:
        """A hybrid model's load: the tokens at the end of `nodes` whose window KV it
        brings up too, what a query at `last`'s end reads (the rest comes up with its full
        layers only), with room made for them in the pool. -1: no room (no load)."""
        windows = self.tree.windows
        if windows is None:
            return 0
        cut = windows.needed_from(last.end)
        tokens = sum(len(n.key) for n in nodes if n.end > cut)
        return tokens if windows.make_room(tokens) else -1

    def _alloc_for_load(self, ancestor: HiTreeNode, last: HiTreeNode,
                        host_indices: torch.Tensor, windowed: int = 0) -> torch.Tensor | None:
        """Device slots for a load, evicting L1 once if needed; the path is kept meanwhile.
        A hybrid model's pool shares its pages between full and window layers: room is
        made for the `windowed` tokens' window pages too, which `give_window` then takes."""
        tree = self.tree
        tree.inc_lock_ref(ancestor)
        tree.protect_host(last)
        if tree.windows is not None:
            short = self.controller.device_pool.pages_short(len(host_indices), windowed)
            if short:
                tree.evict(short * self.page_size)
                if self.controller.device_pool.pages_short(len(host_indices), windowed):
                    tree.release_host(last)
                    tree.dec_lock_ref(ancestor)
                    return None
        device = self.controller.load(host_indices, last.id)
        if device is None:
            tree.evict(len(host_indices))
            device = self.controller.load(host_indices, last.id)
        tree.release_host(last)
        tree.dec_lock_ref(ancestor)
        return device

    def loading_check(self, wait: bool = False) -> int:
        """Apply finished H->D acks: release the load locks. Returns the acks applied."""
        if wait:
            self.controller.wait_loads()
        acks = self.controller.poll_loads()
        for ack in acks:
            nodes, started = self.ongoing.pop(ack.node_id)
            self.tree.dec_lock_ref(nodes[-1])
            if self.tree.observer is not None:
                self.tree.observer("load_back_seconds", time.monotonic() - started)
            if not ack.ok:
                self.counters.transfer_failures += 1
                logger.error("H->D load of %d nodes failed", len(nodes))
                self.tree.demote_unused(nodes)  # garbage on the device
            for n in nodes:  # on L1 again with their copies: reclaimable once loaded
                self.tree.copy_changed(n)
        return len(acks)

    def insert_host_pages(self, anchor: HiTreeNode, tokens: tuple[int, ...],
                          host_indices: torch.Tensor, hashes: list[bytes],
                          extra_key: str | None = None, window_from: int | None = None) -> int:
        """Attach pages fetched from L3 below `anchor` (which must be in L2) as L2-only
        nodes. Pages the tree already holds in L2 are freed; a device-only node on the way
        adopts the fetched copy. Returns the tokens that were new to L2. Touches nothing.

        `tokens` (whole pages), `host_indices` (one slot per token) and `hashes` (one per
        page) are aligned with each other. A hybrid model's pages from token `window_from`
        on hold their window layers' KV too (None: no page does); a node is cut there."""
        tokens, ps = as_key(tokens), self.page_size
        if len(tokens) % ps:
            raise ValueError(f"insert_host_pages: {len(tokens)} tokens are not whole pages "
                             f"of {ps}")
        if window_from is not None and 0 < window_from < len(tokens):
            descend(anchor, tokens[:window_from], extra_key, ps, self._split)
        path = descend(anchor, tokens, extra_key, ps, self._split).path
        pos = new_tokens = 0
        for node in path:
            n = len(node.key)
            if node.backuped:
                self.controller.host_pool.free(host_indices[pos:pos + n])
            else:
                self._set_l3_copy(node, host_indices[pos:pos + n], hashes[pos // ps:],
                                  _holds_window(pos, window_from))
                new_tokens += n
            pos += n
        leaf = path[-1] if path else anchor
        for start, stop in _cut(pos, len(tokens), window_from):
            leaf = self._attach(leaf, tokens[start:stop], None, extra_key)
            self._set_l3_copy(leaf, host_indices[start:stop], hashes[start // ps:],
                              _holds_window(start, window_from))
            new_tokens += stop - start
        if pos < len(tokens):
            self.tree.host_leaf_changed(leaf)
        return new_tokens

    def _set_l3_copy(self, node: HiTreeNode, host: torch.Tensor, hashes: list[bytes],
                     window: bool = False) -> None:
        """`node`'s pages, fetched from L3, are in L2 now (and known to be in L3); `window`:
        with their window layers' KV."""
        node.host_value = host.clone()
        node.host_window = window
        node.hash_value = hashes[:len(node.key) // self.page_size]
        node.storage_backed = True
        node.window_stored = node.window_stored or window  # read from L3: there
        self.tree.copy_changed(node)
        self.tree.kv_events.stored(node, MEDIUM_CPU)  # DISK: reported when the query found them


def _holds_window(start: int, window_from: int | None) -> bool:
    """Whether pages from token `start` on hold window KV (`insert_host_pages`)."""
    return window_from is not None and start >= window_from


def _cut(start: int, stop: int, at: int | None) -> list[tuple[int, int]]:
    """[start, stop) as one span (none when empty), or two where `at` falls inside it."""
    if start >= stop:
        return []
    if at is None or not start < at < stop:
        return [(start, stop)]
    return [(start, at), (at, stop)]
