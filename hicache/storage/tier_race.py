"""A storage tier's races (`race.py`) as the scheduler drives them: a raced request computes
toward its head stop (`head_stop`, read at admission); there the scheduler asks
`continue_head` for the next stop; once the head is final the request goes back to the
queue with it in the tree (`head_computed`) and is admitted again when the tail has arrived
(`ready`), which `terminate` hangs below the head (`_insert_tail`). `StorageTier` is made
of this.

Threading: scheduler thread only, like the storage tier.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from hicache.storage.fetch_queue import PrefetchOp
from hicache.storage.io import StorageController
from hicache.storage.planner import FetchPlanner
from hicache.storage.race import fetch_rate, next_target
from hicache.storage.tier_state import KnownStored, StorageCounters

if TYPE_CHECKING:
    from hicache.tree.hiradix import HiRadixCache, HiTreeNode


class HeadRace:
    """The race half of `StorageTier`, which gives `ops`, `io`, `planner`, `tree`,
    `page_size`, `counters`, `_stored`, `_recomputed` and `terminate`."""

    ops: dict[str, PrefetchOp]
    io: StorageController
    planner: FetchPlanner
    tree: HiRadixCache
    page_size: int
    counters: StorageCounters
    _stored: KnownStored

    def head_stop(self, req_id: str) -> int:
        """Where the request's raced head stops next (tokens from the start of its key), or
        0: no race, or its head is final. Its first call starts the compute side's clock."""
        op = self.ops.get(req_id)
        race = None if op is None else op.race
        if race is None or race.final:
            return 0
        if race.chunk_from is None:
            race.start_chunk(time.monotonic())
        return op.prefix_tokens + race.target * self.page_size

    def continue_head(self, req_id: str, computed: int) -> int:
        """The raced request has computed `computed` tokens (its head stop): where it stops
        next (> computed); `computed`, its head is final (it waits for the tail); or 0, the
        race is over and nothing fetched is used (its prefetch ended: it goes on as any
        prompt)."""
        op = self.ops.get(req_id)
        race = None if op is None else op.race
        if race is None or race.final:
            return 0
        now = time.monotonic()
        race.reached((computed - op.prefix_tokens) // self.page_size, now)
        status = self.io.progress(op)
        front = race.hit_pages - status.completed
        rate = fetch_rate(status.completed, status.handed_out, status.elapsed_s,
                          self.planner.fetch_pages_per_s(max(1, front - race.computed)))
        target = next_target(race, front, status.can_grow, rate)
        if target >= race.hit_pages:  # nothing came: compute it all
            self._race_took(op, now)
            self._recomputed(op, race.hit_pages)
            self.terminate(req_id)
            return 0
        race.target = target
        self.io.limit(op, target)
        if target == race.computed:
            race.final = True
            return computed
        race.start_chunk(now)
        return op.prefix_tokens + target * self.page_size

    def _tail_arrived(self, op: PrefetchOp) -> bool:
        """A raced op whose head is final has its tail: the fetched suffix reaches the head."""
        race = op.race
        return (race is not None and race.final
                and race.hit_pages - op.completed_pages <= race.target)

    def head_computed(self, req_id: str, node: HiTreeNode) -> None:
        """The request's head is final and in the tree, its last page at the end of `node`:
        keep it in L2 (copying it there if the write policy has not), so that the tail can
        hang below it when the request is admitted again."""
        op = self.ops.get(req_id)
        if op is None or op.race is None or not op.race.final or op.head_node is not None:
            return
        head = op.race.target
        self._stored.add(op.hashes[:head])
        self.counters.split_prefetches += 1
        self.counters.head_tokens += head * self.page_size
        if not node.backuped and not self.tree.back_up_path(node):
            self.io.cancel(op)  # no L2 room for the head: the tail is dropped, and computed
        self.tree.protect_host(node)
        op.head_node = node

    def _insert_tail(self, op: PrefetchOp, done: int) -> int:
        """A raced op ends with `done` trailing pages fetched: the pages from its head on join
        the tree below the head, if its head is final and the fetched suffix reaches it; the
        host pages before the head stay with `op` to be freed. Returns the tokens inserted."""
        race = op.race
        if not race.final or op.host_indices is None or race.hit_pages - done > race.target:
            return 0
        anchor = self._tail_anchor(op)
        if anchor is None:
            return 0
        p = self.page_size
        cut = (race.target - op.fetch_base) * p
        tokens = op.tokens[race.target * p:race.hit_pages * p]
        inserted = self.tree.insert_host_pages(anchor, tokens, op.host_indices[cut:],
                                               op.hashes[race.target:race.hit_pages],
                                               op.extra_key)
        op.host_indices = op.host_indices[:cut]
        self.counters.prefetched_tokens += len(tokens)
        self._race_took(op, time.monotonic())
        return inserted

    def _race_took(self, op: PrefetchOp, now: float) -> None:
        """A race the cost model planned is over at `now`: how long it took against its
        estimate scales the model's next races (`FetchPlanner.observe_race`)."""
        race = op.race
        if race.planned_s is not None and race.started_s is not None:
            self.planner.observe_race(race.planned_s, now - race.started_s)

    def _tail_anchor(self, op: PrefetchOp) -> HiTreeNode | None:
        """The node ending exactly at the head, in L2, for the tail to hang below; None when
        the tree lost the head (the fetched tail is then dropped and recomputed)."""
        node = self.tree.node_at(op.anchor, op.tokens[:op.race.target * self.page_size],
                                 op.extra_key)
        return node if node is not None and node.backuped else None
