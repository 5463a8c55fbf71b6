"""`ThrottledBackend` around a real LMDB on a fake clock, and `ThrottleProxy` in front of a
real redis-server (CPU, tmp_path, loopback)."""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from redis_fixtures import RedisServer
from test_storage_lmdb import (
    GEOMETRY,
    assert_closed_twice_then_misses,
    filled_pool,
    keys_of,
    open_store,
    read_back,
    slots,
    write_range,
)

from benchmarks.throttle_proxy import THREAD_NAME, ThrottleProxy
from hicache.storage.backends.base import STAT_ERRORS_BY_OP, STAT_HITS, STAT_KEYS
from hicache.storage.backends.redis_store import RedisStore
from hicache.storage.backends.throttled import (
    STAT_THROTTLE_BANDWIDTH,
    STAT_THROTTLE_BYTES,
    STAT_THROTTLE_DELAY,
    STAT_THROTTLE_LATENCY,
    THROTTLE_STAT_KEYS,
    SharedLink,
    ThrottledBackend,
)
from hicache.storage.page_format import PageCodec

VALUE_BYTES = PageCodec(GEOMETRY).value_bytes
PAGE_S = 1e-3  # the fake link moves one stored page per millisecond
BANDWIDTH = VALUE_BYTES / PAGE_S
LATENCY_S = 0.25e-3
T0 = 100.0  # the fake clock's start (any value; not 0, so an unset time shows)
BARRIER_TIMEOUT_S = 10.0  # only reached when the throttle holds a lock while sleeping
# The proxy tests: fast enough to take milliseconds, with a latency far above the clock's
# resolution so its lower bound is visible.
PROXY_BANDWIDTH = 500e6
PROXY_LATENCY_S = 2e-3
CLOCK_SLACK_S = 1e-6  # asyncio may fire a timer within the clock's resolution (~1 ns) early


class FakeClock:
    """A clock that moves only when told; `sleep` records each delay and, with `advance`,
    moves the clock by it. `barrier`: every sleep waits there first (concurrency tests)."""

    def __init__(self, advance: bool = True, barrier: threading.Barrier | None = None) -> None:
        self.now = T0
        self.advance, self.barrier = advance, barrier
        self.sleeps: list[float] = []
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def sleep(self, seconds: float) -> None:
        if self.barrier is not None:
            self.barrier.wait(BARRIER_TIMEOUT_S)
        with self._lock:
            self.sleeps.append(seconds)
            if self.advance:
                self.now += seconds


def throttled(tmp_path: Path, clock: FakeClock, bandwidth: float | None = BANDWIDTH,
              latency_s: float = LATENCY_S) -> ThrottledBackend:
    return ThrottledBackend(open_store(tmp_path / "l3"), bandwidth, latency_s,
                            value_bytes=VALUE_BYTES, clock=clock, sleep=clock.sleep)


# ----------------------------------------------------------------- ThrottledBackend


def test_pages_round_trip_and_each_call_costs_its_bytes_plus_latency(tmp_path: Path) -> None:
    clock = FakeClock()
    store = throttled(tmp_path, clock)
    pool = filled_pool(1)
    write_range(store, pool, 0, 8, batch=8)
    assert store.batch_exists(keys_of(0, 8)) == 8
    assert read_back(store, pool, 0, 8) == [True] * 8
    # set 8 pages, exists (a round trip), get 8 pages; sequential, so the link is free
    assert clock.sleeps == pytest.approx([8 * PAGE_S + LATENCY_S, LATENCY_S,
                                          8 * PAGE_S + LATENCY_S])
    stats = store.stats()
    assert stats[STAT_THROTTLE_BYTES] == 16 * VALUE_BYTES
    assert stats[STAT_THROTTLE_DELAY] == pytest.approx(sum(clock.sleeps))
    assert clock.now == pytest.approx(T0 + sum(clock.sleeps))
    store.close()


def test_back_to_back_transfers_queue_on_the_link(tmp_path: Path) -> None:
    clock = FakeClock(advance=False)  # the calls come faster than the link drains
    store = throttled(tmp_path, clock)
    pool = filled_pool(2)
    write_range(store, pool, 0, 4, batch=2)
    assert clock.sleeps == pytest.approx([2 * PAGE_S + LATENCY_S, 4 * PAGE_S + LATENCY_S])
    assert store.link.free_at_s == pytest.approx(T0 + 4 * PAGE_S)
    assert store.batch_exists(keys_of(0, 4)) == 4  # no payload: it does not queue
    assert clock.sleeps[-1] == pytest.approx(LATENCY_S)
    clock.now = T0 + 3 * PAGE_S  # one page of the queue is left: the next one waits for it
    store.batch_get(keys_of(0, 1), pool, slots([5]))
    assert clock.sleeps[-1] == pytest.approx(2 * PAGE_S + LATENCY_S)
    clock.now = T0 + 60.0  # the link has long been idle: a transfer starts at once
    store.batch_get(keys_of(0, 3), pool, slots([5, 6, 7]))
    assert clock.sleeps[-1] == pytest.approx(3 * PAGE_S + LATENCY_S)
    assert store.link.free_at_s == pytest.approx(T0 + 60.0 + 3 * PAGE_S)
    store.close()


def test_concurrent_callers_share_the_bandwidth_and_overlap_their_latency(
        tmp_path: Path) -> None:
    clock = FakeClock(advance=False)
    store = throttled(tmp_path, clock)
    pool = filled_pool(3)
    write_range(store, pool, 0, 4, batch=4)
    clock.sleeps.clear()
    # Both callers must reach their sleep before either returns: a lock held while
    # sleeping breaks the barrier.
    clock.barrier = threading.Barrier(2)
    clock.now = store.link.free_at_s  # the link is free now
    start = clock.now
    results: dict[str, object] = {}

    def fetch() -> None:
        results["get"] = store.batch_get(keys_of(0, 4), pool, slots([8, 9, 10, 11]))

    def backup() -> None:
        results["set"] = store.batch_set(keys_of(4, 4), pool, slots([0, 1, 2, 3]))

    run_together(fetch, backup)
    assert results == {"get": [True] * 4, "set": [True] * 4}
    # One transfer got the link at once, the other queued behind it; one latency each.
    assert sorted(clock.sleeps) == pytest.approx([4 * PAGE_S + LATENCY_S,
                                                  8 * PAGE_S + LATENCY_S])
    assert store.link.free_at_s == pytest.approx(start + 8 * PAGE_S)
    store.close()


def test_round_trips_overlap_their_latency(tmp_path: Path) -> None:
    clock = FakeClock(advance=False, barrier=threading.Barrier(2))
    store = throttled(tmp_path, clock)
    run_together(lambda: store.batch_exists(keys_of(0, 4)),
                 lambda: store.batch_exists(keys_of(4, 4)))
    assert clock.sleeps == pytest.approx([LATENCY_S, LATENCY_S])  # not 1x and 2x
    assert store.link.free_at_s == -math.inf  # no payload booked
    store.close()


def run_together(*calls: Callable[[], object]) -> None:
    """Run each call in its own thread at once, wait for all; a call's exception raises."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        for future in [pool.submit(call) for call in calls]:
            future.result()


def test_unlimited_bandwidth_charges_latency_only(tmp_path: Path) -> None:
    clock = FakeClock(advance=False)
    store = throttled(tmp_path, clock, bandwidth=None)
    pool = filled_pool(4)
    write_range(store, pool, 0, 16, batch=16)
    assert read_back(store, pool, 0, 16) == [True] * 16
    assert clock.sleeps == pytest.approx([LATENCY_S, LATENCY_S])
    assert store.link.free_at_s == -math.inf
    assert store.stats()[STAT_THROTTLE_BYTES] == 32 * VALUE_BYTES
    store.close()
    bare = FakeClock()
    store = throttled(tmp_path, bare, bandwidth=None, latency_s=0.0)
    assert read_back(store, pool, 0, 16) == [True] * 16
    assert bare.sleeps == []  # nothing to wait for: no sleep call at all
    store.close()


def test_a_call_without_keys_costs_nothing(tmp_path: Path) -> None:
    clock = FakeClock()
    store = throttled(tmp_path, clock)
    pool = filled_pool()
    assert store.batch_exists([]) == 0
    assert store.batch_get([], pool, slots([])) == []
    assert store.batch_set([], pool, slots([])) == []
    assert clock.sleeps == [] and store.stats()[STAT_THROTTLE_BYTES] == 0
    store.close()


@pytest.mark.parametrize(("bandwidth", "latency_s", "match"), [
    (0.0, 0.0, "bandwidth_bytes_per_s=0.0"), (-5.0, 0.0, "bandwidth_bytes_per_s=-5.0"),
    (math.inf, 0.0, "bandwidth_bytes_per_s=inf"), (math.nan, 0.0, "bandwidth_bytes_per_s=nan"),
    (None, -0.001, "latency_s=-0.001"), (BANDWIDTH, math.nan, "latency_s=nan"),
])
def test_bad_arguments_raise_naming_the_value(tmp_path: Path, bandwidth: float | None,
                                              latency_s: float, match: str) -> None:
    store = open_store(tmp_path / "l3")
    with pytest.raises(ValueError, match=match):
        ThrottledBackend(store, bandwidth, latency_s, value_bytes=VALUE_BYTES)
    with pytest.raises(ValueError, match=match):
        ThrottleProxy("127.0.0.1", 1, bandwidth, latency_s)
    store.close()


def test_bad_value_bytes_and_nesting_raise(tmp_path: Path) -> None:
    store = open_store(tmp_path / "l3")
    with pytest.raises(ValueError, match="value_bytes=0"):
        ThrottledBackend(store, BANDWIDTH, value_bytes=0)
    outer = ThrottledBackend(store, BANDWIDTH, value_bytes=VALUE_BYTES)
    with pytest.raises(TypeError, match="already a ThrottledBackend"):
        ThrottledBackend(outer, BANDWIDTH, value_bytes=VALUE_BYTES)
    with pytest.raises(ValueError, match="nbytes=-1"):
        SharedLink(BANDWIDTH).reserve(-1)
    store.close()


def test_stats_are_inners_plus_the_throttle(tmp_path: Path) -> None:
    clock = FakeClock()
    store = throttled(tmp_path, clock)
    pool = filled_pool(5)
    write_range(store, pool, 0, 4, batch=4)
    read_back(store, pool, 0, 4)
    stats = store.stats()
    assert set(STAT_KEYS) | {STAT_ERRORS_BY_OP} | set(THROTTLE_STAT_KEYS) <= set(stats)
    assert stats[STAT_HITS] == store.inner.stats()[STAT_HITS] == 4
    assert stats[STAT_THROTTLE_BANDWIDTH] == BANDWIDTH
    assert stats[STAT_THROTTLE_LATENCY] == LATENCY_S
    assert stats[STAT_THROTTLE_DELAY] == pytest.approx(2 * (4 * PAGE_S + LATENCY_S))
    assert not set(THROTTLE_STAT_KEYS) & set(store.inner.stats())
    store.close()


def test_inner_faults_and_argument_errors_stay_inners(tmp_path: Path) -> None:
    clock = FakeClock()
    store = throttled(tmp_path, clock)
    pool = filled_pool(6)
    write_range(store, pool, 0, 2, batch=2)
    charged = store.stats()[STAT_THROTTLE_BYTES]
    with pytest.raises(ValueError, match="host slot indices"):  # the inner store's check
        store.batch_get(keys_of(0, 2), pool, slots([0]))
    assert store.stats()[STAT_THROTTLE_BYTES] == charged  # a raising call costs nothing
    assert_closed_twice_then_misses(store, pool)  # close() closes the inner LMDB
    assert store.inner.batch_exists(keys_of(0, 2)) == 0


# ----------------------------------------------------------------- ThrottleProxy


def proxy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME) and t.is_alive()]


def test_redis_through_the_proxy_serves_pages_byte_identically(tmp_path: Path) -> None:
    with RedisServer.start(tmp_path / "redis") as server:
        proxy = ThrottleProxy("127.0.0.1", server.port, PROXY_BANDWIDTH, PROXY_LATENCY_S)
        with proxy:
            assert proxy_threads()
            store = RedisStore(f"redis://127.0.0.1:{proxy.port}/0", PageCodec(GEOMETRY),
                               key_prefix=f"t-{uuid.uuid4().hex[:8]}:")
            pool = filled_pool(7)
            before_s = time.monotonic()
            write_range(store, pool, 0, 16, batch=8)
            assert store.batch_exists(keys_of(0, 16)) == 16
            assert read_back(store, pool, 0, 16) == [True] * 16
            served_s = time.monotonic()
            payload = 16 * VALUE_BYTES
            assert proxy.bytes_up >= payload and proxy.bytes_down >= payload
            assert proxy.connections >= 1
            # Every byte booked its slot on its direction's link, one after another...
            assert proxy.down_link.free_at_s >= before_s + proxy.bytes_down / PROXY_BANDWIDTH
            assert proxy.up_link.free_at_s >= before_s + proxy.bytes_up / PROXY_BANDWIDTH
            # ...and the reply arrived only after its slot plus the latency.
            assert served_s >= proxy.down_link.free_at_s + PROXY_LATENCY_S - CLOCK_SLACK_S
            store.close()
        assert not proxy_threads()
        # Redis itself holds the pages: a direct client sees them.
        direct = RedisStore(server.url, PageCodec(GEOMETRY), key_prefix=store.key_prefix)
        assert read_back(direct, pool, 0, 16) == [True] * 16
        direct.close()


def test_stop_closes_open_connections_and_leaves_no_thread(tmp_path: Path) -> None:
    with RedisServer.start(tmp_path / "redis") as server:
        proxy = ThrottleProxy("127.0.0.1", server.port, None).start()
        store = RedisStore(f"redis://127.0.0.1:{proxy.port}/0", PageCodec(GEOMETRY),
                           key_prefix=f"t-{uuid.uuid4().hex[:8]}:")
        pool = filled_pool(8)
        write_range(store, pool, 0, 2, batch=2)
        proxy.stop()  # the store's connection is still open
        assert not proxy_threads()
        proxy.stop()  # idempotent
        # The connection was closed under the store: a miss, not a hang or an exception.
        assert store.batch_exists(keys_of(0, 2)) == 0
        store.close()
        client = server.client()
        assert client.ping()  # the target is untouched
        client.close()


def test_a_taken_port_fails_start_and_leaves_no_thread() -> None:
    with ThrottleProxy("127.0.0.1", 1, None) as first:
        second = ThrottleProxy("127.0.0.1", 1, None, listen_port=first.port)
        with pytest.raises(OSError):
            second.start()
        with pytest.raises(RuntimeError, match="not started"):
            _ = second.port
    assert not proxy_threads()
