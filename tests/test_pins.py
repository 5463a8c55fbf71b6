"""Pinned prefixes (POST /admin/pin, /admin/unpin): a pinned path leaves L1 after everything
else and only by demotion to L2, L2 never evicts it, a flush keeps it unless told to unpin,
its TTL releases it, and `cache.max_pinned_tokens` caps what pins hold."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager

import pytest
from aiohttp.test_utils import TestClient
from conftest import app_client
from test_eviction_priority import RecordingAllocator
from test_hiradix_cache import make_pools

from hicache.transfer.controller import HiCacheController
from hicache.transfer.engines import CpuTransferEngine
from hicache.tree.hiradix import HiRadixCache
from hicache.tree.pins import PinRefused, PinTable
from hicache.tree.radix import RadixCache
from hicache_server.config import load_config
from hicache_server.engine import Engine
from hicache_server.http.metrics import CacheMetrics
from hicache_server.request import InvalidRequest

PAGE = 16
PARAMS = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
KEY = "secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


def leaf_key(i: int, length: int = 3) -> tuple[int, ...]:
    return tuple(range(100 * i, 100 * i + length))


# ----------------------------------------------------------------------------- the tree

def test_l1_only_a_pinned_path_is_never_evicted_until_unpinned() -> None:
    tree = RadixCache(RecordingAllocator())
    tree.insert(leaf_key(0))
    tree.insert(leaf_key(1))
    node = tree.peek_path(leaf_key(0))[-1]
    tree.retention.pin(node)
    tree.check_integrity()
    assert tree.evict(100) == 3  # the unpinned leaf only
    assert tree.peek_prefix(leaf_key(0)) == 3
    tree.insert(leaf_key(0) + (7, 8))  # a child below the pin is evictable
    assert tree.evict(100) == 2 and tree.peek_prefix(leaf_key(0)) == 3
    tree.retention.unpin(node)
    tree.check_integrity()
    assert tree.evict(100) == 3 and tree.peek_prefix(leaf_key(0)) == 0
    with pytest.raises(AssertionError, match="unpin"):
        tree.retention.unpin(node)


def hi_tree(dev_pages: int = 16, host_pages: int = 16) -> HiRadixCache:
    dev, host = make_pools(dev_pages, host_pages, 1)
    return HiRadixCache(HiCacheController(dev, host, CpuTransferEngine(dev, host)))


def insert(tree: HiRadixCache, key: tuple[int, ...]) -> None:
    tree.insert(key, tree.controller.device_pool.alloc(len(key)))
    tree.writing_check(wait=True)


def test_l2_a_pinned_path_is_demoted_last_and_never_evicted_from_l2() -> None:
    tree = hi_tree()
    insert(tree, leaf_key(0))  # the oldest: LRU would take it first
    insert(tree, leaf_key(1))
    pinned = tree.peek_path(leaf_key(0))[-1]
    tree.retention.pin(pinned)
    assert tree.evict(3) == 3  # the unpinned leaf is demoted first
    assert not pinned.evicted and tree.peek_path(leaf_key(1))[-1].evicted
    assert tree.evict(3) == 3 and pinned.evicted  # then the pinned one: demoted, kept
    assert tree.evict_host(100) == 3  # L2 takes the unpinned one only
    assert tree.peek_prefix(leaf_key(0)) == 3 and tree.peek_prefix(leaf_key(1)) == 0
    assert tree.flush_host() == 0 and pinned.backuped
    tree.check_integrity()
    tree.retention.unpin(pinned)
    assert tree.flush_host() == 3 and tree.peek_prefix(leaf_key(0)) == 0
    tree.check_integrity()


def test_a_pinned_node_not_in_l2_stays_on_l1() -> None:
    tree = hi_tree()
    tree.write_policy = "write_back"  # nothing is copied to L2 before eviction
    tree.insert(leaf_key(0), tree.controller.device_pool.alloc(3))
    node = tree.peek_path(leaf_key(0))[-1]
    tree.retention.pin(node)
    assert not node.backuped and tree.evict(3) == 0 and not node.evicted


def test_the_pin_table_caps_renews_and_expires() -> None:
    tree = RadixCache(RecordingAllocator())
    for i in range(3):
        tree.insert(leaf_key(i, 4))
    table = PinTable(tree, max_tokens=8)
    nodes = [tree.peek_path(leaf_key(i, 4))[-1] for i in range(3)]
    keys = [(leaf_key(i, 4), None) for i in range(3)]
    for i in range(2):
        table.check(keys[i], nodes[i])
        table.pin(keys[i], nodes[i], ttl_s=10.0 * (i + 1), now=0.0)
    assert table.pinned_tokens() == 8
    with pytest.raises(PinRefused, match="would pin 12; 8 are pinned and the cap .* is 8"):
        table.check(keys[2], nodes[2])
    table.check(keys[0], nodes[0])  # a renewal pins nothing new
    table.pin(keys[0], nodes[0], ttl_s=30.0, now=5.0)
    assert nodes[0].pin_ref == 1
    assert table.expire(now=20.0) == 1 and len(table) == 1  # keys[1] ran out at 20
    assert [i.expires_in_s for i in table.infos(now=20.0)] == [15.0]
    assert table.unpin(keys[0]) and not table.unpin(keys[0])
    assert tree.evict(100) == 12
    tree.check_integrity()


# --------------------------------------------------------------------------- the engine

def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def small_engine(**overrides) -> Engine:
    return Engine(load_config(None, {"cache.page_size": PAGE, "cache.max_total_tokens": 256,
                                     "model.device": "cpu", **overrides}))


def cached(e: Engine, ids: list[int]) -> int:
    return e._call(lambda: e.cache.tree.peek_prefix(ids))


def flood(e: Engine, seeds: range) -> None:
    for seed in seeds:
        e.generate(input_ids=prompt(seed, 7 * PAGE), sampling_params=PARAMS)


def test_l1_only_a_pinned_prefix_survives_a_flood_and_its_ttl_releases_it() -> None:
    ids = prompt(1, 4 * PAGE + 5)  # pins its 4 whole pages; the cap is 256 / 4 = 64
    with small_engine() as e:
        out = e.pin(input_ids=ids, ttl_seconds=600)
        assert (out["pinned_tokens"], out["max_pinned_tokens"]) == (4 * PAGE, 64)
        flood(e, range(100, 106))
        hit = e.generate(input_ids=ids, sampling_params=PARAMS)["meta_info"]
        assert hit["cached_tokens_details"]["device"] == 4 * PAGE
        e.pin(input_ids=ids, ttl_seconds=0.2)  # a renewal: the same pin, a new TTL
        stats = e.stats()["pins"]
        assert stats["pinned_tokens"] == 4 * PAGE and len(stats["pins"]) == 1
        assert stats["pins"][0]["expires_in_s"] <= 0.2
        time.sleep(0.4)  # the scheduler's per-step check releases it
        deadline = time.monotonic() + 5
        while e.stats()["pins"]["pins"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert e.stats()["pins"] == {"pinned_tokens": 0, "max_pinned_tokens": 64, "pins": []}
        flood(e, range(110, 114))
        assert cached(e, ids) == 0
        e._call(e.cache.check_integrity)


def test_the_cap_refuses_with_what_is_pinned() -> None:
    with small_engine() as e:
        with pytest.raises(InvalidRequest, match="exceeds the cap .* of 64"):
            e.pin(input_ids=prompt(2, 5 * PAGE), ttl_seconds=60)
        e.pin(input_ids=prompt(3, 3 * PAGE), ttl_seconds=60)
        with pytest.raises(InvalidRequest, match="would pin 96; 48 are pinned and the cap "
                                                 r"\(cache.max_pinned_tokens\) is 64"):
            e.pin(input_ids=prompt(4, 3 * PAGE), ttl_seconds=60)
        for bad in (0, -1, "10", True, 1e9):
            with pytest.raises(InvalidRequest, match="ttl_seconds"):
                e.pin(input_ids=prompt(3, 3 * PAGE), ttl_seconds=bad)
        with pytest.raises(InvalidRequest, match="whole pages"):
            e.pin(input_ids=prompt(3, PAGE - 1), ttl_seconds=60)
    with small_engine(**{"cache.max_pinned_tokens": 0}) as e, \
            pytest.raises(InvalidRequest, match="cap"):
        e.pin(input_ids=prompt(3, PAGE), ttl_seconds=60)
    with small_engine(**{"cache.enable_radix_cache": False}) as e, \
            pytest.raises(InvalidRequest, match="pins need the radix cache"):
        e.pin(input_ids=prompt(3, PAGE), ttl_seconds=60)


@pytest.fixture(scope="module")
def hier() -> Iterator[Engine]:
    # L1 256 tokens, L2 512 (ratio 2): the cap is 128
    with small_engine(**{"cache.hierarchical": True, "host.io_backend": "direct"}) as e:
        yield e


def test_with_l2_a_pinned_prefix_outlives_floods_of_both_tiers_and_flushes(hier) -> None:
    e, ids = hier, prompt(5, 6 * PAGE)
    e.pin(input_ids=ids, extra_key="ns", ttl_seconds=600)
    flood(e, range(200, 216))  # 16 x 7 pages through a 16-page L1 and a 32-page L2
    assert cached(e, ids) == 0  # another namespace
    hit = e.generate(input_ids=ids + [1], extra_key="ns", sampling_params=PARAMS)
    details = hit["meta_info"]["cached_tokens_details"]
    assert details["device"] + details["host"] == 6 * PAGE
    e.flush_cache()  # every tier: the pinned pages stay (moved to L2)
    assert e._call(lambda: e.cache.tree.peek_prefix(ids, "ns")) == 6 * PAGE
    assert e.stats()["tiers"]["host"]["used"] >= 6 * PAGE
    e.flush_cache(["device", "host"], unpin=True)
    assert e._call(lambda: e.cache.tree.peek_prefix(ids, "ns")) == 0
    assert e.stats()["pins"]["pins"] == []
    e._call(e.cache.check_integrity)


def test_unpin(hier) -> None:
    e, ids = hier, prompt(6, 2 * PAGE + 3)
    e.pin(input_ids=ids, ttl_seconds=600)
    assert e.stats()["pins"]["pins"][0]["tokens"] == 2 * PAGE
    assert not e.unpin(input_ids=ids, extra_key="other")
    assert e.unpin(input_ids=ids) and not e.unpin(input_ids=ids)
    assert e.stats()["pins"]["pinned_tokens"] == 0


# ----------------------------------------------------------------------------- HTTP

def client(e: Engine) -> AbstractAsyncContextManager[TestClient]:
    return app_client(e, admin=True, admin_key=KEY, wait_idle=False)


async def test_the_pin_routes(hier) -> None:
    ids = prompt(7, 3 * PAGE)
    async with client(hier) as c:
        resp = await c.post("/admin/pin", json={"input_ids": ids, "ttl_seconds": 120,
                                                "extra_key": "t"}, headers=AUTH)
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["pinned_tokens"] == 3 * PAGE
        tiers = await (await c.get("/admin/tiers", headers=AUTH)).json()
        assert tiers["pinned_tokens"] == 3 * PAGE and tiers["max_pinned_tokens"] == 128
        [pin] = tiers["pins"]
        assert (pin["tokens"], pin["extra_key"]) == (3 * PAGE, "t")
        assert 119 < pin["expires_in_s"] <= 120
        text = CacheMetrics(hier.cache_stats, page_size=PAGE).render().decode()
        assert f"hicache:pinned_tokens {3 * PAGE}.0" in text
        resp = await c.post("/admin/pin", json={"input_ids": prompt(8, 6 * PAGE),
                                                "ttl_seconds": 120}, headers=AUTH)
        assert resp.status == 400
        assert "48 are pinned and the cap" in (await resp.json())["error"]["message"]
        resp = await c.post("/admin/flush", json={"tiers": ["device", "host"]}, headers=AUTH)
        assert resp.status == 200 and "unpinned" not in await resp.json()
        assert hier._call(lambda: hier.cache.tree.peek_prefix(ids, "t")) == 3 * PAGE
        resp = await c.post("/admin/unpin", json={"input_ids": ids}, headers=AUTH)
        assert resp.status == 404  # pinned under extra_key "t"
        resp = await c.post("/admin/unpin", json={"input_ids": ids, "extra_key": "t"},
                            headers=AUTH)
        assert resp.status == 200 and (await resp.json()) == {"success": True}
        resp = await c.post("/admin/pin", json={"input_ids": ids, "ttl_seconds": 120},
                            headers=AUTH)
        assert resp.status == 200
        resp = await c.post("/admin/flush", json={"tiers": ["device", "host"],
                                                  "unpin": True}, headers=AUTH)
        assert resp.status == 200 and (await resp.json())["unpinned"] is True
        assert hier._call(lambda: hier.cache.tree.peek_prefix(ids)) == 0


@pytest.mark.parametrize("route, body, status, message", [
    ("/admin/pin", {"input_ids": [1] * PAGE}, 400, "ttl_seconds` is required"),
    ("/admin/pin", {"input_ids": [1] * PAGE, "ttl_seconds": "1"}, 400, "ttl_seconds"),
    ("/admin/pin", {"ttl_seconds": 5}, 400, "exactly one of"),
    ("/admin/pin", {"text": "a", "ttl_seconds": 5, "ttl": 5}, 400, "unknown field"),
    ("/admin/unpin", {"input_ids": [1] * PAGE, "ttl_seconds": 5}, 400, "unknown field"),
    ("/admin/flush", {"unpin": "yes"}, 400, "unpin"),
])
async def test_bad_pin_bodies(hier, route, body, status, message) -> None:
    async with client(hier) as c:
        resp = await c.post(route, json=body, headers=AUTH)
        assert resp.status == status, await resp.text()
        assert message in (await resp.json())["error"]["message"]


@pytest.mark.parametrize("route", ["/admin/pin", "/admin/unpin"])
async def test_the_pin_routes_are_guarded(hier, route) -> None:
    body = {"input_ids": [1] * PAGE, "ttl_seconds": 5}
    async with client(hier) as c:
        assert (await c.post(route, json=body)).status == 401
        resp = await c.post(route, json=body, headers={"Authorization": "Bearer wrong"})
        assert resp.status == 403


# ------------------------------------------------------- what admission may count on

def test_pinned_pages_that_cannot_leave_l1_are_not_counted_as_freeable() -> None:
    """Without L2 a pinned path is never evicted, so admission must not count it as room:
    `evictable_size() - stuck_pinned_size()` is what `evict` can really free."""
    tree = RadixCache(RecordingAllocator(), page_size=1)
    tree.insert(list(range(8)))
    tree.insert([100, 101, 102])
    pinned = tree.peek_path(list(range(8)))[-1]
    tree.retention.pin(pinned)
    assert tree.evictable_size() == 11 and tree.retention.stuck_pinned_size() == 8
    assert tree.retention.stuck_pinned_size(pinned) == 0  # a request on that path counts it already
    freeable = tree.evictable_size() - tree.retention.stuck_pinned_size()
    assert tree.evict(tree.total_size()) == freeable == 3
    tree.inc_lock_ref(pinned)  # locked: out of evictable_size(), so not stuck either
    assert tree.retention.stuck_pinned_size() == 0
    tree.dec_lock_ref(pinned)
    tree.retention.unpin(pinned)
    assert tree.retention.stuck_pinned_size() == 0 and tree.evict(8) == 8


def test_a_pinned_node_backed_up_in_l2_can_still_leave_l1() -> None:
    dev, host = make_pools(16, 16, 4)
    tree = HiRadixCache(HiCacheController(dev, host, CpuTransferEngine(dev, host)), 4,
                        write_policy="write_back")
    slots = dev.alloc(8)
    tree.insert(list(range(8)), slots)
    node = tree.peek_path(list(range(8)))[-1]
    tree.retention.pin(node)
    assert tree.retention.stuck_pinned_size() == 8  # write_back: no copy in L2 yet
    tree.back_up_path(node)
    tree.writing_check(wait=True)
    assert tree.retention.stuck_pinned_size() == 0  # demotable: it may leave L1 for L2
    tree.retention.unpin(node)


def test_requests_wait_rather_than_fail_when_pins_hold_l1(tmp_path) -> None:
    """L1 only, half of it pinned: requests arriving together that fit only one at a time
    in what is left all finish (none fails on room that admission counted but eviction
    could not free)."""
    import threading
    with Engine(load_config(None, {"model.device": "cpu", "cache.page_size": 16,
                                   "cache.max_total_tokens": 512,
                                   "cache.max_pinned_tokens": 1024})) as e:  # clamped: 240
        info = e.pin(input_ids=list(range(3, 3 + 250)), ttl_seconds=600)
        assert info["pinned_tokens"] == 240
        rng = random.Random(3)
        prompts = [[rng.randrange(3, 256) for _ in range(190)] for _ in range(3)]
        outs: list[dict] = []
        threads = [threading.Thread(target=lambda p=p: outs.append(e.generate(
            input_ids=p, sampling_params={"temperature": 0, "max_new_tokens": 4})))
            for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert sorted(o["meta_info"]["finish_reason"] for o in outs) == ["length"] * 3
        assert e.stats()["counters"]["request_errors"] == 0
