"""L3 on local disk: one LMDB environment, one value per KV page, bounded by LRU eviction.

The environment at `path` (a directory holding data.mdb and lock.mdb) has two databases::

    pages   page hash (16 B) -> stored page (`page_format`: header, payload, tag; valid
            under this key only)
    atime   page hash (16 B) -> last access, uint64 little-endian `time.time_ns()`

Several processes may open one path at once: LMDB locks across processes (lock.mdb), so
servers of one model on one machine share their L3. Readers never block writers. The map is
not writable (`writemap=False`): with a writable map, processes growing the map at the same
time were seen to corrupt the file (a two-process test failed about one run in six), and a
store into a sparse file on a full disk would be SIGBUS instead of an error.

This module holds the `ValueStore` operations (`batch_get` and `batch_set` are its
`get_values` and `put_values` over a host pool), each a body run in one transaction. The
environment under them is `LmdbEnvironment` (`lmdb_env`), a part `LmdbStore` holds:
opening the environment and moving a damaged file aside, transactions retried for the map
size and a full disk, size accounting, LRU eviction, the durability of `sync`. The access
stamps of pages read are kept in memory and written in batches (`lmdb_stamps`).

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
from pathlib import Path
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
from hicache.storage.backends.lmdb_env import INITIAL_MAP_BYTES, MIN_MAP_BYTES, LmdbEnvironment
from hicache.storage.backends.lmdb_stamps import STAMP
from hicache.storage.page_format import PageCodec

__all__ = ["MIN_MAP_BYTES", "LmdbStore"]


class LmdbStore(ValueStore):
    """`ValueStore` over one LMDB environment (see the module docstring).

    `LmdbStore(path, max_size_bytes, codec, *, sync=True, initial_map_bytes=...)`: the
    arguments are its `LmdbEnvironment`'s.
    """

    def __init__(self, path: str | Path, max_size_bytes: int, codec: PageCodec, *,
                 sync: bool = True, initial_map_bytes: int = INITIAL_MAP_BYTES,
                 prefault_bytes: int = 0) -> None:
        # The environment, its transactions, size accounting, eviction and the counters and
        # access stamps they share: a part of its own (`lmdb_env`).
        self.env = LmdbEnvironment(path, max_size_bytes, codec, sync=sync,
                                   initial_map_bytes=initial_map_bytes,
                                   prefault_bytes=prefault_bytes)
        self.path, self.codec = self.env.path, codec
        self.max_size_bytes, self.prefaulted_bytes = (self.env.max_size_bytes,
                                                      self.env.prefaulted_bytes)
        self._scratch_local = threading.local()  # each writing thread's value buffer

    # ------------------------------------------------------------------ ValueStore

    def batch_present(self, keys: Sequence[bytes]) -> list[bool]:
        def body(txn: lmdb.Transaction) -> list[bool]:
            return [txn.get(key, db=self.env.pages) is not None for key in keys]

        return self.env.guard("batch_exists", None,
                              lambda: self.env.txn(False, body)) or [False] * len(keys)

    def with_codec(self, codec: PageCodec) -> ValueStore:
        """The view, and eviction sized by the larger of the two values (`LmdbEnvironment`)."""
        self.env.note_value_bytes(codec.value_bytes)
        return super().with_codec(codec)

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        found = [0]

        def body(txn: lmdb.Transaction) -> None:
            found[0] = 0
            for key in keys:
                if txn.get(key, db=self.env.pages) is None:
                    return
                found[0] += 1

        self.env.guard("batch_exists", None, lambda: self.env.txn(False, body))
        return found[0]

    def get_values(self, keys: Sequence[bytes], take: ValueTaker,
                   codec: PageCodec | None = None) -> list[bool]:
        served = [False] * len(keys)
        corrupt: list[bytes] = []

        def body(txn: lmdb.Transaction) -> None:
            for i, key in enumerate(keys):
                value = txn.get(key, db=self.env.pages)
                if value is None:
                    continue
                if take(i, value):
                    served[i] = True
                else:
                    corrupt.append(bytes(key))

        self.env.guard("batch_get", None, lambda: self.env.txn(False, body))
        hits = sum(served)
        self.env.counts.add(STAT_HITS, hits)
        self.env.counts.add(STAT_MISSES, len(keys) - hits)
        if corrupt:
            self.env.counts.add(STAT_CORRUPT, len(corrupt))
            self.env.guard("delete_corrupt", 0, lambda: self.env.delete(corrupt))
        read = [key for key, ok in zip(keys, served) if ok]
        if read and self.env.stamps.touch(read):
            self.env.guard("touch", None, self.env.flush_stamps)
        return served

    def put_values(self, keys: Sequence[bytes], payload_of: PayloadSource,
                   codec: PageCodec | None = None) -> list[bool]:
        stamps = self.env.stamps.take()
        codec = codec or self.codec
        # One value at a time is encoded here and copied by `put` into LMDB's own pages, so
        # one buffer serves the whole batch, and each writing thread keeps its own across
        # batches: no allocation (and page faults) per page or per batch.
        scratch = self._scratch(codec.value_bytes)

        def body(txn: lmdb.Transaction) -> int:
            self.env.put_stamps(txn, stamps.items())
            stamp = STAMP.pack(time.time_ns())
            written = 0
            for i, key in enumerate(keys):
                # Looked up before encoding: a page stored already costs one B-tree lookup,
                # not a checksum and a copy of the page that `put(overwrite=False)` drops.
                if txn.get(key, db=self.env.pages) is None:
                    txn.put(key, codec.encode_into(key, payload_of(i), scratch),
                            db=self.env.pages)
                    written += 1
                txn.put(key, stamp, db=self.env.atime)
            return written

        written = self.env.guard("batch_set", None,
                                 lambda: self.env.txn(True, body, room_pages=len(keys)))
        if written is None:
            return [False] * len(keys)
        self.env.counts.add(STAT_WRITTEN, written)
        self.env.counts.add(STAT_SKIPPED, len(keys) - written)
        return [True] * len(keys)

    def _scratch(self, size: int) -> bytearray:
        """The calling thread's buffer of one stored value of `size` bytes (made on its first
        write of that size)."""
        buffers = getattr(self._scratch_local, "value", None)
        if buffers is None:
            buffers = self._scratch_local.value = {}
        if size not in buffers:
            buffers[size] = bytearray(size)
        return buffers[size]

    def sample_keys(self, count: int) -> list[bytes]:
        def body(txn: lmdb.Transaction) -> list[bytes]:
            with txn.cursor(db=self.env.pages) as cursor:
                return [bytes(k) for k, _ in zip(cursor.iternext(values=False), range(count))]

        return self.env.guard("sample", [], lambda: self.env.txn(False, body))

    def sample_read(self, keys: Sequence[bytes]) -> int:
        def body(txn: lmdb.Transaction) -> int:
            return sum(len(value) for key in keys
                       if (value := txn.get(key, db=self.env.pages)) is not None)

        return self.env.guard("sample", 0, lambda: self.env.txn(False, body))

    def delete(self, keys: Sequence[bytes]) -> int:
        self.env.stamps.discard(keys)
        return self.env.guard("delete", 0, lambda: self.env.delete(keys))

    def clear(self) -> int:
        self.env.stamps.clear()

        def body(txn: lmdb.Transaction) -> int:
            removed = txn.stat(self.env.pages)["entries"]
            txn.drop(self.env.pages, delete=False)
            txn.drop(self.env.atime, delete=False)
            return removed

        return self.env.guard("clear", 0, lambda: self.env.txn(True, body))

    def stats(self) -> dict[str, Any]:
        out = self.env.counts.snapshot()
        out[STAT_ERRORS_BY_OP] = self.env.faults.by_op()
        out.update({STAT_PAGES: 0, STAT_BYTES: 0, STAT_CAPACITY: self.max_size_bytes,
                    "map_bytes": 0, "high_water_bytes": 0, "path": str(self.path),
                    "prefaulted_bytes": self.prefaulted_bytes})
        self.env.guard("stats", None,
                       lambda: self.env.txn(False, lambda txn: self.env.sizes(txn, out)))
        return out

    def close(self) -> None:
        self.env.close()

    def sync_to_disk(self) -> None:
        """Flush every committed page to disk now (fdatasync); for `sync=False` stores."""
        self.env.sync_to_disk()
