"""L3 on local disk: one LMDB environment, one value per KV page, bounded by LRU eviction.

The environment at `path` (a directory holding data.mdb and lock.mdb) has two databases::

    pages   page hash (16 B) -> stored page (`page_format`: 48-byte header + payload)
    atime   page hash (16 B) -> last access, uint64 little-endian `time.time_ns()`

Several processes may open one path at once: LMDB locks across processes (lock.mdb), so
servers of one model on one machine share their L3. Readers never block writers. The map is
not writable (`writemap=False`): with a writable map, processes growing the map at the same
time were seen to corrupt the file (a two-process test failed about one run in six), and a
store into a sparse file on a full disk would be SIGBUS instead of an error.

Map size: the map starts at `initial_map_bytes` and doubles on `MapFullError` up to
`max_size_bytes`; past that (or when the disk has no room to grow), the least recently used
~10% of the capacity is evicted and the write retried. The data file grows as pages are
written and never past the map, so it never exceeds the bound. When another
process grew the map, a transaction fails with `MapResizedError`: this process adopts the
new size and retries.

Threads: any mix of the `StorageBackend` callers. Every transaction runs under the shared side
of `SharedExclusiveLock`; changing the map size (which LMDB allows only with no transaction
open in the process) and `close` take its exclusive side. Writes are serialised by LMDB's
writer lock.

Buffers: reads use `buffers=True`: a value is a view of the mapped file, valid only until its
transaction ends, so it is copied into the host page inside the transaction.

Durability: `sync=True` (default) flushes the data of each committed transaction (one
msync per `batch_set`; metasync off: a crash may lose the last commit but never corrupts the
tree). `sync=False` leaves flushing to the kernel and `sync_to_disk`: a crash may lose recent
pages, and a power loss may damage the file; checksums keep damaged pages from being served.
"""

from __future__ import annotations

import heapq
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import lmdb
import torch

from hicache.memory_pool_host import HostKVPool
from hicache.storage.base import (
    STAT_BYTES,
    STAT_CAPACITY,
    STAT_CORRUPT,
    STAT_ERRORS,
    STAT_EVICTED,
    STAT_HITS,
    STAT_MISSES,
    STAT_PAGES,
    STAT_SKIPPED,
    STAT_WRITTEN,
    STAT_ERRORS_BY_OP,
    Counters,
    FaultLog,
    SharedExclusiveLock,
    StorageBackend,
    check_batch,
)
from hicache.storage.page_format import PageCodec

logger = logging.getLogger(__name__)
T = TypeVar("T")

INITIAL_MAP_BYTES = 64 * 2**20  # first map size; doubles on demand up to max_size_bytes
MIN_MAP_BYTES = 2**20  # smallest capacity accepted: room for the tree and a few pages
EVICT_FRACTION = 0.10  # share of the capacity freed per eviction round (LRU first)
# Access stamps of pages read are buffered and written in one transaction once this many are
# pending or this many seconds have passed (checked on each read), and with every batch_set,
# eviction and close: a read costs no write transaction (no fdatasync) of its own.
TOUCH_FLUSH_PAGES = 1024
TOUCH_FLUSH_S = 5.0
MAX_TXN_ATTEMPTS = 16  # map grow / evict / resize retries of one call before it gives up
_DB_PAGES = b"pages"
_DB_ATIME = b"atime"
_STAMP = struct.Struct("<Q")
_OVERFLOW_HEADER = 16  # bytes LMDB puts before a value stored in overflow pages


class _Closed(Exception):
    """The store was closed: calls are quiet misses, not errors."""


class LmdbStore(StorageBackend):
    """`StorageBackend` over one LMDB environment (see the module docstring)."""

    def __init__(self, path: str | Path, max_size_bytes: int, codec: PageCodec, *,
                 sync: bool = True, initial_map_bytes: int = INITIAL_MAP_BYTES) -> None:
        if max_size_bytes < MIN_MAP_BYTES:
            raise ValueError(f"LMDB max_size_bytes must be >= {MIN_MAP_BYTES}, "
                             f"got {max_size_bytes}")
        self.path = Path(path).expanduser()
        self.codec = codec
        self.max_size_bytes = max_size_bytes - max_size_bytes % MIN_MAP_BYTES
        self._gate = SharedExclusiveLock()
        self._counts = Counters((STAT_HITS, STAT_MISSES, STAT_CORRUPT, STAT_EVICTED,
                                 STAT_ERRORS, STAT_WRITTEN, STAT_SKIPPED))
        self._faults = FaultLog(logger, self._counts)
        self._touches: dict[bytes, int] = {}  # page hash -> time_ns of its latest read
        self._touch_lock = threading.Lock()
        self._last_flush = time.monotonic()
        self._open(min(initial_map_bytes, self.max_size_bytes), sync)

    def _open(self, map_bytes: int, sync: bool) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        try:
            # lock=True: other processes may open the same path (never open it lock=False).
            env = lmdb.open(str(self.path), map_size=map_bytes, max_dbs=2, lock=True,
                            sync=sync, metasync=False, readahead=True, writemap=False)
            for _ in range(MAX_TXN_ATTEMPTS):
                try:
                    self._pages = env.open_db(_DB_PAGES)
                    self._atime = env.open_db(_DB_ATIME)
                    break
                except lmdb.MapResizedError:  # another process grew the map meanwhile
                    env.set_mapsize(0)
            else:
                raise lmdb.MapResizedError("the map kept growing while it was opened")
        except lmdb.Error as err:
            raise OSError(f"cannot open the LMDB store at {str(self.path)!r}: {err}") from err
        self._env: lmdb.Environment | None = env
        psize = env.stat()["psize"]
        self._value_disk_bytes = -(-(self.codec.value_bytes + _OVERFLOW_HEADER) // psize) * psize
        if env.info()["map_size"] > self.max_size_bytes:
            logger.warning("LMDB store %s already maps %d bytes, over max_size_bytes=%d; it "
                           "stays that size (LMDB files never shrink)", self.path,
                           env.info()["map_size"], self.max_size_bytes)

    # ------------------------------------------------------------------ StorageBackend

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        found = [0]

        def body(txn: lmdb.Transaction) -> None:
            found[0] = 0
            for key in keys:
                if txn.get(key, db=self._pages) is None:
                    return
                found[0] += 1

        self._guard("batch_exists", None, lambda: self._txn(False, body))
        return found[0]

    def batch_get(self, keys: Sequence[bytes], host_pool: HostKVPool,
                  host_indices: torch.Tensor) -> list[bool]:
        pages = check_batch(self.codec, keys, host_pool, host_indices)
        served = [False] * len(keys)
        corrupt: list[bytes] = []
        copy_in = self.codec.value_writer(host_pool)

        def body(txn: lmdb.Transaction) -> None:
            for i, (key, page) in enumerate(zip(keys, pages)):
                value = txn.get(key, db=self._pages)
                if value is None:
                    continue
                if copy_in(value, page):
                    served[i] = True
                else:
                    corrupt.append(bytes(key))

        self._guard("batch_get", None, lambda: self._txn(False, body))
        hits = sum(served)
        self._counts.add(STAT_HITS, hits)
        self._counts.add(STAT_MISSES, len(keys) - hits)
        if corrupt:
            self._counts.add(STAT_CORRUPT, len(corrupt))
            self._guard("delete_corrupt", 0, lambda: self._delete(corrupt))
        self._touch([key for key, ok in zip(keys, served) if ok])
        return served

    def batch_set(self, keys: Sequence[bytes], host_pool: HostKVPool,
                  host_indices: torch.Tensor) -> list[bool]:
        pages = check_batch(self.codec, keys, host_pool, host_indices)
        read_page = self.codec.payload_reader(host_pool)
        touches = self._take_touches()  # lost if this write fails: only LRU order suffers

        def body(txn: lmdb.Transaction) -> int:
            self._put_stamps(txn, touches.items())
            stamp = _STAMP.pack(time.time_ns())
            written = 0
            for key, page in zip(keys, pages):
                if txn.get(key, db=self._pages) is None:
                    txn.put(key, self.codec.encode_into(read_page(page)), db=self._pages)
                    written += 1
                txn.put(key, stamp, db=self._atime)
            return written

        written = self._guard("batch_set", None, lambda: self._txn(True, body))
        if written is None:
            return [False] * len(keys)
        self._counts.add(STAT_WRITTEN, written)
        self._counts.add(STAT_SKIPPED, len(keys) - written)
        return [True] * len(keys)

    def delete(self, keys: Sequence[bytes]) -> int:
        with self._touch_lock:
            for key in keys:
                self._touches.pop(bytes(key), None)
        return self._guard("delete", 0, lambda: self._delete(keys))

    def clear(self) -> int:
        with self._touch_lock:
            self._touches.clear()

        def body(txn: lmdb.Transaction) -> int:
            removed = txn.stat(self._pages)["entries"]
            txn.drop(self._pages, delete=False)
            txn.drop(self._atime, delete=False)
            return removed

        return self._guard("clear", 0, lambda: self._txn(True, body))

    def stats(self) -> dict[str, Any]:
        out = self._counts.snapshot()
        out[STAT_ERRORS_BY_OP] = self._faults.by_op()
        out.update({STAT_PAGES: 0, STAT_BYTES: 0, STAT_CAPACITY: self.max_size_bytes,
                    "map_bytes": 0, "high_water_bytes": 0, "path": str(self.path)})
        self._guard("stats", None, lambda: self._txn(False, lambda txn: self._sizes(txn, out)))
        return out

    def close(self) -> None:
        self._guard("close", None, self._flush_touches)
        with self._gate.exclusive():
            if self._env is not None:
                self._env.close()
                self._env = None

    def sync_to_disk(self) -> None:
        """Flush every committed page to disk now (fdatasync); for `sync=False` stores."""
        def flush() -> None:
            with self._gate.shared():
                self._require_env().sync(True)

        self._guard("sync", None, flush)

    # ------------------------------------------------------------------ transactions

    def _require_env(self) -> lmdb.Environment:
        if self._env is None:
            raise _Closed
        return self._env

    def _txn(self, write: bool, body: Callable[[lmdb.Transaction], T],
             make_room: bool = True) -> T:
        """Run `body` in one transaction, committed when it returns; return its result.

        Retries after another process grew the map and, for writes with `make_room`, after
        the map filled (grow it, or evict at the bound). Other lmdb.Error propagate.
        """
        for _ in range(MAX_TXN_ATTEMPTS):
            try:
                # The env is looked up after the gate is entered (close may have run).
                with self._gate.shared(), self._require_env().begin(
                        write=write, buffers=True) as txn:
                    return body(txn)
            except lmdb.MapResizedError:
                self._adopt_map_size()
            except lmdb.MapFullError:
                if not (write and make_room):
                    raise
                self._make_room()
        raise lmdb.MapFullError(f"no room after {MAX_TXN_ATTEMPTS} attempts "
                                f"(capacity {self.max_size_bytes} bytes)")

    def _guard(self, op: str, fallback: T, call: Callable[[], T]) -> T:
        """`call()`, or `fallback` when the store is closed or LMDB fails (counted, logged)."""
        try:
            return call()
        except _Closed:
            return fallback
        except lmdb.Error as err:
            self._faults.record(op, f"LMDB store {self.path}: {type(err).__name__}: {err}; "
                                  "treated as a miss / skipped write")
            return fallback

    def _adopt_map_size(self) -> None:
        with self._gate.exclusive():
            self._require_env().set_mapsize(0)  # 0: the size another process set

    def _make_room(self) -> None:
        """Double the map, or at the bound (or with the disk full) evict LRU pages."""
        with self._gate.exclusive():
            env = self._require_env()
            size = min(2 * env.info()["map_size"], self.max_size_bytes)
            if size > env.info()["map_size"]:
                env.set_mapsize(size)
                return
        self._evict(max(1, int(EVICT_FRACTION * self.max_size_bytes) // self._value_disk_bytes))

    def _evict(self, count: int) -> int:
        """Delete the `count` pages read or written longest ago; the number deleted."""
        with self._touch_lock:  # read recently, stamp not yet written: not a victim
            recent = set(self._touches)

        def oldest(txn: lmdb.Transaction) -> list[bytes]:
            stamps = ((_STAMP.unpack(v)[0], bytes(k)) for k, v in txn.cursor(self._atime)
                      if bytes(k) not in recent)
            victims = [key for _, key in heapq.nsmallest(count, stamps)]
            if not victims:  # pages without a stamp (never the case for this writer)
                victims = [bytes(k) for k, _ in zip(txn.cursor(self._pages).iternext(
                    values=False), range(count))]
            return victims

        victims = self._txn(False, oldest)
        removed = self._txn(True, lambda txn: self._delete_in(txn, victims), make_room=False)
        self._counts.add(STAT_EVICTED, removed)
        return removed

    def _delete(self, keys: Sequence[bytes]) -> int:
        return self._txn(True, lambda txn: self._delete_in(txn, keys))

    def _delete_in(self, txn: lmdb.Transaction, keys: Sequence[bytes]) -> int:
        removed = 0
        for key in keys:
            removed += txn.delete(key, db=self._pages)
            txn.delete(key, db=self._atime)
        return removed

    def _sizes(self, txn: lmdb.Transaction, out: dict[str, Any]) -> None:
        env = self._require_env()
        info, psize = env.info(), env.stat()["psize"]
        used_pages = 0
        for stat in (env.stat(), txn.stat(self._pages), txn.stat(self._atime)):
            used_pages += stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
        out[STAT_PAGES] = txn.stat(self._pages)["entries"]
        out[STAT_BYTES] = used_pages * psize  # live B-tree and value pages, not the free list
        out["map_bytes"] = info["map_size"]
        out["high_water_bytes"] = (info["last_pgno"] + 1) * psize  # ever used in the map

    # ------------------------------------------------------------------ access times

    # Stamps are wall-clock `time.time_ns()`, not monotonic: they are compared across the
    # processes sharing this store and across restarts, where a monotonic clock means nothing.
    # If the wall clock steps backwards, pages touched after the step look older and are
    # evicted sooner; only the eviction order suffers, never what is served.

    def _touch(self, keys: list[bytes]) -> None:
        if not keys:
            return
        stamp = time.time_ns()
        with self._touch_lock:
            self._touches.update((bytes(key), stamp) for key in keys)
            due = (len(self._touches) >= TOUCH_FLUSH_PAGES
                   or time.monotonic() - self._last_flush >= TOUCH_FLUSH_S)
        if due:
            self._guard("touch", None, self._flush_touches)

    def _take_touches(self) -> dict[bytes, int]:
        with self._touch_lock:
            taken, self._touches = self._touches, {}
            self._last_flush = time.monotonic()
        return taken

    def _flush_touches(self) -> None:
        touches = self._take_touches()
        if touches:
            self._txn(True, lambda txn: self._put_stamps(txn, touches.items()))

    def _put_stamps(self, txn: lmdb.Transaction, stamps: Iterable[tuple[bytes, int]]) -> None:
        for key, stamp in stamps:
            if txn.get(key, db=self._pages) is not None:  # not for pages deleted since
                txn.put(key, _STAMP.pack(stamp), db=self._atime)

