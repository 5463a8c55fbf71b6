"""Typed statistics: one record per tier, units in the field names, read by attribute.

    CacheStats
      requests   RequestCounters   the scheduler's counts since start
      device     DeviceStats       L1 occupancy
      host       HostStats | None  L2 occupancy and copy counts (None without L2)
      storage    StorageStats | None  L3: the backend's stats and the storage tier's counts

`CacheStack.stats(requests)` builds one snapshot on the scheduler thread; `metrics.py` reads
it by attribute; `as_dict()` is the shape `Engine.stats()` returns (docs/architecture.md: per tier
`capacity / used / evictable / protected / hits` in tokens, plus each tier's own counts).
A storage backend's own `stats()` stays a dict (the `StorageBackend` contract); it is read
into `StorageStats` once, here, and its page counts keep their unit: `hit_pages` (pages
served by the backend) never shares a name with `hit_tokens` (prompt tokens served to
requests from L3).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from hicache.events.publisher import EventCounters
from hicache.storage.backends import base as backend_stats
from hicache.storage.planner import CostEstimates
from hicache.storage.tier_state import StorageCounters
from hicache.tree.base import HostCounters


@dataclass
class RequestCounters:
    """The scheduler's counts since start (scheduler thread; plain ints, one owner)."""

    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_device_tokens: int = 0    # prompt tokens served from each tier, not computed
    cached_host_tokens: int = 0
    cached_storage_tokens: int = 0
    request_errors: int = 0          # requests failed by a fault while serving them
    retracted_requests: int = 0      # retractions: a decoding request put back in the queue
                                     # for lack of L1 slots (a request may count more than once)
    delayed_admissions: int = 0      # times admission held a waiting request back for a
                                     # prefill in flight that computes its prefix

    def cached_tokens(self, tier: str) -> int:
        return getattr(self, f"cached_{tier}_tokens")

    def add_cached(self, details: dict[str, int]) -> None:
        """Count one admission's `cached_details` (tokens per tier)."""
        for tier, n in details.items():
            setattr(self, f"cached_{tier}_tokens", self.cached_tokens(tier) + n)

    def as_dict(self) -> dict[str, int]:
        """`Engine.stats()["counters"]`: the names clients have read since the start."""
        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "generated_tokens": self.generated_tokens,
                "cached_device": self.cached_device_tokens,
                "cached_host": self.cached_host_tokens,
                "cached_storage": self.cached_storage_tokens,
                "request_errors": self.request_errors,
                "retracted_requests": self.retracted_requests,
                "delayed_admissions": self.delayed_admissions}


@dataclass(frozen=True)
class DeviceStats:
    capacity_tokens: int
    used_tokens: int
    evictable_tokens: int
    protected_tokens: int
    hit_tokens: int
    capacity_bytes: int = 0  # the pool's KV buffers (0: a record built without a pool)
    windows: WindowStats | None = None  # a hybrid model's window layers; None: no windows

    def as_dict(self) -> dict[str, Any]:
        out = _occupancy(self)
        if self.windows is not None:
            out["window_layers"] = asdict(self.windows)
        return out


@dataclass(frozen=True)
class WindowStats:
    """L1's window layers beside its full ones (the `capacity`/`used` above count the full
    layers' tokens): tokens whose window-layer KV is on L1, and the tombstones."""

    capacity_tokens: int     # window-layer slots in all
    used_tokens: int         # held: by the tree's nodes and by running requests
    cached_tokens: int       # of those, the tree's (cached tokens with window-layer KV)
    tombstoned_tokens: int   # since start: window KV the tree dropped, full layers kept
    capacity_bytes: int = 0


@dataclass(frozen=True)
class HostStats:
    capacity_tokens: int
    used_tokens: int               # the pool's view: the tree's pages and in-flight prefetches
    evictable_tokens: int
    protected_tokens: int
    hit_tokens: int
    counters: HostCounters
    capacity_bytes: int = 0  # the pool's KV buffers (0: a record built without a pool)

    def as_dict(self) -> dict[str, Any]:
        return {**_occupancy(self), **asdict(self.counters)}


@dataclass(frozen=True)
class StorageStats:
    stored_pages: int
    stored_bytes: int
    capacity_bytes: int          # 0: unbounded (a Redis without maxmemory)
    hit_tokens: int              # prompt tokens served to requests from L3
    hit_pages: int               # pages the backend served (batch_get)
    miss_pages: int              # pages asked of the backend and not served
    corrupt_pages: int
    evicted_pages: int
    written_pages: int
    skipped_pages: int
    errors_by_op: dict[str, int]  # faults turned into misses or skipped writes
    counters: StorageCounters
    backend: dict[str, Any] = field(default_factory=dict)  # the backend's own stats, whole
    estimates: CostEstimates | None = None  # the cost model's, None before it was asked
    page_tokens: int = 0  # tokens of one stored page (0: unknown, no token counts)
    page_bytes: int = 0   # bytes of one stored page, header included (0: unknown)

    @property
    def errors(self) -> int:
        return sum(self.errors_by_op.values())

    @property
    def stored_tokens(self) -> int:
        return self.stored_pages * self.page_tokens

    @property
    def capacity_tokens(self) -> int:
        """What `capacity_bytes` holds in whole stored pages, in tokens: an upper bound, the
        store has its own overhead; 0 when unbounded or the page size is unknown."""
        if not self.page_bytes:
            return 0
        return self.capacity_bytes // self.page_bytes * self.page_tokens

    @classmethod
    def read(cls, backend: Mapping[str, Any], io_errors: Mapping[str, int], hit_tokens: int,
             counters: StorageCounters, estimates: CostEstimates | None = None, *,
             page_tokens: int = 0, page_bytes: int = 0) -> StorageStats:
        """From a backend's `stats()` and the I/O threads' fault counts ("exists", "get",
        "set": exceptions a backend let through), summed per operation; `page_tokens` and
        `page_bytes` (one stored page) turn its pages into tokens."""
        faults = dict(backend.get(backend_stats.STAT_ERRORS_BY_OP, {}))
        for op, n in io_errors.items():
            faults[op] = faults.get(op, 0) + n
        def count(key: str) -> int:
            return int(backend.get(key, 0))

        return cls(stored_pages=count(backend_stats.STAT_PAGES),
                   stored_bytes=count(backend_stats.STAT_BYTES),
                   capacity_bytes=count(backend_stats.STAT_CAPACITY), hit_tokens=hit_tokens,
                   hit_pages=count(backend_stats.STAT_HITS),
                   miss_pages=count(backend_stats.STAT_MISSES),
                   corrupt_pages=count(backend_stats.STAT_CORRUPT),
                   evicted_pages=count(backend_stats.STAT_EVICTED),
                   written_pages=count(backend_stats.STAT_WRITTEN),
                   skipped_pages=count(backend_stats.STAT_SKIPPED),
                   errors_by_op=faults, counters=counters, backend=dict(backend),
                   estimates=estimates, page_tokens=page_tokens, page_bytes=page_bytes)

    def as_dict(self) -> dict[str, Any]:
        """The backend's keys (`pages`, `bytes`, `capacity_bytes`, ... and its own extras),
        except its page counts `hits` / `misses`, shown as `hit_pages` / `miss_pages`:
        `hits` is the tier's token count, as for the other tiers."""
        paged = (backend_stats.STAT_HITS, backend_stats.STAT_MISSES)
        extras = {k: v for k, v in self.backend.items() if k not in paged}
        out = {**extras, "hits": self.hit_tokens, "hit_pages": self.hit_pages,
               "miss_pages": self.miss_pages, "errors_by_op": dict(self.errors_by_op),
               "errors": self.errors, **asdict(self.counters)}
        if self.estimates is not None:
            out["cost_model"] = self.estimates._asdict()
        return out


@dataclass(frozen=True)
class SessionStats:
    """Live sessions (`cache.session_retention`) and the tokens they own, each once."""

    live_sessions: int
    owned_device_tokens: int
    owned_host_tokens: int  # evicted from L1, on L2 only


@dataclass(frozen=True)
class PinStats:
    """Pinned prefixes (POST /admin/pin): tokens pinned (each node once), the cap, and each
    pin's `{tokens, extra_key, expires_in_s}`."""

    pinned_tokens: int
    max_pinned_tokens: int
    pins: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class CacheStats:
    requests: RequestCounters
    device: DeviceStats
    host: HostStats | None = None
    storage: StorageStats | None = None
    sessions: SessionStats | None = None  # None: session retention is off
    pins: PinStats | None = None
    events: EventCounters | None = None  # None: KV events are off

    def tiers(self) -> dict[str, DeviceStats | HostStats | StorageStats]:
        """The tiers present, L1 first."""
        out: dict[str, Any] = {"device": self.device}
        if self.host is not None:
            out["host"] = self.host
        if self.storage is not None:
            out["storage"] = self.storage
        return out

    def as_dict(self) -> dict[str, Any]:
        """`Engine.stats()`: `{"tiers": {tier: {...}}, "counters": {...}}`."""
        out = {"tiers": {name: t.as_dict() for name, t in self.tiers().items()},
               "counters": self.requests.as_dict()}
        if self.sessions is not None:
            out["sessions"] = asdict(self.sessions)
        if self.pins is not None:
            out["pins"] = {"pinned_tokens": self.pins.pinned_tokens,
                           "max_pinned_tokens": self.pins.max_pinned_tokens,
                           "pins": [dict(p) for p in self.pins.pins]}
        if self.events is not None:
            out["kv_events"] = asdict(self.events)
        return out


def _occupancy(t: DeviceStats | HostStats) -> dict[str, int]:
    return {"capacity": t.capacity_tokens, "used": t.used_tokens,
            "evictable": t.evictable_tokens, "protected": t.protected_tokens,
            "hits": t.hit_tokens}
