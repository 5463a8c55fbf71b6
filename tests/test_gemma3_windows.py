"""A hybrid model's window layers kept by their window in L1 (`WindowedKVPool`, the tree's
`WindowKV`), through the real engine: random-weight Gemma 3 (windows of 40 tokens, pages of
16) keeps window-layer KV only around its boundaries, gives the tokens of recomputation from
hits whose window KV is whole, from shorter hits once the tree tombstoned it, and when a small
L1 makes it tombstone under pressure, its full-layer KV taking the pages window KV left."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import tier_workload as tiers
from conftest import app_client
from test_gemma3_tiers import write_random_gemma3

from hicache.memory.windowed import WindowedKVPool
from hicache.pages import pages_down

PAGE = tiers.PAGE


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_gemma3(tmp_path_factory.mktemp("gemma3w"))


@pytest.fixture(scope="module")
def recomputed(served: Path) -> list[list[int]]:
    return tiers.recompute(served)


def _windows(e: tiers.Engine) -> dict:
    return e.stats()["tiers"]["device"]["window_layers"]


def test_l1_is_split_and_a_long_prompt_keeps_its_window_kv_while_the_pool_has_room(
        served: Path) -> None:
    """The pages a running request no longer reads stay spare and join the tree with its
    prompt (a prompt diverging inside it hits); under pressure the tree tombstones them
    (`test_a_small_window_pool_...`)."""
    rng = random.Random(1)
    prompt = [rng.randrange(256) for _ in range(650)]
    with tiers.engine(served) as e:
        assert isinstance(e.cache.slots.device_kv(), WindowedKVPool)
        out = e.generate(input_ids=prompt, sampling_params=tiers.GREEDY)
        w = _windows(e)
        device = e.stats()["tiers"]["device"]
        again = e.generate(input_ids=prompt, sampling_params=tiers.GREEDY)
    cached = pages_down(len(prompt) + tiers.GREEDY["max_new_tokens"] - 1, PAGE)
    assert device["used"] == cached
    assert w["cached_tokens"] == cached  # every page's, in a pool with room for them
    assert w["used_tokens"] == w["cached_tokens"]  # nothing runs: the tree's only
    assert again["output_ids"] == out["output_ids"]
    assert again["meta_info"]["cached_tokens"] == pages_down(len(prompt) - 1, PAGE)


def test_hits_are_whole_windows_and_tombstones_shorten_them(
        served: Path, recomputed: list[list[int]]) -> None:
    with tiers.engine(served) as e:
        assert tiers.run_workload(e) == recomputed
        assert e.stats()["counters"]["cached_device"] > 0
        e.cache.check_integrity()
        tree = e.cache.tree
        dropped = e._call(lambda: tree.windows.tombstone_until(10**9))
        assert dropped > 0 and _windows(e)["cached_tokens"] == 0
        before = e.stats()["counters"]["cached_device"]
        convs = tiers.conversations()
        # every boundary lost its window KV: the same tokens, computed from the start
        out = e.generate(input_ids=convs[0][2], sampling_params=tiers.GREEDY)
        assert out["output_ids"] == recomputed[6]
        assert out["meta_info"]["cached_tokens"] == 0
        assert e.stats()["counters"]["cached_device"] == before
        e.cache.check_integrity()


def test_a_small_l1_tombstones_under_pressure_and_serves_the_same_tokens(
        served: Path, recomputed: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Full and window layers share L1's pages: in a pool of a few prompts' pages the window
    KV of cached boundaries is dropped (tombstones) to make room for new requests' pages."""
    from hicache import build

    monkeypatch.setattr(build, "WINDOW_SHARE", 0.05)
    monkeypatch.setattr(build, "WINDOW_FLOOR_WINDOWS", 1)
    monkeypatch.setattr(build, "STEP_TOKENS", 256)  # the floor only: steps stay 2048
    with tiers.engine(served, **{"cache.max_total_tokens": 512}) as e:
        pool = e.cache.slots.device_kv()
        assert isinstance(pool, WindowedKVPool)
        assert tiers.run_workload(e) == recomputed
        w = _windows(e)
        assert w["tombstoned_tokens"] > 0 and w["used_tokens"] <= w["capacity_tokens"]
        assert e.stats()["counters"]["cached_device"] > 0
        e.cache.check_integrity()


def test_full_layer_kv_fills_the_pages_window_kv_left(
        served: Path, recomputed: list[list[int]]) -> None:
    """One pool for both kinds: L1 sized as 384 tokens of the full layers beside their
    window layers' pages (as many again per window group) caches more than 384 tokens of
    full-layer KV, the workload's 528 distinct ones, once requests have left their early
    tokens' windows, and answers as recomputed."""
    with tiers.engine(served, **{"cache.max_total_tokens": 384}) as e:
        pool = e.cache.slots.device_kv()
        assert isinstance(pool, WindowedKVPool) and pool.nominal_pages * tiers.PAGE == 384
        assert tiers.run_workload(e) == recomputed
        device = e.stats()["tiers"]["device"]
        assert 384 < device["used"] <= device["capacity"] == pool.num_pages * tiers.PAGE
        assert _windows(e)["tombstoned_tokens"] > 0
        e.cache.check_integrity()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_l2_keeps_the_window_kv_l1_tombstones_and_loads_it_back(
        served: Path, recomputed: list[list[int]], policy: str, tmp_path: Path) -> None:
    """L1 of 256 tokens beside an L2 of 2,048: pages go down and come back up, the window
    layers' KV with them where a hit's window needs it; every answer as recomputed."""
    with tiers.tiered(served, tmp_path / "lmdb", **{
            "cache.max_total_tokens": 256, "storage.backend": "none", "host.ratio": 8.0,
            "host.write_policy": policy}) as e:
        assert isinstance(e.cache.slots.device_kv(), WindowedKVPool)
        assert tiers.run_workload(e, between_turns=lambda e: e.flush_cache(["device"])) \
            == recomputed
        host = e.stats()["tiers"]["host"]
        assert host["hits"] > 0 and host["load_back_tokens"] > 0
        e.cache.check_integrity()


async def test_the_window_layers_in_server_info_admin_tiers_and_metrics(served: Path) -> None:
    """Through the HTTP server: what L1 holds for the window layers, beside the full ones."""
    with tiers.engine(served) as e:
        async with app_client(e, admin=True) as client:
            prompt = {"input_ids": tiers.conversations()[0][0],
                      "sampling_params": tiers.GREEDY}
            assert (await client.post("/generate", json=prompt)).status == 200
            info = await (await client.get("/get_server_info")).json()
            windows = info["tiers"]["device"]["window_layers"]
            assert windows["capacity_tokens"] > 0 and windows["capacity_bytes"] > 0
            tiers_now = (await (await client.get("/admin/tiers")).json())["tiers"]["device"]
            assert 0 < tiers_now["window_layers"]["cached_tokens"] <= tiers_now["used"]
            metrics = await (await client.get("/metrics")).text()
    assert 'hicache:window_layer_tokens{state="cached"}' in metrics
    assert "hicache:window_tombstoned_tokens_total" in metrics


def test_a_tombstone_gets_its_window_kv_back_from_its_l2_copy(
        served: Path, recomputed: list[list[int]], tmp_path: Path) -> None:
    """L1 drops every node's window KV; the L2 copies (write_through) still hold it, so the
    same prompt again hits all its pages, the window's brought back, with the same tokens."""
    with tiers.tiered(served, tmp_path / "lmdb", **{"storage.backend": "none"}) as e:
        assert tiers.run_workload(e) == recomputed
        tree = e.cache.tree
        e._call(lambda: tree.writing_check(wait=True))
        assert e._call(lambda: tree.windows.tombstone_until(10**9)) > 0
        assert _windows(e)["cached_tokens"] == 0
        prompt = tiers.conversations()[0][2]
        out = e.generate(input_ids=prompt, sampling_params=tiers.GREEDY)
        assert out["output_ids"] == recomputed[6]
        assert out["meta_info"]["cached_tokens_details"]["device"] == pages_down(
            len(prompt) - 1, PAGE)
        assert _windows(e)["cached_tokens"] > 0
        e.cache.check_integrity()
