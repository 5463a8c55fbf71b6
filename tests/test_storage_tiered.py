"""L3 `lmdb+redis`: a private LMDB in front of a shared Redis (real redis-server on loopback).

Each test writes under its own key prefix on the session's Redis; servers a test stops or
fills are its own.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest
from redis_fixtures import RedisServer, count_sends, redis_server
from test_storage_lmdb import (
    CAPACITY,
    CORRUPTIONS,
    GEOMETRY,
    filled_pool,
    keys_of,
    page_bytes,
    read_back,
    slots,
    write_range,
)

from hicache.config_storage import STORAGE_BACKENDS
from hicache.storage.backends import create_backend
from hicache.storage.backends.base import STAT_KEYS
from hicache.storage.backends.lmdb_store import LmdbStore
from hicache.storage.backends.redis_store import RedisStore
from hicache.storage.backends.tiered_store import TieredStore
from hicache.storage.page_format import PageCodec
from hicache_server.args import EXIT_BAD_CONFIG, parse_config
from hicache_server.config import load_config

__all__ = ["redis_server"]  # session fixture, used by name below

# A dead server is noticed at once and probed again every 50-200 ms, so a restart is seen.
FAST_FAULTS = {"socket_timeout_s": 0.2, "connect_timeout_s": 0.2, "backoff_initial_s": 0.05,
               "backoff_max_s": 0.2}
LONG_BACKOFF = {"backoff_initial_s": 10.0, "backoff_max_s": 10.0}
RECOVERY_TIMEOUT_S = 5.0  # a restarted redis-server answers well within this
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
ENGINE_PAGE = 16


def tiered_store(lmdb_path: Path, url: str, prefix: str, **redis_kw: Any) -> TieredStore:
    codec = PageCodec(GEOMETRY)
    return TieredStore(LmdbStore(lmdb_path, CAPACITY, codec, sync=False),
                       RedisStore(url, codec, key_prefix=prefix, **redis_kw))


@pytest.fixture
def make_store(tmp_path: Path, redis_server: RedisServer
               ) -> Iterator[Callable[..., TieredStore]]:
    """Stores on the session's Redis under one fresh key prefix, each with its own LMDB
    unless `lmdb_path` is given; closed afterwards."""
    prefix, made = f"tier-{uuid.uuid4().hex[:8]}:", []

    def make(lmdb_path: Path | None = None) -> TieredStore:
        store = tiered_store(lmdb_path or tmp_path / f"lmdb{len(made)}", redis_server.url,
                             prefix)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


# ----------------------------------------------------------------------- reads and writes


def test_reads_go_to_lmdb_then_redis_for_the_misses_in_one_round_trip(
        make_store: Callable[..., TieredStore], monkeypatch: pytest.MonkeyPatch) -> None:
    store, pool = make_store(), filled_pool(seed=1)
    keys = keys_of(0, 8)
    write_range(store.local, pool, 0, 4)  # pages 0-3 local only
    write_range(store.shared, pool, 4, 4)  # pages 4-7 in Redis only
    assert store.batch_exists(keys) == 8
    store.shared.batch_exists(keys[:1])  # connected: a handshake is a send of its own
    sends = count_sends(monkeypatch)
    assert read_back(store, pool, 0, 8) == [True] * 8  # byte-identical
    assert len(sends) == 1  # the four local misses, one pipeline
    redis_stats = store.shared.stats()
    assert (redis_stats["hits"], redis_stats["misses"]) == (4, 0)  # never asked for 0-3
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["promoted_pages"]) == (8, 0, 4)


def test_a_redis_hit_is_written_into_lmdb_and_the_next_read_is_local(
        make_store: Callable[..., TieredStore], monkeypatch: pytest.MonkeyPatch) -> None:
    store, pool = make_store(), filled_pool(seed=2)
    keys = keys_of(0, 6)
    write_range(store.shared, pool, 0, 6)
    assert store.local.batch_exists(keys) == 0
    assert read_back(store, pool, 0, 6) == [True] * 6
    assert store.local.batch_exists(keys) == 6  # promoted
    sends = count_sends(monkeypatch)
    assert store.batch_exists(keys) == 6 and read_back(store, pool, 0, 6) == [True] * 6
    assert sends == []  # served locally: Redis was not asked
    assert store.stats()["lmdb"]["hits"] == 6


def test_writes_reach_both_parts_and_redis_keeps_the_first_writer(
        make_store: Callable[..., TieredStore], redis_server: RedisServer) -> None:
    store, pool = make_store(), filled_pool(seed=3)
    keys = keys_of(0, 4)
    client = redis_server.client()
    first = store.shared.codec.encode_into(keys[3], page_bytes(pool, 9))  # another server's
    client.set(store.shared.key_prefix + keys[3].hex(), first)
    assert store.batch_set(keys, pool, slots([0, 1, 2, 3])) == [True] * 4
    assert store.local.batch_exists(keys) == store.shared.batch_exists(keys) == 4
    assert client.get(store.shared.key_prefix + keys[0].hex()) == \
        store.shared.codec.encode_into(keys[0], page_bytes(pool, 0))
    assert client.get(store.shared.key_prefix + keys[3].hex()) == first  # SET NX
    stats = store.stats()
    assert (stats["written_pages"], stats["redis"]["written_pages"],
            stats["redis"]["skipped_pages"]) == (4, 3, 1)


# ----------------------------------------------------------------------- faults


def test_a_stopped_redis_leaves_lmdb_serving_and_writing(tmp_path: Path) -> None:
    server = RedisServer.start(tmp_path / "redis")
    store = tiered_store(tmp_path / "lmdb", server.url, "down:", **FAST_FAULTS)
    try:
        pool = filled_pool(seed=4)
        write_range(store, pool, 0, 4)  # in both
        write_range(store.shared, pool, 4, 4)  # in Redis only: lost with it
        server.stop()
        started = time.monotonic()
        assert read_back(store, pool, 0, 8) == [True] * 4 + [None] * 4
        assert store.batch_exists(keys_of(0, 8)) == 4
        write_range(store, pool, 8, 4)  # LMDB takes it: a backup that succeeded
        assert read_back(store, pool, 8, 4) == [True] * 4
        assert time.monotonic() - started < 2.0  # backing off: no timeout per call
        stats = store.stats()
        assert stats["redis"]["errors"] >= 1 and stats["errors"] == stats["redis"]["errors"]
        assert stats["lmdb"]["errors"] == 0 and stats["redis"]["pages"] == 0
        server.restart()  # empty (no persistence); writes reach it again after the back-off
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while store.shared.batch_exists(keys_of(12, 1)) == 0:
            assert time.monotonic() < deadline, "Redis writes never resumed"
            write_range(store, pool, 12, 1)
            time.sleep(0.05)
    finally:
        store.close()
        server.stop()


def test_a_full_redis_skips_its_writes_and_lmdb_keeps_them(tmp_path: Path) -> None:
    with RedisServer.start(tmp_path / "redis", extra_args=(
            "--maxmemory", "1mb", "--maxmemory-policy", "noeviction")) as server:
        store = tiered_store(tmp_path / "lmdb", server.url, "full:", **LONG_BACKOFF)
        pool = filled_pool(seed=5)
        batch = 0
        while store.stats()["redis"]["errors"] == 0:  # 2 KiB pages: a few hundred fill 1 MB
            assert batch < 200, "Redis never refused a write"
            write_range(store, pool, batch * 8, 8)  # True per page all along: LMDB holds it
            batch += 1
        assert store.local.batch_exists(keys_of(0, batch * 8)) == batch * 8
        assert read_back(store, pool, 0, 8) == [True] * 8
        store.close()


def test_a_corrupt_lmdb_page_is_read_from_redis_and_rewritten(
        make_store: Callable[..., TieredStore], redis_server: RedisServer,
        tmp_path: Path) -> None:
    path, pool = tmp_path / "shared-path", filled_pool(seed=6)
    keys = keys_of(0, 4)
    store = make_store(path)
    write_range(store, pool, 0, 4)
    store.local.close()
    with lmdb.open(str(path), max_dbs=2) as env, env.begin(  # a raw writer, store closed
            write=True, db=env.open_db(b"pages")) as txn:
        for key, damage in ((keys[1], "payload_bit"), (keys[2], "truncated")):
            txn.put(key, CORRUPTIONS[damage](txn.get(key)))
    client = redis_server.client()
    name = store.shared.key_prefix + keys[2].hex()
    client.set(name, CORRUPTIONS["tag"](client.get(name)))  # page 2: bad in both
    store = make_store(path)
    assert read_back(store, pool, 0, 4) == [True, True, None, True]  # never a wrong page
    stats = store.stats()
    assert (stats["lmdb"]["corrupt_pages"], stats["redis"]["corrupt_pages"]) == (2, 1)
    assert (stats["corrupt_pages"], stats["promoted_pages"], stats["misses"]) == (3, 1, 1)
    assert store.local.batch_exists(keys[1:2]) == 1  # the good copy replaced the bad one
    assert store.batch_exists(keys[2:3]) == 0 and client.exists(name) == 0  # deleted
    assert read_back(store.local, pool, 1, 1) == [True]


# ----------------------------------------------------------------------- clear, stats


def test_clear_empties_only_lmdb_and_delete_removes_from_both(
        make_store: Callable[..., TieredStore]) -> None:
    store, pool = make_store(), filled_pool(seed=7)
    keys = keys_of(0, 6)
    write_range(store, pool, 0, 6)
    assert store.clear() == 6
    assert store.local.batch_exists(keys) == 0
    assert store.shared.batch_exists(keys) == 6  # other servers' pages stay
    assert read_back(store, pool, 0, 6) == [True] * 6  # read through, promoted again
    assert store.delete(keys[:2]) == 2
    assert store.local.batch_exists(keys[:2]) == store.shared.batch_exists(keys[:2]) == 0


def test_stats_keep_the_backend_keys_and_nest_both_parts(
        make_store: Callable[..., TieredStore]) -> None:
    store, pool = make_store(), filled_pool()
    write_range(store, pool, 0, 3)
    stats = store.stats()
    assert all(isinstance(stats[key], int) for key in STAT_KEYS)
    assert stats["pages"] == stats["lmdb"]["pages"] == 3
    assert stats["capacity_bytes"] == stats["lmdb"]["capacity_bytes"] == CAPACITY
    assert stats["redis"]["key_prefix"] == store.shared.key_prefix
    assert json.loads(json.dumps(stats)) == stats


# ----------------------------------------------------------------------- configuration


def test_config_validates_and_builds_through_the_registry(tmp_path: Path,
                                                          redis_server: RedisServer) -> None:
    assert "lmdb+redis" in STORAGE_BACKENDS
    cfg = load_config(None, {"storage.backend": "lmdb+redis",
                             "storage.lmdb.path": str(tmp_path / "lmdb"),
                             "storage.redis.url": redis_server.url,
                             "storage.redis.key_prefix": "cfg:"}).storage
    assert cfg.enabled and cfg.backend_config == {"lmdb": cfg.lmdb, "redis": cfg.redis}
    store = create_backend(cfg.backend, cfg.backend_config, PageCodec(GEOMETRY))
    assert isinstance(store, TieredStore)
    assert isinstance(store.local, LmdbStore) and store.local.path == tmp_path / "lmdb"
    assert isinstance(store.shared, RedisStore) and store.shared.key_prefix == "cfg:"
    store.close()
    with pytest.raises(ValueError, match="unknown part.s. disk; allowed: lmdb, redis"):
        create_backend("lmdb+redis", {"disk": {}}, PageCodec(GEOMETRY))
    with pytest.raises(ValueError, match="storage.redis: unknown key.s. db"):
        create_backend("lmdb+redis", {"lmdb": {"path": str(tmp_path / "l2")},
                                      "redis": {"db": 1}}, PageCodec(GEOMETRY))


def test_the_extra_config_flag_takes_one_object_per_part(
        capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--hicache-storage-backend", "lmdb+redis", "--hicache-storage-backend-extra-config"]
    cfg, _ = parse_config([*base, '{"lmdb": {"path": "/data/l3"}, "redis": {"key_prefix": "a:"}}'])
    assert (cfg.storage.lmdb.path, cfg.storage.redis.key_prefix) == ("/data/l3", "a:")
    with pytest.raises(SystemExit) as exit_info:
        parse_config([*base, '{"path": "/data/l3"}'])
    assert exit_info.value.code == EXIT_BAD_CONFIG
    assert "storage.extra_config.path" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        parse_config([*base, '{"lmdb": {"paht": "/data/l3"}}'])
    assert exit_info.value.code == EXIT_BAD_CONFIG
    assert "storage.lmdb.paht" in capsys.readouterr().err


# ----------------------------------------------------------------------- two engines


def test_two_engines_with_private_lmdbs_share_one_redis(tmp_path: Path,
                                                        redis_server: RedisServer) -> None:
    from hicache_server.engine import Engine  # the server side only for this test

    prefix = f"eng-{uuid.uuid4().hex[:8]}:"

    def overrides(lmdb_dir: str) -> dict[str, Any]:
        return {"model.device": "cpu", "cache.page_size": ENGINE_PAGE,
                "cache.max_total_tokens": 2048, "cache.hierarchical": True,
                "storage.backend": "lmdb+redis", "storage.lmdb.path": str(tmp_path / lmdb_dir),
                "storage.redis.url": redis_server.url, "storage.redis.key_prefix": prefix,
                "storage.prefetch_policy": "wait_complete", "storage.prefetch_threshold": 32,
                "storage.overlap": False}  # hits fetched whole: the test counts them

    prompt = [(5 * i + 11) % 256 for i in range(100)]
    hit = (len(prompt) - 1) // ENGINE_PAGE * ENGINE_PAGE
    with Engine(load_config(None, overrides("first"))) as first:  # shutdown writes backups
        computed = first.generate(input_ids=prompt, sampling_params=GREEDY)
    assert computed["meta_info"]["cached_tokens_details"]["storage"] == 0
    with Engine(load_config(None, overrides("second"))) as second:
        outs = [second.generate(input_ids=prompt, sampling_params=GREEDY)]
        storage = second.stats()["tiers"]["storage"]
        assert storage["promoted_pages"] == hit // ENGINE_PAGE  # now in this LMDB too
        freed = second.flush_cache()  # all three tiers: this server's LMDB, not Redis
        assert freed["storage"] == storage["lmdb"]["pages"] * ENGINE_PAGE
        outs.append(second.generate(input_ids=prompt, sampling_params=GREEDY))
    for out in outs:  # a storage hit (Redis both times), with the tokens of recomputation
        assert out["output_ids"] == computed["output_ids"]
        assert out["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 0,
                                                             "storage": hit}
