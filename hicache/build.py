"""Builds the cache from the config and the model's KV shape: sizes L1 / L2, opens L3,
and hands back the `CacheStack` the server serves through.

    L1  cache.max_total_tokens, or cache.kv_cache_memory_bytes (whole pages of KV that fit),
        else a share of free GPU memory (or of host RAM on CPU); a hybrid model's window
        layers share one pool of pages with the full ones (`WindowedKVPool`)
    L2  host.size_gb, else host.ratio x L1   (checked against MemAvailable)
    L3  storage.backend through the registry, keyed by the model's page hashes
    pins  cache.max_pinned_tokens, else a quarter of the lowest tier (L2, or L1 without L2)
"""

from __future__ import annotations

import logging

import torch
import zmq

from hicache.config import BYTES_PER_GB, EventsConfig
from hicache.config_storage import TierSections
from hicache.events import (
    EventPublisher,
    EventRecorder,
    NullEventPublisher,
    ZmqEventPublisher,
)
from hicache.memory.device import DeviceKVPool
from hicache.memory.host import HostKVPool, available_memory_bytes
from hicache.memory.windowed import STEP_TOKENS, WindowedKVPool
from hicache.model_kv import ModelKV
from hicache.pages import page_count, pages_down
from hicache.stack import CacheStack
from hicache.storage.backends.base import StorageUnavailable
from hicache.storage.open import open_storage_tier, page_hasher
from hicache.storage.tier import StorageTier
from hicache.transfer.controller import HiCacheController
from hicache.transfer.engines import make_transfer_engine
from hicache.tree.hiradix import HiRadixCache
from hicache.tree.pins import PinTable
from hicache.tree.radix import RadixCache
from hicache.tree.sessions import SessionTable

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
# Of the lowest tier's capacity (L2, or L1 without L2), what pins may hold by default
# (cache.max_pinned_tokens: null): the rest stays for running requests and ordinary reuse.
DEFAULT_PIN_SHARE = 4
# Without L2 pinned pages never leave L1: at most 1/this of it, whatever the config says.
MAX_PIN_SHARE_OF_L1_ONLY = 2
# A hybrid model's L1 is one pool that full and window layers share (`WindowedKVPool`); it is
# sized as a split of its bytes would be: the window layers this share of the full layers'
# tokens (each request needs its window, Gemma 3's 512 or 1,024 tokens, and a step's new
# tokens; each cached boundary its window), at least WINDOW_FLOOR_WINDOWS windows and a
# step's tokens (`windowed.STEP_TOKENS`). The split names the pool's nominal full tokens
# (what L2's host.ratio and the pins' cap count); either kind may take any page.
WINDOW_SHARE = 0.25
WINDOW_FLOOR_WINDOWS = 8


def build_stack(config: TierSections, model: ModelKV) -> CacheStack:
    """Size and build every tier the config asks for, with its pins, sessions and KV
    events. The first event batch, sent at once, is `AllBlocksCleared`: this server starts
    empty."""
    c = config.cache
    pool = _l1_pool(config, model)
    if model.hybrid:
        logger.info("L1 (%s): %d tokens of every layer, or %d of the full layers with the "
                    "window layers of %d, in one pool of %.2f GB", model.device,
                    pool.window_capacity(), pool.allocator.total_size(), pool.window_capacity(),
                    pool.size_bytes / BYTES_PER_GB)
    else:
        logger.info("L1 (%s): %d tokens, %.2f GB", model.device, pool.allocator.total_size(),
                    pool.size_bytes / BYTES_PER_GB)
    window = max((w for w in model.layer_windows if w), default=None) if model.hybrid else None
    events = (EventRecorder(page_hasher(config, model), c.page_size, window)
              if config.events.enabled else None)
    host = controller = None
    if not c.enable_radix_cache:
        tree: RadixCache = RadixCache(pool, c.page_size, disable=True, events=events)
    elif not c.hierarchical:
        tree = RadixCache(pool, c.page_size, eviction_policy=c.eviction_policy, events=events)
    else:
        host = _host_pool(config, pool, model)
        controller = HiCacheController(pool, host, make_transfer_engine(
            pool, host, config.host.io_backend))
        tree = HiRadixCache(controller, c.page_size, write_policy=config.host.write_policy,
                            write_through_threshold=config.host.write_through_threshold,
                            eviction_policy=c.eviction_policy, events=events)
    publisher = _event_publisher(config.events) if events is not None else NullEventPublisher()
    try:
        storage = _storage_tier(config, model, tree, host) if host is not None else None
    except BaseException:
        publisher.shutdown()
        raise
    sessions = SessionTable(tree, c.session_timeout_s) if c.session_retention else None
    stack = CacheStack(pool, tree, host, controller, storage, events, publisher,
                       PinTable(tree, _pin_cap(config, pool, host)), sessions)
    stack.steps.publish_events()
    return stack


def _pin_cap(config: TierSections, pool: DeviceKVPool, host: HostKVPool | None) -> int:
    """cache.max_pinned_tokens, or a quarter of L2 (of L1 without L2), whole pages."""
    cap, page = config.cache.max_pinned_tokens, config.cache.page_size
    l1 = _l1_tokens(pool)
    if cap is None:
        cap = (host.total_size() if host is not None else l1) // DEFAULT_PIN_SHARE
    if host is None:  # pinned pages never leave L1: keep (over) half of it for requests,
        # so a request that fits beside a full cap of pins (the engine's check) can be a
        # pin's own computation (its prompt: the pinned pages and less than a page more)
        cap = min(cap, (l1 - page) // MAX_PIN_SHARE_OF_L1_ONLY)
    return pages_down(cap, page)


def _l1_tokens(pool: DeviceKVPool | WindowedKVPool) -> int:
    """L1's tokens as L2's ratio and the pins' cap count them: a hybrid pool's full pages
    at the split it was sized by (`window_pages`), not every page it shares."""
    if pool.has_windows:
        return pool.nominal_pages * pool.page_size
    return pool.allocator.total_size()


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


def _l1_pool(config: TierSections, model: ModelKV) -> DeviceKVPool | WindowedKVPool:
    """L1: one pool for every layer; for a hybrid model, one pool that full and window
    layers share, of the bytes `window_pages` splits."""
    c = config.cache
    pages = _l1_pages(config, model)
    if not model.hybrid:
        return DeviceKVPool(pages, c.page_size, *model.geometry, model.dtype, model.device)
    full, window = window_pages(pages, c.page_size, model,
                                explicit_tokens=c.max_total_tokens is not None)
    return WindowedKVPool(full, window, c.page_size, model.layer_windows, model.kv_heads,
                          model.head_dim, model.dtype, model.device)


def window_pages(pages: int, page_size: int, model: ModelKV, explicit_tokens: bool
                 ) -> tuple[int, int]:
    """(full pages, window pages) of a hybrid L1 sized at `pages` pages of every layer: with
    `explicit_tokens` (cache.max_total_tokens) the full layers keep that many tokens,
    otherwise the same bytes are split. The window layers get WINDOW_SHARE of the full
    layers' tokens, at least WINDOW_FLOOR_WINDOWS windows and a step's tokens."""
    windows = [w for w in model.layer_windows if w is not None]
    n_window = len(windows)
    n_full = model.num_layers - n_window
    floor = -(-(WINDOW_FLOOR_WINDOWS * (max(windows) + page_size) + STEP_TOKENS)
              // page_size)
    if explicit_tokens:
        return pages, min(pages, max(floor, int(pages * WINDOW_SHARE)))
    budget = pages * model.num_layers  # in pages of one layer
    full = int(budget / (n_full + WINDOW_SHARE * n_window))
    window = int(full * WINDOW_SHARE)
    if window < floor:
        window = min(floor, pages)
        full = max(1, (budget - window * n_window) // n_full)
    return full, max(1, window)


def _l1_pages(config: TierSections, model: ModelKV) -> int:
    c = config.cache
    if c.max_total_tokens is not None:
        return page_count(c.max_total_tokens, c.page_size)
    per_token = DeviceKVPool.bytes_per_token(*model.geometry, model.dtype)
    if c.kv_cache_memory_bytes is not None:
        pages = c.kv_cache_memory_bytes // (per_token * c.page_size)
        if pages < 1:
            raise ValueError(f"cache.kv_cache_memory_bytes {c.kv_cache_memory_bytes} holds no "
                             f"page of this model's KV ({per_token * c.page_size} bytes a "
                             f"page of {c.page_size} tokens)")
        return pages
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


def _host_pool(config: TierSections, pool: DeviceKVPool, model: ModelKV) -> HostKVPool:
    h, ps = config.host, config.cache.page_size
    if h.size_gb is not None:
        pages = int(h.size_gb * BYTES_PER_GB) // pool.page_bytes
    else:
        pages = int(_l1_tokens(pool) * h.ratio) // ps
    host = HostKVPool(max(1, pages), ps, *model.geometry, model.dtype, h.mem_layout)
    logger.info("L2 (host, %s%s): %d tokens, %.2f GB", h.mem_layout,
                ", pinned" if host.is_pinned else "", host.total_size(),
                host.size_bytes / BYTES_PER_GB)
    return host


def _storage_tier(config: TierSections, model: ModelKV, tree: HiRadixCache, host: HostKVPool
                  ) -> StorageTier | None:
    s = config.storage
    if not s.enabled:
        return None
    try:
        return open_storage_tier(config, model, tree, host)
    except StorageUnavailable as err:  # a damaged store that could not be replaced
        logger.error("L3 (%s) unavailable, serving without L3 until a restart: %s",
                     s.backend, err)
        return None


