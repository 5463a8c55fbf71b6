"""Sizes the tiers from the config and the machine, and wires them into one `CacheStack`.

    L1  cache.max_total_tokens, else a share of free GPU memory (or of host RAM on CPU)
    L2  host.size_gb, else host.ratio x L1   (checked against MemAvailable)
    L3  storage.backend through the registry, keyed by the model's page hashes
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from hicache.cache_controller import HiCacheController
from hicache.config import BYTES_PER_GB, Config
from hicache.hashing import PageHasher, model_fingerprint
from hicache.hiradix_cache import HiRadixCache
from hicache.memory_pool import DeviceKVPool
from hicache.memory_pool_host import HostKVPool, available_memory_bytes
from hicache.radix_cache import RadixCache
from hicache.storage import create_backend
from hicache.storage.base import StorageUnavailable
from hicache.storage.page_format import PageCodec, PageGeometry
from hicache.storage_controller import StorageController
from hicache.transfer import make_transfer_engine
from server.models.loader import LoadedModel

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


@dataclass
class CacheStack:
    device_pool: DeviceKVPool
    tree: RadixCache
    host_pool: HostKVPool | None = None
    controller: HiCacheController | None = None

    def stats(self, counters: dict[str, int]) -> dict[str, Any]:
        """Per-tier capacity / used / evictable / protected / hits, in tokens (scheduler
        thread: it reads the tree)."""
        alloc = self.device_pool.allocator
        tiers: dict[str, Any] = {"device": {
            "capacity": alloc.total_size(), "used": alloc.used_size(),
            "evictable": self.tree.evictable_size(), "protected": self.tree.protected_size(),
            "hits": counters["cached_device"]}}
        if isinstance(self.tree, HiRadixCache):
            sizes = self.tree.host_sizes()
            tiers["host"] = {
                "capacity": self.host_pool.total_size(),
                "used": self.host_pool.total_size() - self.host_pool.available_size(),
                "evictable": sizes["evictable"], "protected": sizes["protected"],
                "hits": counters["cached_host"], **vars(self.tree.counters)}
            if self.tree.storage is not None:
                tiers["storage"] = self._storage_stats(counters)
        return {"tiers": tiers, "counters": dict(counters)}

    def _storage_stats(self, counters: dict[str, int]) -> dict[str, Any]:
        """The backend's stats with the faults it caught (`errors_by_op`: "batch_get", ...)
        and those its I/O threads caught ("exists", "get", "set": exceptions a backend let
        through) in one per-operation count; `errors` is their total."""
        io = self.tree.storage.io
        backend = io.backend.stats()
        faults = dict(backend.get("errors_by_op", {}))
        for op, n in io.errors.items():
            faults[op] = faults.get(op, 0) + n
        return {**backend, "hits": counters["cached_storage"], "errors_by_op": faults,
                "errors": sum(faults.values()), **self.tree.storage.counters}

    def close(self) -> None:
        if isinstance(self.tree, HiRadixCache):
            if self.tree.storage is not None:
                self.tree.storage.close()
            self.controller.close()


def build_cache(config: Config, loaded: LoadedModel) -> CacheStack:
    mc, c = loaded.config, config.cache
    geometry = (mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim)
    pages = _l1_pages(config, loaded)
    pool = DeviceKVPool(pages, c.page_size, *geometry, loaded.dtype, loaded.device)
    logger.info("L1 (%s): %d tokens, %.2f GB", loaded.device, pool.allocator.total_size(),
                pool.size_bytes / BYTES_PER_GB)
    if not c.enable_radix_cache:
        return CacheStack(pool, RadixCache(pool, c.page_size, disable=True))
    if not c.hierarchical:
        return CacheStack(pool, RadixCache(pool, c.page_size,
                                           eviction_policy=c.eviction_policy))
    host = _host_pool(config, pool, geometry, loaded.dtype)
    controller = HiCacheController(pool, host, make_transfer_engine(pool, host,
                                                                    config.host.io_backend))
    tree = HiRadixCache(controller, c.page_size, write_policy=config.host.write_policy,
                        write_through_threshold=config.host.write_through_threshold,
                        eviction_policy=c.eviction_policy)
    _attach_storage(config, loaded, tree, host)
    return CacheStack(pool, tree, host, controller)


def _l1_pages(config: Config, loaded: LoadedModel) -> int:
    c, mc = config.cache, loaded.config
    if c.max_total_tokens is not None:
        return -(-c.max_total_tokens // c.page_size)
    per_token = DeviceKVPool.bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads,
                                             mc.head_dim, loaded.dtype)
    if loaded.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(loaded.device)
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


def _host_pool(config: Config, pool: DeviceKVPool, geometry: tuple[int, int, int],
               dtype: torch.dtype) -> HostKVPool:
    h, ps = config.host, config.cache.page_size
    if h.size_gb is not None:
        pages = int(h.size_gb * BYTES_PER_GB) // pool.page_bytes
    else:
        pages = int(pool.allocator.total_size() * h.ratio) // ps
    host = HostKVPool(max(1, pages), ps, *geometry, dtype, h.mem_layout)
    logger.info("L2 (host, %s%s): %d tokens, %.2f GB", h.mem_layout,
                ", pinned" if host.is_pinned else "", host.total_size(),
                host.size_bytes / BYTES_PER_GB)
    return host


def _attach_storage(config: Config, loaded: LoadedModel, tree: HiRadixCache,
                    host: HostKVPool) -> None:
    s, mc = config.storage, loaded.config
    if not s.enabled:
        return
    dtype_name = str(loaded.dtype).removeprefix("torch.")
    codec = PageCodec(PageGeometry(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                                   config.cache.page_size, loaded.dtype))
    try:
        backend = create_backend(s.backend, s.backend_config, codec)
    except StorageUnavailable as err:  # a damaged store that could not be replaced
        logger.error("L3 (%s) unavailable, serving without L3 until a restart: %s",
                     s.backend, err)
        return
    hasher = PageHasher(config.cache.page_size, model_fingerprint(loaded.path), dtype_name,
                        mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim)
    tree.enable_storage(StorageController(backend, host), hasher,
                        prefetch_policy=s.prefetch_policy,
                        prefetch_threshold=s.prefetch_threshold,
                        timeout_base=s.prefetch_timeout_base,
                        timeout_per_ki_token=s.prefetch_timeout_per_ki_token,
                        timeout_max=s.prefetch_timeout_max)
    logger.info("L3 (%s): %s", s.backend, backend.stats())
