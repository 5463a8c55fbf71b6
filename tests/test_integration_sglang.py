"""hicache's SGLang storage backend (`hicache.integrations.sglang.HiCacheStore`) against
SGLang's own interface on the CPU: built by SGLang's `StorageBackendFactory` as
`--hicache-storage-backend dynamic` builds it, registered with a host pool as SGLang's cache
controller does, then called through both of the controller's paths (zero-copy `*_v1` and
the generic flat pages) over real LMDB and Redis stores.

SGLang's HiCache runs only on CUDA, so no SGLang server runs here: the pool is
`sglang_api.FakeHostPool`, the SGLang modules the real ones (`sglang_api.sglang_modules`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest
import redis
import torch
from redis_fixtures import RedisServer, free_port, redis_server
from sglang_api import FakeHostPool, sglang_modules

from hicache.kernels.layouts import LAYER_FIRST, PAGE_FIRST

__all__ = ["redis_server"]  # session fixture, used by name below

LAYOUTS = (LAYER_FIRST, PAGE_FIRST)
PAGES = 4  # pages each test writes: keys "page-0" .. "page-3"
FAST_FAULTS = {"socket_timeout_s": 0.2, "connect_timeout_s": 0.2}
HICACHE_CLASS = {"backend_name": "hicache", "module_path": "hicache.integrations.sglang",
                 "class_name": "HiCacheStore"}


@pytest.fixture(scope="module")
def api() -> Iterator[types.SimpleNamespace]:
    with sglang_modules() as modules:
        yield modules


@pytest.fixture
def lmdb_config(tmp_path: Path) -> dict[str, Any]:
    return {"backend": "lmdb", "lmdb": {"path": str(tmp_path / "l3"), "sync": False}}


def storage_config(api: types.SimpleNamespace, extra: dict[str, Any], *, tp_rank: int = 0,
                   tp_size: int = 1, mla: bool = False, model: str = "org/model") -> Any:
    """SGLang's HiCacheStorageConfig as its cache controller fills it for one rank."""
    return api.Config(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                      attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
                      is_page_first_layout=False, model_name=model,
                      extra_config={**HICACHE_CLASS, **extra})


def attach(api: types.SimpleNamespace, pool: FakeHostPool, extra: dict[str, Any],
           **config: Any) -> Any:
    """What SGLang's `attach_storage_backend` does: the factory, then the pool."""
    backend = api.StorageBackendFactory.create_backend(
        "dynamic", storage_config(api, extra, **config), pool)
    backend.register_mem_pool_host(pool)
    return backend


def keys(count: int = PAGES, first: int = 0) -> list[str]:
    return [f"page-{i}" for i in range(first, first + count)]


def slots(pool: FakeHostPool, pages: list[int]) -> torch.Tensor:
    """Host slot indices of `pages`, whole pages, as the controller passes them."""
    return torch.cat([torch.arange(p * pool.page_size, (p + 1) * pool.page_size)
                      for p in pages])


def backup(store: Any, pool: FakeHostPool, v1: bool, pages: list[int], names: list[str]) -> bool:
    """The controller's `_page_set_zero_copy` or `_generic_page_set`."""
    if v1:
        return all(store.batch_set_v1(names, slots(pool, pages)))
    return store.batch_set(names, [pool.get_data_page(p * pool.page_size) for p in pages])


def prefetch(store: Any, pool: FakeHostPool, v1: bool, pages: list[int],
             names: list[str]) -> list[bool]:
    """The controller's `_page_get_zero_copy` or `_generic_page_get` (per page served)."""
    if v1:
        return store.batch_get_v1(names, slots(pool, pages))
    got = store.batch_get(names, [pool.get_dummy_flat_data_page() for _ in names])
    for page, data in zip(pages, got):
        if data is not None:
            pool.set_from_flat_data_page(page * pool.page_size, data)
    return [data is not None for data in got]


def test_the_factory_builds_it_as_an_sglang_backend(api: types.SimpleNamespace,
                                                    lmdb_config: dict[str, Any]) -> None:
    store = attach(api, FakeHostPool(PAGE_FIRST), {**lmdb_config, "interface_v1": 1})
    assert isinstance(store, api.HiCacheStorage) and isinstance(store, api.HiCacheStore)
    assert store.batch_exists(keys()) == 0 and store.exists("page-0") is False
    store.close()


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("write_v1", "read_v1"), [(True, True), (False, False), (True, False),
                                                   (False, True)],
                         ids=["v1", "generic", "v1-then-generic", "generic-then-v1"])
def test_pages_round_trip_bit_for_bit(api: types.SimpleNamespace, lmdb_config: dict[str, Any],
                                      layout: str, mla: bool, write_v1: bool,
                                      read_v1: bool) -> None:
    src, dst = FakeHostPool(layout, mla=mla).fill(1), FakeHostPool(layout, mla=mla)
    extra = {**lmdb_config, "interface_v1": int(write_v1 or read_v1)}
    writer = attach(api, src, extra)
    assert backup(writer, src, write_v1, [1, 2, 3, 5], keys())
    writer.close()
    reader = attach(api, dst, extra)  # a restarted server: the same namespace
    assert reader.batch_exists(keys()) == PAGES
    assert prefetch(reader, dst, read_v1, [4, 0, 7, 6], keys()) == [True] * PAGES
    pairs = [(1, 4), (2, 0), (3, 7), (5, 6)]
    assert all(dst.page_bytes(d * dst.page_size) == src.page_bytes(s * src.page_size)
               for s, d in pairs)
    untouched = FakeHostPool(layout, mla=mla)
    assert dst.page_bytes(1 * dst.page_size) == untouched.page_bytes(0)  # only asked pages
    reader.close()


def test_batch_exists_counts_leading_hits(api: types.SimpleNamespace,
                                          lmdb_config: dict[str, Any]) -> None:
    pool = FakeHostPool(PAGE_FIRST).fill(2)
    store = attach(api, pool, {**lmdb_config, "interface_v1": 1})
    names = keys()
    assert all(store.batch_set_v1([names[i] for i in (0, 1, 3)], slots(pool, [0, 1, 3])))
    assert store.batch_exists(names) == 2  # page-2 is missing: page-3 does not count
    assert store.batch_exists(names[3:]) == 1 and store.batch_exists([]) == 0
    assert [store.exists(n) for n in names] == [True, True, False, True]
    store.close()


def test_a_damaged_value_is_a_counted_miss_never_served(api: types.SimpleNamespace,
                                                        lmdb_config: dict[str, Any]) -> None:
    src = FakeHostPool(LAYER_FIRST).fill(3)
    store = attach(api, src, lmdb_config)
    assert store.batch_set(keys(2), [src.get_data_page(p * src.page_size) for p in (0, 1)])
    store.close()
    path = lmdb_config["lmdb"]["path"]
    with lmdb.open(path, max_dbs=2) as env:  # a raw second writer, the store closed
        db = env.open_db(b"pages")
        with env.begin(write=True, db=db) as txn:
            name, value = next(iter(txn.cursor()))  # one of the two, flipped in its payload
            damaged = bytearray(value)
            damaged[-1] ^= 0xFF
            txn.put(name, bytes(damaged))
    dst = FakeHostPool(LAYER_FIRST)
    store = attach(api, dst, lmdb_config)
    served = prefetch(store, dst, False, [0, 1], keys(2))
    assert sorted(served) == [False, True]
    stats = store.get_stats().hicache
    assert (stats["corrupt_pages"], stats["hits"], stats["misses"]) == (1, 1, 1)
    assert store.batch_exists(keys(2)) + store.batch_exists(keys(1, 1)) == 1  # deleted
    store.close()


@pytest.mark.parametrize("other", [{"model": "org/other"}, {"tp_rank": 1, "tp_size": 2},
                                   {"dtype": torch.float16}, {"namespace": "salt"}],
                         ids=["model", "tp-rank", "dtype", "salt"])
def test_another_namespace_misses(api: types.SimpleNamespace, lmdb_config: dict[str, Any],
                                  other: dict[str, Any]) -> None:
    pool = FakeHostPool(PAGE_FIRST).fill(4)
    store = attach(api, pool, {**lmdb_config, "interface_v1": 1})
    assert all(store.batch_set_v1(keys(), slots(pool, list(range(PAGES)))))
    store.close()
    config = {k: v for k, v in other.items() if k in ("model", "tp_rank", "tp_size")}
    extra = {**lmdb_config, "interface_v1": 1,
             **({"namespace": other["namespace"]} if "namespace" in other else {})}
    dst = FakeHostPool(PAGE_FIRST, dtype=other.get("dtype", pool.dtype))
    stranger = attach(api, dst, extra, **config)
    assert stranger.batch_exists(keys()) == 0
    assert stranger.batch_get_v1(keys(), slots(dst, list(range(PAGES)))) == [False] * PAGES
    stranger.close()


def test_mla_pages_are_shared_by_every_tp_rank(api: types.SimpleNamespace,
                                               lmdb_config: dict[str, Any]) -> None:
    pool = FakeHostPool(PAGE_FIRST, mla=True).fill(5)
    store = attach(api, pool, {**lmdb_config, "interface_v1": 1}, mla=True, tp_size=2)
    assert all(store.batch_set_v1(keys(), slots(pool, list(range(PAGES)))))
    store.close()
    rank1 = attach(api, FakeHostPool(PAGE_FIRST, mla=True), {**lmdb_config, "interface_v1": 1},
                   mla=True, tp_rank=1, tp_size=2)
    assert rank1.batch_exists(keys()) == PAGES
    rank1.close()


@pytest.mark.parametrize("v1", [True, False], ids=["v1", "generic"])
def test_redis_round_trip_and_damage(api: types.SimpleNamespace, redis_server: RedisServer,
                                     v1: bool) -> None:
    prefix = f"{uuid.uuid4().hex}:"
    extra = {"backend": "redis", "interface_v1": int(v1),
             "redis": {"url": redis_server.url, "key_prefix": prefix}}
    src, dst = FakeHostPool(PAGE_FIRST).fill(6), FakeHostPool(PAGE_FIRST)
    writer, reader = attach(api, src, extra), attach(api, dst, extra)  # two servers, one Redis
    assert backup(writer, src, v1, [0, 1, 2], keys(3))
    assert prefetch(reader, dst, v1, [3, 4, 5], keys(3)) == [True] * 3
    assert [dst.page_bytes(p * 4) for p in (3, 4, 5)] == [src.page_bytes(p * 4) for p in (0, 1, 2)]
    client = redis.Redis.from_url(redis_server.url)
    names = sorted(client.scan_iter(match=f"{prefix}*"))
    assert len(names) == 3
    client.set(names[0], client.get(names[0])[:-1] + b"\0")  # a torn value
    assert sorted(prefetch(reader, FakeHostPool(PAGE_FIRST), v1, [0, 1, 2], keys(3))) == [
        False, True, True]
    assert reader.stats()["corrupt_pages"] == 1 and not client.exists(names[0])
    client.close()
    writer.close()
    reader.close()


def test_an_unreachable_store_is_misses_not_exceptions(api: types.SimpleNamespace) -> None:
    extra = {"backend": "redis", "interface_v1": 1,
             "redis": {"url": f"redis://127.0.0.1:{free_port()}/0", **FAST_FAULTS}}
    pool = FakeHostPool(PAGE_FIRST).fill(7)
    store = attach(api, pool, extra)
    indices = slots(pool, [0, 1])
    assert store.batch_exists(keys(2)) == 0
    assert store.batch_set_v1(keys(2), indices) == [False, False]
    assert store.batch_get_v1(keys(2), indices) == [False, False]
    assert store.set("page-0", pool.get_data_page(0)) is False
    assert store.get("page-0", pool.get_dummy_flat_data_page()) is None
    stats = store.get_stats().hicache
    assert stats["errors"] >= 1 and sum(stats["errors_by_op"].values()) == stats["errors"]
    store.close()


@pytest.mark.parametrize(("extra", "message"), [
    ({"backend": "s3"}, "backend 's3' is not one of lmdb, redis, lmdb\\+redis"),
    ({"pth": "/x"}, "unknown key\\(s\\) pth"),
    ({"lmdb": {"size": 1}}, "lmdb: unknown key\\(s\\) size; allowed: path, max_size_gb, prefault_gb, sync"),
    ({"lmdb": "/tmp/x"}, "lmdb: must be an object of path, max_size_gb, prefault_gb, sync"),
    ({"redis": {"url": "redis://h:1"}}, "redis: given, but the store 'lmdb' reads only lmdb"),
    ({"namespace": 3}, "namespace: must be a string, got 3"),
    ({"backend": "redis", "redis": {"url": "http://h"}}, "storage.redis.url"),
])
def test_bad_extra_config_is_a_clear_error(api: types.SimpleNamespace, tmp_path: Path,
                                           extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        attach(api, FakeHostPool(PAGE_FIRST), extra)


def test_interface_v1_refuses_a_pool_whose_page_view_is_a_copy(
        api: types.SimpleNamespace, lmdb_config: dict[str, Any]) -> None:
    class CopyingPool(FakeHostPool):
        def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
            return super().get_data_page(index, flat).clone()

    with pytest.raises(ValueError, match="not a view of the page's buffers"):
        attach(api, CopyingPool(PAGE_FIRST), {**lmdb_config, "interface_v1": 1})
    store = attach(api, CopyingPool(PAGE_FIRST).fill(8), lmdb_config)  # generic: no view needed
    assert store.set("page-0", store.mem_pool_host.get_data_page(0)) and store.exists("page-0")
    store.close()


def test_get_stats_gives_sglang_storage_metrics_of_each_batch(
        api: types.SimpleNamespace, lmdb_config: dict[str, Any]) -> None:
    pool = FakeHostPool(PAGE_FIRST).fill(9)
    store = attach(api, pool, {**lmdb_config, "interface_v1": 1})
    store.batch_set_v1(keys(3), slots(pool, [0, 1, 2]))
    store.batch_get_v1(keys(4), slots(pool, [4, 5, 6, 7]))
    metrics = store.get_stats()
    assert (metrics.backup_pgs, metrics.prefetch_pgs) == ([3], [3])
    assert len(metrics.backup_bandwidth) == 1 and metrics.backup_bandwidth[0] > 0
    assert metrics.hicache["written_pages"] == 3
    assert store.get_stats().prefetch_pgs == []  # since the last call
    store.close()


def test_import_hicache_imports_no_sglang(tmp_path: Path) -> None:
    code = ("import sys, hicache, hicache.integrations, hicache.integrations.sglang_settings, "
            "hicache.integrations.sglang_pages; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'sglang')))")
    out = subprocess.run([sys.executable, "-c", f"import json; {code}"], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parent.parent)
    assert json.loads(out.stdout) == []


def test_with_the_fleet_secret_another_secret_misses(api: types.SimpleNamespace,
                                                     lmdb_config: dict[str, Any],
                                                     tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`secret_file` (else HICACHE_STORAGE_SECRET) and `encrypt` in the extra config: the
    same secret serves the pages bit for bit, another finds none of its keys."""
    monkeypatch.setenv("HICACHE_STORAGE_SECRET", "s" * 64)
    extra = {**lmdb_config, "interface_v1": 1, "encrypt": True}
    pool = FakeHostPool(PAGE_FIRST).fill(4)
    store = attach(api, pool, extra)
    assert all(store.batch_set_v1(keys(), slots(pool, list(range(PAGES)))))
    store.close()
    secret = tmp_path / "secret"
    secret.write_text("t" * 64)
    secret.chmod(0o600)
    dst = FakeHostPool(PAGE_FIRST)
    stranger = attach(api, dst, {**extra, "secret_file": str(secret)})
    assert stranger.batch_exists(keys()) == 0
    stranger.close()
    same = attach(api, dst, extra)
    assert same.batch_get_v1(keys(), slots(dst, list(range(PAGES)))) == [True] * PAGES
    assert all(dst.page_bytes(p * dst.page_size) == pool.page_bytes(p * pool.page_size)
               for p in range(PAGES))  # a page in two runs (K, V): decrypted, then scattered
    same.close()
