"""L3 by kind of layer, for a hybrid model (docs/architecture.md#hybrid-attention).

A page is stored as two values: its full-attention layers under its page hash, its window
layers under `window_key(page hash)`, each sealed by a codec of those layers alone
(`PageCodec(layers=...)`: the tag covers the key, the header and the layers' indices, so
neither part passes for the other). Every page stored has its full part; a window part is
written only for the pages of the trailing window before a boundary the tree kept
(`window_pages_of`), and a prefix found in L3 is a hit only up to the longest page-aligned
length whose trailing window L3 holds in window parts: the tree's own hit rule
(`WindowKV.hit_nodes`). A model without windows keeps one value per page, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import xxhash

from hicache.model_kv import ModelKV
from hicache.pages import window_start
from hicache.storage.page_format import PageCodec, PageGeometry
from hicache.storage.page_seal import FleetKeys

# The window part's key: a domain-separated hash of the page's key (a secret chain's keys stay
# secret: the window key is no easier to compute than the page's).
WINDOW_KEY_DOMAIN = b"hicache/window-layers/v1"


def window_key(key: bytes) -> bytes:
    """The key of the window part of the page stored under `key`."""
    return xxhash.xxh3_128_digest(WINDOW_KEY_DOMAIN + bytes(key))


def window_keys(keys: Sequence[bytes]) -> list[bytes]:
    return [window_key(k) for k in keys]


class StoreKinds(NamedTuple):
    """Which layers of a hybrid model's page go in which part, and its widest window."""

    full_layers: tuple[int, ...]
    window_layers: tuple[int, ...]
    window: int      # tokens a window layer's query reads, itself included (the widest)
    page_size: int

    @classmethod
    def of(cls, model: ModelKV, page_size: int) -> StoreKinds | None:
        """The kinds of a hybrid model's pages; None for a model with one kind of layer."""
        if not model.hybrid:
            return None
        windows = model.layer_windows
        return cls(tuple(i for i, w in enumerate(windows) if w is None),
                   tuple(i for i, w in enumerate(windows) if w is not None),
                   max(w for w in windows if w is not None), page_size)

    def codecs(self, geometry: PageGeometry, namespace: bytes,
               keys: FleetKeys | None) -> tuple[PageCodec, PageCodec]:
        """(full part's codec, window part's codec) for host pages of `geometry`."""
        return (PageCodec(geometry, namespace=namespace, keys=keys, layers=self.full_layers),
                PageCodec(geometry, namespace=namespace, keys=keys, layers=self.window_layers))

    def needed_from(self, end: int) -> int:
        """The first token (page-aligned down) a window layer's query at `end` reads."""
        return window_start(end, self.window, self.page_size)

    def window_pages_of(self, start: int, end: int) -> int:
        """Of a stored node's pages [start, end) (tokens), how many trailing ones get a window
        part: those a query at its end reads, or at the page before it (the same prompt
        asked again computes at least its last token, so its hit ends a page short)."""
        first = max(start, self.needed_from(max(start, end - self.page_size)))
        return (end - first) // self.page_size

    def window_first(self, base: int, pages: int) -> int:
        """The first of `pages` pages after token `base` whose window part a hit of all of
        them needs (pages before `base` are the tree's)."""
        return max(0, (self.needed_from(base + pages * self.page_size) - base)
                   // self.page_size)
