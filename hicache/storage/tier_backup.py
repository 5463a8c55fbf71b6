"""A storage tier's backups (`StorageTier` holds one `Backups`): a node that reached L2 is
written to L3 with its ancestors not there yet, parents first; its host pages are protected
until the ack, which marks it stored. Pages L3 is known to hold (`KnownStored`: a hit
recomputed, a raced head) are not sent again. A hybrid model's node whose end's window parts
L3 holds (`window_stored`: written, or read from L3) does not write them again when its L2
copy comes back.

Threading: scheduler thread only, like the storage tier; the writes run on the
`StorageController`'s threads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.events.schema import MEDIUM_DISK
from hicache.storage.hashing import PageHasher
from hicache.storage.io import StorageController
from hicache.storage.tier_state import KnownStored, StorageCounters
from hicache.tree.node import node_hashes

if TYPE_CHECKING:
    from hicache.tree.hiradix import HiRadixCache, HiTreeNode


class Backups:
    """The backups in flight (node id -> node) over one tier's I/O, tree and counters."""

    def __init__(self, io: StorageController, tree: HiRadixCache, hasher: PageHasher,
                 counters: StorageCounters, stored: KnownStored) -> None:
        self.io = io
        self.tree = tree
        self.hasher = hasher
        self.page_size = tree.page_size
        self.counters = counters
        self.stored = stored
        self._in_flight: dict[int, HiTreeNode] = {}
        self._window_only: set[int] = set()  # in flight: window parts of a stored node

    def busy(self) -> bool:
        return bool(self._in_flight)

    def backup(self, node: HiTreeNode) -> None:
        """Write a node that just reached L2 to storage, with any ancestor not there yet,
        parents first (a match may have split the node while its D->H copy ran: the upper
        half is acknowledged by the same copy). Host pages stay until each ack."""
        if node.storage_backed and not node.window_stored:  # a boundary in stored pages
            self._backup_window(node)  # (a split): its window parts
        chain = []
        while node is not self.tree.root:
            if node is None:  # it left the tree since it reached L2 (evicted from L2)
                return
            if (node.host_value is not None and not node.storage_backed
                    and node.id not in self._in_flight):
                chain.append(node)
            node = node.parent
        for n in reversed(chain):
            hashes, host = node_hashes(n, self.tree.root, self.hasher), n.host_value
            windows = self._window_pages(n)
            # Pages L3 said it holds (a recomputed hit, a raced head; events said so) are
            # not sent again: a store that skips a page it has still moves it over the link
            # (Redis SET NX carries the value), beside the fetches a race is waiting for.
            known = self.stored.pop_known(hashes)
            if all(known):
                self.tree.mark_stored(n)
                continue
            if any(known):
                keep = [i for i, k in enumerate(known) if not k]
                windows = sum(i >= len(hashes) - windows for i in keep)
                hashes = [hashes[i] for i in keep]
                host = host.view(-1, self.page_size)[keep].reshape(-1)
            self.tree.protect_host(n)
            self._in_flight[n.id] = n
            self.io.backup(n.id, hashes, host, windows)

    def _backup_window(self, node: HiTreeNode) -> None:
        """A stored node's window parts, for the boundary at its end (a split made it after
        the node was stored), when its L2 copy holds the window KV."""
        windows = self._window_pages(node)
        if (not windows or node.parent is None or node.host_value is None
                or node.id in self._in_flight):  # gone from L2 meanwhile, or being written
            return
        hashes = node_hashes(node, self.tree.root, self.hasher)[-windows:]
        host = node.host_value[len(node.key) - windows * self.page_size:]
        self.tree.protect_host(node)
        self._in_flight[node.id] = node
        self._window_only.add(node.id)
        self.io.backup(node.id, hashes, host, windows, full=False)

    def _window_pages(self, node: HiTreeNode) -> int:
        """Of a hybrid model's node, the trailing pages whose window parts L3 gets: those its
        end's window reads, when its L2 copy holds its window KV (`StoreKinds`)."""
        if self.io.window is None or not node.host_window:
            return 0
        return self.io.window.kinds.window_pages_of(node.end - len(node.key), node.end)

    def check(self) -> None:
        """Apply the backup acks: release the host pages, mark the nodes stored."""
        for ack in self.io.poll_backups():
            node = self._in_flight.pop(ack.node_id)
            self.tree.release_host(node)
            if ack.node_id in self._window_only:
                self._window_only.discard(ack.node_id)
                self._window_stored(node, ack.window_pages)
            elif ack.ok:
                self.tree.mark_stored(node)
                self.counters.backed_up_tokens += len(node.key)
                self.tree.kv_events.stored(node, MEDIUM_DISK)
                self._window_stored(node, ack.window_pages)
            else:
                self.counters.backup_failures += 1

    def _window_stored(self, node: HiTreeNode, pages: int) -> None:
        """`pages` window parts of `node`'s end were written: it is window_stored when they
        are all its end reads (pages L3 already held were skipped, their parts unknown)."""
        if pages and pages >= self._window_pages(node):  # (a split since may need fewer)
            self.tree.mark_stored(node, window=True)
        if pages and node.parent is not None:
            self.counters.window_backed_up_tokens += pages * self.page_size
            self.tree.kv_events.window(node, MEDIUM_DISK, True, last_pages=pages)
