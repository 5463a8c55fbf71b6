"""Host buffers of the connector's worker side, made once and reused, so that no copy on
the forward's thread faults new memory in:

    Staging     buffers of whole pages that loads (and saves kept in L2 only) pass through,
                lent for one copy and given back
    WriteRing   the pages waiting for the L3 writer: saves gather blocks into its head, the
                writer frees its tail once it wrote them
    WriteBehind pages a save found no ring row for, by their L2 slot: copied from L2 into
                the ring as rows free, unless a later save reuses the slot first

Why made once: on 2 cores, 64 pages of SmolLM2-135M gathered in 30 ms into a new buffer, 8 ms
into a reused one; and on a VM whose host backs memory when first touched, a freed buffer's
memory costs ~2.7 ms per MB to touch again. A queue that held a staging buffer per waiting
save (the connector's first design) allocated a new one for nearly every step while the
writer waited for idle cores: the forward's threads then spent ~5 s more of system time per
no-reuse pass (docs/integrations.md).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import torch

WORD_BYTES = 8  # host copies move 8-byte words (a byte-wise index_copy is ~3x slower)


def words(pages: torch.Tensor) -> torch.Tensor:
    """A uint8 buffer whose last dim is whole 8-byte words, as words (the worker checks at
    registration that a layer's block is a whole number of them)."""
    return pages.view(torch.int64)


def read_slots(host: torch.Tensor, slots: Sequence[int], out: torch.Tensor) -> None:
    """L2 slots `slots` of `host` ([slots, layers, bytes] uint8) into the rows of `out`."""
    index = torch.tensor(list(slots), dtype=torch.long)
    torch.index_select(words(host), 0, index, out=words(out))


def write_slots(host: torch.Tensor, slots: Sequence[int], rows: torch.Tensor) -> None:
    """The rows of `rows` into L2 slots `slots` of `host` (`read_slots` the other way)."""
    index = torch.tensor(list(slots), dtype=torch.long)
    words(host).index_copy_(0, index, words(rows))

T = TypeVar("T")


class Staging:
    """Staging buffers of `pages` pages each ([pages, layers, layer block bytes] uint8),
    handed out and given back; up to `keep` free ones are kept, the rest freed; `ready` of
    them are made (and zeroed, so their memory is faulted in) up front. Thread-safe."""

    def __init__(self, pages: int, layers: int, block_bytes: int, pin: bool,
                 keep: int, ready: int = 0) -> None:
        self.pages, self._shape, self._pin, self._keep = pages, (pages, layers, block_bytes), pin, keep
        self._free: list[torch.Tensor] = [
            torch.zeros(self._shape, dtype=torch.uint8, pin_memory=pin)
            for _ in range(min(ready, keep))]
        self._lock = threading.Lock()

    def take(self) -> torch.Tensor:
        with self._lock:
            if self._free:
                return self._free.pop()
        return torch.empty(self._shape, dtype=torch.uint8, pin_memory=self._pin)

    def give(self, chunk: torch.Tensor) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(chunk)

    @contextmanager
    def lent(self) -> Iterator[torch.Tensor]:
        """A buffer for the length of a `with` block."""
        chunk = self.take()
        try:
            yield chunk
        finally:
            self.give(chunk)

    def runs(self, items: Sequence[T]) -> Iterator[Sequence[T]]:
        """`items` in runs of at most a buffer's pages."""
        for start in range(0, len(items), self.pages):
            yield items[start:start + self.pages]


class WriteRing:
    """`capacity` page rows ([capacity, layers, layer block bytes] uint8, zeroed at start,
    so the memory is the process's before the first request) used as a ring: `reserve`
    hands out free rows at the head, in order, and `release` frees the oldest once the
    writer wrote them (the writer takes them in the order they were reserved). Thread-safe
    for one thread that reserves (the forward's) and one that releases (the writer)."""

    def __init__(self, capacity: int, layers: int, block_bytes: int, pin: bool) -> None:
        if capacity < 1:
            raise ValueError(f"a write ring needs a page at least, got {capacity}")
        self.capacity = capacity
        self.rows = torch.zeros((capacity, layers, block_bytes), dtype=torch.uint8,
                                pin_memory=pin)
        self._head = 0  # the next row reserve hands out
        self._used = 0  # rows reserved and not yet released
        self._lock = threading.Lock()

    def reserve(self, want: int) -> slice | None:
        """Up to `want` free rows, contiguous, at the head (fewer where the ring wraps or is
        nearly full: ask again for the rest); None when no row is free."""
        with self._lock:
            take = min(want, self.capacity - self._used, self.capacity - self._head)
            if take <= 0:
                return None
            start = self._head
            self._head = (start + take) % self.capacity
            self._used += take
            return slice(start, start + take)

    def release(self, rows: slice) -> None:
        """The oldest reserved rows, written (or given up on): free again."""
        with self._lock:
            self._used -= rows.stop - rows.start

    def cancel(self, rows: slice) -> None:
        """Undo the latest `reserve` (its rows were never queued for the writer)."""
        with self._lock:
            if self._head != rows.stop % self.capacity:
                raise ValueError("only the latest reservation can be cancelled")
            self._head = rows.start
            self._used -= rows.stop - rows.start

    @property
    def used(self) -> int:
        with self._lock:
            return self._used


class WriteBehind:
    """Pages for L3 that a save found no free ring row for (the writer is behind), kept in
    L2: by slot, the page's store key and KV group, oldest first. On vLLM's thread only
    (where every L2 slot is written), so a slot is never read here after a save reused it:
    `forget` drops it first."""

    def __init__(self) -> None:
        self.pages: OrderedDict[int, tuple[bytes, int]] = OrderedDict()

    def add(self, slot: int, key: bytes, group: int) -> None:
        self.pages.pop(slot, None)
        self.pages[slot] = (key, group)

    def forget(self, slots: Iterable[int]) -> int:
        """Pages whose slots a save is about to reuse: never written. How many."""
        return sum(self.pages.pop(slot, None) is not None for slot in slots)

    def to_ring(self, ring: WriteRing, host: torch.Tensor,
                queue: Callable[[tuple[list[tuple[bytes, int]], slice]], None],
                most: int | None = None) -> None:
        """The oldest pages (`most` at most) copied from their L2 slots (`host`: [slots,
        layers, bytes] uint8) into the ring's free rows, each reservation's keys and rows
        `queue`d for the writer."""
        left = len(self.pages) if most is None else min(most, len(self.pages))
        while left and (rows := ring.reserve(left)) is not None:
            left -= rows.stop - rows.start
            taken = [self.pages.popitem(last=False) for _ in range(rows.stop - rows.start)]
            read_slots(host, [slot for slot, _ in taken], ring.rows[rows])
            queue(([page for _, page in taken], rows))
