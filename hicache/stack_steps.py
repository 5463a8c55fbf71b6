"""The per-step part of the one door (`cache.steps`, held by `hicache.stack.CacheStack`): the
copies between the tiers run on their own threads and streams, and their acks are applied
here, on the scheduler thread, in one fixed order: D->H writes (nodes reach L2), their L3
backups, H->D loads, then the storage tier's prefetch and backup acks.

    each step         poll(settle_s); publish_events() at its end; busy(): poll sooner
    a forward pass    launch_loads(): the H->D loads admission queued, as one transfer
    short of L1       wait_copies(): wait for the copies in flight (they free L1 pages)
    flush, shutdown   quiesce(): wait for every copy and backup

Threading: scheduler thread only (the publisher sends from its own thread).
"""

from __future__ import annotations

from hicache.events import EventPublisher, EventRecorder
from hicache.stack_storage import StorageLink
from hicache.transfer.engines import TransferHandle
from hicache.tree.base import PrefixCache


class StepCalls:
    """The acks of the tree's L1<->L2 copies (`tree.host`) and of the L3 part, and the KV
    events the step recorded (`events` None: off)."""

    def __init__(self, tree: PrefixCache, l3: StorageLink, events: EventRecorder | None,
                 publisher: EventPublisher) -> None:
        self._tree = tree
        self._l3 = l3
        self._events = events
        self._publisher = publisher

    def poll(self, settle_s: float = 0.0) -> None:
        """Apply the acks in their fixed order: writes -> backups -> loads -> prefetches;
        `settle_s` > 0 first gives fresh L3 queries up to that long to answer (requests just
        arrived: see `StorageTier.settle`)."""
        if settle_s > 0:
            self._l3.settle(settle_s)
        self._l3.backup(self._tree.host.writing_check())
        self._tree.host.loading_check()
        self._l3.check()

    def busy(self) -> bool:
        """Whether copies, prefetches or backups are in flight (the loop polls sooner)."""
        return self._tree.host.copies_pending() or self._l3.busy()

    def wait_copies(self) -> bool:
        """Block until every copy queued so far has finished and apply the acks (`poll`);
        False, at once, when none was queued or in flight."""
        if not self._tree.host.copies_pending():
            return False
        self._tree.host.wait_copies()
        self.poll()
        return True

    def launch_loads(self) -> TransferHandle | None:
        """Launch the H->D loads admission queued, as one transfer: the model runner before a
        forward pass (its layers wait on the handle), the loop when none will run (loads
        never wait for one). The handle is the last load in flight when none was queued (a
        forward may read the pages of one the loop launched); None when none is queued or
        in flight."""
        return self._tree.host.start_loading()

    def quiesce(self) -> None:
        """Wait for every copy and backup in flight and apply their acks (flush, shutdown).
        Copies first: their acks queue backups, which protect host pages."""
        self._tree.host.wait_copies()
        self._l3.backup(self._tree.host.writing_check())
        self._tree.host.loading_check()
        self._l3.wait_idle()

    def publish_events(self) -> None:
        """End of a scheduler step: send the step's KV events as one batch (if any). Never
        blocks: the publisher queues it for its own thread."""
        if self._events is not None:
            batch = self._events.take()
            if batch:
                self._publisher.publish(batch)


def restate_events(events: EventRecorder, tree: PrefixCache, mark: int = -1) -> None:
    """`AllBlocksCleared` (in place of the events recorded since `mark`, when given), then
    what the tree still holds (pinned pages a flush kept, L1 and L2 after L3 went)."""
    if mark >= 0:
        del events.events[mark:]
    events.cleared()
    tree.kv_events.record_all(tree.iter_nodes())
