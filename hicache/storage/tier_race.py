"""A storage tier's races (`race.py`) as the scheduler drives them: a raced request computes
toward its head stop (`head_stop`, read at admission); there the scheduler asks
`continue_head` for the next stop; once the head is final the request goes back to the
queue with it in the tree (`head_computed`) and is admitted again when the tail has arrived
(`ready`), which `terminate` hangs below the head (`insert_tail`). `StorageTier` holds one
`HeadRace` and looks up the request's op for it.

Threading: scheduler thread only, like the storage tier.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from hicache.storage.fetch_queue import FETCH_BATCH_PAGES, PrefetchOp
from hicache.storage.io import StorageController
from hicache.storage.planner import FetchPlanner
from hicache.storage.race import Race, fetch_rate, next_target, race_batch_pages
from hicache.storage.tier_state import KnownStored, StorageCounters

if TYPE_CHECKING:
    from hicache.tree.hiradix import HiRadixCache, HiTreeNode


class HeadRace:
    """The races of one storage tier, over its I/O, cost model, tree, counters and the pages
    L3 is known to hold; each op's own race state is its `op.race` (`race.Race`)."""

    def __init__(self, io: StorageController, planner: FetchPlanner, tree: HiRadixCache,
                 counters: StorageCounters, stored: KnownStored) -> None:
        self.io = io
        self.planner = planner
        self.tree = tree
        self.page_size = tree.page_size
        self.counters = counters
        self.stored = stored

    def start(self, op: PrefetchOp, hit: int, head: int, pages: int) -> None:
        """Race `op`'s hit of `hit` pages: compute the first `head`, fetch the last `pages`
        (which the host budget holds) from the back."""
        op.fetch_base, op.reverse = hit - pages, True
        op.race = Race(hit, head, planned_s=op.planned_race_s, started_s=time.monotonic())
        self.io.fetch(op, floor=head, batch_pages=race_batch_pages(hit - head,
                                                                   FETCH_BATCH_PAGES))

    def recomputed(self, op: PrefetchOp, hit: int) -> None:
        """The hit's `hit` pages are recomputed rather than fetched."""
        self.stored.add(op.hashes[:hit])
        self.counters.recomputed_hits += 1
        self.counters.recomputed_hit_tokens += hit * self.page_size

    def head_stop(self, op: PrefetchOp) -> int:
        """Where the request's raced head stops next (tokens from the start of its key), or
        0: no race, or its head is final. Its first call starts the compute side's clock."""
        race = op.race
        if race is None or race.final:
            return 0
        if race.chunk_from is None:
            race.start_chunk(time.monotonic())
        return op.prefix_tokens + race.target * self.page_size

    def continue_head(self, op: PrefetchOp, computed: int) -> int | None:
        """The raced request has computed `computed` tokens (its head stop): where it stops
        next (> computed); `computed`, its head is final (it waits for the tail); 0, no
        race; None, the race is lost: nothing came, the whole hit is computed and nothing
        fetched is used (the caller ends the prefetch: it goes on as any prompt)."""
        race = op.race
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
            self.recomputed(op, race.hit_pages)
            return None
        race.target = target
        self.io.limit(op, target)
        if target == race.computed:
            race.final = True
            return computed
        race.start_chunk(now)
        return op.prefix_tokens + target * self.page_size

    def tail_arrived(self, op: PrefetchOp) -> bool:
        """A raced op whose head is final has its tail: the fetched suffix reaches the head."""
        race = op.race
        return (race is not None and race.final
                and race.hit_pages - op.completed_pages <= race.target)

    def head_computed(self, op: PrefetchOp, node: HiTreeNode) -> None:
        """The request's head is final and in the tree, its last page at the end of `node`:
        keep it in L2 (copying it there if the write policy has not), so that the tail can
        hang below it when the request is admitted again."""
        if op.race is None or not op.race.final or op.head_node is not None:
            return
        head = op.race.target
        self.stored.add(op.hashes[:head])
        self.counters.split_prefetches += 1
        self.counters.head_tokens += head * self.page_size
        if not node.backuped and not self.tree.back_up_path(node):
            self.io.cancel(op)  # no L2 room for the head: the tail is dropped, and computed
        self.tree.protect_host(node)
        op.head_node = node

    def insert_tail(self, op: PrefetchOp, done: int) -> int:
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
        window = op.window_run(race.target, race.hit_pages, p)
        inserted = self.tree.insert_host_pages(anchor, tokens, op.host_indices[cut:],
                                               op.hashes[race.target:race.hit_pages],
                                               op.extra_key, window)
        op.host_indices = op.host_indices[:cut]
        self.counters.prefetched_tokens += len(tokens)
        self.counters.window_prefetched_tokens += 0 if window is None else len(tokens) - window
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
