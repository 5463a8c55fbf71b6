"""The L3 contract: `StorageBackend`, its stats keys and exceptions, and a rate-limited log for
its faults."""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from hicache.memory.device import pages_of
from hicache.memory.host import HostKVPool
from hicache.storage.page_format import PageCodec, Payload

# Keys every backend's `stats()` returns (ints; a backend may add its own).
STAT_PAGES = "pages"                  # pages stored now
STAT_BYTES = "bytes"                  # storage used now (what counts against the capacity)
STAT_CAPACITY = "capacity_bytes"      # the capacity bound
STAT_HITS = "hits"                    # pages served by batch_get
STAT_MISSES = "misses"                # pages asked of batch_get and not served (any reason)
STAT_CORRUPT = "corrupt_pages"        # stored values that failed the check: deleted, missed
STAT_EVICTED = "evicted_pages"        # pages removed by the capacity bound
STAT_ERRORS = "errors"                # backend faults turned into misses / skipped writes
STAT_WRITTEN = "written_pages"        # pages stored by batch_set
STAT_SKIPPED = "skipped_pages"        # batch_set pages already present (not rewritten)
STAT_KEYS = (STAT_PAGES, STAT_BYTES, STAT_CAPACITY, STAT_HITS, STAT_MISSES, STAT_CORRUPT,
             STAT_EVICTED, STAT_ERRORS, STAT_WRITTEN, STAT_SKIPPED)
# Every backend's `stats()` also has this one, a dict {operation: faults} summing to STAT_ERRORS.
STAT_ERRORS_BY_OP = "errors_by_op"

# A failing backend logs each operation's fault at most this often (seconds): a dead disk
# must not flood the log at the rate of prefetches.
FAULT_LOG_INTERVAL_S = 60.0


class StorageUnavailable(OSError):
    """A backend found its store damaged and could not put a fresh one in its place.

    Raised by a backend's constructor only. Unlike a plain OSError (a path that cannot be
    used at all: a configuration error that stops start-up), the server starts without L3.
    """


class StoreClosed(Exception):
    """The store was closed (`StorageBackend.close`): a call found no environment or client.

    Raised and caught inside a backend, never raised to its caller: the call is a quiet miss
    or skipped write, not a fault (nothing counted in `errors`, nothing logged).
    """


class StorageBackend(ABC):
    """An L3 page store: page hash -> one KV page, shared across restarts (and processes).

    Units: a key is a 16-byte page hash (`hicache.storage.hashing`), one per page; `host_indices`
    are host pool slot indices of whole pages, `len(keys) * page_size` of them, key i going
    with the i-th page of `host_indices`.

    Threads: one query thread calls `batch_exists`, one fetch thread `batch_get`, one backup
    thread `batch_set`, and the scheduler thread may call `stats`, `clear`, `delete` and
    `close` at any time, all concurrently; implementations must be safe for that.

    Buffers: `batch_get` writes only into the host pages it was given, `batch_set` only reads
    them; the caller keeps those pages allocated and unchanged (`protect_host`) until the call
    returns. A page whose `batch_get` result is False holds undefined bytes.

    Faults: a backend error (I/O, a full or unreachable store) is never raised to the caller:
    it becomes a miss (`batch_get` False, `batch_exists` stops counting) or a skipped write
    (`batch_set` False), is added to `stats()["errors"]` and to its operation's count in
    `stats()["errors_by_op"]` (what `/metrics` and `/admin/tiers` report), and is logged at
    most once a minute per operation (`FaultLog`). A stored value that fails its integrity check is a miss, is deleted, and is
    added to `stats()["corrupt_pages"]`. Wrong arguments (lengths that do not match, a pool
    of another geometry) are programming errors and raise ValueError.
    """

    @abstractmethod
    def batch_exists(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from `keys[0]`, are stored consecutively (stops at the first miss)."""

    def batch_present(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether it is stored (every key checked; this default asks one at a
        time)."""
        return [self.batch_exists([key]) == 1 for key in keys]

    @abstractmethod
    def batch_get(self, keys: Sequence[bytes], host_pool: HostKVPool,
                  host_indices: torch.Tensor) -> list[bool]:
        """Copy page i of `keys` into host page i of `host_indices`; True per page served."""

    @abstractmethod
    def batch_set(self, keys: Sequence[bytes], host_pool: HostKVPool,
                  host_indices: torch.Tensor) -> list[bool]:
        """Store host page i under `keys[i]`; True per page stored now or already present."""

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove `keys`; the number that were stored."""

    @abstractmethod
    def clear(self) -> int:
        """Remove every page; the number removed."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """At least `STAT_KEYS`; counters are since this object was created."""

    @abstractmethod
    def close(self) -> None:
        """Release the store; idempotent. Calls after close are misses and skipped writes."""

    def sample_keys(self, count: int) -> list[bytes]:
        """Up to `count` keys of pages the store holds, any ones (what the fetch probe at
        attach reads, `StorageTier.probe_fetch`); none where the backend cannot list them
        (this default)."""
        return []

    def sample_read(self, keys: Sequence[bytes]) -> int:
        """Read the stored values of `keys` as the fetch path would, without decoding them
        or changing anything (a page of another model or a damaged one is only read): the
        bytes read. The default reads nothing."""
        return 0

    def with_codec(self, codec: PageCodec) -> StorageBackend:
        """This store, for the values of `codec` (a hybrid model's other kind of layers,
        `storage/kinds.py`): the same keys' space, capacity and counters; closing the view
        closes nothing. A backend that stores one kind of value only raises TypeError."""
        raise TypeError(f"{type(self).__name__} stores one kind of page value only")


# (index of the key in the call, its stored value) -> whether the value was good. Called inside
# the read, so the value may be a view valid only during the call (an LMDB map).
ValueTaker = Callable[[int, memoryview | bytes], bool]
# index of the key in the call -> the payload to store under it (`page_format.Payload`),
# encoded (sealed) by the store under that key.
PayloadSource = Callable[[int], Payload]


class ValueStore(StorageBackend):
    """A `StorageBackend` that stores its codec's values (`page_format`) by key: LMDB, Redis
    and both tiered. Its bytes-level entry points serve pages that no `HostKVPool` holds
    (another engine's host pool: `hicache.integrations.sglang`):

        get_values(keys, take)        take(i, value) per stored value of keys[i]: True when
                                      it was good (a hit); False is corrupt: deleted, counted
        put_values(keys, payload_of)  payload_of(i) per key not stored yet, encoded by the
                                      codec; True per page stored now or already present

    Same threads, faults and counters as the pool-level calls, which are these two over a
    pool (`batch_get`, `batch_set` below): a value is handed to `take` only once its size
    and header may be this codec's, and `take` must check it under keys[i]
    (`PageCodec.copy_into(keys[i], ...)` does: a value is good under its own key only).
    """

    codec: PageCodec

    @abstractmethod
    def get_values(self, keys: Sequence[bytes], take: ValueTaker,
                   codec: PageCodec | None = None) -> list[bool]:
        """`take` each stored value of `keys`; True per key whose value `take` accepted.
        `codec`: the values' (None: this store's)."""

    @abstractmethod
    def put_values(self, keys: Sequence[bytes], payload_of: PayloadSource,
                   codec: PageCodec | None = None) -> list[bool]:
        """Store `payload_of(i)` under `keys[i]`, encoded by `codec` (None: this store's);
        True per page stored now or already present."""

    def batch_get(self, keys: Sequence[bytes], host_pool: HostKVPool,
                  host_indices: torch.Tensor) -> list[bool]:
        pages = check_batch(self.codec, keys, host_pool, host_indices)
        copy_in = self.codec.value_writer(host_pool)
        return self.get_values(keys, lambda i, value: copy_in(keys[i], value, pages[i]))

    def batch_set(self, keys: Sequence[bytes], host_pool: HostKVPool,
                  host_indices: torch.Tensor) -> list[bool]:
        pages = check_batch(self.codec, keys, host_pool, host_indices)
        read_page = self.codec.payload_reader(host_pool)
        return self.put_values(keys, lambda i: read_page(pages[i]))

    def with_codec(self, codec: PageCodec) -> ValueStore:
        return CodecView(self, codec)


class CodecView(ValueStore):
    """`store`'s values of another codec (`ValueStore.with_codec`)."""

    def __init__(self, store: ValueStore, codec: PageCodec) -> None:
        self.store, self.codec = store, codec

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        return self.store.batch_exists(keys)

    def batch_present(self, keys: Sequence[bytes]) -> list[bool]:
        return self.store.batch_present(keys)

    def get_values(self, keys: Sequence[bytes], take: ValueTaker,
                   codec: PageCodec | None = None) -> list[bool]:
        return self.store.get_values(keys, take, codec or self.codec)

    def put_values(self, keys: Sequence[bytes], payload_of: PayloadSource,
                   codec: PageCodec | None = None) -> list[bool]:
        return self.store.put_values(keys, payload_of, codec or self.codec)

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.store.delete(keys)

    def clear(self) -> int:
        return self.store.clear()

    def stats(self) -> dict[str, Any]:
        return self.store.stats()

    def close(self) -> None:
        """The store is its owner's to close."""


def check_batch(codec: PageCodec, keys: Sequence[bytes], host_pool: HostKVPool,
                host_indices: torch.Tensor) -> list[int]:
    """The host page ids for `keys`, after checking the pool's geometry and the lengths."""
    codec.check_pool(host_pool)
    page_size = host_pool.page_size
    if host_indices.dim() != 1 or len(host_indices) != len(keys) * page_size:
        raise ValueError(f"{len(keys)} keys need {len(keys) * page_size} host slot indices "
                         f"(page_size={page_size}), got shape {tuple(host_indices.shape)}")
    return pages_of(host_indices, page_size).tolist()


def check_section_keys(section: str, config: Mapping[str, Any], allowed: Sequence[str]) -> None:
    """ValueError naming the keys of a backend's config `section` it does not take."""
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        raise ValueError(f"{section}: unknown key(s) {', '.join(unknown)}; allowed: "
                         f"{', '.join(allowed)}")


class Counters:
    """Named event counts of a backend, added to from any thread."""

    def __init__(self, names: Sequence[str]) -> None:
        self._counts = dict.fromkeys(names, 0)
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._counts[name] += n

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._counts)


class FaultLog:
    """A backend's faults: counted per operation and in total, logged rate-limited.

    `record(op, message)` adds one fault of `op` to `counts` (under STAT_ERRORS) and to its
    own per-operation counts, and logs `message` unless `op` logged within the interval.
    Threading: any thread.
    """

    def __init__(self, logger: logging.Logger, counts: Counters,
                 interval_s: float = FAULT_LOG_INTERVAL_S) -> None:
        self._counts = counts
        self._log = RateLimitedLog(logger, interval_s)
        self._by_op: dict[str, int] = {}
        self._lock = threading.Lock()

    def record(self, op: str, message: str) -> None:
        self._counts.add(STAT_ERRORS, 1)
        with self._lock:
            self._by_op[op] = self._by_op.get(op, 0) + 1
        self._log.warning(op, message)

    def by_op(self) -> dict[str, int]:
        with self._lock:
            return dict(self._by_op)


class RateLimitedLog:
    """Logs a warning per operation name at most once per `interval_s`; counts the rest.

    Threading: any thread (one lock around the bookkeeping).
    """

    def __init__(self, logger: logging.Logger, interval_s: float = FAULT_LOG_INTERVAL_S) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._last: dict[str, float] = {}  # op -> time.monotonic() of its last log line
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, op: str, message: str) -> bool:
        """Log `message` for `op` unless `op` logged within the interval; True when logged."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(op)
            if last is not None and now - last < self._interval_s:
                self._suppressed[op] = self._suppressed.get(op, 0) + 1
                return False
            self._last[op] = now
            suppressed = self._suppressed.pop(op, 0)
        extra = f" ({suppressed} more since the last report)" if suppressed else ""
        self._logger.warning("%s: %s%s", op, message, extra)
        return True


class SharedExclusiveLock:
    """Many holders of the shared side, or one of the exclusive side (not re-entrant).

    A waiting exclusive side blocks new shared entries, so it cannot starve. A thread must
    never take either side while it holds one.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not (self._exclusive or self._waiting))
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            self._cond.wait_for(lambda: not (self._exclusive or self._shared))
            self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()
