"""L3 on local disk: one LMDB environment, one value per KV page, bounded by LRU eviction.

The environment at `path` (a directory holding data.mdb and lock.mdb) has two databases::

    pages   page hash (16 B) -> stored page (`page_format`: 48-byte header + payload)
    atime   page hash (16 B) -> last access, uint64 little-endian `time.time_ns()`

Several processes may open one path at once: LMDB locks across processes (lock.mdb), so
servers of one model on one machine share their L3. Readers never block writers. The map is
not writable (`writemap=False`): with a writable map, processes growing the map at the same
time were seen to corrupt the file (a two-process test failed about one run in six), and a
store into a sparse file on a full disk would be SIGBUS instead of an error.

This module holds the `ValueStore` operations (`batch_get` and `batch_set` are its
`get_values` and `put_values` over a host pool), each a body run in one transaction. The
environment under them is `LmdbEnvironment` (`lmdb_env`), which `LmdbStore` extends and whose
constructor it takes: opening the environment and moving a damaged file aside, transactions
retried for the map size and a full disk, size accounting, LRU eviction, the durability of
`sync`. The access stamps of pages read are kept in memory and written in batches
(`lmdb_stamps`).

Threads: any mix of the `StorageBackend` callers. Every transaction runs under the shared side
of the environment's gate (a `SharedExclusiveLock`; resizing the map and `close` take its
exclusive side). Writes are serialised by LMDB's writer lock. Reads are not: several fetch
threads may call `batch_get` at once (into disjoint host pages), each in its own read
transaction, and their copies and checksums run with the GIL released (`page_format`).

Buffers: reads use `buffers=True`: a value is a view of the mapped file, valid only until its
transaction ends, so it is copied into the host page (or handed to `get_values`' taker) inside
the transaction, once, straight from the map.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import lmdb

from hicache.storage.backends.base import (
    STAT_BYTES,
    STAT_CAPACITY,
    STAT_CORRUPT,
    STAT_ERRORS_BY_OP,
    STAT_HITS,
    STAT_MISSES,
    STAT_PAGES,
    STAT_SKIPPED,
    STAT_WRITTEN,
    PayloadSource,
    ValueStore,
    ValueTaker,
)
from hicache.storage.backends.lmdb_env import MIN_MAP_BYTES, LmdbEnvironment
from hicache.storage.backends.lmdb_stamps import STAMP

__all__ = ["MIN_MAP_BYTES", "LmdbStore"]


class LmdbStore(LmdbEnvironment, ValueStore):
    """`ValueStore` over one LMDB environment (see the module docstring).

    `LmdbStore(path, max_size_bytes, codec, *, sync=True, initial_map_bytes=...)`: the
    arguments are `LmdbEnvironment`'s.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._scratch_local = threading.local()  # each writing thread's value buffer

    # ------------------------------------------------------------------ ValueStore

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

    def get_values(self, keys: Sequence[bytes], take: ValueTaker) -> list[bool]:
        served = [False] * len(keys)
        corrupt: list[bytes] = []

        def body(txn: lmdb.Transaction) -> None:
            for i, key in enumerate(keys):
                value = txn.get(key, db=self._pages)
                if value is None:
                    continue
                if take(i, value):
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
        read = [key for key, ok in zip(keys, served) if ok]
        if read and self._stamps.touch(read):
            self._guard("touch", None, self._flush_stamps)
        return served

    def put_values(self, keys: Sequence[bytes], payload_of: PayloadSource) -> list[bool]:
        stamps = self._stamps.take()
        # One value at a time is encoded here and copied by `put` into LMDB's own pages, so
        # one buffer serves the whole batch, and each writing thread keeps its own across
        # batches: no allocation (and page faults) per page or per batch.
        scratch = self._scratch()

        def body(txn: lmdb.Transaction) -> int:
            self._put_stamps(txn, stamps.items())
            stamp = STAMP.pack(time.time_ns())
            written = 0
            for i, key in enumerate(keys):
                # Looked up before encoding: a page stored already costs one B-tree lookup,
                # not a checksum and a copy of the page that `put(overwrite=False)` drops.
                if txn.get(key, db=self._pages) is None:
                    txn.put(key, self.codec.encode_into(payload_of(i), scratch), db=self._pages)
                    written += 1
                txn.put(key, stamp, db=self._atime)
            return written

        written = self._guard("batch_set", None,
                              lambda: self._txn(True, body, room_pages=len(keys)))
        if written is None:
            return [False] * len(keys)
        self._counts.add(STAT_WRITTEN, written)
        self._counts.add(STAT_SKIPPED, len(keys) - written)
        return [True] * len(keys)

    def _scratch(self) -> bytearray:
        """The calling thread's buffer of one stored value (made on its first write)."""
        scratch = getattr(self._scratch_local, "value", None)
        if scratch is None:
            scratch = self._scratch_local.value = bytearray(self.codec.value_bytes)
        return scratch

    def sample_keys(self, count: int) -> list[bytes]:
        def body(txn: lmdb.Transaction) -> list[bytes]:
            with txn.cursor(db=self._pages) as cursor:
                return [bytes(k) for k, _ in zip(cursor.iternext(values=False), range(count))]

        return self._guard("sample", [], lambda: self._txn(False, body))

    def sample_read(self, keys: Sequence[bytes]) -> int:
        def body(txn: lmdb.Transaction) -> int:
            return sum(len(value) for key in keys
                       if (value := txn.get(key, db=self._pages)) is not None)

        return self._guard("sample", 0, lambda: self._txn(False, body))

    def delete(self, keys: Sequence[bytes]) -> int:
        self._stamps.discard(keys)
        return self._guard("delete", 0, lambda: self._delete(keys))

    def clear(self) -> int:
        self._stamps.clear()

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
                    "map_bytes": 0, "high_water_bytes": 0, "path": str(self.path),
                    "prefaulted_bytes": self.prefaulted_bytes})
        self._guard("stats", None, lambda: self._txn(False, lambda txn: self._sizes(txn, out)))
        return out

    def close(self) -> None:
        self._guard("close", None, self._flush_stamps)
        with self._gate.exclusive():
            self._close_env()

    def sync_to_disk(self) -> None:
        """Flush every committed page to disk now (fdatasync); for `sync=False` stores."""
        def flush() -> None:
            with self._gate.shared():
                self._require_env().sync(True)

        self._guard("sync", None, flush)
