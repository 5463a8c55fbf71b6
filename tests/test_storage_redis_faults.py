"""L3 Redis against a peer that answers junk: a fake RESP server on loopback (`JunkRedis`).

A junk reply (`+OK` or `:1` to every command: a misconfigured proxy, another service on the
port) is a backend fault like a dead server: a miss or a skipped write, counted per
operation, never raised, and the store recovers by itself once the peer behaves.

Pure-junk peers answer redis-py's connection handshake with junk too (every connection
fails there); greeting peers (`greet=True`) answer the handshake as Redis does and junk
only the data commands, which is where each reply's type is checked. Only the tests that
switch a peer to proxy a real redis-server need one (`redis_server`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis_fixtures import (
    JUNK_EMPTY_ARRAY,
    JUNK_NIL,
    JUNK_OK,
    JUNK_ONE,
    JUNK_REPLIES,
    JunkRedis,
    RedisServer,
    redis_server,
)
from test_storage_lmdb import (
    CAPACITY,
    GEOMETRY,
    filled_pool,
    keys_of,
    read_back,
    slots,
    write_range,
)

from hicache.storage.backends.lmdb_store import LmdbStore
from hicache.storage.backends.redis_store import RedisStore
from hicache.storage.backends.tiered_store import TieredStore
from hicache.storage.page_format import PageCodec
from hicache_server.config import load_config

__all__ = ["redis_server"]  # session fixture, used by name below

# Back-off short enough that a test waits it out between calls (each call then probes the
# peer, so each counts one fault), long enough to be a real interval.
JUNK_BACKOFF = {"backoff_initial_s": 0.01, "backoff_max_s": 0.02}
BACKOFF_WAIT_S = 0.03  # > backoff_max_s: the next call is sent, not backed off
LONG_BACKOFF = {"backoff_initial_s": 10.0, "backoff_max_s": 10.0}  # surely still backing off
RECOVERY_TIMEOUT_S = 5.0  # a store probes a behaving peer within its back-off (<= 0.02 s)
# An engine's store has the default back-off (0.5 s doubling to 30 s): a few faults before
# the peer behaves leave it at a few seconds.
ENGINE_RECOVERY_TIMEOUT_S = 30.0
PAGES = 4
REPLY_NAMES = {JUNK_OK: "ok", JUNK_ONE: "one", JUNK_NIL: "nil", JUNK_EMPTY_ARRAY: "empty"}
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
ENGINE_PAGE = 16
POLL_S = 0.02


def wait_out_backoff() -> None:
    time.sleep(BACKOFF_WAIT_S)


def wait_until(condition: Callable[[], bool], timeout_s: float = RECOVERY_TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


@pytest.fixture
def junk_store() -> Iterator[Callable[..., tuple[JunkRedis, RedisStore]]]:
    """(peer, store on it) for a junk reply; both stopped / closed afterwards."""
    made: list[tuple[JunkRedis, RedisStore]] = []

    def make(reply: bytes, greet: bool = False, **kw: Any) -> tuple[JunkRedis, RedisStore]:
        peer = JunkRedis.start(reply, greet)
        kw = {"key_prefix": f"junk-{uuid.uuid4().hex[:8]}:", **JUNK_BACKOFF, **kw}
        made.append((peer, RedisStore(peer.url, PageCodec(GEOMETRY), **kw)))
        return made[-1]

    yield make
    for peer, store in made:
        store.close()
        peer.stop()


# ------------------------------------------------------------------ junk at every reply


@pytest.mark.parametrize("reply", [JUNK_OK, JUNK_ONE], ids=REPLY_NAMES.get)
def test_a_junk_peer_is_a_counted_fault_for_every_call_and_never_raises(
        junk_store: Callable[..., tuple[JunkRedis, RedisStore]], reply: bytes) -> None:
    peer, store = junk_store(reply)
    pool, keys, where = filled_pool(), keys_of(0, PAGES), slots(list(range(PAGES)))
    stats = store.stats()  # what a server logs at start-up
    assert (stats["errors"], stats["errors_by_op"]) == (1, {"stats": 1})
    assert (stats["pages"], stats["bytes"], stats["capacity_bytes"]) == (0, 0, 0)
    calls: dict[str, Callable[[], object]] = {
        "batch_exists": lambda: store.batch_exists(keys),
        "batch_get": lambda: store.batch_get(keys, pool, where),
        "batch_set": lambda: store.batch_set(keys, pool, where),
        "delete": lambda: store.delete(keys),
        "clear": store.clear}
    results = {}
    for op, call in calls.items():
        wait_out_backoff()  # so that each call asks the peer
        results[op] = call()
    assert results == {"batch_exists": 0, "batch_get": [False] * PAGES,
                       "batch_set": [False] * PAGES, "delete": 0, "clear": 0}
    wait_out_backoff()
    stats = store.stats()
    assert stats["errors_by_op"] == {"stats": 2, **dict.fromkeys(calls, 1)}
    assert stats["errors"] == len(calls) + 2  # + both stats() calls
    assert (stats["hits"], stats["misses"], stats["written_pages"], stats["skipped_pages"],
            stats["corrupt_pages"]) == (0, PAGES, 0, 0, 0)
    assert peer.accepted >= len(calls) + 2  # a fresh connection per probe, never the old one


# What each command's junk reply is, as redis-py 8.1 hands it over (or what it raises), and
# whether the store can tell it from a real answer. Those it cannot are absent: EXISTS ":1"
# (present), GET "$-1" (absent), SET NX "+OK" (stored) or "$-1" (present), UNLINK ":1"
# (removed), DBSIZE ":1".
DETECTABLE = [
    ("batch_exists", JUNK_OK),  # b"OK"
    ("batch_exists", JUNK_NIL),  # None
    ("batch_exists", JUNK_EMPTY_ARRAY),  # []
    ("batch_get", JUNK_ONE),  # 1: never reaches the page codec
    ("batch_get", JUNK_EMPTY_ARRAY),  # []
    ("batch_set", JUNK_ONE),  # False (redis-py's SET callback: not "OK")
    ("batch_set", JUNK_EMPTY_ARRAY),  # []
    ("delete", JUNK_OK),  # b"OK"
    ("delete", JUNK_NIL),  # None
    ("delete", JUNK_EMPTY_ARRAY),  # []
    *(("clear", reply) for reply in JUNK_REPLIES),  # SCAN: (79, 75), or redis-py raises
    *(("stats", reply) for reply in JUNK_REPLIES),  # INFO: {"__raw__": ["OK"]} or raises
]
FALLBACKS: dict[str, object] = {"batch_exists": 0, "batch_get": [False] * PAGES,
                                "batch_set": [False] * PAGES, "delete": 0, "clear": 0}


@pytest.mark.parametrize(("op", "reply"), DETECTABLE,
                         ids=[f"{op}-{REPLY_NAMES[reply]}" for op, reply in DETECTABLE])
def test_a_reply_of_the_wrong_type_is_a_fault_of_its_operation(
        junk_store: Callable[..., tuple[JunkRedis, RedisStore]], op: str,
        reply: bytes) -> None:
    peer, store = junk_store(reply, greet=True, **LONG_BACKOFF)
    pool, keys, where = filled_pool(), keys_of(0, PAGES), slots(list(range(PAGES)))
    calls: dict[str, Callable[[], object]] = {
        "batch_exists": lambda: store.batch_exists(keys),
        "batch_get": lambda: store.batch_get(keys, pool, where),
        "batch_set": lambda: store.batch_set(keys, pool, where),
        "delete": lambda: store.delete(keys), "clear": store.clear, "stats": store.stats}
    result = calls[op]()
    if op == "stats":
        assert (result["pages"], result["bytes"], result["evicted_pages"]) == (0, 0, 0)
    else:
        assert result == FALLBACKS[op]
    stats = store.stats() if op != "stats" else result  # backing off: not sent
    assert stats["errors_by_op"] == {op: 1}
    assert (stats["written_pages"], stats["skipped_pages"], stats["hits"]) == (0, 0, 0)
    assert peer.accepted == 1
    # A connection whose replies are out of step must not be used again: the store closed it.
    assert wait_until(lambda: peer.open_connections == 0)


def test_a_get_answered_ok_is_corrupt_and_its_delete_a_fault(
        junk_store: Callable[..., tuple[JunkRedis, RedisStore]]) -> None:
    """b"OK" is a value of the right type: the page check refuses it, and the UNLINK that
    deletes it is answered junk."""
    _, store = junk_store(JUNK_OK, greet=True)
    pool = filled_pool()
    assert store.batch_get(keys_of(0, PAGES), pool, slots(list(range(PAGES)))) == \
        [False] * PAGES
    stats = store.stats()
    assert (stats["corrupt_pages"], stats["errors_by_op"]) == (PAGES, {"delete_corrupt": 1})


# ------------------------------------------------------------------ recovery


@pytest.mark.parametrize("greet", [False, True], ids=["junk-handshake", "junk-data"])
@pytest.mark.parametrize("reply", [JUNK_OK, JUNK_ONE], ids=REPLY_NAMES.get)
def test_a_junk_peer_that_starts_behaving_is_used_after_the_backoff(
        junk_store: Callable[..., tuple[JunkRedis, RedisStore]], redis_server: RedisServer,
        reply: bytes, greet: bool) -> None:
    peer, store = junk_store(reply, greet)
    pool, keys, where = filled_pool(seed=3), keys_of(0, PAGES), slots(list(range(PAGES)))
    assert store.batch_get(keys, pool, where) == [False] * PAGES
    assert store.stats()["errors"] >= 1  # batch_get's, or (GET answered b"OK") its delete's
    peer.behave(redis_server.port)  # new connections only: the store must reconnect
    assert wait_until(lambda: store.batch_set(keys, pool, where) == [True] * PAGES)
    wait_out_backoff()  # the read side's own interval
    assert read_back(store, pool, 0, PAGES) == [True] * PAGES  # byte-identical
    client = redis_server.client()
    assert all(client.exists(store.key_prefix + key.hex()) for key in keys)  # really stored
    errors = store.stats()["errors"]
    for _ in range(3):
        assert store.batch_exists(keys) == PAGES
        assert read_back(store, pool, 0, PAGES) == [True] * PAGES
        write_range(store, pool, 0, PAGES)  # present: skipped, counted as stored
    stats = store.stats()
    assert stats["errors"] == errors and stats["written_pages"] == PAGES
    assert stats["pages"] >= PAGES and stats["bytes"] > 0
    store.clear()


# ------------------------------------------------------------------ lmdb+redis


@pytest.mark.parametrize("reply", [JUNK_OK, JUNK_ONE], ids=REPLY_NAMES.get)
def test_lmdb_redis_with_a_junk_peer_degrades_to_lmdb_alone(tmp_path: Path,
                                                             reply: bytes) -> None:
    codec = PageCodec(GEOMETRY)
    with JunkRedis.start(reply) as peer:
        store = TieredStore(LmdbStore(tmp_path / "lmdb", CAPACITY, codec, sync=False),
                            RedisStore(peer.url, codec, key_prefix="tier-junk:",
                                       **JUNK_BACKOFF))
        try:
            assert store.stats()["redis"]["errors"] == 1  # at start-up: no exception
            pool = filled_pool(seed=4)
            wait_out_backoff()
            write_range(store, pool, 0, 2 * PAGES)  # True per page: LMDB holds them
            wait_out_backoff()
            assert store.batch_exists(keys_of(0, 3 * PAGES)) == 2 * PAGES
            wait_out_backoff()
            assert read_back(store, pool, 0, 3 * PAGES) == [True] * (2 * PAGES) + \
                [None] * PAGES  # LMDB's pages exact; the rest misses, asked of Redis
            stats = store.stats()
            assert stats["lmdb"]["errors"] == 0 and stats["lmdb"]["written_pages"] == 2 * PAGES
            assert stats["redis"]["errors"] >= 4 and stats["errors"] == stats["redis"]["errors"]
            assert stats["redis"]["written_pages"] == 0 and stats["promoted_pages"] == 0
            assert {f"redis.{op}" for op in ("stats", "batch_set", "batch_exists", "batch_get")
                    } <= set(stats["errors_by_op"])
        finally:
            store.close()


# ------------------------------------------------------------------ an engine


def engine_overrides(**storage: Any) -> dict[str, Any]:
    return {"model.device": "cpu", "cache.page_size": ENGINE_PAGE,
            "cache.max_total_tokens": 2048, "cache.hierarchical": True,
            "storage.prefetch_policy": "wait_complete", "storage.prefetch_threshold": 32,
            **{f"storage.{key}": value for key, value in storage.items()}}


def stored_pages(server: RedisServer, prefix: str) -> int:
    client = server.client()
    try:
        return sum(1 for _ in client.scan_iter(match=prefix + "*"))
    finally:
        client.close()


def test_an_engine_starts_on_a_junk_peer_computes_and_backs_up_once_it_behaves(
        redis_server: RedisServer) -> None:
    from hicache_server.engine import Engine  # the server side only for this test

    def prompt(n: int) -> list[int]:
        return [(7 * i + 3 * n + 1) % 256 for i in range(100)]

    with Engine(load_config(None, engine_overrides(backend="none"))) as plain:
        expected = plain.generate(input_ids=prompt(0), sampling_params=GREEDY)["output_ids"]
    prefix = f"eng-junk-{uuid.uuid4().hex[:8]}:"
    with JunkRedis.start(JUNK_OK) as peer, Engine(load_config(None, engine_overrides(
            backend="redis", **{"redis.url": peer.url, "redis.key_prefix": prefix}))) as engine:
        out = engine.generate(input_ids=prompt(0), sampling_params=GREEDY)
        assert out["output_ids"] == expected  # recomputed: the same greedy tokens
        assert out["meta_info"]["cached_tokens_details"]["storage"] == 0
        storage = engine.stats()["tiers"]["storage"]
        assert storage["errors"] > 0 and storage["written_pages"] == 0
        assert stored_pages(redis_server, prefix) == 0
        peer.behave(redis_server.port)
        deadline, n = time.monotonic() + ENGINE_RECOVERY_TIMEOUT_S, 1
        while stored_pages(redis_server, prefix) == 0:  # a backup after the back-off
            assert time.monotonic() < deadline, "no backup reached Redis"
            engine.generate(input_ids=prompt(n), sampling_params=GREEDY)
            n += 1
            time.sleep(POLL_S)
        # the writer counts a page after Redis took it: the count may trail the keys seen
        while engine.stats()["tiers"]["storage"]["written_pages"] == 0:
            assert time.monotonic() < deadline, "Redis holds pages the stats never counted"
            time.sleep(POLL_S)
    client = redis_server.client()
    for name in client.scan_iter(match=prefix + "*"):
        client.delete(name)
    client.close()
