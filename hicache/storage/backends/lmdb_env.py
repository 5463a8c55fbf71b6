"""The LMDB environment under `LmdbStore`: opening it, transactions, size accounting, eviction.

`LmdbEnvironment` owns the environment at `path` and its two databases (`pages`, `atime`; see
`lmdb_store`, whose `LmdbStore` adds the `StorageBackend` operations on top). Each operation
is a body run in one transaction::

    txn(write, body)            run `body` in one transaction, committed when it returns;
                                retried after a map resize, a full map or a full disk
    guard(op, fallback, call)   `call()`, or `fallback` when closed or LMDB fails (counted)
    _evict(count)               delete the `count` pages read or written longest ago
    sizes(txn, out)             the pages / bytes / map figures of `stats()`

Map size: the map starts at `initial_map_bytes` and doubles on `MapFullError` up to
`max_size_bytes`; past that, the least recently used ~10% of the capacity is evicted and the
write retried. The data file grows as pages are written and never past the map, so it never
exceeds the bound. When another process grew the map, a transaction fails with
`MapResizedError`: this process adopts the new size and retries.

Full disk (ENOSPC, EDQUOT, EFBIG, or EIO while `room_bytes` is below the write plus
`lmdb_file.SPACE_MARGIN_BYTES`): counted (op "disk_full"), the least recently used pages
evicted (as many as the write needs or a tenth of those stored) and the write retried; a
`PanicError` closes and reopens the environment. Damaged file: checked against its meta pages
at open (`lmdb_file.damage`; a short one is moved aside as `*.corrupt-<UTC stamp>`) and before
each transaction (one that shrank is a counted fault, a miss, and a fresh environment);
a truncation between that check and the reads is still a SIGBUS. Why, and what each costs:
docs/tiers.md ("When the LMDB store is damaged or its disk is full").

Threads: any mix of the `StorageBackend` callers. Every transaction runs under the shared side
of `SharedExclusiveLock`; changing the map size (which LMDB allows only with no transaction
open in the process) and `close` take its exclusive side. Writes are serialised by LMDB's
writer lock.

Buffers: transactions are begun with `buffers=True`: a value a body reads is a view of the
mapped file, valid only until its transaction ends; a body copies what it keeps.

Prefault (`prefault_bytes`, 0 by default): `lmdb_prefault`.

Durability: `sync=True` (default) flushes the data of each committed transaction (one
msync per `batch_set`; metasync off: a crash may lose the last commit but never corrupts the
tree). `sync=False` leaves flushing to the kernel and `sync_to_disk`: a crash may lose recent
pages, and a power loss may damage the file; checksums keep damaged pages from being served.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from hicache.storage.backends import lmdb_file
from hicache.storage.backends.base import (
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
    Counters,
    FaultLog,
    SharedExclusiveLock,
    StorageUnavailable,
    StoreClosed,
)
from hicache.storage.backends.lmdb_file import Replaced
from hicache.storage.backends.lmdb_prefault import prefault
from hicache.storage.backends.lmdb_stamps import STAMP, PendingStamps
from hicache.storage.page_format import PageCodec

# The store's logger: every LMDB line keeps the name operators filter on (and the README shows).
logger = logging.getLogger("hicache.storage.backends.lmdb_store")
T = TypeVar("T")

INITIAL_MAP_BYTES = 64 * 2**20  # first map size; doubles on demand up to max_size_bytes
MIN_MAP_BYTES = 2**20  # smallest capacity accepted: room for the tree and a few pages
EVICT_FRACTION = 0.10  # share of the capacity freed per eviction round (LRU first)
EVICT_FIRST_COMMIT = 4  # keys deleted by an eviction's first commit (see _delete_victims)
MAX_TXN_ATTEMPTS = 16  # map grow / evict / resize retries of one call before it gives up
_DB_PAGES = b"pages"
_DB_ATIME = b"atime"
_OVERFLOW_HEADER = 16  # bytes LMDB puts before a value stored in overflow pages
OP_DISK_FULL = "disk_full"  # `errors_by_op` key of writes retried after evicting for space
# Evictions for space one write may cause before it gives up: each frees a tenth of the store
# at least, so a write that still fails after this many is failing for another reason (an EIO
# taken for a full disk must not empty the store 10% at a time).
MAX_SPACE_EVICTIONS = 3


class LmdbEnvironment:
    """One LMDB environment and its transactions (see the module docstring), held by one
    `LmdbStore`: the gate, the environment and its data file, the counters and fault log of
    the store's `stats()`, and the pending access stamps. The store's operations are bodies
    run by `txn` under `guard`."""

    def __init__(self, path: str | Path, max_size_bytes: int, codec: PageCodec, *,
                 sync: bool = True, initial_map_bytes: int = INITIAL_MAP_BYTES,
                 prefault_bytes: int = 0) -> None:
        if max_size_bytes < MIN_MAP_BYTES:
            raise ValueError(f"LMDB max_size_bytes must be >= {MIN_MAP_BYTES}, "
                             f"got {max_size_bytes}")
        self.path = Path(path).expanduser()
        self.codec = codec
        self.max_size_bytes = max_size_bytes - max_size_bytes % MIN_MAP_BYTES
        self._gate = SharedExclusiveLock()
        self.counts = Counters((STAT_HITS, STAT_MISSES, STAT_CORRUPT, STAT_EVICTED,
                                 STAT_ERRORS, STAT_WRITTEN, STAT_SKIPPED))
        self.faults = FaultLog(logger, self.counts)
        self.stamps = PendingStamps()  # of pages read, written in batches (lmdb_stamps)
        self._sync = sync
        self._first_map_bytes = min(initial_map_bytes, self.max_size_bytes)
        self._env: lmdb.Environment | None = None
        self._file: lmdb_file.FileSize | None = None  # data.mdb of self._env, for its size
        self._open()
        self.prefaulted_bytes = prefault(self, prefault_bytes) if prefault_bytes > 0 else 0

    def _open(self) -> None:
        """Open the environment at `path`, after moving a damaged data file aside.

        Raises OSError when the path cannot hold a store at all (not a directory, no
        permission), StorageUnavailable when a damaged file could not be replaced.
        """
        self.path.mkdir(parents=True, exist_ok=True)
        moved = self._move_aside_if_damaged()
        try:
            env = self._open_env()
        except OSError as err:
            if moved is None:
                raise
            raise StorageUnavailable(f"LMDB store {self.path}: the damaged data file was "
                                     f"moved to {moved.name}, but no fresh store can be "
                                     f"created: {err}") from err
        self._env = env
        self.psize = env.stat()["psize"]
        self._value_disk_bytes = 0
        self.note_value_bytes(self.codec.value_bytes)
        if env.info()["map_size"] > self.max_size_bytes:
            logger.warning("LMDB store %s already maps %d bytes, over max_size_bytes=%d; it "
                           "stays that size (LMDB files never shrink)", self.path,
                           env.info()["map_size"], self.max_size_bytes)

    def _move_aside_if_damaged(self) -> Path | None:
        """Rename a data file LMDB must not map (see `lmdb_file.damage`); its new path."""
        problem = lmdb_file.lasting_damage(self.path)
        if problem is None:
            return None
        try:
            moved = lmdb_file.move_aside(self.path)
        except OSError as err:
            raise StorageUnavailable(f"LMDB store {self.path}: {problem}, and it cannot be "
                                     f"moved aside: {err}") from err
        logger.error("LMDB store %s: %s (truncated or damaged); moved it to %s with its "
                     "lock file, starting an empty store", self.path, problem, moved.name)
        return moved

    def _open_env(self) -> lmdb.Environment:
        try:
            # lock=True: other processes may open the same path (never open it lock=False).
            env = lmdb.open(str(self.path), map_size=self._first_map_bytes, max_dbs=2,
                            lock=True, sync=self._sync, metasync=False, readahead=True,
                            writemap=False)
            for _ in range(MAX_TXN_ATTEMPTS):
                try:
                    self.pages = env.open_db(_DB_PAGES)
                    self.atime = env.open_db(_DB_ATIME)
                    break
                except lmdb.MapResizedError:  # another process grew the map meanwhile
                    env.set_mapsize(0)
            else:
                raise lmdb.MapResizedError("the map kept growing while it was opened")
            self._file = lmdb_file.FileSize(self.path / lmdb_file.DATA_FILE)
        except lmdb.Error as err:
            raise OSError(f"cannot open the LMDB store at {str(self.path)!r}: {err}") from err
        return env

    def _close_env(self) -> None:
        """Close the environment and its data file (exclusive side of the gate held)."""
        if self._env is not None:
            self._env.close()
            self._env = None
        if self._file is not None:
            self._file.close()
            self._file = None

    # ------------------------------------------------------------------ transactions

    def used_bytes(self) -> int:
        """Where the map's last page ends in data.mdb (inside a transaction: what it sees)."""
        return (self._require_env().info()["last_pgno"] + 1) * self.psize

    def _require_env(self) -> lmdb.Environment:
        if self._env is None:
            raise StoreClosed
        return self._env

    def note_value_bytes(self, value_bytes: int) -> None:
        """Values of `value_bytes` are stored too (a hybrid model's second kind): eviction
        and the disk-full check count pages of the largest."""
        disk = -(-(value_bytes + _OVERFLOW_HEADER) // self.psize) * self.psize
        self._value_disk_bytes = max(self._value_disk_bytes, disk)

    def txn(self, write: bool, body: Callable[[lmdb.Transaction], T],
             make_room: bool = True, room_pages: int = 1) -> T:
        """Run `body` in one transaction, committed when it returns; return its result.

        Retries after another process grew the map and, for writes with `make_room`, after
        the map filled (grow it, or evict at the bound) or the disk did (evict for
        `room_pages` values). Raises `Replaced` when the environment had to be replaced
        (`_attempt`); other lmdb.Error propagate.
        """
        space_evictions = 0
        for _ in range(MAX_TXN_ATTEMPTS):
            try:
                return self._attempt(write, body)
            except lmdb.MapResizedError:
                self._adopt_map_size()
            except lmdb.MapFullError:
                if not (write and make_room):
                    raise
                self._make_room()
            except lmdb.Error as err:
                if not (write and make_room and lmdb_file.out_of_space(
                        err, self.path, room_pages * self._value_disk_bytes)):
                    raise
                space_evictions += 1
                if space_evictions > MAX_SPACE_EVICTIONS:  # eviction does not help: a real
                    raise                                   # I/O error, not a full disk
                self.faults.record(OP_DISK_FULL, f"LMDB store {self.path}: a commit found "
                                    f"the disk full ({err}); evicting old pages, retrying")
                if not self._evict_for_space(room_pages):
                    raise
        raise lmdb.MapFullError(f"no room after {MAX_TXN_ATTEMPTS} attempts "
                                f"(capacity {self.max_size_bytes} bytes)")

    def _attempt(self, write: bool, body: Callable[[lmdb.Transaction], T]) -> T:
        """One transaction of `txn`, once the data file still holds what the map uses.

        A file that shrank (a read past its end would be a SIGBUS) or an environment LMDB
        flagged as fatal is replaced, outside the shared side of the gate, and `Replaced`
        raised.
        """
        with self._gate.shared():
            env = self._require_env()  # looked up inside the gate: close may have run
            problem = self._shrunk(env)
            if problem is None:
                try:
                    with env.begin(write=write, buffers=True) as txn:
                        return body(txn)
                except lmdb.PanicError as err:
                    problem = f"LMDB flagged the environment as unusable ({err})"
        self._replace_env(env, problem)
        raise Replaced(f"{problem}; the environment was closed and reopened")

    def _shrunk(self, env: lmdb.Environment) -> str | None:
        """Why the data file no longer holds the pages the map uses, or None."""
        if self._file is None:
            raise StoreClosed
        # env.info() reads the meta pages through the map: they must be there first.
        need = lmdb_file.NUM_METAS * self.psize
        size = self._file.bytes()
        if size >= need:
            need = (env.info()["last_pgno"] + 1) * self.psize
            # Sized again after the meta was read: a commit (of another thread or process)
            # writes its pages before its meta page, so a file sized first could look short
            # of the meta that a commit in between made current.
            size = self._file.bytes()
        if size >= need:
            return None
        return f"the data file shrank to {size} bytes under the map, which needs {need}"

    def _replace_env(self, env: lmdb.Environment, problem: str) -> None:
        """Close `env` and open the path afresh (`_open` moves a short file aside), unless
        another thread did already. If that fails the store stays closed: calls are misses."""
        with self._gate.exclusive():
            if self._env is not env:
                return
            self._close_env()
            try:
                self._open()
            except OSError as err:
                logger.error("LMDB store %s: %s, and it cannot be reopened (%s); the store "
                             "stays closed until a restart", self.path, problem, err)

    def guard(self, op: str, fallback: T, call: Callable[[], T]) -> T:
        """`call()`, or `fallback` when the store is closed or LMDB fails (counted, logged)."""
        try:
            return call()
        except StoreClosed:
            return fallback
        except (lmdb.Error, Replaced) as err:
            self.faults.record(op, f"LMDB store {self.path}: {type(err).__name__}: {err}; "
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

    def _evict_for_space(self, pages: int) -> int:
        """Evict for a write of `pages` that found the disk full: that many LRU pages, or a
        tenth of those stored if more (the disk, not `max_size_bytes`, bounds the store
        here); the number evicted."""
        stored = self.txn(False, lambda txn: txn.stat(self.pages)["entries"])
        return self._evict(max(pages, int(EVICT_FRACTION * stored), 1))

    def _evict(self, count: int) -> int:
        """Delete the `count` pages read or written longest ago; the number deleted."""
        recent = self.stamps.recent()  # read recently, stamp not yet written: not a victim

        def oldest(txn: lmdb.Transaction) -> list[bytes]:
            stamps = ((STAMP.unpack(v)[0], bytes(k)) for k, v in txn.cursor(self.atime)
                      if bytes(k) not in recent)
            victims = [key for _, key in heapq.nsmallest(count, stamps)]
            if not victims:  # pages without a stamp (never the case for this writer)
                victims = [bytes(k) for k, _ in zip(txn.cursor(self.pages).iternext(
                    values=False), range(count))]
            return victims

        return self._delete_victims(self.txn(False, oldest))

    def _delete_victims(self, victims: list[bytes]) -> int:
        """Delete `victims` in commits of EVICT_FIRST_COMMIT keys, doubling; the number deleted.

        A delete copies the B-tree pages it changes into free pages, and with the map or the
        disk full only the few pages the last commits freed are free. Small first commits fit
        in those, and the value pages each one frees serve the larger commits after it.
        A failed commit ends the eviction; it raises only when nothing was deleted.
        """
        removed, start, size = 0, 0, EVICT_FIRST_COMMIT
        while start < len(victims):
            chunk = victims[start:start + size]
            try:
                removed += self.txn(True, lambda txn, keys=chunk: self.delete_in(txn, keys),
                                     make_room=False)
            except lmdb.Error:
                if not removed:
                    raise
                break
            start, size = start + len(chunk), 2 * size
        self.counts.add(STAT_EVICTED, removed)
        return removed

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.txn(True, lambda txn: self.delete_in(txn, keys))

    def delete_in(self, txn: lmdb.Transaction, keys: Sequence[bytes]) -> int:
        removed = 0
        for key in keys:
            removed += txn.delete(key, db=self.pages)
            txn.delete(key, db=self.atime)
        return removed

    def sizes(self, txn: lmdb.Transaction, out: dict[str, Any]) -> None:
        env = self._require_env()
        info, psize = env.info(), env.stat()["psize"]
        used_pages = 0
        for stat in (env.stat(), txn.stat(self.pages), txn.stat(self.atime)):
            used_pages += stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
        out[STAT_PAGES] = txn.stat(self.pages)["entries"]
        out[STAT_BYTES] = used_pages * psize  # live B-tree and value pages, not the free list
        out["map_bytes"] = info["map_size"]
        out["high_water_bytes"] = (info["last_pgno"] + 1) * psize  # ever used in the map
        out[STAT_CAPACITY] = self.capacity_bytes()
        out["configured_capacity_bytes"] = self.max_size_bytes

    def capacity_bytes(self) -> int:
        """What the store can grow to: `max_size_bytes`, or less where the filesystem (or
        RLIMIT_FSIZE) cannot hold that much: the data file's size on disk now plus the room it may
        still grow by. `max_size_bytes` when the room cannot be read."""
        try:
            # on disk: a prefaulted tail is a hole until LMDB writes there
            size = self._file.allocated_bytes() if self._file is not None else 0
            room = lmdb_file.room_bytes(self.path)
        except OSError:
            return self.max_size_bytes
        return min(self.max_size_bytes, size + room)

    def close(self) -> None:
        """Write the pending access stamps, then close (idempotent; later calls are misses)."""
        self.guard("close", None, self.flush_stamps)
        with self._gate.exclusive():
            self._close_env()

    def sync_to_disk(self) -> None:
        """Flush every committed page to disk now (fdatasync); for `sync=False` stores."""
        def flush() -> None:
            with self._gate.shared():
                self._require_env().sync(True)

        self.guard("sync", None, flush)

    # ------------------------------------------------------------------ access times

    def flush_stamps(self) -> None:
        stamps = self.stamps.take()
        if stamps:
            self.txn(True, lambda txn: self.put_stamps(txn, stamps.items()))

    def put_stamps(self, txn: lmdb.Transaction, stamps: Iterable[tuple[bytes, int]]) -> None:
        for key, stamp in stamps:
            if txn.get(key, db=self.pages) is not None:  # not for pages deleted since
                txn.put(key, STAMP.pack(stamp), db=self.atime)
