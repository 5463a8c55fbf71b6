"""vLLM's KV cache groups as `HiCacheConnector` stores them, and the hit rule of a hybrid
model (docs/architecture.md, "L3 by kind"). Imports no vLLM: plain values in, plain values out.

With vLLM's hybrid KV cache manager a model has several groups of layers, each with its own
block ids per request: full-attention groups, and sliding-window groups whose blocks before
a request's window are vLLM's null block. Every group has as many layers (vLLM pads them to
one page size), so the connector's unit is one group's block of a page, one L2 slot, one
stored value: group 0 under the page's key, group g under `store_key(..., g)`, each sealed
by a codec of that group's layers (`PageCodec(layers=...)`), so no unit passes for another.
A model of one group keeps one value per page under its key, as before.

The rule (hicache's own, by kind): a prefix of P blocks hits only when every full group's
unit is held for its blocks [first, P) and every window group's for [needed_from(P), P),
the blocks a query at P reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, TypeVar

from hicache.pages import window_start

T = TypeVar("T")

NULL_BLOCK_ID = 0  # vLLM's null block (its block pool's first): a window group's skipped block


class KVGroup(NamedTuple):
    """One of vLLM's KV cache groups."""

    names: tuple[str, ...]  # its layers' names, in vLLM's order
    layers: tuple[int, ...]  # their indices among the model's layers, ascending
    window: int | None  # tokens a query reads (itself included); None: full attention


class KVGroups(NamedTuple):
    """The groups of a model's KV cache; one group: the model has one kind of layer."""

    groups: tuple[KVGroup, ...]
    block_size: int

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def full(self) -> tuple[int, ...]:
        return tuple(g for g, x in enumerate(self.groups) if x.window is None)

    @property
    def windowed(self) -> tuple[int, ...]:
        return tuple(g for g, x in enumerate(self.groups) if x.window is not None)

    @property
    def unit_layers(self) -> int:
        """Layers of one unit (one group's block): the widest group's."""
        return max(len(x.names) for x in self.groups)

    def needed_from(self, end: int) -> int:
        """The first block a window layer's query at block boundary `end` reads."""
        windows = [x.window for x in self.groups if x.window is not None]
        if not windows:
            return end
        return window_start(end * self.block_size, max(windows), self.block_size) \
            // self.block_size

    def hit_end(self, first: int, full: Sequence[bool], window: Sequence[bool]) -> int:
        """The longest hit's end (a block boundary; `first`: none) from block `first`, where
        `full[i]` / `window[i]` say whether block `first + i`'s full / window units are held."""
        end = first
        while end - first < len(full) and full[end - first]:
            end += 1
        while end > first and not all(window[i - first]
                                      for i in range(max(first, self.needed_from(end)), end)):
            end -= 1
        return end

    def layout(self) -> list[list[object]]:
        """What names the groups in the key namespace: per group its layers and window."""
        return [[list(x.layers), x.window] for x in self.groups]


def by_group(items: Iterable[T], group_of: Callable[[T], int] = lambda x: x.group  # type: ignore[attr-defined]
             ) -> list[tuple[int, list[T]]]:
    """`items` by the group each is of (a load's, a save's), in group order, each group's in
    the order given."""
    groups: dict[int, list[Any]] = {}
    for item in items:
        groups.setdefault(group_of(item), []).append(item)
    return sorted(groups.items())
