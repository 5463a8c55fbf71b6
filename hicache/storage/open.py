"""Opening the storage tier (L3) over a running tree and host pool: the backend from the
registry, its throttle, and the page hasher whose keys it stores pages under (the KV events'
block hashes too). Called at start (`hicache.build.build_stack`) and by a runtime attach
(`hicache.stack_admin.AdminCalls.attach_storage`).
"""

from __future__ import annotations

import logging

from hicache.config_storage import TierSections, storage_secret
from hicache.memory.host import HostKVPool
from hicache.model_kv import ModelKV
from hicache.storage.backends import create_backend
from hicache.storage.backends.base import (
    STAT_ERRORS,
    STAT_ERRORS_BY_OP,
    StorageBackend,
    StorageUnavailable,
)
from hicache.storage.backends.throttled import ThrottledBackend
from hicache.storage.hashing import PageHasher
from hicache.storage.io import StorageController, WindowParts
from hicache.storage.kinds import StoreKinds
from hicache.storage.page_format import PageCodec, PageGeometry
from hicache.storage.page_seal import FleetKeys, Protection
from hicache.storage.tier import StorageTier
from hicache.tree.hiradix import HiRadixCache

logger = logging.getLogger(__name__)

# What the start-up log says of each protection (never a key or the secret).
PROTECTION_NAMES = {Protection.CHECKSUM: "checksum (no fleet secret)",
                    Protection.MAC: "MAC (fleet secret)",
                    Protection.ENCRYPTED: "AES-GCM encrypted (fleet secret)"}
MB = 10**6  # storage.throttle.bandwidth_mb_s is in decimal megabytes
MS_PER_S = 1000.0


def fleet_keys(config: TierSections) -> FleetKeys | None:
    """The keys of the fleet secret (`storage.secret_file` or HICACHE_STORAGE_SECRET), or
    None without one; ConfigError for one that cannot be read or is too short."""
    secret = storage_secret(config.storage)
    return None if secret is None else FleetKeys(secret, config.storage.encrypt)


def page_hasher(config: TierSections, model: ModelKV) -> PageHasher:
    """The L3 page keys of this model and geometry (the KV events' block hashes too),
    rooted in the fleet secret where there is one."""
    dtype_name = str(model.dtype).removeprefix("torch.")
    keys = fleet_keys(config)
    return PageHasher(config.cache.page_size, model.fingerprint, dtype_name,
                      *model.geometry, root_key=None if keys is None else keys.root_key)


def open_storage_tier(config: TierSections, model: ModelKV, tree: HiRadixCache, host: HostKVPool,
                      *, must_answer: bool = False) -> StorageTier:
    """The storage tier of `config.storage` (a backend other than "none"). `must_answer`
    (a runtime attach): the backend's first call, `stats()`, must count no fault, or it
    is closed and StorageUnavailable raised; at start a Redis that is down is served
    around instead (misses behind a back-off until it returns)."""
    s, ps = config.storage, config.cache.page_size
    events = tree.events  # one hasher for both: the same keys, each node's hashed once
    hasher = events.hasher if events is not None else page_hasher(config, model)
    geometry, keys = PageGeometry(*model.geometry, ps, model.dtype), fleet_keys(config)
    kinds = StoreKinds.of(model, ps)
    if kinds is None:
        codec = PageCodec(geometry, namespace=hasher.namespace, keys=keys)
    else:  # a hybrid model's page in two parts (`kinds.py`)
        codec, window_codec = kinds.codecs(geometry, hasher.namespace, keys)
    logger.info("L3 pages: format v3, %s%s", PROTECTION_NAMES[codec.protection],
                "" if kinds is None else ", full and window layers apart")
    backend = create_backend(s.backend, s.backend_config, codec)
    if must_answer:
        check_answers(s.backend, backend)
    if s.throttle.enabled:
        bandwidth = s.throttle.bandwidth_mb_s
        backend = ThrottledBackend(backend, None if bandwidth is None else bandwidth * MB,
                                   s.throttle.latency_ms / MS_PER_S,
                                   value_bytes=codec.value_bytes)
        logger.warning("L3 (%s) is throttled to %s MB/s and %s ms per call (storage.throttle)",
                       s.backend, bandwidth, s.throttle.latency_ms)
    stats = backend.stats()
    logger.info("L3 (%s): %s", s.backend, stats)
    window = None if kinds is None else WindowParts(kinds, _window_view(backend, window_codec,
                                                                        s.backend))
    tier = StorageTier(tree, StorageController(backend, host, s.fetch_workers, window), hasher,
                       prefetch_policy=s.prefetch_policy,
                       prefetch_threshold=s.prefetch_threshold,
                       timeout_base=s.prefetch_timeout_base,
                       timeout_per_ki_token=s.prefetch_timeout_per_ki_token,
                       timeout_max=s.prefetch_timeout_max,
                       cost_model=s.cost_model, overlap=s.overlap)
    if s.cost_model and not stats.get(STAT_ERRORS, 0):  # a store that answers: time it
        log_probe(s.backend, tier.probe_fetch(), host.page_bytes)
    return tier


def _window_view(backend: StorageBackend, codec: PageCodec, name: str) -> StorageBackend:
    """The store's view for a hybrid model's window parts; ValueError (the store closed)
    for a backend that keeps one kind of value only."""
    try:
        return backend.with_codec(codec)
    except TypeError as err:
        backend.close()
        raise ValueError(f"L3 ({name}) cannot keep a hybrid model's window layers apart: "
                         f"{err}") from None


def log_probe(name: str, reads: list[tuple[int, float]], page_bytes: int) -> None:
    if not reads:
        logger.info("L3 (%s) fetch probe: too few stored pages to time; the fetch model "
                    "learns from the first fetches", name)
        return
    timed = ", ".join(f"{pages} pages in {seconds * MS_PER_S:.1f} ms" for pages, seconds in reads)
    pages = sum(p for p, _ in reads)
    rate = pages * page_bytes / max(sum(s for _, s in reads), 1e-9) / MB
    logger.info("L3 (%s) fetch probe: %s (%.1f MB/s on one thread)", name, timed, rate)


def check_answers(name: str, backend: StorageBackend) -> None:
    """Raise StorageUnavailable (closing `backend`) when its first call counted a fault:
    a fresh backend's counters hold that call's alone (the `stats()` contract)."""
    stats = backend.stats()
    faults = stats.get(STAT_ERRORS_BY_OP, {})
    if stats.get(STAT_ERRORS, 0) or any(faults.values()):
        backend.close()
        raise StorageUnavailable(f"L3 ({name}) did not answer its first call (faults by "
                                 f"operation: {dict(faults)}); the server log has the error")
