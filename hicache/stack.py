"""The tier owner: builds L1 / L2 / L3 from the config and the model's KV shape, then runs them
as one `CacheStack` for the scheduler.

    L1  cache.max_total_tokens, else a share of free GPU memory (or of host RAM on CPU)
    L2  host.size_gb, else host.ratio x L1   (checked against MemAvailable)
    L3  storage.backend through the registry, keyed by the model's page hashes

Each scheduler step starts with `poll()`, which applies the tiers' acknowledgements in one
fixed order: D->H writes (nodes reach L2), their L3 backups, H->D loads, then the storage
tier's prefetch and backup acks. The scheduler calls the stack and the `PrefixCache`
interface only; a tier the configuration lacks answers with a harmless default (no L3: no
prefetch, always ready, nothing to restart).

Threading: scheduler thread only, like the tree it owns (`close` once the loop has stopped).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
import zmq

from hicache.config import BYTES_PER_GB, Config, EventsConfig
from hicache.events import EventPublisher, EventRecorder, NullEventPublisher, ZmqEventPublisher
from hicache.events.publisher import EventCounters
from hicache.memory.device import DeviceKVPool
from hicache.memory.host import HostKVPool, available_memory_bytes
from hicache.policies import PREFETCH_POLICIES, check_choice
from hicache.stats import CacheStats, DeviceStats, HostStats, RequestCounters, StorageStats
from hicache.storage.backends import create_backend
from hicache.storage.backends.base import (
    STAT_ERRORS,
    STAT_ERRORS_BY_OP,
    StorageBackend,
    StorageUnavailable,
)
from hicache.storage.backends.throttled import ThrottledBackend
from hicache.storage.hashing import PageHasher, model_fingerprint
from hicache.storage.io import StorageController
from hicache.storage.page_format import HEADER_BYTES, PageCodec, PageGeometry
from hicache.storage.tier import Resume, StorageTier
from hicache.transfer.controller import HiCacheController
from hicache.transfer.engines import make_transfer_engine
from hicache.tree.base import PrefixCache
from hicache.tree.hiradix import HiRadixCache
from hicache.tree.radix import RadixCache

logger = logging.getLogger(__name__)

# Share of the GPU memory left free after loading the weights that L1 takes (the rest is
# activations and the CUDA context; SGLang's mem_fraction_static plays the same role).
GPU_KV_FRACTION = 0.85
# On the CPU, L1 defaults to this share of available RAM, capped at CPU_MAX_L1_TOKENS: a CPU
# serves small models, and a huge L1 only hides the hierarchy.
CPU_KV_FRACTION = 0.1
CPU_MAX_L1_TOKENS = 65536
# When both L1 and L2 are sized automatically (cache.max_total_tokens and host.size_gb unset),
# L2 = host.ratio x L1 may take at most this share of the available host memory: L1 is made
# smaller rather than asking for more pinned memory than the machine has (a GPU can hold more
# KV than the host can pin twice over).
HOST_AUTO_FRACTION = 0.5
MB = 10**6  # storage.throttle.bandwidth_mb_s is in decimal megabytes
MS_PER_S = 1000.0




class ModelKV(NamedTuple):
    """What the tiers need to know of the model: its KV geometry and where its weights are
    (the page hashes' model fingerprint)."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    path: Path

    @property
    def geometry(self) -> tuple[int, int, int]:
        return (self.num_layers, self.kv_heads, self.head_dim)


@dataclass(eq=False)
class CacheStack:
    """The tree, the pools, the L1<->L2 controller and the storage tier, run as one.
    `host_pool` and `controller` are None without L2, `storage` None without L3."""

    device_pool: DeviceKVPool
    tree: PrefixCache
    host_pool: HostKVPool | None = None
    controller: HiCacheController | None = None
    storage: StorageTier | None = None
    # KV events: the tree records into `events` (None: off), `publish_events` sends them
    events: EventRecorder | None = None
    publisher: EventPublisher = field(default_factory=NullEventPublisher)

    @property
    def page_size(self) -> int:
        return self.tree.page_size

    def storage_page_bytes(self) -> int | None:
        """Bytes of one stored L3 page (header + payload), None without L2 (where no L3 can
        be attached). Known whether or not L3 is attached now: the metrics take it once at
        start, and L3 may be attached later (`attach_storage`); without L3 the stats have
        no storage tier to apply it to."""
        if self.host_pool is None:
            return None
        return HEADER_BYTES + self.host_pool.page_bytes

    def set_observer(self, observe: Callable[[str, float], None]) -> None:
        """Latency hook for metrics: the tree's load-backs, the storage tier's prefetches."""
        self.tree.observer = observe
        if self.storage is not None:
            self.storage.observer = observe

    # ------------------------------------------------------------------------- each step

    def poll(self) -> None:
        """Apply the acks in their fixed order: writes -> backups -> loads -> prefetches."""
        self._backup(self.tree.writing_check())
        self.tree.loading_check()
        if self.storage is not None:
            self.storage.check()

    def _backup(self, written: Sequence) -> None:
        if self.storage is not None:
            for node in written:
                self.storage.backup(node)

    def publish_events(self) -> None:
        """End of a scheduler step: send the step's KV events as one batch (if any). Never
        blocks: the publisher queues it for its own thread."""
        if self.events is not None:
            batch = self.events.take()
            if batch:
                self.publisher.publish(batch)

    def event_counters(self) -> EventCounters:
        """Batches and events sent and dropped since start (a copy)."""
        return replace(self.publisher.counters)

    def busy(self) -> bool:
        """Whether copies, prefetches or backups are in flight (the loop polls sooner)."""
        return self.tree.copies_pending() or (self.storage is not None and self.storage.busy())

    def start_loading(self) -> None:
        """Launch queued H->D loads when no forward pass will (they never wait for one)."""
        if self.tree.copies_pending():
            self.tree.start_loading()

    # ---------------------------------------------------------------------- L3 prefetch

    def prefetch(self, req_id: str, key: Sequence[int], extra_key: str | None,
                 resume: Resume | None = None) -> bool:
        """Match `key` and start fetching from L3 what it has beyond its L1+L2 hit; False
        when there is no L3 (then nothing is matched: the match would count a use) or
        nothing worth fetching."""
        if self.storage is None:
            return False
        m = self.tree.match_prefix(key, extra_key, count_hit=False)  # counted at its end
        hit = m.device_indices.numel() + m.host_hit_length
        return self.storage.prefetch(req_id, m.last_host_node, key[hit:], extra_key, resume,
                                     prefix_tokens=hit)

    def head_stop(self, req_id: str) -> int:
        """Where the request's first admission stops computing (tokens from its start) so
        that the tail of its L3 hit, fetched meanwhile, joins it after; 0: no such stop."""
        return 0 if self.storage is None else self.storage.head_stop(req_id)

    def head_computed(self, req_id: str, node: Any) -> None:
        """The request computed its head, whose last page ends `node` (in the tree)."""
        if self.storage is not None:
            self.storage.head_computed(req_id, node)

    def observe_forward(self, rows: list[tuple[int, int]], seconds: float) -> None:
        """A forward pass of `rows` (prefix tokens, tokens computed) took `seconds`: what the
        storage tier's cost model learns this engine's prefill rate from."""
        if self.storage is not None:
            self.storage.observe_forward(rows, seconds)

    def settle(self, timeout_s: float) -> None:
        """Give fresh L3 queries up to `timeout_s` to answer (see `StorageTier.settle`)."""
        if self.storage is not None:
            self.storage.settle(timeout_s)

    def prefetch_ready(self, req_id: str) -> bool:
        """Whether the prefetch policy lets the request be admitted now."""
        return self.storage is None or self.storage.ready(req_id)

    def end_prefetch(self, req_id: str) -> int:
        """End the request's prefetch (idempotent); the tokens it brought into L2."""
        return 0 if self.storage is None else self.storage.terminate(req_id)

    def take_restarts(self) -> list[tuple[str, Resume]]:
        """Prefetches to start again after a fresh match, with the clock each keeps."""
        if self.storage is None:
            return []
        out = []
        for rid in self.storage.take_restarts():
            resume = self.storage.restart(rid)
            if resume is not None:
                out.append((rid, resume))
        return out

    # --------------------------------------------------------------------------- admin

    def quiesce(self) -> None:
        """Wait for every copy and backup in flight and apply their acks (flush, shutdown).
        Copies first: their acks queue backups, which protect host pages."""
        self.tree.wait_copies()
        self._backup(self.tree.writing_check())
        self.tree.loading_check()
        if self.storage is not None:
            self.storage.wait_idle()

    def flush(self, tiers: Sequence[str]) -> dict[str, int]:
        """Empty the named tiers (names from `TIERS`, no request running); tokens freed per
        tier asked (0 for a tier the configuration lacks)."""
        out = dict.fromkeys(tiers, 0)
        self.quiesce()
        mark = len(self.events.events) if self.events is not None else 0
        if "device" in tiers:
            with self.tree.flushing():
                out["device"] = self.tree.evict(self.tree.total_size())
        if "host" in tiers:
            out["host"] = self.tree.flush_host()
        if "storage" in tiers and self.storage is not None:
            out["storage"] = self.storage.clear() * self.page_size
        if self.events is not None and self._flushes_all(tiers):
            self._restate(mark)
        return out

    def _flushes_all(self, tiers: Sequence[str]) -> bool:
        """Whether a flush of `tiers` empties L3 or every tier this stack has: its events
        are then one `AllBlocksCleared` (L3's pages cannot be listed one by one)."""
        has = (["device"] + ["host"] * (self.host_pool is not None)
               + ["storage"] * (self.storage is not None))
        return ("storage" in tiers and self.storage is not None) or all(t in tiers for t in has)

    def _restate(self, mark: int = -1) -> None:
        """`AllBlocksCleared` (in place of the events recorded since `mark`, when given),
        then what the tree still holds (pinned pages a flush kept, L1 and L2 after L3 went)."""
        if mark >= 0:
            del self.events.events[mark:]
        self.events.cleared()
        self.tree.record_all()

    def stats(self, requests: RequestCounters) -> CacheStats:
        """One snapshot of every tier, in tokens (storage: its pages and bytes too); the
        counters are copies, so another thread may read it while the scheduler goes on."""
        alloc = self.device_pool.allocator
        device = DeviceStats(alloc.total_size(), alloc.used_size(), self.tree.evictable_size(),
                             self.tree.protected_size(), requests.cached_device_tokens)
        host = storage = None
        if self.host_pool is not None:
            sizes = self.tree.host_sizes()
            host = HostStats(self.host_pool.total_size(),
                             self.host_pool.total_size() - self.host_pool.available_size(),
                             sizes.evictable, sizes.protected, requests.cached_host_tokens,
                             replace(self.tree.counters))
        if self.storage is not None:
            io = self.storage.io
            storage = StorageStats.read(io.backend.stats(), io.errors,
                                        requests.cached_storage_tokens,
                                        replace(self.storage.counters),
                                        self.storage.estimates())
        events = self.event_counters() if self.events is not None else None
        return CacheStats(replace(requests), device, host, storage, events=events)

    def check_integrity(self) -> None:
        """The tree's invariants, counting the host pages in-flight prefetches hold."""
        if self.storage is not None:
            self.tree.check_integrity(held_host_tokens=self.storage.held_host_tokens())
        else:
            self.tree.check_integrity()

    # ------------------------------------------------------------- L3 attach / detach
    # Both run on the scheduler thread with no request running or waiting (the engine
    # checks): no prefetch is then in flight, and no node is locked by a request.

    def attach_storage(self, config: Config, model: ModelKV) -> None:
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
        tier = _open_storage_tier(config, model, self.tree, self.host_pool,
                                  must_answer=True)
        tier.observer = self.tree.observer  # the metrics hook `set_observer` gave the tree
        self.quiesce()  # a node's host pages hold its KV only once its D->H copy is acked
        self.storage = tier
        for node in self.tree.iter_nodes():  # parents first; a backed-up chain is skipped
            if node.host_value is not None:
                tier.backup(node)

    def detach_storage(self) -> bool:
        """Let in-flight copies and their backups land, close L3 (its prefetches and backups
        finish first), forget which nodes it held. False when none was attached."""
        if self.storage is None:
            return False
        self.quiesce()
        storage, self.storage = self.storage, None
        try:
            storage.close()
        except Exception:  # the tier is gone either way: the detach stands
            logger.exception("closing L3 at its detach failed; the server goes on without it")
        finally:
            for node in self.tree.iter_nodes():
                node.storage_backed = False
            if self.events is not None:  # routers forget this server's L3 pages
                self._restate()
        return True

    def set_prefetch_policy(self, policy: str) -> None:
        """The attached L3's prefetch policy from now on (SGLang's re-attach of the same
        backend updates it); admissions read it at each check."""
        check_choice("storage.prefetch_policy", policy, PREFETCH_POLICIES)
        if self.storage is not None:
            self.storage.policy = policy

    def close(self) -> None:
        """Let every prefetch and backup finish, stop the I/O and copy threads; send the
        last KV events and stop the publisher (its thread joined, its sockets closed)."""
        try:
            if self.storage is not None:
                self.storage.close()
            if self.controller is not None:
                self.controller.close()
            self.publish_events()
        finally:
            self.publisher.shutdown()


def build_stack(config: Config, model: ModelKV) -> CacheStack:
    """Size and build every tier the config asks for."""
    c = config.cache
    pages = _l1_pages(config, model)
    pool = DeviceKVPool(pages, c.page_size, *model.geometry, model.dtype, model.device)
    logger.info("L1 (%s): %d tokens, %.2f GB", model.device, pool.allocator.total_size(),
                pool.size_bytes / BYTES_PER_GB)
    if not c.enable_radix_cache:
        return _with_events(config, model, CacheStack(pool, RadixCache(pool, c.page_size,
                                                                       disable=True)))
    if not c.hierarchical:
        return _with_events(config, model, CacheStack(pool, RadixCache(
            pool, c.page_size, eviction_policy=c.eviction_policy)))
    host = _host_pool(config, pool, model)
    controller = HiCacheController(pool, host, make_transfer_engine(pool, host,
                                                                    config.host.io_backend))
    tree = HiRadixCache(controller, c.page_size, write_policy=config.host.write_policy,
                        write_through_threshold=config.host.write_through_threshold,
                        eviction_policy=c.eviction_policy)
    stack = _with_events(config, model, CacheStack(pool, tree, host, controller))
    try:
        stack.storage = _storage_tier(config, model, tree, host)
    except BaseException:
        stack.publisher.shutdown()
        raise
    return stack


def _with_events(config: Config, model: ModelKV, stack: CacheStack) -> CacheStack:
    """Give `stack` its KV event recorder and publisher when `config.events` asks for them.
    The first batch, sent at once, is `AllBlocksCleared`: this server starts empty."""
    if not config.events.enabled:
        return stack
    stack.events = stack.tree.events = EventRecorder(_page_hasher(config, model),
                                                     config.cache.page_size)
    stack.publisher = _event_publisher(config.events)
    stack.publish_events()
    return stack


def _event_publisher(e: EventsConfig) -> EventPublisher:
    """The ZMQ publisher; a socket that cannot be opened (a port in use: another server on
    this host with the default endpoint) is a ValueError naming the keys."""
    try:
        return ZmqEventPublisher(e.endpoint, e.replay_endpoint, e.topic,
                                 buffer_steps=e.buffer_steps, hwm=e.hwm,
                                 max_queue_size=e.max_queue_size)
    except zmq.ZMQError as err:
        raise ValueError(f"events.endpoint {e.endpoint!r} or events.replay_endpoint "
                         f"{e.replay_endpoint!r} cannot be opened: {err}; give each server "
                         "on this host its own ports (or tcp://*:0)") from None


def _page_hasher(config: Config, model: ModelKV) -> PageHasher:
    """The L3 page keys of this model and geometry (the KV events' block hashes too)."""
    dtype_name = str(model.dtype).removeprefix("torch.")
    return PageHasher(config.cache.page_size, model_fingerprint(model.path), dtype_name,
                      *model.geometry)


def _l1_pages(config: Config, model: ModelKV) -> int:
    c = config.cache
    if c.max_total_tokens is not None:
        return -(-c.max_total_tokens // c.page_size)
    per_token = DeviceKVPool.bytes_per_token(*model.geometry, model.dtype)
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        budget_tokens = int(free * GPU_KV_FRACTION) // per_token
    else:
        budget_tokens = min(int(available_memory_bytes() * CPU_KV_FRACTION) // per_token,
                            CPU_MAX_L1_TOKENS)
    if c.hierarchical and c.enable_radix_cache and config.host.size_gb is None:
        host_tokens = int(available_memory_bytes() * HOST_AUTO_FRACTION) // per_token
        if budget_tokens * config.host.ratio > host_tokens:
            logger.info("L1 sized to %d tokens so that L2 (host.ratio %.1f x L1) fits in %.0f%% "
                        "of the available host memory", int(host_tokens / config.host.ratio),
                        config.host.ratio, HOST_AUTO_FRACTION * 100)
            budget_tokens = int(host_tokens / config.host.ratio)
    return max(1, budget_tokens // c.page_size)


def _host_pool(config: Config, pool: DeviceKVPool, model: ModelKV) -> HostKVPool:
    h, ps = config.host, config.cache.page_size
    if h.size_gb is not None:
        pages = int(h.size_gb * BYTES_PER_GB) // pool.page_bytes
    else:
        pages = int(pool.allocator.total_size() * h.ratio) // ps
    host = HostKVPool(max(1, pages), ps, *model.geometry, model.dtype, h.mem_layout)
    logger.info("L2 (host, %s%s): %d tokens, %.2f GB", h.mem_layout,
                ", pinned" if host.is_pinned else "", host.total_size(),
                host.size_bytes / BYTES_PER_GB)
    return host


def _storage_tier(config: Config, model: ModelKV, tree: HiRadixCache, host: HostKVPool
                  ) -> StorageTier | None:
    s = config.storage
    if not s.enabled:
        return None
    try:
        return _open_storage_tier(config, model, tree, host)
    except StorageUnavailable as err:  # a damaged store that could not be replaced
        logger.error("L3 (%s) unavailable, serving without L3 until a restart: %s",
                     s.backend, err)
        return None


def _open_storage_tier(config: Config, model: ModelKV, tree: HiRadixCache, host: HostKVPool,
                       *, must_answer: bool = False) -> StorageTier:
    """The storage tier of `config.storage` (a backend other than "none"). `must_answer`
    (a runtime attach): the backend's first call, `stats()`, must count no fault, or it
    is closed and StorageUnavailable raised; at start a Redis that is down is served
    around instead (misses behind a back-off until it returns)."""
    s, ps = config.storage, config.cache.page_size
    codec = PageCodec(PageGeometry(*model.geometry, ps, model.dtype))
    backend = create_backend(s.backend, s.backend_config, codec)
    if must_answer:
        _check_answers(s.backend, backend)
    events = tree.events  # one hasher for both: the same keys, each node's hashed once
    hasher = events.hasher if events is not None else _page_hasher(config, model)
    if s.throttle.enabled:
        bandwidth = s.throttle.bandwidth_mb_s
        backend = ThrottledBackend(backend, None if bandwidth is None else bandwidth * MB,
                                   s.throttle.latency_ms / MS_PER_S,
                                   value_bytes=codec.value_bytes)
        logger.warning("L3 (%s) is throttled to %s MB/s and %s ms per call (storage.throttle)",
                       s.backend, bandwidth, s.throttle.latency_ms)
    logger.info("L3 (%s): %s", s.backend, backend.stats())
    return StorageTier(tree, StorageController(backend, host, s.fetch_workers), hasher,
                       prefetch_policy=s.prefetch_policy,
                       prefetch_threshold=s.prefetch_threshold,
                       timeout_base=s.prefetch_timeout_base,
                       timeout_per_ki_token=s.prefetch_timeout_per_ki_token,
                       timeout_max=s.prefetch_timeout_max,
                       cost_model=s.cost_model, overlap=s.overlap)


def _check_answers(name: str, backend: StorageBackend) -> None:
    """Raise StorageUnavailable (closing `backend`) when its first call counted a fault:
    a fresh backend's counters hold that call's alone (the `stats()` contract)."""
    stats = backend.stats()
    faults = stats.get(STAT_ERRORS_BY_OP, {})
    if stats.get(STAT_ERRORS, 0) or any(faults.values()):
        backend.close()
        raise StorageUnavailable(f"L3 ({name}) did not answer its first call (faults by "
                                 f"operation: {dict(faults)}); the server log has the error")
