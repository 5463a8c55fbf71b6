"""The one walk down a radix tree: every lookup of a key (match, insert, peek, the storage
tier's `reach_below`, the L3 prefetch's `insert_host_pages`) goes through `descend`.

What every walk keeps true (docs/architecture.md "Contracts" and "Traps"):
- only the key's whole pages count (`aligned_end`); a partial last page is never looked at;
- a child is found in O(1) by its `child_key`: the namespace and the edge's first page;
- an edge is matched in whole pages, and a walk that ends inside an edge stops there: it never
  continues into that edge's children ("Hello_world" must not match through "Hello_L.A.!" +
  "world", SGLang PR #7).

The walk finds; it changes nothing but the one split it may be asked to make. Touching (access
time, hit counts), requeueing and adopting slots stay with the callers, which get the path.

Speed (`benchmarks/bench_radix.py`): the key is a tuple before the walk starts (one copy for
a list, none for a tuple) and is never cut to whole pages (the walk stops at the last whole
page instead); an edge the key spans costs one slice of the key and one C-level tuple
comparison; only a mismatch pays for a binary search, and that one is O(edge) too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from hicache.pages import pages_down
from hicache.tree.node import ChildKey, Key, TreeNode

# split(node, n): cut `node`'s edge after `n` tokens and return the upper node (the tree's
# `_split`, which keeps its node count and the subclass's per-node state right).
Splitter = Callable[[TreeNode, int], TreeNode]


class Walk(NamedTuple):
    path: list[TreeNode]      # nodes whose whole edge lies on the key, top down, start excluded
    matched: int              # tokens of the key spelled below the start (a partial edge too)
    inside: TreeNode | None   # the node whose edge the walk ended inside (only without split)


def as_key(key: Sequence[int]) -> Key:
    """The token ids as a tuple: the caller's own tuple (no copy), else one copy."""
    if isinstance(key, tuple):
        return key
    if isinstance(key, torch.Tensor):
        return tuple(key.tolist())
    return tuple(key)


def aligned_end(key: Key, page_size: int) -> int:
    """How many leading tokens of `key` make whole pages (the only ones a tree stores)."""
    return pages_down(len(key), page_size)


def child_key(key: Key, pos: int, extra_key: str | None, page_size: int) -> ChildKey:
    """The key under which the edge starting at `key[pos]` hangs from its parent: its
    namespace and its first page (one token id when `page_size == 1`)."""
    if page_size == 1:
        return (extra_key, key[pos])
    return (extra_key, key[pos:pos + page_size])


def equal_pages(edge: Key, key: Key, pos: int, n: int, page_size: int) -> int:
    """Tokens of `edge` equal to `key[pos:]`, in whole pages, when its first page is equal
    (the child lookup found it) and its first `n` tokens are not (a whole-page count).

    A binary search over pages, each probe comparing only the pages between the prefix
    known to be equal and the probe, so O(n) token comparisons in all, at C speed.
    """
    lo, hi = 1, n // page_size - 1  # the first lo pages are equal, the first hi + 1 are not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        a, b = lo * page_size, mid * page_size
        if key[pos + a:pos + b] == edge[a:b]:
            lo = mid
        else:
            hi = mid - 1
    return lo * page_size


def descend(start: TreeNode, key: Key, extra_key: str | None, page_size: int,
            split: Splitter | None = None) -> Walk:
    """Follow `key`'s whole pages down from `start` under namespace `extra_key`.

    When the walk ends inside an edge, `split` (if given) cuts that edge there and the upper
    node ends the path; without `split` the path holds whole edges only and `inside` is the
    node the walk ended in. Either way nothing below that edge is looked at.
    """
    end = aligned_end(key, page_size)
    node, pos, path = start, 0, []
    while pos < end:
        child = node.children.get(child_key(key, pos, extra_key, page_size))
        if child is None:
            break
        edge = child.key
        stop = pos + len(edge)
        if stop <= end:  # the key spans the edge: one slice, one C-level comparison
            if key[pos:stop] == edge:
                path.append(child)
                node, pos = child, stop
                continue
            n = equal_pages(edge, key, pos, len(edge), page_size)
        else:  # the key ends inside the edge
            n = end - pos
            if key[pos:end] != edge[:n]:
                n = equal_pages(edge, key, pos, n, page_size)
        # the walk ends inside this edge, `n` tokens in
        if split is None:
            return Walk(path, pos + n, child)
        path.append(split(child, n))
        return Walk(path, pos + n, None)
    return Walk(path, pos, None)
