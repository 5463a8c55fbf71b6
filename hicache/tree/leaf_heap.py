"""A lazy min-heap of eviction candidates: the radix trees' way to evict without walking the
whole tree (one per tier: L1 leaves, L2 leaves)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Any

Node = Any  # a tree node; the heap only hands it to `priority` and `is_candidate`

# Stale entries accumulate in a lazy heap; it is rebuilt once it holds more than HEAP_SLACK
# times the tree's nodes, plus HEAP_SLACK_MIN (amortised O(1) per push).
HEAP_SLACK = 4
HEAP_SLACK_MIN = 64


class LeafHeap:
    """Lazy min-heap of eviction candidates.

    An entry is pushed whenever a node may have become a candidate or its priority changed;
    stale entries (node no longer a candidate, priority changed since) are dropped when they
    surface. `evict` therefore never walks the whole tree.
    """

    def __init__(self, priority: Callable[[Node], tuple], is_candidate:
                 Callable[[Node], bool]) -> None:
        self._priority = priority
        self._is_candidate = is_candidate
        self._heap: list[tuple[tuple, int, Node]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, node: Node) -> None:
        if self._is_candidate(node):
            heapq.heappush(self._heap, (self._priority(node), next(self._seq), node))

    def pop(self) -> Node | None:
        """The lowest-priority candidate, or None when there is none."""
        while self._heap:
            prio, _, node = heapq.heappop(self._heap)
            if self._is_candidate(node) and prio == self._priority(node):
                return node
        return None

    def rebuild_if_stale(self, num_nodes: int, nodes: Callable[[], Iterator[Node]]) -> None:
        """Rebuild from `nodes()` (every node of the tree) once the stale entries pass the
        slack for a tree of `num_nodes`."""
        if len(self._heap) > HEAP_SLACK * num_nodes + HEAP_SLACK_MIN:
            self.rebuild(nodes())

    def rebuild(self, nodes: Iterator[Node]) -> None:
        self._heap = [(self._priority(n), next(self._seq), n) for n in nodes
                      if self._is_candidate(n)]
        heapq.heapify(self._heap)

    def clear(self) -> None:
        self._heap = []
