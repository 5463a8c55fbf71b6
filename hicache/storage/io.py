"""L3 <-> L2: the query, fetch and backup threads between the storage backend and the host pool.

    prefetch  scheduler: submit(op)  -> query thread: batch_exists -> op.hit_pages
              scheduler: fetch(op)   -> fetch thread: batch_get ...  -> op.completed_pages grows
              scheduler: cancel(op)  -> thread stops between batches; op.finished is set
                                        once it will never touch op.host_indices again
    backup    scheduler: backup(...) -> thread: batch_set      -> poll_backups() acks

Threading: `submit`, `fetch`, `cancel`, `backup`, `poll_*` are called on the scheduler
thread, which owns the host pool's allocator and the tree; the three daemon threads only call
the backend and read/write the host pages they were handed. Queries have a thread of their
own so that one is never queued behind a long fetch: a request whose query finds nothing is
admitted at once (the scheduler waits a moment for fresh queries, `settle`). A backend that raises is a
miss or a skipped backup, counted here and logged at most once a minute; nothing reaches
the scheduler.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

import torch

from hicache.memory.host import HostKVPool
from hicache.storage.backends.base import RateLimitedLog, StorageBackend
from hicache.threads import one_openmp_thread

logger = logging.getLogger(__name__)

# Pages per backend call. SGLang's HiCache queries storage in batches of 128 pages; a batch
# is also the granularity at which a cancelled prefetch stops.
STORAGE_BATCH_PAGES = 128
# Backups queued together are written in one backend call of at most this many pages.
BACKUP_BATCH_PAGES = 256


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
    hit_pages: int | None = None            # (thread) consecutive pages storage holds
    completed_pages: int = 0                # (thread) consecutive pages fetched into L2
    cancelled: bool = False                 # (scheduler, read by the threads) stop now
    lock: threading.Lock = field(default_factory=threading.Lock)
    queried: threading.Event = field(default_factory=threading.Event)   # hit_pages is set
    finished: threading.Event = field(default_factory=threading.Event)  # no more writes


class BackupAck(NamedTuple):
    node_id: int
    ok: bool


class StorageController:
    """Owns the backend and the three I/O threads (see the module docstring)."""

    def __init__(self, backend: StorageBackend, host_pool: HostKVPool) -> None:
        self.backend = backend
        self.host_pool = host_pool
        self.page_size = host_pool.page_size
        self.errors: dict[str, int] = {"exists": 0, "get": 0, "set": 0}
        self._log = RateLimitedLog(logger)  # a failing backend: once a minute per operation
        self._query_q: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._prefetch_q: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._backup_q: queue.Queue[tuple[int, list[bytes], torch.Tensor] | None] = (
            queue.Queue())
        self._backup_acks: queue.Queue[BackupAck] = queue.Queue()
        self._backups_in_flight = 0
        self._idle = threading.Condition()
        self._threads = [
            threading.Thread(target=self._run_tasks, args=(self._query_q,),
                             name="hicache-query", daemon=True),
            threading.Thread(target=self._run_tasks, args=(self._prefetch_q,),
                             name="hicache-prefetch", daemon=True),
            threading.Thread(target=self._run_backup, name="hicache-backup", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------------ prefetch

    def submit(self, op: PrefetchOp) -> None:
        """Ask storage how many of `op.hashes` it holds (sets `op.hit_pages`, `op.queried`)."""
        self._query_q.put(lambda: self._query(op))

    def fetch(self, op: PrefetchOp) -> None:
        """Fetch the first `len(op.host_indices) // page_size` pages into `op.host_indices`."""
        self._prefetch_q.put(lambda: self._fetch(op))

    def cancel(self, op: PrefetchOp) -> int:
        """Stop `op` after the batch in flight; returns the pages completed so far (final:
        pages beyond it may still be written until `op.finished` is set)."""
        with op.lock:
            op.cancelled = True
            return op.completed_pages

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

    def _fetch(self, op: PrefetchOp) -> None:
        try:
            total = len(op.host_indices) // self.page_size
            for start in range(0, total, STORAGE_BATCH_PAGES):
                if op.cancelled:
                    break
                keys = op.hashes[start:min(total, start + STORAGE_BATCH_PAGES)]
                slots = op.host_indices[start * self.page_size:
                                        (start + len(keys)) * self.page_size]
                oks = self._call("get", lambda k=keys, s=slots: self.backend.batch_get(
                    k, self.host_pool, s), [False] * len(keys))
                good = _leading_true(oks)
                with op.lock:
                    op.completed_pages += good
                if good < len(keys):
                    break
        finally:
            op.finished.set()

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
        self._prefetch_q.put(None)
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
