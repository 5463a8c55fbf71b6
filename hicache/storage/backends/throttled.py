"""`ThrottledBackend`: any `StorageBackend` made to behave like a slower medium (tests and
benchmarks), and `SharedLink`, the virtual timeline of one shared transfer link.

    ThrottledBackend(LmdbStore(...), bandwidth_bytes_per_s=200e6, latency_s=0.5e-3,
                     value_bytes=codec.value_bytes)

What each call costs, charged after the inner call has returned (so the bytes are in place
when the caller wakes up):

    batch_get, batch_set    latency_s + len(keys) * value_bytes / bandwidth (on the link)
    batch_exists            latency_s (one round trip, no payload)
    delete, clear, stats,   free
    close

Every key is charged its full stored value, hit or miss: the model is a medium that moves
the asked pages, not a count of what the inner backend found.

The link is one for all threads (several fetch threads and a backup thread call at once):

    time ──────────────────────────────────────────────────────────────►
    caller A   [── transfer A ──]·· latency ··▶ A returns
    caller B                    [── transfer B ──]·· latency ··▶ B returns
                ▲ A starts at now; B starts when the link is free (A's end)

A transfer occupies the link for bytes / bandwidth from max(now, the link's free time);
latency is propagation, so concurrent calls' latencies overlap.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from hicache.memory.host import HostKVPool
from hicache.storage.backends.base import StorageBackend
from hicache.storage.page_format import PageCodec

__all__ = [
    "STAT_THROTTLE_BANDWIDTH", "STAT_THROTTLE_BYTES", "STAT_THROTTLE_DELAY",
    "STAT_THROTTLE_LATENCY", "SharedLink", "Slot", "ThrottledBackend",
]

# Keys `ThrottledBackend.stats()` adds to the inner backend's.
STAT_THROTTLE_BANDWIDTH = "throttle_bandwidth_bytes_per_s"  # None: unlimited
STAT_THROTTLE_LATENCY = "throttle_latency_s"
STAT_THROTTLE_DELAY = "throttle_delay_s"  # seconds slept in total, all threads
STAT_THROTTLE_BYTES = "throttle_bytes"  # bytes charged to the link in total
THROTTLE_STAT_KEYS = (STAT_THROTTLE_BANDWIDTH, STAT_THROTTLE_LATENCY, STAT_THROTTLE_DELAY,
                      STAT_THROTTLE_BYTES)


class Slot(NamedTuple):
    """A transfer's time on a `SharedLink`, in seconds of the link's clock."""

    start_s: float
    end_s: float


class SharedLink:
    """One link of `bandwidth_bytes_per_s` shared by every caller: a virtual timeline.

    `reserve(nbytes)` books the next `nbytes / bandwidth` seconds of the link from
    max(now, `free_at_s`) and returns that slot; the caller waits for it itself (nothing
    here sleeps). Zero bytes (a round trip without payload), or any bytes on an unlimited
    link (`bandwidth_bytes_per_s=None`), get the slot (now, now) and leave the timeline as
    it is: they never queue. Threading: any thread (one lock around the timeline).
    """

    def __init__(self, bandwidth_bytes_per_s: float | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if bandwidth_bytes_per_s is not None and not (
                math.isfinite(bandwidth_bytes_per_s) and bandwidth_bytes_per_s > 0):
            raise ValueError(f"bandwidth_bytes_per_s={bandwidth_bytes_per_s!r}: must be a "
                             "finite number > 0, or None for unlimited")
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self._clock = clock
        self._free_at_s = -math.inf  # when the last booked transfer ends (clock seconds)
        self._lock = threading.Lock()

    @property
    def free_at_s(self) -> float:
        """When the link is free of every transfer booked so far; -inf before the first."""
        with self._lock:
            return self._free_at_s

    def reserve(self, nbytes: int) -> Slot:
        """Book `nbytes` on the link: the slot they occupy (`start_s` >= now)."""
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes}: must be >= 0")
        with self._lock:
            now = self._clock()
            if self.bandwidth_bytes_per_s is None or nbytes == 0:
                return Slot(now, now)
            start = max(now, self._free_at_s)
            end = start + nbytes / self.bandwidth_bytes_per_s
            self._free_at_s = end
            return Slot(start, end)


def check_latency(latency_s: float) -> float:
    """`latency_s` if it is a finite number >= 0; else a ValueError naming it."""
    if not (math.isfinite(latency_s) and latency_s >= 0):
        raise ValueError(f"latency_s={latency_s!r}: must be a finite number >= 0")
    return latency_s


class ThrottledBackend(StorageBackend):
    """`inner` behind a link of `bandwidth_bytes_per_s` (None: unlimited) and `latency_s`
    seconds of round-trip latency (see the module docstring for what each call costs).

    `value_bytes`: the bytes of one stored page (`PageCodec.value_bytes`). `clock` and
    `sleep` (seconds) are injectable so tests run on a fake clock.

    Threads: those of `StorageBackend`, all at once; the calling thread sleeps its own
    delay, outside every lock. Faults and wrong arguments are `inner`'s (a closed inner is
    a miss, still charged); a call with no keys costs nothing.
    """

    def __init__(self, inner: StorageBackend, bandwidth_bytes_per_s: float | None,
                 latency_s: float = 0.0, *, value_bytes: int,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if isinstance(inner, ThrottledBackend):
            # The stats keys would clash; one throttle with the combined figures says it.
            raise TypeError("inner is already a ThrottledBackend: wrap the backend once")
        if value_bytes <= 0:
            raise ValueError(f"value_bytes={value_bytes}: must be > 0 (PageCodec.value_bytes)")
        self.inner = inner
        self.link = SharedLink(bandwidth_bytes_per_s, clock)
        self.latency_s = check_latency(latency_s)
        self.value_bytes = value_bytes
        self._clock, self._sleep = clock, sleep
        self._delay_s = 0.0  # seconds slept, all threads
        self._bytes = 0  # bytes charged to the link
        self._lock = threading.Lock()  # guards the two totals above

    # ------------------------------------------------------------------ StorageBackend

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        found = self.inner.batch_exists(keys)
        if keys:
            self._charge(0)
        return found

    def batch_present(self, keys: Sequence[bytes]) -> list[bool]:
        found = self.inner.batch_present(keys)
        if keys:
            self._charge(0)
        return found

    def batch_get(self, keys: Sequence[bytes], host_pool: HostKVPool,
                  host_indices: torch.Tensor) -> list[bool]:
        served = self.inner.batch_get(keys, host_pool, host_indices)
        if keys:
            self._charge(len(keys) * self.value_bytes)
        return served

    def batch_set(self, keys: Sequence[bytes], host_pool: HostKVPool,
                  host_indices: torch.Tensor) -> list[bool]:
        stored = self.inner.batch_set(keys, host_pool, host_indices)
        if keys:
            self._charge(len(keys) * self.value_bytes)
        return stored

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.inner.delete(keys)

    def clear(self) -> int:
        return self.inner.clear()

    def stats(self) -> dict[str, Any]:
        """`inner`'s stats plus `THROTTLE_STAT_KEYS` (which an inner backend never has)."""
        out = self.inner.stats()
        with self._lock:
            out.update({STAT_THROTTLE_BANDWIDTH: self.link.bandwidth_bytes_per_s,
                        STAT_THROTTLE_LATENCY: self.latency_s,
                        STAT_THROTTLE_DELAY: self._delay_s, STAT_THROTTLE_BYTES: self._bytes})
        return out

    def sample_keys(self, count: int) -> list[bytes]:
        return self.inner.sample_keys(count)

    def sample_read(self, keys: Sequence[bytes]) -> int:
        """The inner read, charged as a `batch_get` of the same keys."""
        nbytes = self.inner.sample_read(keys)
        self._charge(len(keys) * self.value_bytes)
        return nbytes

    def with_codec(self, codec: PageCodec) -> StorageBackend:
        """`inner`'s view for `codec`'s values, behind this same link."""
        view = ThrottledBackend(self.inner.with_codec(codec), None, self.latency_s,
                                value_bytes=codec.value_bytes, clock=self._clock,
                                sleep=self._sleep)
        view.link = self.link
        return view

    def close(self) -> None:
        self.inner.close()

    # ------------------------------------------------------------------ the delay

    def _charge(self, nbytes: int) -> float:
        """Book `nbytes` on the link, then sleep until they are through plus the latency;
        the seconds slept (0 when that moment has passed)."""
        slot = self.link.reserve(nbytes)
        delay_s = max(0.0, slot.end_s + self.latency_s - self._clock())
        with self._lock:
            self._bytes += nbytes
            self._delay_s += delay_s
        if delay_s > 0:
            self._sleep(delay_s)
        return delay_s
