"""How the engine sizes L1 and L2 when the config leaves them to it."""

from __future__ import annotations

import pytest
import torch

from hicache import build as cache_setup
from hicache.memory import DeviceKVPool
from hicache.model_kv import ModelKV
from hicache.stack import CacheStack
from hicache.stats import RequestCounters, StorageStats
from hicache.storage.tier_state import StorageCounters
from hicache_server.config import load_config

PER_TOKEN = DeviceKVPool.bytes_per_token(2, 2, 32, torch.float32)  # 1 KiB
GIB = 1 << 30


def loaded_on_cpu() -> ModelKV:
    return ModelKV(2, 2, 32, torch.float32, torch.device("cpu"), "test-model")


@pytest.fixture
def host_memory(monkeypatch: pytest.MonkeyPatch):
    def set_available(nbytes: int) -> None:
        monkeypatch.setattr(cache_setup, "available_memory_bytes", lambda: nbytes)
    return set_available


def l1_tokens(**overrides) -> int:
    cfg = load_config(None, {"cache.page_size": 16, **overrides})
    return cache_setup._l1_pages(cfg, loaded_on_cpu()) * 16


def test_auto_l1_leaves_room_for_an_auto_l2_in_host_memory(host_memory) -> None:
    host_memory(64 * GIB)
    plain = l1_tokens()
    assert plain == cache_setup.CPU_MAX_L1_TOKENS  # 10% of 64 GiB is far more than the cap
    host_memory(64 * 1024 * PER_TOKEN)  # room for 64 Ki tokens of KV in all
    tiered = l1_tokens(**{"cache.hierarchical": True, "host.ratio": 4.0})
    # L2 = 4 x L1 must fit in half of it: L1 <= 8 Ki tokens, not the 6.4 Ki of the CPU share.
    assert tiered == 64 * 1024 * cache_setup.CPU_KV_FRACTION // 16 * 16
    host_memory(16 * 1024 * PER_TOKEN)
    alone = l1_tokens()  # 10% of 16 Ki tokens
    tiered = l1_tokens(**{"cache.hierarchical": True, "host.ratio": 16.0})
    assert tiered * 16 <= 16 * 1024 * cache_setup.HOST_AUTO_FRACTION < alone * 16
    assert tiered == 512


def test_explicit_sizes_are_taken_as_given(host_memory) -> None:
    host_memory(16 * 1024 * PER_TOKEN)
    assert l1_tokens(**{"cache.hierarchical": True, "cache.max_total_tokens": 4096}) == 4096
    # An explicit L2 size leaves L1 to its own budget (the host pool checks its own size).
    explicit = l1_tokens(**{"cache.hierarchical": True, "host.size_gb": 1.0})
    assert explicit == l1_tokens()


def test_l1_in_bytes_is_the_whole_pages_of_kv_that_fit(host_memory) -> None:
    host_memory(64 * GIB)  # the budget alone decides, whatever the free memory
    page = 16 * PER_TOKEN
    assert l1_tokens(**{"cache.kv_cache_memory_bytes": 100 * page + page - 1}) == 1600
    assert l1_tokens(**{"cache.kv_cache_memory_bytes": page}) == 16
    with pytest.raises(ValueError, match="holds no page of this model's KV"):
        l1_tokens(**{"cache.kv_cache_memory_bytes": page - 1})
    with pytest.raises(ValueError, match="not both"):
        l1_tokens(**{"cache.kv_cache_memory_bytes": page, "cache.max_total_tokens": 16})


def l1_only_stack(**overrides) -> CacheStack:
    cfg = load_config(None, {"cache.page_size": 4, "cache.max_total_tokens": 64,
                             "model.device": "cpu", **overrides})
    return cache_setup.build_stack(cfg, loaded_on_cpu())


def test_a_stack_without_l2_or_l3_answers_with_harmless_defaults() -> None:
    """The scheduler calls one interface whatever the tiers: an L1-only stack has no
    prefetch to start, is always ready, has nothing to restart, and flushes 0 from L2."""
    stack = l1_only_stack()
    tree = stack.tree
    tree.insert(list(range(8)), stack.device_pool.alloc(8))
    assert not stack.l3.prefetch("r", list(range(8)), None)
    assert stack.l3.ready("r") and stack.l3.end("r") == 0
    assert stack.l3.take_restarts() == [] and not stack.steps.busy()
    assert tree.host.init_load_back(tree.root).device_indices.numel() == 0
    assert tree.host.host_sizes().total == 0 and tree.host.writing_check() == []
    assert not hasattr(tree, "writing_check")  # the defaults are the NoHostTier's
    stack.steps.poll()
    stack.check_integrity()
    stats = stack.stats(RequestCounters(requests=1, cached_device_tokens=4))
    assert stats.host is None and stats.storage is None
    assert (stats.device.used_tokens, stats.device.hit_tokens) == (8, 4)
    assert set(stats.as_dict()["tiers"]) == {"device"}
    assert stack.flush(["device", "host", "storage"]) == {"device": 8, "host": 0, "storage": 0}
    stack.admin.close()


def test_the_snapshot_does_not_move_with_the_counters() -> None:
    """Stats are read on another thread than the one that counts: a snapshot is a copy."""
    counters = RequestCounters(requests=1)
    stack = l1_only_stack()
    stats = stack.stats(counters)
    counters.requests += 1
    assert stats.requests.requests == 1


def test_storage_page_counts_never_share_a_name_with_token_counts() -> None:
    """A backend counts pages (`hits`, `misses`); the tier counts tokens (`hits`). One
    overwrote the other in the old merged dict, while `misses` stayed in pages."""
    backend = {"pages": 3, "bytes": 300, "capacity_bytes": 1000, "hits": 5, "misses": 2,
               "errors_by_op": {"batch_get": 1}, "path": "/tmp/x"}
    s = StorageStats.read(backend, {"get": 2}, hit_tokens=64, counters=StorageCounters())
    assert (s.hit_tokens, s.hit_pages, s.miss_pages, s.errors) == (64, 5, 2, 3)
    shown = s.as_dict()
    assert (shown["hits"], shown["hit_pages"], shown["miss_pages"]) == (64, 5, 2)
    assert "misses" not in shown and shown["path"] == "/tmp/x"
    assert shown["errors_by_op"] == {"batch_get": 1, "get": 2} and shown["errors"] == 3


def test_a_hybrid_model_s_bytes_are_one_pool_that_either_kind_of_layer_fills() -> None:
    """Gemma 3 270M's shape (3 full layers, 15 of a 512-token window) at the bytes of 4,096
    tokens of every layer: 1,536 pages of the full layers' width, which hold 24,576 tokens
    of full-layer KV alone, or 4,096 with all their window KV; the split names 4,096."""
    windows = tuple(None if i % 6 == 5 else 512 for i in range(18))
    model = ModelKV(18, 1, 256, torch.float32, torch.device("cpu"), "gemma3-shape", windows)
    budget = 4096 * DeviceKVPool.bytes_per_token(18, 1, 256, torch.float32)
    cfg = load_config(None, {"cache.page_size": 16, "cache.kv_cache_memory_bytes": budget,
                             "model.device": "cpu"})
    pool = cache_setup._l1_pool(cfg, model)
    assert (pool.num_pages, pool.groups, pool.nominal_pages * 16) == (1536, 5, 4096)
    assert pool.size_bytes == (1536 + 1) * pool.shared.page_bytes  # the padding page beside
    assert pool.size_bytes - pool.shared.page_bytes == budget
    assert pool.allocator.total_size() == 24576 and pool.window_capacity() == 4096
    assert cache_setup._l1_tokens(pool) == 4096  # what host.ratio and the pins count
    full_only = pool.alloc(24576, window=False)
    assert full_only is not None and pool.free_pages() == 0
    pool.free(full_only)
    every_layer = pool.alloc(4096)
    assert every_layer is not None and pool.window_used() == 4096 and pool.free_pages() == 0
