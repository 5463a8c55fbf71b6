"""L1 for a hybrid model (sliding-window layers beside full ones): one pool of pages shared
by both kinds, and the page map between them.

    pool          pages of `G` layers (G = the model's full layers), K and V: every page
                  is a full page of a request's slots, or one window group's page
    window group  the window layers `g*G .. g*G + G - 1` (`groups` of them, the last one
                  possibly short): window layer j keeps its K/V in the pool's buffer
                  `j % G`, at its group's page for the token's full page
    page_map[p]   the `groups` pages holding full page p's window-layer KV, one per group;
                  PADDING_PAGE (0) in every column: no window-layer KV for p

vLLM's hybrid manager shares its block pool the same way (groups of as many layers as the
full group, every block the same size), so the bytes go where the model needs them: the
full layers of every cached token, the window layers of the tokens some query still reads,
and neither kind has a share of its own (`WINDOW_SHARE` sizes the pool only). A forward's
window layers read the same buffers as the full layers, through their group's map: no
kernel sees the sharing, and a key before the window maps to the padding page, which no
kernel reads (every backend skips or masks keys before the window).

A request's new tokens take a full page and a page of each window group (`alloc`); a
running request marks its window pages spare as they leave every window (`spare_window`):
kept, so that its prompt joins the tree with them (`claim`) and a later prompt that
diverges inside it still hits, as vLLM keeps freed blocks cached, but the first taken back,
oldest first, when the pool is short. The tree gives a node's back when it tombstones it
(`drop_window`); `free` gives both. When the pool is short even so, the caller evicts
(`hicache.stack_slots.SlotCalls.alloc`): the tree's unlocked pages free full and window
pages alike.

Threading: the scheduler thread owns allocation and the map, like `DeviceKVPool`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from hicache.memory.device import (
    INDEX_DTYPE,
    PADDING_PAGE,
    DeviceKVPool,
    PagedSlots,
    pages_of,
    slots_of,
)

if TYPE_CHECKING:
    from typing import Any

# The most tokens one scheduler step allocates (hicache_server.engine.MAX_BATCH_TOKENS): a
# request holds window slots for its window and at most this many new tokens at a time.
STEP_TOKENS = 2048


class WindowedKVPool(PagedSlots):
    """See the module docstring. `layer_windows[l]`: layer l's window W (it reads keys
    `p - W < j <= p`), None for a full layer; both kinds must be present. Sized as
    `num_pages` full pages and `window_pages` pages of every window layer would be, in one
    pool that either kind may fill."""

    has_windows = True

    def __init__(self, num_pages: int, window_pages: int, page_size: int,
                 layer_windows: Sequence[int | None], kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device) -> None:
        full = [i for i, w in enumerate(layer_windows) if w is None]
        windowed = [i for i, w in enumerate(layer_windows) if w is not None]
        if not full or not windowed:
            raise ValueError(f"WindowedKVPool needs full and window layers, got windows "
                             f"{list(layer_windows)}")
        per_page = len(full)
        self.groups = -(-len(windowed) // per_page)
        self.page_size, self.num_layers = page_size, len(layer_windows)
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.max_window = max(w for w in layer_windows if w is not None)
        self.nominal_pages = num_pages  # the full pages the pool was sized for (L2's ratio)
        # the pages of both kinds: the bytes the two pools would take, in pages as wide as
        # the full layers (window group g's layers in the buffers of the full ones)
        pages = num_pages + window_pages * len(windowed) // per_page
        self.shared = DeviceKVPool(pages, page_size, per_page, kv_heads, head_dim, dtype, device)
        self.num_pages = self.shared.num_pages
        self.allocator = _FullSlots(self)
        self.full_layers, self.window_layers = tuple(full), tuple(windowed)
        # the window layers of each group, in model order
        self.group_layers = tuple(tuple(windowed[g * per_page:(g + 1) * per_page])
                                  for g in range(self.groups))
        # each layer's buffer in the pool and its group (None: a full layer)
        self._route = [(full.index(i), None) if i in full
                       else (windowed.index(i) % per_page, windowed.index(i) // per_page)
                       for i in range(self.num_layers)]
        self.k_buffers = [self.shared.k_buffers[b] for b, _ in self._route]
        self.v_buffers = [self.shared.v_buffers[b] for b, _ in self._route]
        # [num_pages + 1, groups] full page -> its window pages (PADDING_PAGE: none)
        self._map = torch.full((self.num_pages + 1, self.groups), PADDING_PAGE,
                               dtype=INDEX_DTYPE)
        self._device_map = self._map.to(self.device)
        self._spare: dict[int, None] = {}  # full pages whose window pages are spare, oldest first
        self._full_held = 0  # full pages handed out (the rest of the used pages are windows')
        self._window_held = 0  # full pages with window pages mapped

    # ---------------------------------------------------------------------- geometry

    @property
    def dtype(self) -> torch.dtype:
        return self.shared.dtype

    @property
    def device(self) -> torch.device:
        return self.shared.device

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers, K and V (what L2 and L3 store of a page)."""
        return self.shared.page_bytes // len(self.full_layers) * self.num_layers

    @property
    def size_bytes(self) -> int:
        return self.shared.size_bytes

    @property
    def full_token_bytes(self) -> int:
        """Bytes of one token's K and V in the full layers."""
        return self.shared.page_bytes // self.page_size

    @property
    def window_token_bytes(self) -> int:
        """Bytes of one token's K and V in the window layers."""
        return self.full_token_bytes // len(self.full_layers) * len(self.window_layers)

    @property
    def window_bytes(self) -> int:
        """Bytes of the pool's pages that hold window-layer KV now (spare ones included)."""
        return self._window_held * self.groups * self.shared.page_bytes

    @property
    def window_capacity_bytes(self) -> int:
        """Bytes the window layers' pages take when the pool holds `window_capacity` tokens
        with their window KV (the rest of the pool is their full pages)."""
        return self.window_capacity() // self.page_size * self.groups * self.shared.page_bytes

    def is_window_layer(self, layer: int) -> bool:
        return self._route[layer][1] is not None

    def kv_group(self, layer: int) -> int:
        """0 for a full layer, 1 + g for a layer of window group g: layers of one group read
        the pool by the same slots."""
        group = self._route[layer][1]
        return 0 if group is None else 1 + group

    # ----------------------------------------------------------------------- slots

    def alloc(self, num_tokens: int, window: bool = True) -> torch.Tensor | None:
        """Full slots for `num_tokens` (whole pages), each page with a page of every window
        group unless `window` is False; None, with nothing taken, when the pool is short
        (spare window pages are taken back first)."""
        if num_tokens < 0 or num_tokens % self.page_size:
            raise ValueError(f"alloc needs a non-negative multiple of page_size="
                             f"{self.page_size} tokens, got {num_tokens}")
        pages = num_tokens // self.page_size
        taken = self._take(pages * (1 + self.groups) if window else pages)
        if taken is None:
            return None
        self._full_held += pages
        if window and pages:
            self._set_map(taken[:pages], taken[pages:].view(pages, self.groups))
            self._window_held += pages
        return slots_of(taken[:pages], self.page_size)

    def give_window(self, indices: torch.Tensor) -> bool:
        """Window pages for full slots that have none (whole pages); False, with nothing
        taken, when the pool is short."""
        pages = pages_of(indices.to(dtype=INDEX_DTYPE), self.page_size)
        taken = self._take(pages.numel() * self.groups)
        if taken is None:
            return False
        self._set_map(pages, taken.view(-1, self.groups))
        self._window_held += pages.numel()
        return True

    def free(self, indices: torch.Tensor) -> None:
        """Give back full pages and the window pages mapped to them (the pool's own
        `free` checks every page: freed twice, or never handed out, raises)."""
        self.drop_window(indices)
        self.shared.free(indices)
        self._full_held -= indices.numel() // self.page_size

    def drop_window(self, indices: torch.Tensor) -> int:
        """Give back the window pages of these full slots (whole pages) that have them; the
        tokens given back."""
        pages = pages_of(indices.to(dtype=INDEX_DTYPE), self.page_size)
        mapped = self._map[pages]
        live = mapped[:, 0] != PADDING_PAGE
        if not bool(live.any()):
            return 0
        self.claim(indices)
        self.shared.free(slots_of(mapped[live].reshape(-1), self.page_size))
        self._set_map(pages[live], torch.full_like(mapped[live], PADDING_PAGE))
        count = int(live.sum())
        self._window_held -= count
        return count * self.page_size

    def move_window(self, source: torch.Tensor, dest: torch.Tensor) -> None:
        """Hand the window pages of full slots `source` to full slots `dest` (whole pages,
        aligned; `dest`'s have none): the same tokens' KV, computed twice."""
        self.claim(source)
        src = pages_of(source.to(dtype=INDEX_DTYPE), self.page_size)
        dst = pages_of(dest.to(dtype=INDEX_DTYPE), self.page_size)
        self._set_map(dst, self._map[src].clone())
        self._set_map(src, torch.full_like(self._map[src], PADDING_PAGE))

    def window_pages_of(self, indices: torch.Tensor) -> torch.Tensor:
        """The first window group's page of each full page of `indices` (PADDING_PAGE:
        none; a page has every group's or none)."""
        return self._map[pages_of(indices.to(dtype=INDEX_DTYPE), self.page_size), 0]

    def group_pages_of(self, indices: torch.Tensor) -> torch.Tensor:
        """`[pages, groups]`: each window group's page of each full page of `indices`."""
        return self._map[pages_of(indices.to(dtype=INDEX_DTYPE), self.page_size)]

    def spare_window(self, indices: torch.Tensor) -> int:
        """No running query reads these full slots' window KV any more (whole pages of a
        request's own): keep it spare (see the module docstring); the tokens marked."""
        pages = pages_of(indices.to(dtype=INDEX_DTYPE), self.page_size)
        live = pages[self._map[pages, 0] != PADDING_PAGE].tolist()
        for page in live:
            self._spare[page] = None
        return len(live) * self.page_size

    def claim(self, indices: torch.Tensor) -> None:
        """These full slots' window pages are no longer spare (the tree holds them now)."""
        if self._spare:
            for page in pages_of(indices.to(dtype=INDEX_DTYPE), self.page_size).tolist():
                self._spare.pop(page, None)

    def _take(self, pages: int) -> torch.Tensor | None:
        """`pages` page ids from the pool, taking spare window pages back, oldest first,
        when it is short; None, with nothing taken, when even that is not enough."""
        short = pages - self.free_pages()
        if short > 0 and len(self._spare) * self.groups < short:
            return None
        if short > 0:
            spare = []
            while len(spare) * self.groups < short:
                spare.append(next(iter(self._spare)))
                del self._spare[spare[-1]]
            self.drop_window(slots_of(torch.tensor(spare, dtype=INDEX_DTYPE), self.page_size))
        slots = self.shared.alloc(pages * self.page_size)
        return None if slots is None else pages_of(slots, self.page_size)

    def free_pages(self) -> int:
        """Pages free now, for either kind."""
        return self.shared.allocator.num_free_pages

    def spare_pages(self) -> int:
        """Full pages whose window pages are spare (each holds a page of every group)."""
        return len(self._spare)

    def pages_short(self, num_tokens: int, window_tokens: int | None = None) -> int:
        """Pages the pool lacks for `num_tokens` full slots and window pages for
        `window_tokens` of them (all of them: None), spare pages counted as free (0: none)."""
        window = num_tokens if window_tokens is None else window_tokens
        need = (num_tokens + window * self.groups) // self.page_size
        return max(0, need - self.free_pages() - len(self._spare) * self.groups)

    def window_available(self) -> int:
        """Window-layer tokens the pool can give now: its free pages as pages of every
        group, and the spare ones (taken back when needed). Full slots take the same pages."""
        return (self.free_pages() // self.groups + len(self._spare)) \
            * self.page_size

    def window_capacity(self) -> int:
        """The most tokens the pool holds with their window-layer KV (full pages too)."""
        return self.num_pages // (1 + self.groups) * self.page_size

    def request_capacity(self) -> int:
        """The most tokens one request can hold alone: every one with its window pages (a
        prompt no longer than a window and a step), or the pool less a page of every group
        for each page a window and a step's tokens take."""
        window = -(-(self.max_window + STEP_TOKENS) // self.page_size) + 1
        return max(self.window_capacity(),
                   (self.num_pages - window * self.groups) * self.page_size)

    def window_used(self) -> int:
        """Window-layer tokens held (spare ones are not)."""
        return (self._window_held - len(self._spare)) * self.page_size

    def full_used(self) -> int:
        """Full-layer tokens held (a request's or the tree's)."""
        return self._full_held * self.page_size

    def _set_map(self, pages: torch.Tensor, window_pages: torch.Tensor) -> None:
        self._map[pages] = window_pages
        if self._device_map is not self._map:
            self._device_map[pages.to(self.device)] = window_pages.to(self.device)

    # ---------------------------------------------------------------------- forward

    def window_slots(self, slots: torch.Tensor, group: int = 0) -> torch.Tensor:
        """Window group `group`'s slots of full `slots` (on the pool's device): the padding
        page's slots where a page has no window KV."""
        ps = self.page_size
        return self._device_map[slots // ps, group] * ps + slots % ps

    def batch_for(self, layer: int, batch: Any) -> Any:
        """`batch` as layer `layer` reads the pool: a window layer's slots mapped to its
        group's slots (once per forward, shared by the group's layers)."""
        group = self._route[layer][1]
        if group is None:
            return batch
        return batch.memo(f"windowed_kv_pool/window_batch/{group}",
                          lambda: self._window_batch(batch, group))

    def _window_batch(self, batch: Any, group: int) -> Any:
        tensors = [batch.out_slots, *batch.seq_slots]
        mapped = self.window_slots(torch.cat(tensors), group).split([t.numel() for t in tensors])
        return replace(batch, out_slots=mapped[0], seq_slots=list(mapped[1:]))

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V buffers of `layer` (a window layer's by its group's slots)."""
        return self.k_buffers[layer], self.v_buffers[layer]

    def set_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write into `layer`'s buffer; `slots` as `batch_for(layer)` gives them."""
        self.shared.set_kv(self._route[layer][0], slots, k, v)


class _FullSlots:
    """A `WindowedKVPool`'s slots as its callers count them (`pool.allocator`): every page
    in `total_size`, the free ones in `available_size`, the full slots handed out in
    `used_size`; the pages window layers hold are neither free nor counted as used."""

    def __init__(self, pool: WindowedKVPool) -> None:
        self._pool = pool
        self.page_size = pool.page_size

    def total_size(self) -> int:
        return self._pool.num_pages * self.page_size

    def available_size(self) -> int:
        return self._pool.free_pages() * self.page_size

    def used_size(self) -> int:
        return self._pool.full_used()
