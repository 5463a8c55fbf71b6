"""L3 <-> L2: the query thread, the fetch workers and the backup thread between the storage
backend and the host pool.

    prefetch  scheduler: submit(op)  -> query thread: batch_exists -> op.hit_pages
              scheduler: fetch(op)   -> its pages join the fetch queue in batches; the
                                        fetch workers take batches round robin over the
                                        ops queued (batch_get) -> op.completed_pages grows
              scheduler: cancel(op)  -> no batch of it is handed out again; op.finished is
                                        set once no worker will touch op.host_indices again
    backup    scheduler: backup(...) -> thread: batch_set      -> poll_backups() acks

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

Threading: `submit`, `fetch`, `cancel`, `backup`, `poll_*` are called on the scheduler
thread, which owns the host pool's allocator and the tree; the daemon threads only call the
backend and read/write the host pages they were handed (the backends' copies and checksums
release the GIL, so workers overlap). Queries have a thread of their own so that one is
never queued behind a long fetch: a request whose query finds nothing is admitted at once
(the scheduler waits a moment for fresh queries, `settle`). A backend that raises is a miss
or a skipped backup, counted here and logged at most once a minute; nothing reaches the
scheduler.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

import torch

from hicache.config import DEFAULT_FETCH_WORKERS
from hicache.memory.host import HostKVPool
from hicache.storage.backends.base import RateLimitedLog, StorageBackend
from hicache.threads import one_openmp_thread

logger = logging.getLogger(__name__)

# Pages per existence query. SGLang's HiCache queries storage in batches of 128 pages.
STORAGE_BATCH_PAGES = 128
# Pages per fetch call: the unit the workers share out, and at which a cancelled prefetch
# stops. Small enough that a 2k-token prompt of 16-token pages (128 pages) is spread over
# every worker and a short prefetch waits behind at most one batch per worker; large enough
# that a call's fixed cost (a transaction, a Redis round trip) stays small against its bytes.
FETCH_BATCH_PAGES = 32
# Backups queued together are written in one backend call of at most this many pages.
BACKUP_BATCH_PAGES = 256
# The fetch probe at attach (`StorageController.probe`): three reads of distinct stored
# pages, of 1, 4 and 16 pages, so that the fetch model's two coefficients (latency, seconds
# per byte) have three points that differ in size; at most PROBE_BUDGET_S of reading (a
# 16-page read of a 2k-token model's pages is ~2 MB: 0.4 s at 5 MB/s).
PROBE_PAGES = (1, 4, 16)
PROBE_BUDGET_S = 0.5


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
    head_node: Any = None                   # the head's last node once computed (tier.py)
    hit_pages: int | None = None            # (thread) consecutive pages storage holds
    completed_pages: int = 0                # (thread) leading pages fetched into L2
    fetch_seconds: float = 0.0              # (thread) first batch start -> last batch end
    observed_pages: int = 0                 # completed pages the cost model has seen
    cancelled: bool = False                 # (scheduler, read by the threads) stop now
    lock: threading.Lock = field(default_factory=threading.Lock)
    queried: threading.Event = field(default_factory=threading.Event)   # hit_pages is set
    finished: threading.Event = field(default_factory=threading.Event)  # no more writes
    fetch: _FetchProgress | None = None     # (thread, under the queue's lock) batches


@dataclass(eq=False)
class _FetchProgress:
    """One fetch's batches, as the fetch queue hands them out (under its lock). Pages are
    counted in `host_indices` (page i is `hashes[fetch_base + i]`). Front to back, batches
    go out from `next` up to `stop`; back to front, from `next` down to `stop`."""

    total: int                  # pages to fetch: len(host_indices) // page_size
    reverse: bool = False       # back to front
    next: int = 0               # the edge of the pages not handed out yet
    stop: int = 0               # no batch at or past this page (forward), below it (reverse)
    in_flight: int = 0          # batches a worker holds
    # batch start (forward) or end (reverse) -> its pages served, at its start / end
    arrived: dict[int, int] = field(default_factory=dict)
    completed: int = 0          # leading (forward) or trailing (reverse) pages arrived
    started_at: float | None = None

    @classmethod
    def of(cls, total: int, reverse: bool) -> _FetchProgress:
        return cls(total, reverse, next=total if reverse else 0, stop=0 if reverse else total)

    def left(self) -> bool:
        """Whether a batch is left to hand out."""
        return self.next > self.stop if self.reverse else self.next < self.stop

    def hand_out(self, batch_pages: int) -> tuple[int, int]:
        """The next batch `[start, end)`."""
        if self.reverse:
            start, end = max(self.stop, self.next - batch_pages), self.next
            self.next = start
        else:
            start, end = self.next, min(self.stop, self.next + batch_pages)
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


class FetchProgress(NamedTuple):
    """A fetch as it stands (`StorageController.progress`), pages of its host_indices."""

    completed: int            # leading (forward) or trailing (reverse) pages arrived
    handed_out: int           # pages given to workers so far (arrived, or in flight)
    can_grow: bool            # more may arrive (batches in flight or left)
    elapsed_s: float | None   # since its first batch was handed out; None: not yet


class _FetchQueue:
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

    def put(self, op: PrefetchOp, floor: int = 0) -> None:
        total = len(op.host_indices) // self.page_size
        with self._cv:
            op.fetch = _FetchProgress.of(total, op.reverse)
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
                    start, end = f.hand_out(self.batch_pages)
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

    def progress(self, op: PrefetchOp) -> FetchProgress:
        with self._cv:
            f = op.fetch
            if f is None:
                return FetchProgress(0, 0, not op.cancelled, None)
            handed = f.total - f.next if f.reverse else f.next
            elapsed = None if f.started_at is None else time.monotonic() - f.started_at
            can_grow = not op.cancelled and (f.in_flight > 0 or f.left())
            return FetchProgress(f.completed, handed, can_grow, elapsed)

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


class BackupAck(NamedTuple):
    node_id: int
    ok: bool


class StorageController:
    """Owns the backend and the three I/O threads (see the module docstring)."""

    def __init__(self, backend: StorageBackend, host_pool: HostKVPool,
                 fetch_workers: int = DEFAULT_FETCH_WORKERS) -> None:
        if fetch_workers < 1:
            raise ValueError(f"fetch_workers must be >= 1, got {fetch_workers}")
        self.backend = backend
        self.host_pool = host_pool
        self.page_size = host_pool.page_size
        self.errors: dict[str, int] = {"exists": 0, "get": 0, "set": 0, "sample": 0}
        self._log = RateLimitedLog(logger)  # a failing backend: once a minute per operation
        self._query_q: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._fetches = _FetchQueue(self.page_size)
        self._backup_q: queue.Queue[tuple[int, list[bytes], torch.Tensor] | None] = (
            queue.Queue())
        self._backup_acks: queue.Queue[BackupAck] = queue.Queue()
        self._backups_in_flight = 0
        self._idle = threading.Condition()
        self._threads = [
            threading.Thread(target=self._run_tasks, args=(self._query_q,),
                             name="hicache-query", daemon=True),
            threading.Thread(target=self._run_backup, name="hicache-backup", daemon=True),
            *(threading.Thread(target=self._run_fetches, name=f"hicache-fetch-{i}",
                               daemon=True) for i in range(fetch_workers)),
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------------ prefetch

    def submit(self, op: PrefetchOp) -> None:
        """Ask storage how many of `op.hashes` it holds (sets `op.hit_pages`, `op.queried`)."""
        self._query_q.put(lambda: self._query(op))

    def fetch(self, op: PrefetchOp, floor: int = 0) -> None:
        """Fetch pages `op.fetch_base + i` of `op.hashes` into page i of `op.host_indices`,
        for the `len(op.host_indices) // page_size` pages it holds (back to front when
        `op.reverse`, none below page `floor` of `op.hashes`)."""
        self._fetches.put(op, floor - op.fetch_base)

    def limit(self, op: PrefetchOp, floor: int) -> None:
        """A back-to-front fetch hands out no batch below page `floor` of `op.hashes`."""
        self._fetches.limit(op, floor - op.fetch_base)

    def progress(self, op: PrefetchOp) -> FetchProgress:
        """Where `op`'s fetch stands (pages of its host_indices)."""
        return self._fetches.progress(op)

    def cancel(self, op: PrefetchOp) -> int:
        """Stop `op` after the batches in flight; returns the leading pages completed so far
        (final: pages beyond it may still be written until `op.finished` is set)."""
        return self._fetches.cancel(op)

    def _query(self, op: PrefetchOp) -> None:
        hits = 0
        for start in range(0, len(op.hashes), STORAGE_BATCH_PAGES):
            if op.cancelled:
                break
            batch = op.hashes[start:start + STORAGE_BATCH_PAGES]
            n = self._call("exists", lambda b=batch: self.backend.batch_exists(b), 0)
            hits += n
            if n < len(batch):
                break
        with op.lock:
            op.hit_pages = hits
        op.queried.set()

    def _run_fetches(self) -> None:
        one_openmp_thread()
        while (batch := self._fetches.take()) is not None:
            op, start, end = batch
            served = 0
            try:
                served = self._fetch_batch(op, start, end)
            finally:
                self._fetches.done(op, start, end, served)

    def _fetch_batch(self, op: PrefetchOp, start: int, end: int) -> int:
        """Pages `[start, end)` of the fetch; how many leading ones were served."""
        keys = op.hashes[op.fetch_base + start:op.fetch_base + end]
        slots = op.host_indices[start * self.page_size:end * self.page_size]
        oks = self._call("get", lambda: self.backend.batch_get(keys, self.host_pool, slots),
                         [False] * len(keys))
        return _leading_true(oks[::-1] if op.reverse else oks)

    @staticmethod
    def _run_tasks(tasks: queue.Queue[Callable[[], None] | None]) -> None:
        one_openmp_thread()  # beside the forward pass: no pool of its own (hicache.threads)
        while (task := tasks.get()) is not None:
            task()

    # -------------------------------------------------------------------------- backup

    def backup(self, node_id: int, hashes: list[bytes], host_indices: torch.Tensor) -> None:
        """Write a node's host pages to storage; the ack comes from `poll_backups`.
        Callers queue parents before children, so L3 never holds a child without its parent
        unless the parent's write failed."""
        with self._idle:
            self._backups_in_flight += 1
        self._backup_q.put((node_id, hashes, host_indices))

    def poll_backups(self) -> list[BackupAck]:
        acks = []
        while True:
            try:
                acks.append(self._backup_acks.get_nowait())
            except queue.Empty:
                return acks

    def wait_backups(self) -> None:
        """Block until every queued backup has been written (or has failed)."""
        with self._idle:
            self._idle.wait_for(lambda: self._backups_in_flight == 0)

    def _run_backup(self) -> None:
        one_openmp_thread()
        while (item := self._backup_q.get()) is not None:
            batch = [item]
            pages = len(item[1])
            while pages < BACKUP_BATCH_PAGES:  # drain what is already queued
                try:
                    nxt = self._backup_q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._backup_q.put(None)
                    break
                batch.append(nxt)
                pages += len(nxt[1])
            self._write_batch(batch)

    def _write_batch(self, batch: list[tuple[int, list[bytes], torch.Tensor]]) -> None:
        keys = [h for _, hashes, _ in batch for h in hashes]
        slots = torch.cat([s for _, _, s in batch])
        oks = self._call("set", lambda: self.backend.batch_set(keys, self.host_pool, slots),
                         [False] * len(keys))
        pos = 0
        for node_id, hashes, _ in batch:
            ok = all(oks[pos:pos + len(hashes)])
            pos += len(hashes)
            self._backup_acks.put(BackupAck(node_id, ok))
        with self._idle:
            self._backups_in_flight -= len(batch)
            self._idle.notify_all()

    # ---------------------------------------------------------------------------- probe

    def probe(self, sizes: Sequence[int] = PROBE_PAGES,
              budget_s: float = PROBE_BUDGET_S) -> list[tuple[int, float]]:
        """Timed reads of pages the store holds, `sizes[i]` pages each, distinct pages, on
        the calling thread: (pages, seconds) per read. Stops once `budget_s` is spent; none
        where the store holds too few pages or cannot list them; a fault ends it."""
        out: list[tuple[int, float]] = []
        keys = self._call("sample", lambda: self.backend.sample_keys(sum(sizes)), [])
        spent, start = 0.0, 0
        for n in sizes:
            batch = keys[start:start + n]
            if len(batch) < n or spent >= budget_s:
                break
            began = time.perf_counter()
            nbytes = self._call("sample", lambda b=batch: self.backend.sample_read(b), 0)
            seconds = time.perf_counter() - began
            if not nbytes:
                break
            out.append((n, seconds))
            spent, start = spent + seconds, start + n
        return out

    # ---------------------------------------------------------------------------- misc

    def _call(self, op: str, fn: Callable[[], Any], on_error: Any) -> Any:
        """Run a backend call; any exception becomes `on_error`, counted, logged rarely."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - any storage fault is a miss, never a crash
            self.errors[op] += 1
            self._log.warning(op, f"storage call failed ({self.errors[op]} so far): {exc!r}")
            return on_error

    def close(self) -> None:
        """Write pending backups, stop the threads, close the backend (idempotent)."""
        if not any(t.is_alive() for t in self._threads):
            return
        self._query_q.put(None)
        self._fetches.close()
        self._backup_q.put(None)
        for t in self._threads:
            t.join()
        self.backend.close()


def _leading_true(flags: list[bool]) -> int:
    n = 0
    for ok in flags:
        if not ok:
            break
        n += 1
    return n
