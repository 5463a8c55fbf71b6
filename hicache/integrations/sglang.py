"""`HiCacheStore`: hicache's L3 stores (LMDB, Redis, both tiered) as an SGLang HiCache storage
backend, loaded by name::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "hicache", "module_path": "hicache.integrations.sglang",
      "class_name": "HiCacheStore", "interface_v1": 1, "backend": "lmdb"}'

SGLang's factory builds it as `HiCacheStore(storage_config, kwargs)`; its cache controller then
registers its host pool (`register_mem_pool_host`), and only then is the store opened: the
page format and the key namespace are the pool's (`sglang_pages`, `sglang_settings`).

    SGLang calls                      hicache does
    batch_exists(keys)                backend.batch_exists: leading hits
    batch_get_v1 / batch_set_v1       the page bytes in the host pool, in place (zero-copy)
    batch_get / batch_set, get / set  the flat page tensors SGLang hands over (generic)
    exists, clear, get_stats, close

Every value is hicache's stored page (`page_format`): a header naming the pool's geometry
and the payload's length, and a checksum. A value that fails them is a miss, deleted and
counted (`corrupt_pages`), never copied into SGLang's pool as data. A store that fails (a
Redis that is down, a full disk) is a miss or a skipped write, counted in `errors`: the
backends never raise their faults, so nothing reaches SGLang's prefetch and backup threads.

Threads: SGLang's prefetch thread(s) call the get and exists paths, its backup thread the set
paths, its scheduler `clear`, `get_stats` and `close`, all at once; the backends are safe for
that, and this class's own state is fixed once the pool is registered, but for the metrics
(one lock).

Imports SGLang: load this module only inside SGLang (hicache itself never imports it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from hicache.integrations import sglang_pages as pages
from hicache.integrations.sglang_settings import (
    CONFIG_FLAG,
    StoreSettings,
    namespace_bytes,
    namespace_root,
    page_namespace,
    store_key,
)
from hicache.storage.backends import create_backend
from hicache.storage.backends.base import ValueStore

__all__ = ["HiCacheStore", "StoreMetrics"]

logger = logging.getLogger(__name__)

GB = 1e9  # SGLang's storage metrics give bandwidth in GB/s


@dataclass
class StoreMetrics:
    """The fields of SGLang's `StorageMetrics` (pages and GB/s per prefetch and backup batch
    since the last `get_stats`), for when SGLang's metrics module cannot be imported."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


class HiCacheStore(HiCacheStorage):
    """An SGLang `HiCacheStorage` over one hicache `ValueStore` (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig,
                 kwargs: dict[str, Any] | None = None) -> None:
        # Validated now, so a bad extra config stops the attach before any store is opened.
        self.settings = StoreSettings.from_extra_config(storage_config.extra_config)
        self.storage_config = storage_config
        self.store: ValueStore | None = None
        self._pending = StoreMetrics()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the pool

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Open the store for this pool's pages: its codec, its key namespace."""
        super().register_mem_pool_host(mem_pool_host)
        if self.settings.interface_v1:
            pages.check_in_place(mem_pool_host)
        namespace = page_namespace(self.storage_config, pages.pool_format(mem_pool_host),
                                   self.settings.namespace)
        fleet = self.settings.fleet
        codec = pages.page_codec(mem_pool_host, namespace_bytes(namespace), fleet)
        self._root = namespace_root(namespace, fleet)
        self.page_size = mem_pool_host.page_size
        if self.store is not None:
            self.store.close()
        try:
            self.store = create_backend(self.settings.backend, self.settings.backend_config(),
                                        codec)
        except ValueError as e:
            raise ValueError(f"{CONFIG_FLAG}: {e}") from e
        logger.info("hicache L3 (%s) for SGLang: namespace %s", self.settings.backend,
                    namespace)

    def _keys(self, keys: Sequence[str]) -> list[bytes]:
        return [store_key(self._root, key) for key in keys]

    def _store(self) -> ValueStore:
        if self.store is None:
            raise RuntimeError("HiCacheStore: register_mem_pool_host first (SGLang's cache "
                               "controller does, right after building the backend)")
        return self.store

    def _page_indices(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[int]:
        """The host slot index that starts each key's page (what get_data_page takes)."""
        if host_indices.numel() != len(keys) * self.page_size:
            raise ValueError(f"{len(keys)} keys need {len(keys) * self.page_size} host "
                             f"indices (page_size={self.page_size}), got {host_indices.numel()}")
        return host_indices[::self.page_size].tolist()

    # ------------------------------------------------------------------ zero-copy (v1)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        store, pool = self._store(), self.mem_pool_host
        starts = self._page_indices(keys, host_indices)
        begin = time.perf_counter()
        ids = self._keys(keys)
        served = store.get_values(ids, lambda i, value: store.codec.copy_into(
            ids[i], value, pages.page_runs(pool, starts[i])))
        self._record("prefetch", sum(served), begin)
        return served

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        store, pool = self._store(), self.mem_pool_host
        starts = self._page_indices(keys, host_indices)
        begin = time.perf_counter()
        stored = store.put_values(self._keys(keys),
                                  lambda i: pages.page_runs(pool, starts[i]))
        self._record("backup", sum(stored), begin)
        return stored

    # ------------------------------------------------------------------ generic

    def batch_get(self, keys: list[str], target_locations: list[torch.Tensor] | None = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Each page into its flat page tensor (SGLang's `get_dummy_flat_data_page`s; new
        ones when none are given); None per miss."""
        store = self._store()
        targets = target_locations or [self.mem_pool_host.get_dummy_flat_data_page()
                                       for _ in keys]
        begin = time.perf_counter()
        ids = self._keys(keys)
        served = store.get_values(ids, lambda i, value: store.codec.copy_into(
            ids[i], value, pages.tensor_bytes(targets[i])))
        self._record("prefetch", sum(served), begin)
        return [target if ok else None for target, ok in zip(targets, served)]

    def get(self, key: str, target_location: torch.Tensor | None = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_set(self, keys: list[str], values: list[torch.Tensor] | None = None,
                  target_locations: Any = None, target_sizes: Any = None) -> bool:
        """Store the flat page tensors `values` (`get_data_page(index)`); True when all are
        stored (SGLang's generic backup counts a batch whole)."""
        if values is None or len(values) != len(keys):
            raise ValueError(f"{len(keys)} keys need as many flat pages, got "
                             f"{None if values is None else len(values)}")
        begin = time.perf_counter()
        stored = self._store().put_values(self._keys(keys),
                                          lambda i: pages.tensor_bytes(values[i]))
        self._record("backup", sum(stored), begin)
        return all(stored)

    def set(self, key: str, value: torch.Tensor | None = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], None if value is None else [value])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self._store().batch_exists(self._keys(keys)) if keys else 0

    # ------------------------------------------------------------------ control

    def clear(self) -> None:
        """Remove every page of the store: LMDB's whole environment, Redis' every key under
        its key prefix (every namespace's), lmdb+redis' local part only."""
        removed = self._store().clear()
        logger.info("hicache L3 (%s) cleared: %d pages", self.settings.backend, removed)

    def stats(self) -> dict[str, Any]:
        """The store's own counters (`hicache.storage.backends.base.STAT_KEYS`: hits,
        misses, corrupt_pages, errors, errors_by_op, ...)."""
        return self._store().stats()

    def get_stats(self) -> Any:
        """SGLang's `StorageMetrics` of the batches since the last call, the store's counters
        (`stats()`) riding along as its `hicache` attribute."""
        with self._lock:
            pending, self._pending = self._pending, StoreMetrics()
        metrics = _storage_metrics_class()(**vars(pending))
        metrics.hicache = self.stats()
        return metrics

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def _record(self, kind: str, count: int, begin: float) -> None:
        """One `kind` ("prefetch" or "backup") batch of `count` pages moved since `begin`
        (perf_counter), for get_stats."""
        rate = count * self._store().codec.payload_bytes / GB / max(
            time.perf_counter() - begin, 1e-9)
        with self._lock:
            getattr(self._pending, f"{kind}_pgs").append(count)
            getattr(self._pending, f"{kind}_bandwidth").append(rate)


def _storage_metrics_class() -> type:
    """SGLang's `StorageMetrics` (what its metrics collector asserts it gets), else
    `StoreMetrics`: SGLang installed without its dependencies, as this project's tests do,
    cannot import its metrics module."""
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics
    except ImportError:
        return StoreMetrics
    return StorageMetrics
