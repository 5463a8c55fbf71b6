"""Access stamps of the LMDB pages read, buffered so that a read costs no write transaction.

A stamp is the wall-clock `time.time_ns()` of a page's latest read (or write), stored in the
atime database as `STAMP` (uint64 little-endian); the store writes the pending ones in one
transaction once `due` (this many pages pending, or this long since the last write) and with
every `batch_set`, eviction and close. Stamps are wall-clock, not monotonic: they are compared
across the processes sharing a store and across restarts, where a monotonic clock means
nothing. If the wall clock steps backwards, pages touched after the step look older and are
evicted sooner; only the eviction order suffers, never what is served.

Threading: any thread (one lock).
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Iterable

# Pending stamps are written once this many are buffered or this many seconds have passed
# (checked on each read): at most one fdatasync per ~1k pages read, and the LRU order on disk
# at most a few seconds old.
TOUCH_FLUSH_PAGES = 1024
TOUCH_FLUSH_S = 5.0
STAMP = struct.Struct("<Q")  # a stamp as the atime database stores it


class PendingStamps:
    def __init__(self, flush_pages: int = TOUCH_FLUSH_PAGES,
                 flush_s: float = TOUCH_FLUSH_S) -> None:
        self._stamps: dict[bytes, int] = {}  # page hash -> time_ns of its latest read
        self._lock = threading.Lock()
        self._flush_pages, self._flush_s = flush_pages, flush_s
        self._last_take = time.monotonic()

    def touch(self, keys: Iterable[bytes]) -> bool:
        """Stamp `keys` read now; whether the pending stamps are due to be written."""
        stamp = time.time_ns()
        with self._lock:
            self._stamps.update((bytes(key), stamp) for key in keys)
            return (len(self._stamps) >= self._flush_pages
                    or time.monotonic() - self._last_take >= self._flush_s)

    def take(self) -> dict[bytes, int]:
        """Every pending stamp, now no longer pending (lost if their write fails: only the
        LRU order suffers)."""
        with self._lock:
            taken, self._stamps = self._stamps, {}
            self._last_take = time.monotonic()
        return taken

    def discard(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._stamps.pop(bytes(key), None)

    def clear(self) -> None:
        with self._lock:
            self._stamps.clear()

    def recent(self) -> set[bytes]:
        """Pages read since the last write of stamps: never eviction victims."""
        with self._lock:
            return set(self._stamps)
