"""How the engine sizes L1 and L2 when the config leaves them to it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hicache.config import load_config
from hicache.memory_pool import DeviceKVPool
from server import cache_setup

GEOMETRY = {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 32}
PER_TOKEN = DeviceKVPool.bytes_per_token(2, 2, 32, torch.float32)  # 1 KiB
GIB = 1 << 30


def loaded_on_cpu() -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(**GEOMETRY), dtype=torch.float32,
                           device=torch.device("cpu"))


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
