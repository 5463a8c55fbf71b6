"""Page rounding: every tier stores whole pages of `page_size` tokens, so token counts are
rounded to pages in one place."""

from __future__ import annotations


def pages_down(tokens: int, page_size: int) -> int:
    """`tokens` rounded down to whole pages, in tokens (what a tree can hold of them)."""
    return tokens // page_size * page_size


def pages_up(tokens: int, page_size: int) -> int:
    """`tokens` rounded up to whole pages, in tokens (the slots they take)."""
    return -(-tokens // page_size) * page_size


def page_count(tokens: int, page_size: int) -> int:
    """How many pages hold `tokens` (the last one maybe partly)."""
    return -(-tokens // page_size)
