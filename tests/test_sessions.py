"""Session-aware retention (SGLang's `--enable-session-radix-cache`): nodes a live session's
requests used are evicted from L1 and L2 after every unowned node, in the policy's order
within each class; closing a session (POST /close_session) or its timeout releases them."""

from __future__ import annotations

import random
import time
from contextlib import AbstractAsyncContextManager

import pytest
from aiohttp.test_utils import TestClient
from conftest import app_client
from hypothesis import given, settings
from hypothesis import strategies as st
from test_eviction_priority import RecordingAllocator, fake_clock
from test_hiradix_cache import make_pools

from hicache.transfer.controller import HiCacheController
from hicache.transfer.engines import CpuTransferEngine
from hicache.tree.hiradix import HiRadixCache
from hicache.tree.radix import RadixCache
from hicache.tree.sessions import SessionTable
from hicache_server.args import parse_config
from hicache_server.config import load_config
from hicache_server.engine import Engine
from hicache_server.http.native import parse_generate
from hicache_server.request import InvalidRequest

PAGE = 16
PARAMS = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


# ----------------------------------------------------------------------------- the tree

def leaf_key(i: int, length: int = 3) -> tuple[int, ...]:
    return tuple(range(100 * i, 100 * i + length))  # distinct first tokens: root's children


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 8), owned=st.sets(st.integers(0, 7)),
       policy=st.sampled_from(["lru", "lfu"]), data=st.data())
def test_owned_leaves_are_evicted_last_in_policy_order(n, owned, policy, data) -> None:
    """n sibling leaves, inserted at ticks 1..n, each hit a random number of times; some
    owned by a session. One eviction at a time takes every unowned leaf before any owned
    one, and within each class the policy's order (lru: oldest; lfu: fewest hits, then
    oldest)."""
    owned = {i for i in owned if i < n}
    hits = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    with fake_clock() as clock:
        tree = RadixCache(RecordingAllocator(), eviction_policy=policy)
        for i in range(n):
            clock.now = float(i + 1)
            tree.insert(leaf_key(i))
        for i in range(n):
            for _ in range(hits[i]):
                clock.now += 1.0
                tree.match_prefix(leaf_key(i))
        tick = {i: tree.peek_path(leaf_key(i))[-1].last_access_time for i in range(n)}
        for i in owned:
            tree.retention.own(tree.peek_path(leaf_key(i))[-1], "s")
        tree.check_integrity()
        order = []
        while len(order) < n:
            assert tree.evict(1) == 3
            order += [i for i in range(n) if i not in order and not tree.peek_prefix(leaf_key(i))]
    policy_key = (lambda i: tick[i]) if policy == "lru" else (lambda i: (1 + hits[i], tick[i]))
    expected = (sorted(set(range(n)) - owned, key=policy_key) + sorted(owned, key=policy_key))
    assert order == expected


def test_split_copies_ownership_and_delete_drops_it() -> None:
    tree = RadixCache(RecordingAllocator(), page_size=2)
    tree.insert((1, 2, 3, 4, 5, 6))
    tree.retention.own(tree.peek_path((1, 2, 3, 4, 5, 6))[-1], "a")
    tree.insert((1, 2, 9, 9))  # splits the owned edge after (1, 2)
    tree.check_integrity()
    upper = tree.peek_path((1, 2))[-1]
    assert upper.owners == {"a"} and len(upper.key) == 2
    assert tree.peek_path((1, 2, 9, 9))[-1].owners == frozenset()  # a new, unowned leaf
    assert tree.retention.owned_tokens().device == 6
    assert tree.evict(2) == 2  # the unowned (9, 9) leaf goes first
    assert tree.peek_prefix((1, 2, 3, 4, 5, 6)) == 6
    assert tree.evict(6) == 6  # then the owned ones: deleted, they leave the session
    tree.check_integrity()
    assert tree.retention.owned_tokens().device == 0 and tree.retention.disown("a") == 0


def test_closing_a_session_puts_its_nodes_back_in_policy_order() -> None:
    with fake_clock() as clock:
        tree = RadixCache(RecordingAllocator())
        clock.now = 1.0
        tree.insert(leaf_key(0))  # older, owned
        tree.retention.own(tree.peek_path(leaf_key(0))[-1], "s")
        clock.now = 2.0
        tree.insert(leaf_key(1))  # newer, unowned
        table = SessionTable(tree, timeout_s=10.0)
        table.touch("s", now=1.0)
        assert table.expire(now=10.5) == []
        assert table.sizes() == (1, 3, 0)
        assert table.close("s") and not table.close("s")
        tree.check_integrity()
        tree.evict(1)
    assert tree.peek_prefix(leaf_key(0)) == 0 and tree.peek_prefix(leaf_key(1)) == 3


def test_a_session_times_out_oldest_first() -> None:
    tree = RadixCache(RecordingAllocator())
    tree.insert(leaf_key(0))
    tree.retention.own(tree.peek_path(leaf_key(0))[-1], "old")
    table = SessionTable(tree, timeout_s=5.0)
    table.touch("old", now=0.0)
    table.touch("new", now=3.0)
    assert table.expire(now=4.9) == []
    assert table.expire(now=5.0) == ["old"] and "new" in table
    assert tree.retention.owned_tokens().device == 0
    assert table.expire(now=8.0) == ["new"] and len(table) == 0
    with pytest.raises(ValueError, match="timeout"):
        SessionTable(tree, timeout_s=0)


def test_l2_evicts_owned_host_leaves_last() -> None:
    """Two prefixes demoted to L2 (the owned one older); an L2 eviction of one takes the
    unowned one, and after `disown` the owned one is evictable in LRU order again."""
    dev, host = make_pools(16, 16, 1)
    ctrl = HiCacheController(dev, host, CpuTransferEngine(dev, host))
    tree = HiRadixCache(ctrl, page_size=1)
    for i in range(2):
        slots = dev.alloc(3)
        tree.insert(leaf_key(i), slots)
        tree.writing_check(wait=True)
    tree.retention.own(tree.peek_path(leaf_key(0))[-1], "s")
    assert tree.evict(6) == 6  # both demoted to L2
    tree.check_integrity()
    assert tree.evict_host(3) == 3
    assert tree.peek_prefix(leaf_key(0)) == 3 and tree.peek_prefix(leaf_key(1)) == 0
    assert tree.retention.owned_tokens() == (0, 3)
    tree.retention.disown("s")
    assert tree.evict_host(3) == 3 and tree.peek_prefix(leaf_key(0)) == 0
    tree.check_integrity()


# --------------------------------------------------------------------------- the engine

def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def session_engine(timeout_s: float = 600.0) -> Engine:
    return Engine(load_config(None, {
        "cache.page_size": PAGE, "cache.max_total_tokens": 256, "model.device": "cpu",
        "cache.session_retention": True, "cache.session_timeout_s": timeout_s}))


def cached(e: Engine, ids: list[int]) -> int:
    return e._call(lambda: e.cache.tree.peek_prefix(ids))


def flood(e: Engine, seed: int) -> None:
    """A prompt of 8 pages in a 16-page L1 that holds two 5-page prefixes: one must go."""
    e.generate(input_ids=prompt(seed, 8 * PAGE - 8), sampling_params=PARAMS)


def test_a_live_sessions_older_prefix_survives_l1_pressure_then_goes_once_closed() -> None:
    old, new = prompt(1, 5 * PAGE), prompt(2, 5 * PAGE)
    with session_engine() as e:
        e.generate(input_ids=old, sampling_params=PARAMS, session_id="chat-1")
        e.generate(input_ids=new, sampling_params=PARAMS)  # newer, no session
        assert e.stats()["sessions"]["live_sessions"] == 1
        assert e.stats()["sessions"]["owned_device_tokens"] >= 4 * PAGE
        flood(e, 3)
        assert cached(e, old) >= 4 * PAGE and cached(e, new) == 0  # LRU alone: the reverse
        again = e.generate(input_ids=old, sampling_params=PARAMS, session_id="chat-1")
        assert again["meta_info"]["cached_tokens_details"]["device"] >= 4 * PAGE
        assert e.close_session("chat-1") and not e.close_session("chat-1")
        assert e.stats()["sessions"] == {"live_sessions": 0, "owned_device_tokens": 0,
                                         "owned_host_tokens": 0}
        e.generate(input_ids=new, sampling_params=PARAMS)  # newer than `old` now
        flood(e, 4)
        assert cached(e, old) == 0 and cached(e, new) >= 4 * PAGE
        e._call(e.cache.check_integrity)


def test_a_session_with_no_request_for_its_timeout_releases_its_prefix() -> None:
    old, new = prompt(5, 5 * PAGE), prompt(6, 5 * PAGE)
    with session_engine(timeout_s=0.3) as e:
        e.generate(input_ids=old, sampling_params=PARAMS, session_id="s")
        e.generate(input_ids=new, sampling_params=PARAMS)
        time.sleep(0.5)  # the scheduler's per-step check closes "s"
        deadline = time.monotonic() + 5
        while e.stats()["sessions"]["live_sessions"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert e.stats()["sessions"]["live_sessions"] == 0
        flood(e, 7)
        assert cached(e, old) == 0 and cached(e, new) >= 4 * PAGE


def test_a_request_of_a_closed_session_reopens_it_and_n_choices_share_it() -> None:
    with session_engine() as e:
        reqs = e.make_requests(input_ids=[1, 2, 3], sampling_params={"n": 2}, session_id="x")
        assert [r.input.session_id for r in reqs] == ["x", "x"]
        with pytest.raises(InvalidRequest, match="session_id"):
            e.make_request(input_ids=[1, 2, 3], session_id=7)
        with pytest.raises(InvalidRequest, match="session_id"):
            e.make_request(input_ids=[1, 2, 3], session_id="")
        e.generate(input_ids=prompt(8, 3 * PAGE), sampling_params=PARAMS, session_id="x")
        assert e.close_session("x")
        e.generate(input_ids=prompt(8, 3 * PAGE), sampling_params=PARAMS, session_id="x")
        assert e.stats()["sessions"]["live_sessions"] == 1


def test_the_flag_and_the_config_keys() -> None:
    config, _ = parse_config(["--enable-session-radix-cache"])
    assert config.cache.session_retention and config.cache.session_timeout_s == 600
    assert not parse_config([])[0].cache.session_retention
    with pytest.raises(Exception, match="session_timeout_s"):
        load_config(None, {"cache.session_timeout_s": 0})


# ----------------------------------------------------------------------------- HTTP

def client(e: Engine) -> AbstractAsyncContextManager[TestClient]:
    # /close_session is not guarded by the admin key
    return app_client(e, admin=True, admin_key="secret", wait_idle=False)


@pytest.fixture(scope="module")
def engine() -> Engine:
    with session_engine() as e:
        yield e


def test_session_params_id_only() -> None:
    assert parse_generate({"text": "a", "session_params": {"id": "s1"}}).session_id == "s1"
    assert parse_generate({"text": "a", "session_id": "s1",
                           "session_params": {"id": "s1"}}).session_id == "s1"
    assert parse_generate({"text": "a"}).session_id is None


async def test_the_routes_take_a_session_id(engine) -> None:
    async with client(engine) as c:
        body = {"input_ids": prompt(9, 2 * PAGE + 1), "sampling_params": PARAMS}
        resp = await c.post("/generate", json={**body, "session_id": "g"})
        assert resp.status == 200, await resp.text()
        resp = await c.post("/generate", json={**body, "session_params": {"id": "p"}})
        assert resp.status == 200, await resp.text()
        resp = await c.post("/v1/completions", json={"prompt": prompt(10, 2 * PAGE + 1),
                                                     "max_tokens": 1, "session_id": "o"})
        assert resp.status == 200, await resp.text()
        resp = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "q" * 3 * PAGE}], "max_tokens": 1,
            "session_id": "c"})
        assert resp.status == 200, await resp.text()
        tiers = await (await c.get("/admin/tiers",
                                   headers={"Authorization": "Bearer secret"})).json()
        assert tiers["sessions"]["live_sessions"] == 4
        assert tiers["sessions"]["owned_device_tokens"] >= 6 * PAGE
        for sid, ok in (("g", True), ("g", False), ("never", False)):
            resp = await c.post("/close_session", json={"session_id": sid})
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["success"] is ok
        assert engine.stats()["sessions"]["live_sessions"] == 3


@pytest.mark.parametrize("route, body, message", [
    ("/generate", {"text": "a", "session_id": 5}, "session_id"),
    ("/generate", {"text": "a", "session_id": ["s"]}, "session_id"),
    ("/generate", {"text": "a", "session_params": "s"}, "session_params"),
    ("/generate", {"text": "a", "session_params": {"id": "s", "rid": "r"}}, "rid not supported"),
    ("/generate", {"text": "a", "session_params": {"id": 3}}, "session_id"),
    ("/generate", {"text": "a", "session_id": "a", "session_params": {"id": "b"}},
     "different sessions"),
    ("/v1/completions", {"prompt": "a", "session_id": 1.5}, "session_id"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "session_id": {}}, "session_id"),
    ("/close_session", {}, "required"),
    ("/close_session", {"session_id": 1}, "session_id"),
    ("/close_session", {"session_id": "s", "other": 1}, "unknown field"),
])
async def test_bad_session_fields_are_400(engine, route, body, message) -> None:
    async with client(engine) as c:
        resp = await c.post(route, json=body)
        assert resp.status == 400, await resp.text()
        assert message in (await resp.json())["error"]["message"]


def test_metrics_show_live_sessions() -> None:
    from hicache_server.http.metrics import CacheMetrics

    with session_engine() as e:
        e.generate(input_ids=prompt(11, 2 * PAGE + 1), sampling_params=PARAMS, session_id="m")
        text = CacheMetrics(e.cache_stats, page_size=PAGE).render().decode()
    assert "hicache:live_sessions 1.0" in text
    assert 'hicache:session_owned_tokens{tier="device"} 32.0' in text
