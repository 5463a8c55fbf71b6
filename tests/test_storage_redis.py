"""L3 Redis backend against real redis-server processes on loopback: one node and a Cluster.

Each test writes under its own key prefix, so the session's servers are shared safely.
Servers that a test stops, pauses or fills are its own.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from redis_fixtures import (
    RedisClusterNodes,
    RedisServer,
    count_sends,
    redis_cluster,
    redis_server,
)
from test_storage_lmdb import (
    GEOMETRY,
    NUM_PAGES,
    assert_closed_twice_then_misses,
    filled_pool,
    keys_of,
    page_bytes,
    read_back,
    slots,
    write_range,
)

from hicache.config import ConfigError
from hicache.config_storage import RedisConfig
from hicache.kernels.layouts import LAYER_FIRST, PAGE_FIRST
from hicache.memory.host import HostKVPool
from hicache.storage.backends import create_backend
from hicache.storage.backends.redis_store import PASSWORD_ENV, Backoff, RedisStore
from hicache.storage.page_format import HEADER_BYTES, PageCodec
from hicache_server.config import load_config

__all__ = ["redis_cluster", "redis_server"]  # session fixtures, used by name below

TOPOLOGIES = ("single", "cluster")
TINY_BACKOFF = {"backoff_initial_s": 0.05, "backoff_max_s": 0.2}
# Long enough that the calls right after a fault are surely inside the interval (asserted),
# short enough that recovery takes a second.
SHORT_BACKOFF = {"backoff_initial_s": 0.5, "backoff_max_s": 1.0}
LONG_BACKOFF = {"backoff_initial_s": 10.0, "backoff_max_s": 10.0}
RECOVERY_TIMEOUT_S = 5.0  # a restarted server is back well within this
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
ENGINE_PAGE = 16
SUBPROCESS_TIMEOUT_S = 120


@pytest.fixture
def target(request: pytest.FixtureRequest) -> RedisServer | RedisClusterNodes:
    """The session's single node or cluster, per the test's `topology` parameter."""
    name = "redis_cluster" if request.param == "cluster" else "redis_server"
    return request.getfixturevalue(name)


@pytest.fixture
def make_store(target: RedisServer | RedisClusterNodes) -> Iterator[Callable[..., RedisStore]]:
    """Stores on `target` under one fresh key prefix (unless given), closed afterwards."""
    prefix, made = f"t-{uuid.uuid4().hex[:8]}:", []

    def make(**kw: Any) -> RedisStore:
        kw.setdefault("key_prefix", prefix)
        store = RedisStore(target.url, PageCodec(GEOMETRY),
                           cluster=isinstance(target, RedisClusterNodes), **kw)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def raw(target: RedisServer | RedisClusterNodes) -> redis.Redis | redis.RedisCluster:
    if isinstance(target, RedisClusterNodes):
        return redis.RedisCluster.from_url(target.url)
    return target.client()


def name_of(store: RedisStore, key: bytes) -> str:
    return store.key_prefix + key.hex()


parametrize_topology = pytest.mark.parametrize("target", TOPOLOGIES, indirect=True)


# ----------------------------------------------------------------------- contract


@parametrize_topology
@pytest.mark.parametrize("layout", [PAGE_FIRST, LAYER_FIRST])
def test_round_trip_is_byte_identical(make_store: Callable[..., RedisStore], target: Any,
                                      layout: str) -> None:
    store, src = make_store(), filled_pool(seed=1, layout=layout)
    write_range(store, src, 0, 2 * NUM_PAGES)
    assert read_back(store, src, 0, 2 * NUM_PAGES) == [True] * (2 * NUM_PAGES)
    dst = HostKVPool(NUM_PAGES, src.page_size, *GEOMETRY[:3], torch.float32, LAYER_FIRST,
                     check_available=False)
    assert store.batch_get(keys_of(0, 4), dst, slots([3, 2, 1, 0])) == [True] * 4
    assert [page_bytes(dst, p) for p in (3, 2, 1, 0)] == [page_bytes(src, p) for p in range(4)]
    value = raw(target).get(name_of(store, keys_of(0, 1)[0]))  # the format LMDB stores
    assert value == store.codec.encode_into(keys_of(0, 1)[0], page_bytes(src, 0))
    stats = store.stats()
    assert (stats["written_pages"], stats["hits"], stats["errors"]) == (64, 68, 0)
    assert stats["pages"] >= 64 and stats["cluster"] == isinstance(target, RedisClusterNodes)


@parametrize_topology
def test_batch_exists_counts_consecutive_pages_from_the_first(
        make_store: Callable[..., RedisStore], target: Any) -> None:
    store, pool = make_store(), filled_pool()
    keys = keys_of(0, 8)
    assert store.batch_set(keys[:4] + keys[5:6], pool, slots([0, 1, 2, 3, 5])) == [True] * 5
    assert store.batch_exists(keys) == 4
    assert store.batch_exists(keys[5:6] + keys[:4]) == 5
    assert store.batch_exists(keys[4:]) == 0
    assert store.batch_exists([]) == 0


@parametrize_topology
def test_pipelines_are_one_round_trip_per_server(make_store: Callable[..., RedisStore],
                                                 target: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    store, pool = make_store(), filled_pool()
    store.batch_exists(keys_of(0, NUM_PAGES))  # connect to every node (handshakes are sends)
    sends = count_sends(monkeypatch)
    servers = 3 if isinstance(target, RedisClusterNodes) else 1
    for call in (lambda: store.batch_set(keys_of(0, NUM_PAGES), pool, slots(list(range(32)))),
                 lambda: store.batch_exists(keys_of(0, NUM_PAGES)),
                 lambda: store.batch_get(keys_of(0, NUM_PAGES), pool, slots(list(range(32))))):
        sends.clear()
        call()
        assert len(sends) == len(set(sends)) == servers  # 32 keys spread over every node


@pytest.mark.parametrize("target", ["single"], indirect=True)
def test_first_writer_wins(make_store: Callable[..., RedisStore], target: Any) -> None:
    """A second writer of the same keys changes nothing (SET NX)."""
    first, second = make_store(), make_store()
    pool_a, pool_b = filled_pool(seed=1), filled_pool(seed=2)
    write_range(first, pool_a, 0, 8)
    write_range(second, pool_b, 0, 8)  # same keys: already present counts as stored
    assert second.stats()["skipped_pages"] == 8 and second.stats()["written_pages"] == 0
    assert read_back(second, pool_a, 0, 8) == [True] * 8


@parametrize_topology
def test_ttl_is_set_only_when_configured(make_store: Callable[..., RedisStore],
                                         target: Any) -> None:
    pool, client = filled_pool(), raw(target)
    expiring = make_store(ttl_seconds=100)
    lasting = make_store(key_prefix=expiring.key_prefix + "lasting:")
    write_range(expiring, pool, 0, 2)
    write_range(lasting, pool, 0, 2)
    assert 0 < client.ttl(name_of(expiring, keys_of(0, 1)[0])) <= 100
    assert client.ttl(name_of(lasting, keys_of(0, 1)[0])) == -1  # no expiry
    lasting.clear()


@parametrize_topology
def test_a_corrupt_value_is_a_miss_deleted_and_counted(make_store: Callable[..., RedisStore],
                                                       target: Any) -> None:
    store, pool, client = make_store(), filled_pool(), raw(target)
    write_range(store, pool, 0, 5)
    keys = keys_of(0, 5)
    good = store.codec.encode_into(keys[2], page_bytes(pool, 2))
    flipped = good[:HEADER_BYTES + 5] + bytes([good[HEADER_BYTES + 5] ^ 1]) + good[
        HEADER_BYTES + 6:]
    client.set(name_of(store, keys[1]), b"garbage")
    client.set(name_of(store, keys[2]), flipped)
    client.set(name_of(store, keys[3]), good[:-1])  # truncated
    client.set(name_of(store, keys[4]), good)  # page 2's good value, renamed to page 4
    assert read_back(store, pool, 0, 5) == [True, None, None, None, None]
    assert [client.exists(name_of(store, k)) for k in keys] == [1, 0, 0, 0, 0]
    stats = store.stats()
    assert (stats["corrupt_pages"], stats["misses"], stats["errors"]) == (4, 4, 0)


@parametrize_topology
def test_clear_and_delete_touch_only_this_stores_keys(make_store: Callable[..., RedisStore],
                                                      target: Any) -> None:
    store, pool, client = make_store(), filled_pool(), raw(target)
    write_range(store, pool, 0, 10)
    foreign = ["foreign", store.key_prefix + "not-a-page-hash", "other:" + "ab" * 16,
               store.key_prefix + "*" + "ab" * 16]
    for name in foreign:
        client.set(name, b"keep me")
    assert store.delete(keys_of(0, 2) + keys_of(100, 1)) == 2
    assert store.clear() == 8
    assert store.batch_exists(keys_of(2, 8)) == 0
    assert all(client.get(name) == b"keep me" for name in foreign)
    unprefixed = make_store(key_prefix="")  # matches page-hash-shaped keys only
    write_range(unprefixed, pool, 0, 3)
    assert unprefixed.clear() == 3
    assert all(client.get(name) == b"keep me" for name in foreign)
    for name in foreign:
        client.delete(name)


@parametrize_topology
def test_prefetch_backup_and_admin_threads_share_one_store(make_store: Callable[..., RedisStore],
                                                           target: Any) -> None:
    store, pool = make_store(), filled_pool()
    write_range(store, pool, 0, NUM_PAGES)
    failures: list[str] = []

    def prefetch() -> None:  # as the prefetch thread: exists then get, into its own pool
        for _ in range(20):
            if store.batch_exists(keys_of(0, NUM_PAGES)) != NUM_PAGES or not all(
                    r for r in read_back(store, pool, 0, NUM_PAGES)):
                failures.append("prefetch")

    thread = threading.Thread(target=prefetch)
    thread.start()
    write_range(store, pool, NUM_PAGES, 10 * NUM_PAGES)  # the backup thread's part
    for _ in range(20):
        store.stats()  # the scheduler's part
    thread.join()
    assert failures == [] and store.stats()["errors"] == 0
    assert read_back(store, pool, 0, 11 * NUM_PAGES) == [True] * (11 * NUM_PAGES)


# ------------------------------------------------------------------------- faults


def test_backoff_doubles_to_its_cap_and_resets() -> None:
    gate = Backoff(0.05, 0.2)
    assert gate.ready()
    assert [gate.failed() for _ in range(4)] == [0.05, 0.1, 0.2, 0.2]
    assert not gate.ready()
    gate.succeeded()
    assert gate.ready() and gate.failed() == 0.05
    with pytest.raises(ValueError, match="0 < initial_s <= max_s"):
        Backoff(1.0, 0.5)


def wait_until(condition: Callable[[], bool], timeout_s: float = RECOVERY_TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_stopped_or_paused_redis_is_a_miss_and_recovers(tmp_path: Path) -> None:
    server = RedisServer.start(tmp_path / "redis")
    try:
        store = RedisStore(server.url, PageCodec(GEOMETRY), socket_timeout_s=0.2,
                           **SHORT_BACKOFF)
        pool, keys, where = filled_pool(), keys_of(0, 4), slots([0, 1, 2, 3])
        write_range(store, pool, 0, 4)
        server.stop()
        started = time.monotonic()
        assert store.batch_get(keys, pool, where) == [False] * 4
        assert store.batch_exists(keys) == 0  # backing off: not even sent
        assert store.batch_set(keys, pool, where) == [False] * 4
        assert store.stats()["pages"] == 0
        assert time.monotonic() - started < 2.0  # a dead server costs no timeouts
        stats = store.stats()
        assert stats["errors"] >= 1 and stats["backoff_calls"] >= 1
        server.restart()  # same port, empty (no persistence)
        assert wait_until(lambda: store.batch_set(keys, pool, where) == [True] * 4)
        assert read_back(store, pool, 0, 4) == [True] * 4
        errors = store.stats()["errors"]
        server.client().execute_command("CLIENT", "PAUSE", 1000)  # slow: reads time out
        assert store.batch_get(keys, pool, where) == [False] * 4
        assert store.stats()["errors"] == errors + 1
        server.client().execute_command("CLIENT", "UNPAUSE")
        assert wait_until(lambda: store.batch_get(keys, pool, where) == [True] * 4)
        store.close()
    finally:
        server.stop()


def test_a_full_redis_skips_backups_and_still_serves_reads(tmp_path: Path) -> None:
    with RedisServer.start(tmp_path / "redis", extra_args=(
            "--maxmemory", "1mb", "--maxmemory-policy", "noeviction")) as server:
        store = RedisStore(server.url, PageCodec(GEOMETRY), **LONG_BACKOFF)
        pool, stored, refused = filled_pool(), [], None
        for batch in range(200):  # 2 KiB pages: a few hundred fill 1 MB
            keys = keys_of(batch * 8, 8)
            oks = store.batch_set(keys, pool, slots(list(range(8))))
            stored += [k for k, ok in zip(keys, oks) if ok]
            if not all(oks):
                refused = batch
                break
        assert refused is not None, "Redis never refused a write"
        stats = store.stats()
        assert stats["errors"] == 1 and stats["written_pages"] == len(stored)
        assert stats["capacity_bytes"] == 2**20
        if stored:  # the read side is not paused by a refused write
            assert store.batch_exists(stored) == len(stored)
        assert store.batch_set(keys_of(10**6, 1), pool, slots([0])) == [False]  # backing off
        assert store.stats()["backoff_calls"] >= 1
        store.close()


def test_the_password_comes_from_the_url_or_the_environment_and_is_never_shown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    secret = "s3cret-pw"
    with RedisServer.start(tmp_path / "redis", password=secret) as server:
        pool, where = filled_pool(), slots([0])
        url_with = f"redis://:{secret}@127.0.0.1:{server.port}/0"
        caplog.set_level(logging.INFO, logger="hicache.storage.backends.redis_store")
        in_url = RedisStore(url_with, PageCodec(GEOMETRY))
        assert in_url.batch_set(keys_of(0, 1), pool, where) == [True]
        assert in_url.stats()["url"] == f"redis://:***@127.0.0.1:{server.port}/0"
        anonymous = RedisStore(server.url, PageCodec(GEOMETRY), **TINY_BACKOFF)
        assert anonymous.batch_exists(keys_of(0, 1)) == 0  # NOAUTH: a fault, a miss
        assert anonymous.stats()["errors"] >= 1
        monkeypatch.setenv(PASSWORD_ENV, secret)
        from_env = RedisStore(server.url, PageCodec(GEOMETRY))
        assert from_env.batch_exists(keys_of(0, 1)) == 1
        for store in (in_url, anonymous, from_env):
            assert secret not in json.dumps(store.stats())
            store.close()
        assert caplog.records and secret not in caplog.text


def test_close_is_idempotent_and_later_calls_are_quiet_misses(redis_server: RedisServer) -> None:
    store, pool = RedisStore(redis_server.url, PageCodec(GEOMETRY), key_prefix="closed:"), \
        filled_pool()
    write_range(store, pool, 0, 2)
    assert store.clear() == 2
    assert_closed_twice_then_misses(store, pool)


def test_registry_and_arguments(redis_server: RedisServer) -> None:
    codec = PageCodec(GEOMETRY)
    store = create_backend("redis", RedisConfig(url=redis_server.url, key_prefix="reg:"), codec)
    assert isinstance(store, RedisStore) and store.key_prefix == "reg:"
    store.close()
    mapping = create_backend("redis", {"url": redis_server.url, "socket_timeout_s": 0.5}, codec)
    assert isinstance(mapping, RedisStore)
    mapping.close()
    with pytest.raises(ValueError, match="allowed: url, cluster, key_prefix, ttl_seconds"):
        create_backend("redis", {"url": redis_server.url, "db": 1}, codec)
    with pytest.raises(ConfigError, match="must start with one of redis://"):
        RedisStore("http://127.0.0.1:1", codec)
    with pytest.raises(ValueError, match="a cluster needs redis:// or rediss:// and db 0"):
        RedisStore("redis://:pw@127.0.0.1:1/2", codec, cluster=True)
    with pytest.raises(ValueError, match="'redis://127.0.0.1:x/0' is not a Redis URL"):
        RedisStore("redis://127.0.0.1:x/0", codec)
    with pytest.raises(ValueError, match="socket_timeout_s must be > 0 seconds, got 0"):
        RedisStore(redis_server.url, codec, socket_timeout_s=0)
    with pytest.raises(ValueError, match="keys need 8 host slot indices"):
        RedisStore(redis_server.url, codec).batch_get(keys_of(0, 2), filled_pool(), slots([0]))


# ------------------------------------------------------------------ two engines

# The second engine of each pair, in another process: one process serves every pair (torch
# imports once). argv: a JSON list of config overrides, the prompt, the sampling params.
SECOND_ENGINES = """
import json, sys
from hicache_server.config import load_config
from hicache_server.engine import Engine
configs, prompt, sampling = (json.loads(a) for a in sys.argv[1:4])
results = []
for overrides in configs:
    with Engine(load_config(None, overrides)) as engine:
        out = engine.generate(input_ids=prompt, sampling_params=sampling)
    results.append({"output_ids": out["output_ids"],
                    "details": out["meta_info"]["cached_tokens_details"]})
print(json.dumps(results))
"""


def engine_overrides(target: RedisServer | RedisClusterNodes) -> dict[str, Any]:
    return {"model.device": "cpu", "cache.page_size": ENGINE_PAGE,
            "cache.max_total_tokens": 2048, "cache.hierarchical": True,
            "storage.backend": "redis", "storage.redis.url": target.url,
            "storage.redis.cluster": isinstance(target, RedisClusterNodes),
            "storage.redis.key_prefix": f"e-{uuid.uuid4().hex[:8]}:",
            "storage.prefetch_policy": "wait_complete", "storage.prefetch_threshold": 32,
            "storage.overlap": False}  # a hit fetched whole: the test counts what L3 serves


def test_a_prefix_computed_by_one_engine_is_a_storage_hit_for_another_process(
        redis_server: RedisServer, redis_cluster: RedisClusterNodes) -> None:
    from hicache_server.engine import Engine  # the server side only for this test

    prompt = [(7 * i + 3) % 256 for i in range(100)]
    configs, computed = [engine_overrides(redis_server), engine_overrides(redis_cluster)], []
    for overrides in configs:
        with Engine(load_config(None, overrides)) as first:  # shutdown writes the backups
            computed.append(first.generate(input_ids=prompt, sampling_params=GREEDY))
        assert computed[-1]["meta_info"]["cached_tokens_details"] == {
            "device": 0, "host": 0, "storage": 0}  # computed from scratch
    done = subprocess.run(
        [sys.executable, "-c", SECOND_ENGINES, json.dumps(configs), json.dumps(prompt),
         json.dumps(GREEDY)], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
        env={**os.environ, "HICACHE_HOME": os.environ["HICACHE_HOME"]}, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    hit = (len(prompt) - 1) // ENGINE_PAGE * ENGINE_PAGE
    for first, second in zip(computed, json.loads(done.stdout.strip().splitlines()[-1])):
        assert second["output_ids"] == first["output_ids"]  # the tokens of recomputation
        assert second["details"] == {"device": 0, "host": 0, "storage": hit}


@pytest.mark.parametrize("target", TOPOLOGIES[:1], indirect=True)
def test_sample_keys_and_reads_what_it_stores(make_store: Callable[..., RedisStore],
                                              target: Any) -> None:
    """What the fetch probe at attach reads: keys of this store's form, their raw values."""
    store, pool = make_store(), filled_pool()
    keys = keys_of(0, 8)
    assert store.batch_set(keys, pool, slots(list(range(8)))) == [True] * 8
    sample = store.sample_keys(4)
    assert len(sample) == 4 and set(sample) <= set(keys)
    assert store.sample_read(sample) == 4 * store.codec.value_bytes
    assert store.stats()["errors"] == 0
