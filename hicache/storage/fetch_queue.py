"""The prefetches' state, and the fetch queue the fetch workers take batches from.

Fairness: a fetch is cut into batches of FETCH_BATCH_PAGES and the workers serve the queued
fetches in turn, one batch each, a fetch's first batch before the next batch of any fetch
already started; so a request's large prefetch delays another's by at most the batches in
flight, and a short prefetch that arrives behind a long one finishes in its own time, not
after it. Several batches of one fetch run at once (a fetch alone uses every
worker); `completed_pages` counts the leading pages that arrived, whatever order the
batches end in, and a failed batch ends the fetch at its first missing page.

Direction: a fetch runs front to back, or, for a hit whose head is computed meanwhile (the
race, `race.py`), back to front: batches are handed out from the last page down,
`completed_pages` counts the trailing pages that arrived, a failed batch ends the fetch at its
last missing page, and `limit(op, floor)` stops it above the pages the compute side has
taken (no batch below `floor` is handed out).

Threading: the scheduler thread puts, limits and cancels, the fetch workers take and report
(`io.StorageController`); all of the queue's bookkeeping is under one condition variable,
and a `PrefetchOp`'s thread-written fields under its `lock`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

import torch

# Pages per fetch call: the unit the workers share out, and at which a cancelled prefetch
# stops. Small enough that a 2k-token prompt of 16-token pages (128 pages) is spread over
# every worker and a short prefetch waits behind at most one batch per worker; large enough
# that a call's fixed cost (a transaction, a Redis round trip) stays small against its bytes.
FETCH_BATCH_PAGES = 32


class PrefetchState(Enum):
    """Where a prefetch stands, as the scheduler thread sees it (`StorageTier.check` moves it
    on; only `StorageTier` writes it):

        QUERYING --query answered--> FETCHING | WAITING | RESTART | DONE
        WAITING  --the fetch it waits for ends, or went stale--> FETCHING | RESTART | DONE
        FETCHING --the fetch thread sets `finished`--> DONE
        RESTART  --the scheduler matches again--> a new op (this one is dropped)

    Only FETCHING and DONE ops may hold host pages (`host_indices`)."""

    QUERYING = "querying"  # storage asked how many of the pages it holds
    WAITING = "waiting"    # another prefetch below the same anchor fetches our first pages
    RESTART = "restart"    # our prefix reached L2 meanwhile: match again, fetch the rest
    FETCHING = "fetching"  # host pages allocated, the fetch thread fills them
    DONE = "done"          # nothing more will be written: fetched, failed, or not worth it


@dataclass(eq=False)
class PrefetchOp:
    """One request's L3 -> L2 prefetch. Fields marked (thread) are written by an I/O thread
    under `lock`; the rest belong to the scheduler thread."""

    req_id: str
    hashes: list[bytes]                     # one per page beyond the L1+L2 hit
    anchor: Any = None                      # tree node the pages extend
    tokens: tuple[int, ...] = ()            # the pages' tokens
    extra_key: str | None = None            # the request's namespace
    host_indices: torch.Tensor | None = None  # slots for exactly the pages fetched
    started_at: float = field(default_factory=time.monotonic)
    state: PrefetchState = PrefetchState.QUERYING
    waiting_for: str | None = None          # WAITING: the request whose fetch we wait for
    done_step: int | None = None            # the `check` step it became DONE in
    is_restart: bool = False                # started again after a fresh match
    timeout_tokens: int = 0                 # what the timeout policy's limit is sized by
    prefix_tokens: int = 0                  # the L1+L2 hit the pages extend, in tokens
    fetch_base: int = 0                     # the page of `hashes` host_indices[0] holds: the
                                            # fetch covers hashes[fetch_base:]
    reverse: bool = False                   # fetched back to front (a race, `race.py`)
    race: Any = None                        # the race of a hit split into a computed head
                                            # and a fetched tail (`race.Race`, tier.py)
    planned_race_s: float | None = None     # the cost model's estimate of that race
    head_node: Any = None                   # the head's last node once computed (tier.py)
    window_from: int = 0                    # a hybrid model's: pages [window_from,
    window_end: int = 0                     # window_end) of `hashes` get their window
    window_ok: bytearray | None = None      # parts too; (thread) 1 per page that did
    hit_pages: int | None = None            # (thread) consecutive pages storage holds
    completed_pages: int = 0                # (thread) leading pages fetched into L2
    fetch_seconds: float = 0.0              # (thread) first batch start -> last batch end
    observed_pages: int = 0                 # completed pages the cost model has seen
    cancelled: bool = False                 # (scheduler, read by the threads) stop now
    lock: threading.Lock = field(default_factory=threading.Lock)
    queried: threading.Event = field(default_factory=threading.Event)   # hit_pages is set
    finished: threading.Event = field(default_factory=threading.Event)  # no more writes
    fetch: FetchBatches | None = None     # (thread, under the queue's lock) batches

    def window_run(self, first: int, last: int, page_size: int) -> int | None:
        """Tokens into pages [first, last) of `hashes` from which every page up to `last`
        came with its window part (a hybrid model's); None when the last page did not."""
        i = last
        while self.window_ok is not None and i > first and self.window_ok[i - 1]:
            i -= 1
        return None if i == last else (i - first) * page_size


@dataclass(eq=False)
class FetchBatches:
    """One fetch's batches, as the fetch queue hands them out (under its lock). Pages are
    counted in `host_indices` (page i is `hashes[fetch_base + i]`). Front to back, batches
    go out from `next` up to `stop`; back to front, from `next` down to `stop`."""

    total: int                  # pages to fetch: len(host_indices) // page_size
    reverse: bool = False       # back to front
    batch_pages: int = FETCH_BATCH_PAGES  # pages per batch handed out
    next: int = 0               # the edge of the pages not handed out yet
    stop: int = 0               # no batch at or past this page (forward), below it (reverse)
    in_flight: int = 0          # batches a worker holds
    # batch start (forward) or end (reverse) -> its pages served, at its start / end
    arrived: dict[int, int] = field(default_factory=dict)
    completed: int = 0          # leading (forward) or trailing (reverse) pages arrived
    started_at: float | None = None

    @classmethod
    def of(cls, total: int, reverse: bool, batch_pages: int) -> FetchBatches:
        return cls(total, reverse, batch_pages, next=total if reverse else 0,
                   stop=0 if reverse else total)

    def left(self) -> bool:
        """Whether a batch is left to hand out."""
        return self.next > self.stop if self.reverse else self.next < self.stop

    def hand_out(self) -> tuple[int, int]:
        """The next batch `[start, end)`."""
        if self.reverse:
            start, end = max(self.stop, self.next - self.batch_pages), self.next
            self.next = start
        else:
            start, end = self.next, min(self.stop, self.next + self.batch_pages)
            self.next = end
        return start, end

    def record(self, start: int, end: int, served: int) -> int:
        """Batch `[start, end)` served `served` pages (its first ones forward, its last ones
        backward); returns the pages completed."""
        if self.reverse:
            self.arrived[end] = served
            if served < end - start:
                self.stop = max(self.stop, end - served)  # nothing below the miss counts
            while self.total - self.completed in self.arrived:
                self.completed += self.arrived.pop(self.total - self.completed)
            self.completed = min(self.completed, self.total - self.stop)
        else:
            self.arrived[start] = served
            if served < end - start:
                self.stop = min(self.stop, start + served)  # nothing past the miss counts
            while self.completed < self.stop and self.completed in self.arrived:
                self.completed += self.arrived.pop(self.completed)
            self.completed = min(self.completed, self.stop)
        return self.completed


class FetchStatus(NamedTuple):
    """A fetch as it stands (`StorageController.progress`), pages of its host_indices."""

    completed: int            # leading (forward) or trailing (reverse) pages arrived
    handed_out: int           # pages given to workers so far (arrived, or in flight)
    can_grow: bool            # more may arrive (batches in flight or left)
    elapsed_s: float | None   # since its first batch was handed out; None: not yet


class FetchQueue:
    """The fetches with batches left, served round robin (see the module docstring).

    `take` blocks for the next batch `(op, first page, end page)`; `done` records what it
    served. Threading: the scheduler puts and cancels, the workers take and report; all
    bookkeeping is under one condition variable.
    """

    def __init__(self, page_size: int, batch_pages: int = FETCH_BATCH_PAGES) -> None:
        self.page_size = page_size
        self.batch_pages = batch_pages
        self._fresh: deque[PrefetchOp] = deque()  # no batch handed out yet: served first
        self._ready: deque[PrefetchOp] = deque()  # started, more batches left
        self._cv = threading.Condition()
        self._closed = False

    def put(self, op: PrefetchOp, floor: int = 0, batch_pages: int | None = None) -> None:
        """Queue `op`'s fetch (none below page `floor` when reversed), in batches of
        `batch_pages` (None: the queue's)."""
        total = len(op.host_indices) // self.page_size
        with self._cv:
            op.fetch = FetchBatches.of(total, op.reverse, batch_pages or self.batch_pages)
            if op.reverse:
                op.fetch.stop = min(total, max(0, floor))
            if op.cancelled or total == 0:
                op.finished.set()
                return
            self._fresh.append(op)
            self._cv.notify()

    def take(self) -> tuple[PrefetchOp, int, int] | None:
        """The next batch, fairly; None once the queue is closed."""
        with self._cv:
            while True:
                while self._fresh or self._ready:
                    op = (self._fresh or self._ready).popleft()
                    f = op.fetch
                    if op.cancelled or not f.left():
                        self._maybe_finish(op)
                        continue
                    start, end = f.hand_out()
                    f.in_flight += 1
                    if f.started_at is None:
                        f.started_at = time.monotonic()
                    if f.left():
                        self._ready.append(op)  # its next batch after the others' turn
                        self._cv.notify()  # for an idle worker
                    return op, start, end
                if self._closed:
                    return None
                self._cv.wait()

    def done(self, op: PrefetchOp, start: int, end: int, served: int) -> None:
        """A worker's batch `[start, end)` served its first `served` pages."""
        with self._cv:
            f = op.fetch
            f.in_flight -= 1
            completed = f.record(start, end, served)
            with op.lock:
                op.completed_pages = completed
                op.fetch_seconds = time.monotonic() - f.started_at
            self._maybe_finish(op)

    def limit(self, op: PrefetchOp, floor: int) -> None:
        """A back-to-front fetch: no batch below page `floor` (of its host_indices) from now."""
        with self._cv:
            f = op.fetch
            if f is not None and f.reverse:
                f.stop = min(f.total, max(f.stop, floor))
                self._maybe_finish(op)

    def progress(self, op: PrefetchOp) -> FetchStatus:
        with self._cv:
            f = op.fetch
            if f is None:
                return FetchStatus(0, 0, not op.cancelled, None)
            handed = f.total - f.next if f.reverse else f.next
            elapsed = None if f.started_at is None else time.monotonic() - f.started_at
            can_grow = not op.cancelled and (f.in_flight > 0 or f.left())
            return FetchStatus(f.completed, handed, can_grow, elapsed)

    def cancel(self, op: PrefetchOp) -> int:
        """No more batches of `op`; the leading pages completed so far."""
        with self._cv:
            with op.lock:
                op.cancelled = True
                completed = op.completed_pages
            if op.fetch is not None:
                self._maybe_finish(op)
            return completed

    def _maybe_finish(self, op: PrefetchOp) -> None:
        f = op.fetch
        if f.in_flight == 0 and (op.cancelled or not f.left()):
            op.finished.set()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
