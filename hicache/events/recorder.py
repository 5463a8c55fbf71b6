"""The events of one scheduler step, as the tree and the tiers report them.

The tree calls `stored` / `removed` / `cleared` as it moves pages (scheduler thread only);
the tier owner takes the step's events with `take()` at the end of the step and hands them
to the publisher as one batch. A tree without a recorder (`events=None`) pays nothing: no
page hash is computed for events.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from hicache.events.schema import (
    GROUP_FULL,
    GROUP_WINDOW,
    KIND_FULL,
    KIND_WINDOW,
    REASON_FLUSHED,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from hicache.pages import PageHashes


class EventRecorder:
    """Collects events until `take()`. `hasher` names the pages (the L3 page hash chain),
    `page_size` is tokens per page. Starts with `AllBlocksCleared`: a subscriber drops what
    it knew of a server that restarted."""

    def __init__(self, hasher: PageHashes, page_size: int, window: int | None = None) -> None:
        self.hasher = hasher
        self.page_size = page_size
        self.window = window  # a hybrid model's window: events name their KV group
        self.events: list[KVEvent] = [AllBlocksCleared()]
        self._reason: str | None = None  # overrides removals' reason (`flushing`)

    def stored(self, hashes: list[bytes], parent: bytes | None, tokens: Sequence[int],
               medium: str, group: int = GROUP_FULL) -> None:
        """`hashes` landed on `medium`; `group`: of a hybrid model's layers, which kind."""
        if not hashes:
            return
        event = BlockStored(list(hashes), parent, list(tokens), self.page_size, None, medium,
                            None)
        if self.window is not None:
            event.group_idx = group
            event.kv_cache_spec_kind = KIND_WINDOW if group == GROUP_WINDOW else KIND_FULL
            event.kv_cache_spec_sliding_window = self.window if group == GROUP_WINDOW else None
        self.events.append(event)

    def removed(self, hashes: list[bytes], medium: str, reason: str,
                group: int = GROUP_FULL) -> None:
        if hashes:
            self.events.append(BlockRemoved(
                list(hashes), medium, group_idx=None if self.window is None else group,
                reason=self._reason or reason))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    @contextmanager
    def flushing(self) -> Iterator[None]:
        """Removals recorded inside are an operator's flush (reason "flushed")."""
        outer, self._reason = self._reason, REASON_FLUSHED
        try:
            yield
        finally:
            self._reason = outer

    def take(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first."""
        events, self.events = self.events, []
        return events
