"""Pages: every tier stores whole pages of `page_size` tokens, so token counts are rounded
to pages in one place; and what names a page (`PageHashes`, which the tree, the KV events
and L3 share; `hicache.storage.hashing.PageHasher` is the one in use)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


def pages_down(tokens: int, page_size: int) -> int:
    """`tokens` rounded down to whole pages, in tokens (what a tree can hold of them)."""
    return tokens // page_size * page_size


def pages_up(tokens: int, page_size: int) -> int:
    """`tokens` rounded up to whole pages, in tokens (the slots they take)."""
    return -(-tokens // page_size) * page_size


def window_start(end: int, window: int, page_size: int) -> int:
    """The first token (page-aligned down) a window layer reads for a query at `end`, its
    window `window` tokens (the query's own included): the hybrid hit rule's in every tier."""
    return pages_down(max(0, end - window + 1), page_size)


def page_count(tokens: int, page_size: int) -> int:
    """How many pages hold `tokens` (the last one maybe partly)."""
    return -(-tokens // page_size)


class PageHashes(Protocol):
    """What names pages (`hicache.storage.hashing.PageHasher`): the hashes of `tokens`' whole
    pages, chained after `prev` (None: from the root of namespace `extra_key`)."""

    def hash_pages(self, tokens: Sequence[int], prev: bytes | None = None,
                   extra_key: str | None = None) -> list[bytes]: ...
