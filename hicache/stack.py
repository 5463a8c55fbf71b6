"""The one door into the cache: `CacheStack` runs the tree, the pools, the L1<->L2 controller,
the storage tier, the pins and the sessions as one, and hands the server opaque handles for
all it does with them (`hicache.build.build_stack` builds it from the config).

    a request   match -> Hit;  admit(hit) -> Lease (locked, loaded back from L2);
                cache_prefix(lease, ...) at its prefill's end;  release(lease, ...) at its end
    each step   poll() applies the tiers' acks in one fixed order: D->H writes (nodes reach
                L2), their L3 backups, H->D loads, then the storage tier's prefetch and backup
                acks; expire() ends the sessions and pins that timed out
    admin       pin / unpin, close_session, flush, stats, attach / detach L3

No tree node crosses this door: a `Hit` and a `Lease` hold theirs privately. A tier the
configuration lacks answers with a harmless default (no L3: no prefetch, always ready,
nothing to restart). See docs/architecture.md.

Threading: scheduler thread only, like the tree it owns (`close` once the loop has stopped).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from hicache.config import TierSections
from hicache.events import EventPublisher, EventRecorder, NullEventPublisher
from hicache.events.publisher import EventCounters
from hicache.handles import Admitted, Hit, Lease, Requester, Resume
from hicache.memory.device import DeviceKVPool
from hicache.memory.host import HostKVPool
from hicache.model_kv import ModelKV
from hicache.stack_requests import RequestCalls
from hicache.stack_storage import StorageCalls
from hicache.stats import (
    CacheStats,
    DeviceStats,
    HostStats,
    PinStats,
    RequestCounters,
    SessionStats,
)
from hicache.storage.open import open_storage_tier
from hicache.storage.planner import CostEstimates
from hicache.storage.tier import StorageTier
from hicache.transfer.controller import HiCacheController
from hicache.transfer.engines import TransferHandle
from hicache.tree.base import PrefixCache
from hicache.tree.pins import PinRefused, PinTable
from hicache.tree.sessions import SessionTable

__all__ = ["CacheStack", "PinRefused"]

logger = logging.getLogger(__name__)


class CacheStack:
    """The tree, the pools, the L1<->L2 controller, the storage tier, the pins and the
    sessions, run as one. `host_pool` and `controller` are None without L2, `storage` None
    without L3, `sessions` None without `cache.session_retention`; `pins` holds nothing
    unless given a cap (`build_stack` gives cache.max_pinned_tokens). Its parts: `requests`
    (the calls of a request's life) and `l3` (the storage tier, or its harmless answers)."""

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
        # KV events: the tree records into `events` (None: off), `publish_events` sends them
        self.events = events
        self.publisher = publisher if publisher is not None else NullEventPublisher()
        self.pins = pins if pins is not None else PinTable(tree, 0)
        self.sessions = sessions
        self.requests = RequestCalls(tree, device_pool, sessions)
        self.l3 = StorageCalls(tree, storage)

    @property
    def storage(self) -> StorageTier | None:
        """The attached storage tier (None without L3)."""
        return self.l3.tier

    @property
    def page_size(self) -> int:
        return self.tree.page_size

    @property
    def enabled(self) -> bool:
        """Whether prefixes are cached at all (False: --disable-radix-cache)."""
        return not self.tree.disable

    def tiers(self) -> tuple[str, ...]:
        """The tiers this stack has now, L1 first (L3 comes and goes: attach / detach)."""
        return (("device",) + ("host",) * (self.host_pool is not None)
                + ("storage",) * (self.storage is not None))

    def device_capacity(self) -> int:
        """L1 tokens in all (free, the tree's and the requests')."""
        return self.device_pool.allocator.total_size()

    def device_kv(self) -> DeviceKVPool:
        """The L1 buffers a forward pass writes and reads by slot: the model runner's data
        plane. Every slot it touches comes from a lease or `alloc`."""
        return self.device_pool

    def alloc(self, tokens: int) -> torch.Tensor | None:
        """`tokens` free L1 slots (whole pages) for a request's new tokens; None when fewer
        are free (`evict` first)."""
        return self.device_pool.alloc(tokens)

    def free_slots(self) -> int:
        """L1 tokens free now (not the tree's, not a request's)."""
        return self.device_pool.available_size()

    # ------------------------------------------------------- a request (`stack_requests`)

    def peek(self, key: Sequence[int], extra_key: str | None = None) -> int:
        """Tokens of `key` cached in any tier, touching nothing (for ranking)."""
        return self.requests.peek(key, extra_key)

    def match(self, key: Sequence[int], who: Requester) -> Hit:
        return self.requests.match(key, who)

    def room_beyond(self, hit: Hit) -> int:
        return self.requests.room_beyond(hit)

    def admit(self, hit: Hit, evict_tokens: int = 0) -> Admitted:
        return self.requests.admit(hit, evict_tokens)

    def cache_prefix(self, lease: Lease, tokens: Sequence[int], slots: torch.Tensor,
                     who: Requester, shared: int) -> tuple[Lease, torch.Tensor]:
        return self.requests.cache_prefix(lease, tokens, slots, who, shared)

    def release(self, lease: Lease, tokens: Sequence[int], slots: torch.Tensor,
                who: Requester, shared: int, admitted: int, *, count_use: bool = True) -> None:
        self.requests.release(lease, tokens, slots, who, shared, admitted,
                              count_use=count_use)

    def evict(self, tokens: int) -> int:
        """Free at least `tokens` L1 tokens of unlocked pages if possible; the tokens freed."""
        return self.tree.evict(tokens)

    def evictable_size(self) -> int:
        return self.tree.evictable_size()

    def set_observer(self, observe: Callable[[str, float], None]) -> None:
        """Latency hook for metrics: the tree's load-backs, the storage tier's prefetches."""
        self.tree.observer = self.l3.observer = observe
        if self.storage is not None:
            self.storage.observer = observe

    # ------------------------------------------------------------------------- each step

    def poll(self, settle_s: float = 0.0) -> None:
        """Apply the acks in their fixed order: writes -> backups -> loads -> prefetches;
        `settle_s` > 0 first gives fresh L3 queries up to that long to answer (requests just
        arrived: see `StorageTier.settle`)."""
        if settle_s > 0:
            self.l3.settle(settle_s)
        self.l3.backup(self.tree.host.writing_check())
        self.tree.host.loading_check()
        self.l3.check()

    def publish_events(self) -> None:
        """End of a scheduler step: send the step's KV events as one batch (if any). Never
        blocks: the publisher queues it for its own thread."""
        if self.events is not None:
            batch = self.events.take()
            if batch:
                self.publisher.publish(batch)

    def _event_counters(self) -> EventCounters:
        """Batches and events sent and dropped since start (a copy)."""
        return replace(self.publisher.counters)

    def busy(self) -> bool:
        """Whether copies, prefetches or backups are in flight (the loop polls sooner)."""
        return self.tree.host.copies_pending() or self.l3.busy()

    def wait_copies(self) -> bool:
        """Block until every copy queued so far has finished and apply the acks (`poll`);
        False, at once, when none was queued or in flight."""
        if not self.tree.host.copies_pending():
            return False
        self.tree.host.wait_copies()
        self.poll()
        return True

    def launch_loads(self) -> TransferHandle | None:
        """Launch the H->D loads admission queued, as one transfer: the model runner before a
        forward pass (its layers wait on the handle), the loop when none will run (loads
        never wait for one). None when none are queued."""
        return self.tree.host.start_loading()

    def expire(self, now: float) -> None:
        """End the sessions idle for their timeout and the pins past their TTL (once per
        step: O(1) unless the oldest session is due, O(pins) and there are few)."""
        if self.sessions is not None:
            self.sessions.expire(now)
        if self.pins:
            self.pins.expire(now)

    # ------------------------------------------------------------------ sessions, pins

    def touch_session(self, session_id: str, now: float) -> None:
        """A request of `session_id` arrived (opens it); nothing without session retention."""
        if self.sessions is not None:
            self.sessions.touch(session_id, now)

    def close_session(self, session_id: str) -> bool:
        """Close a session, disowning its nodes; False when it was not open (or sessions are
        off)."""
        return self.sessions is not None and self.sessions.close(session_id)

    @property
    def max_pinned_tokens(self) -> int:
        return self.pins.max_tokens

    def pin(self, ids: Sequence[int], extra_key: str | None, ttl_s: float, now: float
            ) -> int | None:
        """Pin the cached path spelling `ids` (whole pages) until `now + ttl_s`, renewing
        its pin; the tokens pinned in all then, None when it is not cached (all of it, on
        L1). PinRefused past the cap."""
        end = self.tree.node_at(self.tree.root, ids, extra_key)
        if end is None:
            return None
        key = (tuple(ids), extra_key)
        self.pins.check(key, end)
        self.pins.pin(key, end, ttl_s, now)
        self.tree.host.back_up_path(end)  # a pinned page must reach L2 to leave L1 (best effort)
        return self.pins.pinned_tokens()

    def unpin(self, ids: Sequence[int], extra_key: str | None) -> bool:
        """Release the pin of `ids`; False when none."""
        return self.pins.unpin((tuple(ids), extra_key))

    def unpin_all(self) -> int:
        """Release every pin; how many there were."""
        return self.pins.clear()

    # ------------------------------------------------------------ L3 (`stack_storage`)

    def prefetch(self, req_id: str, key: Sequence[int], extra_key: str | None,
                 resume: Resume | None = None) -> bool:
        return self.l3.prefetch(req_id, key, extra_key, resume)

    def prefetch_ready(self, req_id: str) -> bool:
        return self.l3.ready(req_id)

    def head_stop(self, req_id: str) -> int:
        return self.l3.head_stop(req_id)

    def continue_head(self, req_id: str, computed: int) -> int:
        return self.l3.continue_head(req_id, computed)

    def head_computed(self, req_id: str, lease: Lease) -> None:
        self.l3.head_computed(req_id, lease)

    def end_prefetch(self, req_id: str) -> int:
        return self.l3.end(req_id)

    def take_restarts(self) -> list[tuple[str, Resume]]:
        return self.l3.take_restarts()

    def observe_forward(self, rows: list[tuple[int, int]], seconds: float) -> None:
        """A forward pass of `rows` (prefix tokens, tokens computed) took `seconds`: what the
        storage tier's cost model learns this engine's prefill rate from."""
        self.l3.observe_forward(rows, seconds)

    def cost_estimates(self) -> CostEstimates | None:
        """What the storage tier's cost model estimates now; None without L3."""
        return self.l3.estimates()

    # --------------------------------------------------------------------------- admin

    def quiesce(self) -> None:
        """Wait for every copy and backup in flight and apply their acks (flush, shutdown).
        Copies first: their acks queue backups, which protect host pages."""
        self.tree.host.wait_copies()
        self.l3.backup(self.tree.host.writing_check())
        self.tree.host.loading_check()
        self.l3.wait_idle()

    def flush(self, tiers: Sequence[str]) -> dict[str, int]:
        """Empty the named tiers (names from `TIERS`, no request running); tokens freed per
        tier asked (0 for a tier the configuration lacks)."""
        out = dict.fromkeys(tiers, 0)
        self.quiesce()
        mark = len(self.events.events) if self.events is not None else 0
        if "device" in tiers:
            with self.tree.kv_events.flushing():
                out["device"] = self.tree.evict(self.tree.total_size())
        if "host" in tiers:
            out["host"] = self.tree.host.flush_host()
        if "storage" in tiers:
            out["storage"] = self.l3.clear() * self.page_size
        if self.events is not None and self._flushes_all(tiers):
            self._restate(mark)
        return out

    def _flushes_all(self, tiers: Sequence[str]) -> bool:
        """Whether a flush of `tiers` empties L3 or every tier this stack has: its events
        are then one `AllBlocksCleared` (L3's pages cannot be listed one by one)."""
        has = self.tiers()
        return ("storage" in tiers and "storage" in has) or all(t in tiers for t in has)

    def _restate(self, mark: int = -1) -> None:
        """`AllBlocksCleared` (in place of the events recorded since `mark`, when given),
        then what the tree still holds (pinned pages a flush kept, L1 and L2 after L3 went)."""
        if mark >= 0:
            del self.events.events[mark:]
        self.events.cleared()
        self.tree.kv_events.record_all(self.tree.iter_nodes())

    def stats(self, requests: RequestCounters) -> CacheStats:
        """One snapshot of every tier, in tokens (storage: its pages and bytes too), the
        pins and the live sessions; the counters are copies, so another thread may read it
        while the scheduler goes on."""
        alloc = self.device_pool.allocator
        device = DeviceStats(alloc.total_size(), alloc.used_size(), self.tree.evictable_size(),
                             self.tree.protected_size(), requests.cached_device_tokens,
                             self.device_pool.size_bytes)
        host = storage = None
        if self.host_pool is not None:
            sizes = self.tree.host.host_sizes()
            host = HostStats(self.host_pool.total_size(),
                             self.host_pool.total_size() - self.host_pool.available_size(),
                             sizes.evictable, sizes.protected, requests.cached_host_tokens,
                             self.tree.host.host_counters(), self.host_pool.size_bytes)
        storage = self.l3.stats(requests.cached_storage_tokens)
        events = self._event_counters() if self.events is not None else None
        pins = PinStats(self.pins.pinned_tokens(), self.pins.max_tokens,
                        tuple(p._asdict() for p in self.pins.infos(time.monotonic())))
        sessions = SessionStats(*self.sessions.sizes()) if self.sessions is not None else None
        return CacheStats(replace(requests), device, host, storage, events=events,
                          sessions=sessions, pins=pins)

    def check_integrity(self) -> None:
        """The tree's invariants, counting the host pages in-flight prefetches hold."""
        self.tree.check_integrity(held_host_tokens=self.l3.held_host_tokens())

    # ------------------------------------------------------------- L3 attach / detach
    # Both run on the scheduler thread with no request running or waiting (the engine
    # checks): no prefetch is then in flight, and no node is locked by a request.

    def attach_storage(self, config: TierSections, model: ModelKV) -> None:
        """Open L3 from `config.storage` under the running tree and back up to it what L2
        holds (in the background, parents first), as every page that reaches L2 from now
        on. Raises, the stack unchanged: ValueError without L2, with L3 attached already
        or for a section the backend refuses; an OSError (StorageUnavailable among them)
        when the store cannot be opened, or opens and fails its first call (a Redis that
        is down)."""
        if self.controller is None or self.host_pool is None:
            raise ValueError("L3 needs the host tier (L2): cache.hierarchical is off")
        if self.storage is not None:
            raise ValueError("L3 is attached already; detach it first")
        tier = open_storage_tier(config, model, self.tree, self.host_pool, must_answer=True)
        self.quiesce()  # a node's host pages hold its KV only once its D->H copy is acked
        self.l3.attach(tier)

    def detach_storage(self) -> bool:
        """Let in-flight copies and their backups land, close L3 (its prefetches and backups
        finish first), forget which nodes it held. False when none was attached."""
        if self.storage is None:
            return False
        self.quiesce()
        self.l3.detach()
        if self.events is not None:  # routers forget this server's L3 pages
            self._restate()
        return True

    def set_prefetch_policy(self, policy: str) -> None:
        """The attached L3's prefetch policy from now on (SGLang's re-attach of the same
        backend updates it); admissions read it at each check."""
        self.l3.set_policy(policy)

    def close(self) -> None:
        """Let every prefetch and backup finish, stop the I/O and copy threads; send the
        last KV events and stop the publisher (its thread joined, its sockets closed)."""
        try:
            self.l3.close()
            if self.controller is not None:
                self.controller.close()
            self.publish_events()
        finally:
            self.publisher.shutdown()
