"""L3 by kind (`hicache.storage.kinds`): a hybrid model's page stored as a full-layer part under
its page hash and a window-layer part under `window_key`, each by a codec of its layers alone,
through every store (LMDB, Redis, both tiered, throttled) and both host layouts; neither part
passes for the other or under another key.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from redis_fixtures import RedisServer, redis_server

from hicache.kernels.layouts import HOST_LAYOUTS
from hicache.memory.host import HostKVPool
from hicache.model_kv import ModelKV
from hicache.storage.backends.base import STAT_CORRUPT, StorageBackend
from hicache.storage.backends.lmdb_store import LmdbStore
from hicache.storage.backends.redis_store import RedisStore
from hicache.storage.backends.throttled import ThrottledBackend
from hicache.storage.backends.tiered_store import TieredStore
from hicache.storage.kinds import StoreKinds, window_key, window_keys
from hicache.storage.page_format import PageCodec, PageGeometry

__all__ = ["redis_server"]  # session fixture, used by name below

PAGE = 4
# Gemma 3's pattern, shortened: window, window, full, window, window, full
WINDOWS = (8, 8, None, 8, 8, None)
MODEL = ModelKV(6, 2, 8, torch.float32, torch.device("cpu"), "m", WINDOWS)
GEOMETRY = PageGeometry(6, 2, 8, PAGE, torch.float32)
KINDS = StoreKinds.of(MODEL, PAGE)
STORES = ("lmdb", "redis", "lmdb+redis", "throttled")


def keys_of(first: int, count: int) -> list[bytes]:
    return [i.to_bytes(16, "little") for i in range(first, first + count)]


def filled_pool(layout: str, pages: int = 8, seed: int = 0) -> HostKVPool:
    pool = HostKVPool(pages, PAGE, 6, 2, 8, torch.float32, layout=layout, pin_memory=False)
    data = torch.randn(pages, 6, 2, PAGE, 2, 8, generator=torch.Generator().manual_seed(seed))
    pool.set_pages(torch.arange(pages), data)
    return pool


@pytest.fixture
def make_store(tmp_path: Path, redis_server: RedisServer
               ) -> Iterator[Callable[[str, PageCodec], StorageBackend]]:
    closing: list[StorageBackend] = []

    def make(kind: str, codec: PageCodec) -> StorageBackend:
        lmdb_store = LmdbStore(tmp_path / uuid.uuid4().hex, 2**24, codec, sync=False)
        redis_store = RedisStore(redis_server.url, codec, key_prefix=f"{uuid.uuid4().hex}:")
        closing.extend((lmdb_store, redis_store))
        return {"lmdb": lmdb_store, "redis": redis_store,
                "lmdb+redis": TieredStore(lmdb_store, redis_store),
                "throttled": ThrottledBackend(lmdb_store, None, value_bytes=codec.value_bytes)
                }[kind]

    yield make
    for store in closing:
        store.close()


def test_the_kinds_of_a_hybrid_model_and_none_for_a_plain_one() -> None:
    assert KINDS == StoreKinds((2, 5), (0, 1, 3, 4), 8, PAGE)
    assert StoreKinds.of(MODEL._replace(layer_windows=()), PAGE) is None
    assert StoreKinds.of(MODEL._replace(layer_windows=(8,) * 6), PAGE) is None  # all windowed
    # a node [0, 40) keeps window parts for what a query at 40, or at 36, reads: from 28 on
    assert KINDS.needed_from(40) == 32 and KINDS.needed_from(36) == 28
    assert KINDS.window_pages_of(0, 40) == 3
    assert KINDS.window_pages_of(36, 40) == 1  # never before the node's own start
    assert KINDS.window_first(16, 6) == 4  # pages after token 16: a hit to 40 reads from 32


def test_a_part_stores_only_its_layers_and_the_header_counts_them() -> None:
    full, window = KINDS.codecs(GEOMETRY, b"ns", None)
    per_layer = 2 * PAGE * 2 * 8 * 4
    assert (full.payload_bytes, window.payload_bytes) == (2 * per_layer, 4 * per_layer)
    assert full.geometry.num_layers == 2 and window.geometry.num_layers == 4
    with pytest.raises(ValueError, match="distinct, ascending"):
        PageCodec(GEOMETRY, layers=(3, 2))
    with pytest.raises(ValueError, match="distinct, ascending"):
        PageCodec(GEOMETRY, layers=(6,))


def test_neither_part_passes_for_the_other_nor_under_another_key() -> None:
    full, window = KINDS.codecs(GEOMETRY, b"ns", None)
    key = keys_of(7, 1)[0]
    two_layers = bytes(range(256)) * (full.payload_bytes // 256)
    value = full.encode_into(key, two_layers)
    assert full.decode(key, value) == two_layers
    assert full.decode(window_key(key), value) is None  # moved to the window part's key
    assert full.decode(keys_of(8, 1)[0], value) is None
    assert window.decode(key, value) is None
    # the same layer count, other layers: the tag covers their indices
    other = PageCodec(GEOMETRY, namespace=b"ns", layers=(0, 1))
    assert other.decode(key, value) is None
    assert window_key(key) != key and len(window_key(key)) == 16


@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("kind", STORES)
def test_both_parts_round_trip_through_every_store(
        make_store: Callable[[str, PageCodec], StorageBackend], kind: str, layout: str) -> None:
    full, window = KINDS.codecs(GEOMETRY, b"ns", None)
    store = make_store(kind, full)
    windows = store.with_codec(window)
    source = filled_pool(layout)
    keys, slots = keys_of(0, 4), torch.arange(4 * PAGE)
    assert store.batch_set(keys, source, slots) == [True] * 4
    assert windows.batch_set(window_keys(keys[2:]), source, slots[2 * PAGE:]) == [True] * 2
    assert store.batch_exists(keys) == 4
    assert windows.batch_exists(window_keys(keys)) == 0  # only the last two have theirs
    assert windows.batch_exists(window_keys(keys[2:])) == 2

    target = filled_pool(layout, seed=1)
    before = target.get_pages(torch.arange(4))
    assert store.batch_get(keys, target, slots) == [True] * 4
    assert windows.batch_get(window_keys(keys), target, slots) == [False, False, True, True]
    got, want = target.get_pages(torch.arange(4)), source.get_pages(torch.arange(4))
    full_layers, window_layers = list(KINDS.full_layers), list(KINDS.window_layers)
    assert torch.equal(got[:, full_layers], want[:, full_layers])
    assert torch.equal(got[2:, window_layers], want[2:, window_layers])
    # pages 0-1 had no window part: their window layers are the target's own, untouched
    assert torch.equal(got[:2, window_layers], before[:2, window_layers])


def test_a_window_part_swapped_under_another_page_is_a_counted_miss(
        make_store: Callable[[str, PageCodec], StorageBackend]) -> None:
    full, window = KINDS.codecs(GEOMETRY, b"ns", None)
    store = make_store("lmdb", full)
    windows = store.with_codec(window)
    source = filled_pool("page_first")
    keys = keys_of(0, 2)
    windows.batch_set(window_keys(keys), source, torch.arange(2 * PAGE))
    wk = window_keys(keys)

    def swap(txn) -> None:
        a, b = (bytes(txn.get(k, db=store.env.pages)) for k in wk)
        txn.put(wk[0], b, db=store.env.pages)
        txn.put(wk[1], a, db=store.env.pages)

    store.env.txn(True, swap)
    target = filled_pool("page_first", seed=1)
    assert windows.batch_get(wk, target, torch.arange(2 * PAGE)) == [False, False]
    assert store.stats()[STAT_CORRUPT] == 2



@pytest.mark.parametrize("kind", STORES)
def test_every_store_says_which_keys_it_holds(
        make_store: Callable[[str, PageCodec], StorageBackend], kind: str) -> None:
    full, window = KINDS.codecs(GEOMETRY, b"ns", None)
    store = make_store(kind, full)
    windows = store.with_codec(window)
    keys = keys_of(0, 5)
    windows.batch_set(window_keys([keys[1], keys[3]]), filled_pool("page_first"),
                      torch.arange(2 * PAGE))
    assert windows.batch_present(window_keys(keys)) == [False, True, False, True, False]
    assert store.batch_present([]) == []


def test_a_restart_query_finds_an_earlier_boundary_whose_window_l3_holds(
        tmp_path: Path) -> None:
    """Full parts for 20 pages, window parts only for what a hit of 4 pages reads: the query
    says 4, however far the full parts go past it (`StorageController._window_hit`)."""
    from hicache.storage.fetch_queue import PrefetchOp
    from hicache.storage.io import StorageController, WindowParts

    full, window = KINDS.codecs(GEOMETRY, b"ns", None)
    store = LmdbStore(tmp_path / "l3", 2**24, full, sync=False)
    pool = filled_pool("page_first", pages=20)
    io = StorageController(store, pool, 1, WindowParts(KINDS, store.with_codec(window)))
    try:
        keys = keys_of(0, 20)
        store.batch_set(keys, pool, torch.arange(20 * PAGE))
        first = KINDS.window_first(0, 4)
        io.window.store.batch_set(window_keys(keys[first:4]), pool,
                                  torch.arange(first * PAGE, 4 * PAGE))
        for pages in (4, 5, 12, 20):
            op = PrefetchOp("r", keys[:pages])
            io.submit(op)
            assert op.queried.wait(10)
            assert op.hit_pages == 4, pages
    finally:
        io.close()
