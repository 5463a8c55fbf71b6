"""The one door into the cache: `CacheStack` runs the tree, the pools, the L1<->L2 controller,
the storage tier, the pins and the sessions as one, answering `hicache.door.CacheDoor` (the
contract: seven calls of a request's life and five parts, `slots`, `retention`, `steps`,
`l3` and `admin`). `hicache.build.build_stack` builds it from the config.

No tree node crosses this door: a `Hit` and a `Lease` hold theirs privately. A tier the
configuration lacks answers with a harmless default (no L3: no prefetch, always ready,
nothing to restart). See docs/architecture.md.

Threading: scheduler thread only, like the tree it owns (`admin.close` once the loop has
stopped).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from hicache.door import CacheDoor
from hicache.events import EventPublisher, EventRecorder, NullEventPublisher
from hicache.handles import Admitted, Hit, Lease, Requester
from hicache.memory.device import DeviceKVPool
from hicache.memory.host import HostKVPool
from hicache.stack_admin import AdminCalls
from hicache.stack_l3 import L3Calls
from hicache.stack_retention import RetentionCalls
from hicache.stack_slots import SlotCalls
from hicache.stack_steps import StepCalls, restate_events
from hicache.stack_storage import StorageLink
from hicache.stats import (
    CacheStats,
    DeviceStats,
    HostStats,
    PinStats,
    RequestCounters,
    SessionStats,
    WindowStats,
)
from hicache.storage.tier import StorageTier
from hicache.transfer.controller import HiCacheController
from hicache.tree.base import PrefixCache, concat
from hicache.tree.node import TreeNode
from hicache.tree.pins import PinRefused, PinTable
from hicache.tree.sessions import SessionTable

__all__ = ["CacheStack", "PinRefused"]


class CacheStack(CacheDoor):
    """The tree, the pools, the L1<->L2 controller, the storage tier, the pins and the
    sessions, run as one. `host_pool` and `controller` are None without L2, `storage` None
    without L3, `sessions` None without `cache.session_retention`; `pins` holds nothing
    unless given a cap (`build_stack` gives cache.max_pinned_tokens). The stack owns them
    all; its parts hold references to what each reads."""

    def __init__(self, device_pool: DeviceKVPool, tree: PrefixCache,
                 host_pool: HostKVPool | None = None,
                 controller: HiCacheController | None = None,
                 storage: StorageTier | None = None, events: EventRecorder | None = None,
                 publisher: EventPublisher | None = None, pins: PinTable | None = None,
                 sessions: SessionTable | None = None) -> None:
        self.device_pool = device_pool
        self.tree = tree
        self.host_pool = host_pool
        self.controller = controller
        # KV events: the tree records into `events` (None: off), `steps.publish_events` sends
        self.events = events
        self.publisher = publisher if publisher is not None else NullEventPublisher()
        self.pins = pins if pins is not None else PinTable(tree, 0)
        self.sessions = sessions
        self.slots = SlotCalls(tree, device_pool)
        self.retention = RetentionCalls(tree, self.pins, sessions)
        self.l3_link = StorageLink(tree, storage)  # the stack's side of L3, read by its parts
        self.l3 = L3Calls(tree, self.l3_link)
        self.steps = StepCalls(tree, self.l3_link, events, self.publisher)
        self.admin = AdminCalls(tree, host_pool, controller, self.l3_link, self.steps, events,
                                self.publisher)

    @property
    def storage(self) -> StorageTier | None:
        """The attached storage tier (None without L3)."""
        return self.l3_link.tier

    @property
    def page_size(self) -> int:
        return self.tree.page_size

    @property
    def enabled(self) -> bool:
        """Whether prefixes are cached at all (False: --disable-radix-cache)."""
        return not self.tree.disable

    # ------------------------------------------------------------------------ a request

    def peek(self, key: Sequence[int], extra_key: str | None = None) -> int:
        """Tokens of `key` cached in any tier, touching nothing (for ranking)."""
        return self.tree.peek_prefix(key, extra_key)

    def match(self, key: Sequence[int], who: Requester) -> Hit:
        """The longest cached prefix of `key` in L1 and L2 (touched, its priority raised to
        `who`'s; its use is counted once, at `release`)."""
        m = self.tree.match_prefix(key, who.extra_key, priority=who.priority, count_hit=False)
        return Hit(m.device_indices, m.host_hit_length, m.last_device_node, m.last_host_node)

    def admit(self, hit: Hit, evict_tokens: int = 0) -> Admitted:
        """Lock `hit`'s L1 path, evict `evict_tokens` (keeping its L2 pages), and queue the
        load-back of its L2 part (skipped when too short to pay, or when L1 has no room)."""
        end = hit._device_end
        self.tree.inc_lock_ref(end)
        try:
            if evict_tokens:
                self._evict_keeping(hit, evict_tokens)
            slots, loaded = hit.device_slots, 0
            # a hybrid model's tombstones in the hit's window: their window KV from L2
            whole = self.tree.windows is None or self.tree.host.reload_windows(hit._host_end)
            if hit.host_tokens and whole:
                lb = self.tree.host.init_load_back(hit._host_end)
                if lb.device_indices.numel():
                    slots = torch.cat([slots, lb.device_indices])
                    loaded = lb.device_indices.numel()
                    self.tree.inc_lock_ref(lb.last_node)
                    self.tree.dec_lock_ref(end)
                    end = lb.last_node
            if self.tree.windows is not None and not loaded:  # L1 alone: its window rule
                valid = self.tree.windows.valid_end(end)
                if valid is not end:
                    self.tree.inc_lock_ref(valid)
                    self.tree.dec_lock_ref(end)
                    end, slots = valid, slots[:valid.end]
        except BaseException:
            self.tree.dec_lock_ref(end)
            raise
        return Admitted(Lease(end), slots, loaded)

    def _evict_keeping(self, hit: Hit, tokens: int) -> None:
        """Evict L1 `tokens` while the hit's L2 pages are kept (an L1 eviction may make
        room in L2 for its write-back)."""
        if not hit.host_tokens:
            self.slots.evict(tokens)
            return
        self.tree.host.protect_host(hit._host_end)
        try:
            self.slots.evict(tokens)  # a hybrid model's: window KV first (`SlotCalls.evict`)
        finally:
            self.tree.host.release_host(hit._host_end)

    def cache_prefix(self, lease: Lease, tokens: Sequence[int], slots: torch.Tensor,
                     who: Requester, shared: int) -> tuple[Lease, torch.Tensor]:
        """Give the tree `tokens` (whole pages: a prefilled prompt) with their `slots`, and
        move the lease to their end. The caller's copies of pages the tree had already
        are freed. Returns the new lease and the tree's slots for `tokens`, which the
        caller reads from now on. Counts no use (`release` does)."""
        self._insert(tokens, slots, who, shared, count_hit=False)
        path = self.tree.peek_path(tokens, who.extra_key)  # no second hit for the policies
        tree_slots = concat([node.value for node in path])
        assert tree_slots.numel() == len(tokens), "an inserted key is whole nodes on L1"
        self.tree.inc_lock_ref(path[-1])
        self._own(path[-1], who)
        self.tree.dec_lock_ref(lease._end)
        return Lease(path[-1]), tree_slots

    def release(self, lease: Lease, tokens: Sequence[int], slots: torch.Tensor,
                who: Requester, shared: int, admitted: int, *, count_use: bool = True) -> None:
        """End the lease: `tokens` (whole pages computed; empty to keep nothing) go to the
        tree where they pass the `admitted` tokens the admission held; the slots neither the
        tree nor its copies keep go back to the pool. Counts the request's one use of its
        path (`count_use`: not when it only steps aside, a retraction)."""
        end = lease._end
        if len(tokens) > admitted:  # pages new since admission, maybe cached at prefill
            self._insert(tokens, slots, who, shared, count_hit=count_use)  # (again): a
            self._own_key(tokens, who)                                    # fresh access
        elif count_use:  # nothing computed to add (or failed): the prefix it held
            self.tree.count_use(end, who.priority)
        self._own(end, who)
        rest = slots[max(len(tokens), shared):]  # never the tree's
        if rest.numel():
            self.device_pool.free(rest)
        self.tree.dec_lock_ref(end)

    def _insert(self, tokens: Sequence[int], slots: torch.Tensor, who: Requester,
                shared: int, count_hit: bool) -> None:
        """Insert `tokens` with their slots; the caller's copies of pages the tree already
        held (beyond the `shared` ones it reads from the tree) are freed."""
        present = self.tree.insert(tokens, slots[:len(tokens)], who.extra_key,
                                   count_hit=count_hit, priority=who.priority)
        if present > shared:  # the tree had these pages: the caller's are duplicates
            self.device_pool.free(slots[shared:present])

    def _owns(self, who: Requester) -> bool:
        """Whether `who` has a live session to own paths. A session closed meanwhile stays
        closed: its late requests own nothing."""
        return self.sessions is not None and who.session_id in self.sessions

    def _own(self, end: TreeNode, who: Requester) -> None:
        """`who`'s live session owns the path ending at `end`."""
        if self._owns(who):
            self.tree.retention.own(end, who.session_id)

    def _own_key(self, tokens: Sequence[int], who: Requester) -> None:
        """`who`'s live session owns the path spelling `tokens` (walked only then: a
        request's end without sessions walks the tree once, in its insert)."""
        if self._owns(who):
            path = self.tree.peek_path(tokens, who.extra_key)
            if path:
                self.tree.retention.own(path[-1], who.session_id)

    # ---------------------------------------------------------------------------- admin

    def flush(self, tiers: Sequence[str]) -> dict[str, int]:
        """Empty the named tiers (names from `TIERS`, no request running); tokens freed per
        tier asked (0 for a tier the configuration lacks)."""
        out = dict.fromkeys(tiers, 0)
        self.steps.quiesce()
        mark = len(self.events.events) if self.events is not None else 0
        if "device" in tiers:
            with self.tree.kv_events.flushing():
                out["device"] = self.tree.evict(self.tree.total_size())
        if "host" in tiers:
            out["host"] = self.tree.host.flush_host()
        if "storage" in tiers:
            out["storage"] = self.l3_link.clear() * self.page_size
        if self.events is not None and self._flushes_all(tiers):
            restate_events(self.events, self.tree, mark)
        return out

    def _flushes_all(self, tiers: Sequence[str]) -> bool:
        """Whether a flush of `tiers` empties L3 or every tier this stack has: its events
        are then one `AllBlocksCleared` (L3's pages cannot be listed one by one)."""
        has = self.admin.tiers()
        return ("storage" in tiers and "storage" in has) or all(t in tiers for t in has)

    def stats(self, requests: RequestCounters) -> CacheStats:
        """One snapshot of every tier, in tokens (storage: its pages and bytes too), the
        pins and the live sessions; the counters are copies, so another thread may read it
        while the scheduler goes on."""
        alloc = self.device_pool.allocator  # a hybrid pool's: full slots used, every page
        device = DeviceStats(alloc.total_size(), alloc.used_size(), self.tree.evictable_size(),
                             self.tree.protected_size(), requests.cached_device_tokens,
                             self.device_pool.size_bytes, self._window_stats())
        host = None
        if self.host_pool is not None:
            sizes = self.tree.host.host_sizes()
            host = HostStats(self.host_pool.total_size(),
                             self.host_pool.total_size() - self.host_pool.available_size(),
                             sizes.evictable, sizes.protected, requests.cached_host_tokens,
                             self.tree.host.host_counters(), self.host_pool.size_bytes)
        storage = self.l3_link.stats(requests.cached_storage_tokens)
        events = replace(self.publisher.counters) if self.events is not None else None
        pins = PinStats(self.pins.pinned_tokens(), self.pins.max_tokens,
                        tuple(p._asdict() for p in self.pins.infos(time.monotonic())))
        sessions = SessionStats(*self.sessions.sizes()) if self.sessions is not None else None
        return CacheStats(replace(requests), device, host, storage, events=events,
                          sessions=sessions, pins=pins)

    def _window_stats(self) -> WindowStats | None:
        windows = self.tree.windows
        if windows is None:
            return None
        pool = self.device_pool
        return WindowStats(pool.window_capacity(), pool.window_used(), windows.live,
                           windows.tombstoned_tokens, pool.window_capacity_bytes)

    def check_integrity(self) -> None:
        """The tree's invariants, counting the host pages in-flight prefetches hold (tests;
        not part of the door)."""
        self.tree.check_integrity(held_host_tokens=self.l3_link.held_host_tokens())
