"""Pages coming up into the two-tier tree: L2 -> L1 load-backs (`init_load_back`, acked in
`loading_check`) and L3 -> L2 pages a prefetch fetched (`insert_host_pages`).
`HiRadixCache` is made of this; see `hiradix.py` for the node states and invariants.

Threading: scheduler thread only, like the tree.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from hicache.events.schema import MEDIUM_CPU, MEDIUM_GPU
from hicache.transfer.controller import HiCacheController
from hicache.tree.base import EMPTY, HostCounters, LoadBack
from hicache.tree.leaf_heap import LeafHeap
from hicache.tree.node import HiTreeNode
from hicache.tree.walk import as_key, descend

logger = logging.getLogger(__name__)


class HostLoads:
    """Load-backs and fetched pages over the tree's nodes, pools and heaps (given by
    `HiRadixCache`: its controller, counters, heaps and the base tree's operations)."""

    controller: HiCacheController
    counters: HostCounters
    page_size: int
    load_back_threshold: int
    observer: Callable[[str, float], None] | None
    _ongoing_loads: dict[int, tuple[list[HiTreeNode], float]]
    _copy_heap: LeafHeap
    _host_heap: LeafHeap
    _evictable: int
    _split: Callable[..., Any]

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
        if len(host_indices) < self.load_back_threshold:
            return LoadBack(EMPTY, node)
        device = self._alloc_for_load(node, last_host_node, host_indices)
        if device is None:
            return LoadBack(EMPTY, node)
        offset = 0
        for n in nodes:
            n.value = device[offset:offset + len(n.key)]
            offset += len(n.key)
            self.kv_events.stored(n, MEDIUM_GPU)
        self._evictable += offset
        self.inc_lock_ref(last_host_node)
        self._ongoing_loads[last_host_node.id] = (nodes, time.monotonic())
        self.counters.load_back_tokens += offset
        return LoadBack(device, last_host_node)

    def _alloc_for_load(self, ancestor: HiTreeNode, last: HiTreeNode,
                        host_indices: torch.Tensor) -> torch.Tensor | None:
        """Device slots for a load, evicting L1 once if needed; the path is kept meanwhile."""
        self.inc_lock_ref(ancestor)
        self.protect_host(last)
        device = self.controller.load(host_indices, last.id)
        if device is None:
            self.evict(len(host_indices))
            device = self.controller.load(host_indices, last.id)
        self.release_host(last)
        self.dec_lock_ref(ancestor)
        return device

    def loading_check(self, wait: bool = False) -> int:
        """Apply finished H->D acks: release the load locks. Returns the acks applied."""
        if wait:
            self.controller.wait_loads()
        acks = self.controller.poll_loads()
        for ack in acks:
            nodes, started = self._ongoing_loads.pop(ack.node_id)
            self.dec_lock_ref(nodes[-1])
            if self.observer is not None:
                self.observer("load_back_seconds", time.monotonic() - started)
            if not ack.ok:
                self.counters.transfer_failures += 1
                logger.error("H->D load of %d nodes failed", len(nodes))
                for n in reversed(nodes):  # garbage on the device: drop what is unused
                    if self._is_device_leaf(n):
                        self._demote(n)
            for n in nodes:  # on L1 again with their copies: reclaimable once loaded
                self._copy_heap.push(n)
        return len(acks)

    def insert_host_pages(self, anchor: HiTreeNode, tokens: tuple[int, ...],
                          host_indices: torch.Tensor, hashes: list[bytes],
                          extra_key: str | None = None) -> int:
        """Attach pages fetched from L3 below `anchor` (which must be in L2) as L2-only
        nodes. Pages the tree already holds in L2 are freed; a device-only node on the way
        adopts the fetched copy. Returns the tokens that were new to L2. Touches nothing.

        `tokens` (whole pages), `host_indices` (one slot per token) and `hashes` (one per
        page) are aligned with each other."""
        tokens, ps = as_key(tokens), self.page_size
        if len(tokens) % ps:
            raise ValueError(f"insert_host_pages: {len(tokens)} tokens are not whole pages "
                             f"of {ps}")
        path = descend(anchor, tokens, extra_key, ps, self._split).path
        pos = new_tokens = 0
        for node in path:
            n = len(node.key)
            if node.backuped:
                self.controller.host_pool.free(host_indices[pos:pos + n])
            else:
                self._set_l3_copy(node, host_indices[pos:pos + n], hashes[pos // ps:])
                new_tokens += n
            pos += n
        if pos < len(tokens):
            leaf = self._attach(path[-1] if path else anchor, tokens[pos:], None, extra_key)
            self._set_l3_copy(leaf, host_indices[pos:], hashes[pos // ps:])
            self._host_heap.push(leaf)
            new_tokens += len(tokens) - pos
        return new_tokens

    def _set_l3_copy(self, node: HiTreeNode, host: torch.Tensor, hashes: list[bytes]) -> None:
        """`node`'s pages, fetched from L3, are in L2 now (and known to be in L3)."""
        node.host_value = host.clone()
        node.hash_value = hashes[:len(node.key) // self.page_size]
        node.storage_backed = True
        self._copy_heap.push(node)
        self.kv_events.stored(node, MEDIUM_CPU)  # DISK: reported when the query found them
