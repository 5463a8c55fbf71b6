"""Prometheus metrics of the cache hierarchy, each `CacheMetrics` in its own registry.

Two kinds of samples:

    latency    histograms fed through `observe(name, seconds)`, the hook the scheduler and
               the tree call (`ttft_seconds`, `load_back_seconds`, `prefetch_seconds`)
    state      counters and gauges read from a stats snapshot (`Engine.stats()`'s shape) at
               scrape time, so nothing is counted twice and a scrape sees one consistent step

The stats snapshot is a typed `hicache.stats.CacheStats`, read by attribute; a tier missing
from it (an L1-only or L1+L2 configuration) simply yields no samples. Token counts are tokens; storage counts its own units in pages, converted here
with `page_size`.

Threading: `observe` may be called from any thread (prometheus-client is thread-safe);
`render` calls `stats_fn` on the caller's thread, so a blocking `stats_fn` (the engine's
waits for the scheduler) belongs off the event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from hicache.stats import CacheStats, DeviceStats, HostStats, StorageStats

logger = logging.getLogger(__name__)

PREFIX = "hicache:"
# The classic text format (what `generate_latest` writes for these names); every Prometheus
# version scrapes it.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Histogram bounds in seconds. TTFT spans a cached short prompt (milliseconds) to a long
# prefill queued behind others (vLLM's TTFT buckets reach 80 s for the same reason).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
# An L2->L1 load-back moves pages over PCIe (or memcpy on CPU): tens of microseconds per page
# up to a large prefix's tens of milliseconds.
LOAD_BACK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 0.5, 1.0)
# An L3->L2 prefetch is disk or network I/O, cut by the timeout policy at
# storage.prefetch_timeout_max (30 s by default).
PREFETCH_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                    60.0)
HISTOGRAMS: dict[str, tuple[str, tuple[float, ...]]] = {
    "ttft_seconds": ("Time from arrival to the first generated token", TTFT_BUCKETS),
    "load_back_seconds": ("Time of one L2->L1 load-back, queued to ready", LOAD_BACK_BUCKETS),
    "prefetch_seconds": ("Time of one L3->L2 prefetch, started to stopped", PREFETCH_BUCKETS),
}

StatsFn = Callable[[], CacheStats]


class TierSummary(NamedTuple):
    """One tier's occupancy, in tokens."""

    capacity: int
    used: int
    evictable: int
    protected: int
    hits: int


def tier_summaries(stats: CacheStats) -> dict[str, TierSummary]:
    """Capacity / used / evictable / protected / hits per tier present in `stats`, in tokens.

    Storage counts pages and bytes; its record converts them (`StorageStats.capacity_tokens`:
    what its bytes hold in whole stored pages, an upper bound). Every stored page is
    evictable.
    """
    out = {"device": _memory_tier(stats.device)}
    if stats.host is not None:
        out["host"] = _memory_tier(stats.host)
    if stats.storage is not None:
        s = stats.storage
        out["storage"] = TierSummary(s.capacity_tokens, s.stored_tokens, s.stored_tokens, 0,
                                     s.hit_tokens)
    return out


def _memory_tier(t: DeviceStats | HostStats) -> TierSummary:
    return TierSummary(t.capacity_tokens, t.used_tokens, t.evictable_tokens, t.protected_tokens,
                       t.hit_tokens)


class CacheMetrics:
    """Histograms fed by `observe`, plus a collector that reads `stats_fn()` at scrape time.

    `page_size` converts the evicted storage pages to tokens.
    """

    content_type = CONTENT_TYPE

    def __init__(self, stats_fn: StatsFn, *, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.registry = CollectorRegistry(auto_describe=False)
        self._histograms = {
            name: Histogram(PREFIX + name, doc, buckets=buckets, registry=self.registry)
            for name, (doc, buckets) in HISTOGRAMS.items()}
        self._unknown: set[str] = set()
        self.registry.register(_StatsCollector(stats_fn, page_size))

    def observe(self, name: str, seconds: float) -> None:
        """Record one latency sample. An unknown name is logged once and dropped: this hook
        runs on the scheduler thread, which a metrics mistake must never stop."""
        hist = self._histograms.get(name)
        if hist is not None:
            hist.observe(seconds)
        elif name not in self._unknown:
            self._unknown.add(name)
            logger.warning("metrics: no histogram named %r (known: %s); dropped", name,
                           ", ".join(HISTOGRAMS))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (calls `stats_fn`)."""
        return generate_latest(self.registry)


class _StatsCollector:
    """Counters and gauges derived from one stats snapshot per scrape."""

    def __init__(self, stats_fn: StatsFn, page_size: int) -> None:
        self._stats_fn = stats_fn
        self._page_size = page_size

    def collect(self) -> Iterator[Metric]:
        stats = self._stats_fn()
        yield from _request_metrics(stats)
        yield from _tier_gauges(tier_summaries(stats))
        yield from _window_metrics(stats)
        yield _evicted(stats, self._page_size)
        yield from _transfer_metrics(stats)
        yield from _storage_faults(stats.storage)
        yield from _session_metrics(stats)
        yield from _event_metrics(stats)


def _counter(name: str, doc: str, value: float | None = None,
             label: str | None = None) -> CounterMetricFamily:
    """A counter family: unlabelled with `value`, or with `label` to add samples to."""
    if label is None:
        return CounterMetricFamily(PREFIX + name, doc, value=value or 0)
    return CounterMetricFamily(PREFIX + name, doc, labels=[label])


def _request_metrics(stats: CacheStats) -> Iterator[Metric]:
    r = stats.requests
    yield _counter("requests", "Requests received", r.requests)
    yield _counter("prompt_tokens", "Prompt tokens received", r.prompt_tokens)
    yield _counter("generated_tokens", "Tokens generated", r.generated_tokens)
    yield _counter("request_errors", "Requests the server failed while serving them (a fault "
                   "on one request's behalf; the others went on)", r.request_errors)
    yield _counter("retracted_requests", "Decoding requests put back in the queue for lack of "
                   "L1 slots (they resume from the cache)", r.retracted_requests)
    yield _counter("delayed_admissions", "Times admission held a waiting request back for a "
                   "prefill in flight that computes its prefix (delay scheduling)",
                   r.delayed_admissions)
    cached = _counter("cached_tokens", "Prompt tokens served from each tier instead of "
                      "being computed", label="tier")
    total = 0
    for tier in stats.tiers():
        n = r.cached_tokens(tier)
        cached.add_metric([tier], n)
        total += n
    yield cached
    hit_rate = GaugeMetricFamily(PREFIX + "cache_hit_rate", "Cached prompt tokens / prompt "
                                 "tokens since start (0 before the first request)")
    hit_rate.add_metric([], total / r.prompt_tokens if r.prompt_tokens else 0.0)
    yield hit_rate


def _tier_gauges(summaries: Mapping[str, TierSummary]) -> Iterator[Metric]:
    capacity = GaugeMetricFamily(PREFIX + "tier_capacity_tokens", "Tokens each tier can hold",
                                 labels=["tier"])
    used = GaugeMetricFamily(PREFIX + "tier_used_tokens", "Tokens each tier holds now",
                             labels=["tier"])
    for tier, s in summaries.items():
        if s.capacity:
            capacity.add_metric([tier], s.capacity)
        used.add_metric([tier], s.used)
    yield capacity
    yield used


def _window_metrics(stats: CacheStats) -> Iterator[Metric]:
    """A hybrid model's window layers on L1 (the tier gauges count its full layers)."""
    w = stats.device.windows
    if w is None:
        return
    tokens = GaugeMetricFamily(PREFIX + "window_layer_tokens", "L1 tokens of the window "
                               "layers: capacity, used (tree and running requests), cached "
                               "(the tree's)", labels=["state"])
    for state, n in (("capacity", w.capacity_tokens), ("used", w.used_tokens),
                     ("cached", w.cached_tokens)):
        tokens.add_metric([state], n)
    yield tokens
    yield _counter("window_tombstoned_tokens", "Tokens whose window-layer KV the tree "
                   "dropped from L1, keeping their full layers (tombstones)",
                   w.tombstoned_tokens)


def _evicted(stats: CacheStats, page_size: int) -> Metric:
    evicted = _counter("evicted_tokens", "Tokens evicted from each tier (an L1 eviction "
                       "with an L2 copy is a demotion)", label="tier")
    if stats.host is not None:
        evicted.add_metric(["device"], stats.host.counters.device_evicted_tokens)
        evicted.add_metric(["host"], stats.host.counters.host_evicted_tokens)
    if stats.storage is not None:
        evicted.add_metric(["storage"], stats.storage.evicted_pages * page_size)
    return evicted


def _transfer_metrics(stats: CacheStats) -> Iterator[Metric]:
    host, storage = stats.host, stats.storage
    if host is not None:
        yield _counter("load_back_tokens", "Tokens loaded back from L2 to L1",
                       host.counters.load_back_tokens)
        yield _counter("host_reclaimed_copy_tokens", "Tokens of L2 copies dropped to make "
                       "room while L1 kept the pages (counted in evicted_tokens{tier=host})",
                       host.counters.reclaimed_copy_tokens)
        yield _counter("host_write_dropped_tokens", "Tokens whose D->H copy was skipped "
                       "because L2 had no room even after evicting (they stay on L1 only)",
                       host.counters.write_dropped_tokens)
    backup = _counter("backup_tokens", "Tokens copied down to a lower tier", label="dest")
    if host is not None:
        backup.add_metric(["host"], host.counters.written_tokens)
    if storage is not None:
        backup.add_metric(["storage"], storage.counters.backed_up_tokens)
        yield _counter("prefetch_tokens", "Tokens prefetched from L3 to L2",
                       storage.counters.prefetched_tokens)
        yield _counter("prefetch_restarts", "L3 prefetches started again after a fresh "
                       "match, their prefix brought into the tree by another one meanwhile",
                       storage.counters.prefetch_restarts)
        yield from _cost_metrics(storage)
    yield backup


def _cost_metrics(storage: StorageStats) -> Iterator[Metric]:
    """What the storage tier's cost model decided, and what it estimates now (a gauge is
    absent until the model has its first estimate)."""
    c = storage.counters
    yield _counter("storage_split_prefetches", "L3 hits split into a head computed on the "
                   "device and a tail fetched meanwhile", c.split_prefetches)
    yield _counter("storage_head_tokens", "Tokens of those heads (computed, not fetched)",
                   c.head_tokens)
    yield _counter("storage_recomputed_hit_tokens", "Tokens of L3 hits recomputed because "
                   "the cost model found fetching them slower", c.recomputed_hit_tokens)
    e = storage.estimates
    if e is None:
        return
    for name, doc, value in (
            ("estimated_prefill_tokens_per_second",
             "The cost model's prefill rate (a 2048-token prefill from scratch)",
             e.prefill_tokens_per_s),
            ("storage_estimated_fetch_bytes_per_second", "The cost model's L3 fetch bandwidth",
             e.fetch_bandwidth_bytes_per_s),
            ("storage_estimated_fetch_latency_seconds", "The cost model's L3 fetch latency",
             e.fetch_latency_s),
            ("storage_race_time_factor",
             "Planned races' actual over estimated time (scales a race's estimate)",
             e.race_time_factor)):
        if value is not None:
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)


def _storage_faults(storage: StorageStats | None) -> Iterator[Metric]:
    if storage is None:
        return
    errors = _counter("storage_errors", "Storage backend faults (turned into misses or "
                      "skipped writes) by operation", label="op")
    for op, n in sorted(storage.errors_by_op.items()):
        errors.add_metric([op], n)
    yield errors
    yield _counter("storage_corrupt_pages", "Stored pages that failed their integrity check "
                   "(deleted, served as misses)", storage.corrupt_pages)


def _session_metrics(stats: CacheStats) -> Iterator[Metric]:
    """Pinned tokens; live sessions (0 with `cache.session_retention` off) and the tokens they own, per
    tier present."""
    if stats.pins is not None:
        yield GaugeMetricFamily(PREFIX + "pinned_tokens", "Tokens pinned by POST /admin/pin "
                                "(each node once; cap cache.max_pinned_tokens)",
                                value=stats.pins.pinned_tokens)
    s = stats.sessions
    yield GaugeMetricFamily(PREFIX + "live_sessions", "Sessions open (a request with their "
                            "session_id within cache.session_timeout_s, not closed)",
                            value=s.live_sessions if s is not None else 0)
    if s is None:
        return
    owned = GaugeMetricFamily(PREFIX + "session_owned_tokens", "Tokens live sessions own "
                              "(evicted after unowned ones), per tier", labels=["tier"])
    owned.add_metric(["device"], s.owned_device_tokens)
    if stats.host is not None:
        owned.add_metric(["host"], s.owned_host_tokens)
    yield owned


def _event_metrics(stats: CacheStats) -> Iterator[Metric]:
    """KV events sent and lost (absent with events off)."""
    e = stats.events
    if e is None:
        return
    yield _counter("kv_event_batches", "KV event batches published (one per scheduler step "
                   "with changes)", e.batches)
    yield _counter("kv_events", "KV events published (BlockStored, BlockRemoved, "
                   "AllBlocksCleared)", e.events)
    yield _counter("kv_events_dropped", "KV events lost to a full publisher queue or a "
                   "failing socket", e.dropped_events)
