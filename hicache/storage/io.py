"""L3 <-> L2: the query thread, the fetch workers and the backup thread between the storage
backend and the host pool.

    prefetch  scheduler: submit(op)  -> query thread: batch_exists -> op.hit_pages
              scheduler: fetch(op)   -> its pages join the fetch queue in batches; the
                                        fetch workers take batches round robin over the
                                        ops queued (batch_get) -> op.completed_pages grows
              scheduler: cancel(op)  -> no batch of it is handed out again; op.finished is
                                        set once no worker will touch op.host_indices again
    backup    scheduler: backup(...) -> thread: batch_set      -> poll_backups() acks

A hybrid model's pages have two parts in L3 (`kinds.py`, `WindowParts`): the backend stores
the full layers' part; the window part is read and written beside it through the backend's
view for the window codec. A query's hit ends where the tree's rule would (`_window_hit`); a
fetch brings window parts for the trailing window of what it fetches (`op.window_ok`, one
flag per page); a backup writes them for a node's trailing pages that it is asked to.

The prefetches' state and the fetch queue (its fairness, its two directions) are in
`fetch_queue.py`.

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
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from hicache.config_storage import DEFAULT_FETCH_WORKERS
from hicache.memory.host import HostKVPool
from hicache.storage.backends.base import RateLimitedLog, StorageBackend
from hicache.storage.fetch_queue import (
    FETCH_BATCH_PAGES,
    FetchQueue,
    FetchStatus,
    PrefetchOp,
    PrefetchState,
)
from hicache.storage.kinds import StoreKinds, window_keys
from hicache.threads import one_openmp_thread

logger = logging.getLogger(__name__)

__all__ = ["FETCH_BATCH_PAGES", "BackupAck", "PrefetchOp", "PrefetchState", "StorageController"]

# Pages per existence query. SGLang's HiCache queries storage in batches of 128 pages.
STORAGE_BATCH_PAGES = 128
# Backups queued together are written in one backend call of at most this many pages.
BACKUP_BATCH_PAGES = 256
# The fetch probe at attach (`StorageController.probe`): three reads of distinct stored
# pages, of 1, 4 and 16 pages, so that the fetch model's two coefficients (latency, seconds
# per byte) have three points that differ in size; at most PROBE_BUDGET_S of reading (a
# 16-page read of a 2k-token model's pages is ~2 MB: 0.4 s at 5 MB/s).
PROBE_PAGES = (1, 4, 16)
PROBE_BUDGET_S = 0.5


class BackupAck(NamedTuple):
    node_id: int
    ok: bool               # its full parts are stored
    window_pages: int = 0  # its last pages' window parts, all stored (a hybrid model's)


class WindowParts(NamedTuple):
    """A hybrid model's second kind of page value: which layers, and the store's view for
    the window part's codec (`StorageBackend.with_codec`)."""

    kinds: StoreKinds
    store: StorageBackend


class Backup(NamedTuple):
    node_id: int
    hashes: list[bytes]
    host_indices: torch.Tensor
    window_pages: int  # of the last pages, how many get a window part too (hybrid models)
    full: bool = True  # False: the window parts alone (the full parts are stored already)


class StorageController:
    """Owns the backend and the three I/O threads (see the module docstring)."""

    def __init__(self, backend: StorageBackend, host_pool: HostKVPool,
                 fetch_workers: int = DEFAULT_FETCH_WORKERS,
                 window: WindowParts | None = None) -> None:
        if fetch_workers < 1:
            raise ValueError(f"fetch_workers must be >= 1, got {fetch_workers}")
        self.backend = backend
        self.window = window
        self.host_pool = host_pool
        self.page_size = host_pool.page_size
        self.errors: dict[str, int] = {"exists": 0, "get": 0, "set": 0, "sample": 0}
        self._log = RateLimitedLog(logger)  # a failing backend: once a minute per operation
        self._query_q: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._fetches = FetchQueue(self.page_size)
        self._backup_q: queue.Queue[Backup | None] = queue.Queue()
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

    def fetch(self, op: PrefetchOp, floor: int = 0, batch_pages: int | None = None) -> None:
        """Fetch pages `op.fetch_base + i` of `op.hashes` into page i of `op.host_indices`,
        for the `len(op.host_indices) // page_size` pages it holds (back to front when
        `op.reverse`, none below page `floor` of `op.hashes`), `batch_pages` a call (None:
        FETCH_BATCH_PAGES)."""
        if self.window is not None:
            end = op.fetch_base + len(op.host_indices) // self.page_size
            first = self.window.kinds.window_first(op.prefix_tokens, end)
            op.window_from, op.window_end = max(first, op.fetch_base), end
            op.window_ok = bytearray(len(op.hashes))
        self._fetches.put(op, floor - op.fetch_base, batch_pages)

    def limit(self, op: PrefetchOp, floor: int) -> None:
        """A back-to-front fetch hands out no batch below page `floor` of `op.hashes`."""
        self._fetches.limit(op, floor - op.fetch_base)

    def progress(self, op: PrefetchOp) -> FetchStatus:
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
        if self.window is not None and hits:
            hits = self._window_hit(op, hits)
        with op.lock:
            op.hit_pages = hits
        op.queried.set()

    def _window_hit(self, op: PrefetchOp, pages: int) -> int:
        """The longest prefix of the `pages` whose full parts L3 holds that is a hit by the
        tree's rule: L3 holds the window parts of its trailing window (those of pages before
        `op.hashes[0]` are the tree's to judge). One check of that window; when a part is
        missing, one of every page's, and the longest prefix they allow."""
        kinds, store = self.window
        first = kinds.window_first(op.prefix_tokens, pages)
        keys = window_keys(op.hashes[first:pages])
        if self._call("exists", lambda: store.batch_exists(keys), 0) == len(keys):
            return pages
        present = self._call("exists", lambda: store.batch_present(
            window_keys(op.hashes[:pages])), [False] * pages)
        for end in range(pages - 1, 0, -1):
            if all(present[kinds.window_first(op.prefix_tokens, end):end]):
                return end
        return 0

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
        if self.window is not None:
            self._fetch_windows(op, op.fetch_base + start, op.fetch_base + end)
        oks = self._call("get", lambda: self.backend.batch_get(keys, self.host_pool, slots),
                         [False] * len(keys))
        return _leading_true(oks[::-1] if op.reverse else oks)

    def _fetch_windows(self, op: PrefetchOp, first: int, last: int) -> None:
        """The window parts of pages [first, last) of `op.hashes` that its fetch brings
        (`op.window_from` on): a page whose part is missing or bad has no window KV, and
        is still served (its full layers are)."""
        lo, hi = max(first, op.window_from), min(last, op.window_end)
        if lo >= hi:
            return
        ps = self.page_size
        slots = op.host_indices[(lo - op.fetch_base) * ps:(hi - op.fetch_base) * ps]
        oks = self._call("get", lambda: self.window.store.batch_get(
            window_keys(op.hashes[lo:hi]), self.host_pool, slots), [False] * (hi - lo))
        for i, ok in enumerate(oks, lo):
            op.window_ok[i] = ok

    @staticmethod
    def _run_tasks(tasks: queue.Queue[Callable[[], None] | None]) -> None:
        one_openmp_thread()  # beside the forward pass: no pool of its own (hicache.threads)
        while (task := tasks.get()) is not None:
            task()

    # -------------------------------------------------------------------------- backup

    def backup(self, node_id: int, hashes: list[bytes], host_indices: torch.Tensor,
               window_pages: int = 0, full: bool = True) -> None:
        """Write a node's host pages to storage (not when `full` is False), and the window
        parts of its last `window_pages` (a hybrid model's); the ack comes from
        `poll_backups` (its full parts stored). Callers queue parents before children, so
        L3 never holds a child without its parent unless the parent's write failed."""
        with self._idle:
            self._backups_in_flight += 1
        self._backup_q.put(Backup(node_id, hashes, host_indices, window_pages, full))

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
            pages = len(item.hashes)
            while pages < BACKUP_BATCH_PAGES:  # drain what is already queued
                try:
                    nxt = self._backup_q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._backup_q.put(None)
                    break
                batch.append(nxt)
                pages += len(nxt.hashes)
            self._write_batch(batch)

    def _write_batch(self, batch: list[Backup]) -> None:
        full = [b for b in batch if b.full]
        keys = [h for b in full for h in b.hashes]
        oks = self._call("set", lambda: self.backend.batch_set(
            keys, self.host_pool, torch.cat([b.host_indices for b in full])),
            [False] * len(keys)) if keys else []
        windows = self._write_windows(batch) if self.window is not None else []
        pos = 0
        for i, b in enumerate(batch):
            n = len(b.hashes) if b.full else 0
            ok = all(oks[pos:pos + n])
            pos += n
            self._backup_acks.put(BackupAck(b.node_id, ok, windows[i] if windows else 0))
        with self._idle:
            self._backups_in_flight -= len(batch)
            self._idle.notify_all()

    def _write_windows(self, batch: list[Backup]) -> list[int]:
        """The window parts of the backups' last `window_pages` pages; per backup, how many
        were stored: all or none (one not stored leaves its boundary no hit after a
        restart)."""
        ps, starts = self.page_size, [len(b.hashes) - b.window_pages for b in batch]
        keys = window_keys([h for b, s in zip(batch, starts) for h in b.hashes[s:]])
        if not keys:
            return [0] * len(batch)
        slots = torch.cat([b.host_indices[s * ps:] for b, s in zip(batch, starts)])
        oks = self._call("set", lambda: self.window.store.batch_set(keys, self.host_pool,
                                                                    slots), [False] * len(keys))
        out, pos = [], 0
        for b in batch:
            out.append(b.window_pages if all(oks[pos:pos + b.window_pages]) else 0)
            pos += b.window_pages
        return out

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
