"""The storage tier's small state types: its counters, the page hashes L3 is known to hold
(`KnownStored`), and the clock a restarted prefetch keeps (`Resume`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass
class StorageCounters:
    """The storage tier's counts since start (scheduler thread; plain ints, one owner)."""

    prefetched_tokens: int = 0
    backed_up_tokens: int = 0
    backup_failures: int = 0     # backups that failed (per node written)
    prefetch_restarts: int = 0
    split_prefetches: int = 0    # hits split into a computed head and a fetched tail
    head_tokens: int = 0         # tokens of those heads (recomputed, not fetched)
    recomputed_hits: int = 0     # hits the cost model chose to recompute rather than fetch
    recomputed_hit_tokens: int = 0
    # a hybrid model's window layers (`kinds.py`): tokens whose window part was written, and
    # tokens fetched with theirs; `backed_up_tokens` / `prefetched_tokens` count full parts
    window_backed_up_tokens: int = 0
    window_prefetched_tokens: int = 0


# Page hashes remembered as held by L3 while the requests that recompute them run (a hit the
# cost model chose to recompute, the head of a split one): their backup is skipped rather
# than written again over what may be a slow link. Bounded, oldest forgotten first; a page
# L3 evicts meanwhile is then missing from it, never wrong (the hash fixes the contents).
KNOWN_STORED_PAGES = 65536


class KnownStored:
    """An insertion-ordered, bounded set of page hashes L3 answered that it holds."""

    def __init__(self, capacity: int = KNOWN_STORED_PAGES) -> None:
        self.capacity = capacity
        self._hashes: dict[bytes, None] = {}

    def add(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self._hashes.pop(h, None)
            self._hashes[h] = None
        while len(self._hashes) > self.capacity:
            del self._hashes[next(iter(self._hashes))]

    def clear(self) -> None:
        """L3 was emptied: nothing is known stored any more."""
        self._hashes.clear()

    def pop_known(self, hashes: list[bytes]) -> list[bool]:
        """Per hash, whether it is known stored; the known ones are forgotten."""
        known = [h in self._hashes for h in hashes]
        for h, k in zip(hashes, known):
            if k:
                del self._hashes[h]
        return known


class Resume(NamedTuple):
    """A restarted prefetch keeps its first attempt's clock and timeout budget."""

    started_at: float
    timeout_tokens: int
