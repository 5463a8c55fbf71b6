"""The L3 fetch workers: batches shared round robin between prefetches, out-of-order batches
counted as leading pages, a failed batch ending its fetch, cancellation; a raced hit's fetch
back to front, counted as trailing pages, above a floor the compute side moves up."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from hicache.memory.host import HostKVPool
from hicache.storage.backends.base import StorageBackend
from hicache.storage.io import FETCH_BATCH_PAGES, PrefetchOp, StorageController

PS = 4
WAIT_S = 10.0  # a bound on waits that succeed in microseconds; reached only by a bug


class ScriptedBackend(StorageBackend):
    """Serves every page (writes the page index into it), records the order of calls, and
    blocks a call whose first key is in `hold` until that key's event is set; keys in
    `missing` are not served."""

    def __init__(self) -> None:
        self.calls: list[list[bytes]] = []
        self.hold: dict[bytes, threading.Event] = {}
        self.entered: dict[bytes, threading.Event] = {}
        self.missing: set[bytes] = set()
        self._lock = threading.Lock()

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        return len(keys)

    def batch_get(self, keys: Sequence[bytes], host_pool: HostKVPool,
                  host_indices: torch.Tensor) -> list[bool]:
        with self._lock:
            self.calls.append(list(keys))
        if keys[0] in self.entered:
            self.entered[keys[0]].set()
        if keys[0] in self.hold:
            assert self.hold[keys[0]].wait(WAIT_S)
        return [k not in self.missing for k in keys]

    def batch_set(self, keys: Sequence[bytes], host_pool: HostKVPool,
                  host_indices: torch.Tensor) -> list[bool]:
        return [True] * len(keys)

    def delete(self, keys: Sequence[bytes]) -> int:
        return 0

    def clear(self) -> int:
        return 0

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def key(op: str, page: int) -> bytes:
    return f"{op}-{page:06d}".encode()


def op_of(name: str, pages: int, pool: HostKVPool, skip: int = 0,
          reverse: bool = False) -> PrefetchOp:
    op = PrefetchOp(name, [key(name, i) for i in range(skip + pages)], fetch_base=skip,
                    reverse=reverse)
    op.host_indices = pool.alloc(pages * PS)
    assert op.host_indices is not None
    return op


@pytest.fixture
def pool() -> HostKVPool:
    return HostKVPool(4096, PS, 1, 1, 2, torch.float32)


def controller(backend: StorageBackend, pool: HostKVPool, workers: int) -> StorageController:
    return StorageController(backend, pool, fetch_workers=workers)


def test_a_short_prefetch_is_not_queued_behind_a_long_one(pool) -> None:
    """One worker, a long fetch holding its first batch: a short fetch that arrives meanwhile
    is served next, before the long one's remaining batches."""
    backend = ScriptedBackend()
    first = key("long", 0)
    backend.hold[first], backend.entered[first] = threading.Event(), threading.Event()
    io = controller(backend, pool, workers=1)
    try:
        long, short = op_of("long", 6 * FETCH_BATCH_PAGES, pool), op_of("short", 3, pool)
        io.fetch(long)
        assert backend.entered[first].wait(WAIT_S)
        io.fetch(short)
        backend.hold[first].set()
        assert short.finished.wait(WAIT_S) and long.finished.wait(WAIT_S)
        order = [call[0].split(b"-")[0] for call in backend.calls]
        assert order[:2] == [b"long", b"short"]  # one batch of the long one, then the short
        assert order.count(b"long") == 6 and short.completed_pages == 3
        assert long.completed_pages == 6 * FETCH_BATCH_PAGES
    finally:
        io.close()


def test_batches_share_the_workers_round_robin(pool) -> None:
    """Two fetches queued together alternate batch by batch."""
    backend = ScriptedBackend()
    gate = key("gate", 0)
    backend.hold[gate], backend.entered[gate] = threading.Event(), threading.Event()
    io = controller(backend, pool, workers=1)
    try:
        blocker = op_of("gate", 1, pool)
        io.fetch(blocker)  # the worker waits here while both fetches queue up
        assert backend.entered[gate].wait(WAIT_S)
        a, b = op_of("a", 3 * FETCH_BATCH_PAGES, pool), op_of("b", 3 * FETCH_BATCH_PAGES, pool)
        io.fetch(a)
        io.fetch(b)
        backend.hold[gate].set()
        assert a.finished.wait(WAIT_S) and b.finished.wait(WAIT_S)
        order = [call[0].split(b"-")[0] for call in backend.calls[1:]]
        assert order == [b"a", b"b"] * 3
    finally:
        io.close()


def test_pages_count_once_every_batch_before_them_arrived(pool) -> None:
    """Two workers: the second batch ends first, yet completed_pages counts only leading
    pages, and all of them once the first batch ends."""
    backend = ScriptedBackend()
    first = key("op", 0)
    backend.hold[first], backend.entered[first] = threading.Event(), threading.Event()
    io = controller(backend, pool, workers=2)
    try:
        op = op_of("op", 2 * FETCH_BATCH_PAGES, pool)
        io.fetch(op)
        assert backend.entered[first].wait(WAIT_S)
        deadline = threading.Event()
        while len(backend.calls) < 2:  # the second worker took the second batch
            deadline.wait(0.001)
        deadline.wait(0.05)
        assert op.completed_pages == 0 and not op.finished.is_set()
        backend.hold[first].set()
        assert op.finished.wait(WAIT_S)
        assert op.completed_pages == 2 * FETCH_BATCH_PAGES and op.fetch_seconds > 0
    finally:
        io.close()


@pytest.mark.parametrize("workers", [1, 3])
def test_a_missing_page_ends_the_fetch_at_it(pool, workers) -> None:
    backend = ScriptedBackend()
    backend.missing.add(key("op", FETCH_BATCH_PAGES + 5))
    io = controller(backend, pool, workers=workers)
    try:
        op = op_of("op", 4 * FETCH_BATCH_PAGES, pool)
        io.fetch(op)
        assert op.finished.wait(WAIT_S)
        assert op.completed_pages == FETCH_BATCH_PAGES + 5
    finally:
        io.close()


def test_the_fetch_reads_from_its_base(pool) -> None:
    """A fetch whose host pages start at page `fetch_base` of the hit reads hashes from there,
    in order."""
    backend = ScriptedBackend()
    io = controller(backend, pool, workers=2)
    try:
        op = op_of("op", 10, pool, skip=7)
        io.fetch(op)
        assert op.finished.wait(WAIT_S)
        fetched = sorted(k for call in backend.calls for k in call)
        assert fetched == [key("op", i) for i in range(7, 17)] and op.completed_pages == 10
    finally:
        io.close()


def test_a_reverse_fetch_goes_back_to_front_above_its_floor(pool) -> None:
    """Batches are handed out from the last page down, none below the floor; the pages that
    arrived are counted from the back."""
    backend = ScriptedBackend()
    io = controller(backend, pool, workers=1)
    try:
        pages = 3 * FETCH_BATCH_PAGES + 5
        op = op_of("op", pages, pool, reverse=True)
        io.fetch(op, floor=FETCH_BATCH_PAGES)
        assert op.finished.wait(WAIT_S)
        firsts = [call[0] for call in backend.calls]
        assert firsts == [key("op", pages - FETCH_BATCH_PAGES),
                          key("op", pages - 2 * FETCH_BATCH_PAGES),
                          key("op", FETCH_BATCH_PAGES)]
        assert op.completed_pages == pages - FETCH_BATCH_PAGES
    finally:
        io.close()


def test_a_reverse_fetch_in_small_batches_counts_each_as_it_arrives(pool) -> None:
    """A race's fetch in batches of its own size: back to front, none below the floor, the
    trailing pages counted batch by batch (the compute side sees the rate early)."""
    backend = ScriptedBackend()
    pages, floor, batch = 24, 6, 5
    second = key("op", pages - 2 * batch)
    backend.hold[second], backend.entered[second] = threading.Event(), threading.Event()
    io = controller(backend, pool, workers=1)
    try:
        op = op_of("op", pages, pool, reverse=True)
        io.fetch(op, floor=floor, batch_pages=batch)
        assert backend.entered[second].wait(WAIT_S)
        assert io.progress(op).completed == batch  # the last batch is in, the next in flight
        backend.hold[second].set()
        assert op.finished.wait(WAIT_S)
        assert [len(call) for call in backend.calls] == [5, 5, 5, 3]
        assert [call[0] for call in backend.calls] == [
            key("op", 19), key("op", 14), key("op", 9), key("op", floor)]
        assert op.completed_pages == pages - floor
    finally:
        io.close()


def test_a_reverse_fetch_stops_at_its_last_missing_page(pool) -> None:
    """A miss in a back-to-front fetch ends it there: the pages below cannot join the suffix."""
    backend = ScriptedBackend()
    pages = 2 * FETCH_BATCH_PAGES
    backend.missing.add(key("op", pages - 5))
    io = controller(backend, pool, workers=1)
    try:
        op = op_of("op", pages, pool, reverse=True)
        io.fetch(op)
        assert op.finished.wait(WAIT_S)
        assert op.completed_pages == 4 and len(backend.calls) == 1
        assert io.progress(op).completed == 4 and not io.progress(op).can_grow
    finally:
        io.close()


def test_limit_raises_the_floor_of_a_reverse_fetch_in_flight(pool) -> None:
    """The compute side took more pages: no batch below the new floor is handed out."""
    backend = ScriptedBackend()
    pages = 4 * FETCH_BATCH_PAGES
    held = key("op", pages - FETCH_BATCH_PAGES)
    backend.hold[held], backend.entered[held] = threading.Event(), threading.Event()
    io = controller(backend, pool, workers=1)
    try:
        op = op_of("op", pages, pool, reverse=True)
        io.fetch(op)
        assert backend.entered[held].wait(WAIT_S)
        progress = io.progress(op)
        assert (progress.completed, progress.handed_out, progress.can_grow) == (
            0, FETCH_BATCH_PAGES, True)
        io.limit(op, 3 * FETCH_BATCH_PAGES)  # the rest of the hit is the compute side's
        backend.hold[held].set()
        assert op.finished.wait(WAIT_S)
        assert len(backend.calls) == 1 and op.completed_pages == FETCH_BATCH_PAGES
    finally:
        io.close()


def test_cancel_hands_out_no_more_batches(pool) -> None:
    backend = ScriptedBackend()
    first = key("op", 0)
    backend.hold[first], backend.entered[first] = threading.Event(), threading.Event()
    io = controller(backend, pool, workers=1)
    try:
        op = op_of("op", 5 * FETCH_BATCH_PAGES, pool)
        io.fetch(op)
        assert backend.entered[first].wait(WAIT_S)
        assert io.cancel(op) == 0 and not op.finished.is_set()  # a batch is in flight
        backend.hold[first].set()
        assert op.finished.wait(WAIT_S)
        assert len(backend.calls) == 1 and op.completed_pages == FETCH_BATCH_PAGES
    finally:
        io.close()


def test_a_cancelled_or_empty_fetch_finishes_at_once(pool) -> None:
    io = controller(ScriptedBackend(), pool, workers=1)
    try:
        op = op_of("op", 4, pool)
        op.cancelled = True
        io.fetch(op)
        assert op.finished.is_set()
        empty = op_of("empty", 0, pool)
        io.fetch(empty)
        assert empty.finished.is_set()
    finally:
        io.close()


def test_close_stops_every_worker(pool) -> None:
    io = controller(ScriptedBackend(), pool, workers=3)
    fetchers = [t for t in io._threads if t.name.startswith("hicache-fetch-")]
    assert len(fetchers) == 3 and all(t.is_alive() for t in fetchers)
    io.close()
    assert not any(t.is_alive() for t in io._threads)


def test_fetch_workers_must_be_positive(pool) -> None:
    with pytest.raises(ValueError, match="fetch_workers must be >= 1, got 0"):
        StorageController(ScriptedBackend(), pool, fetch_workers=0)
