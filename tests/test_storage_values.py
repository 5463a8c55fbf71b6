"""The bytes-level entry points of the stores (`ValueStore.get_values` / `put_values`) and the
codec's payloads in parts: what another engine's host pool (SGLang's) is stored through.

Every store kind is the real one: LMDB in `tmp_path`, Redis on the session's loopback
redis-server, and both tiered.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from redis_fixtures import RedisServer, redis_server

from hicache.storage.backends.base import STAT_CORRUPT, STAT_HITS, ValueStore
from hicache.storage.backends.lmdb_store import LmdbStore
from hicache.storage.backends.redis_store import RedisStore
from hicache.storage.backends.tiered_store import STAT_PROMOTED, TieredStore
from hicache.storage.page_format import PageCodec, PageGeometry

__all__ = ["redis_server"]  # session fixture, used by name below

GEOMETRY = PageGeometry(2, 1, 12, 4, torch.float16)  # hicache's layout: 384 payload bytes
PAYLOAD = 2 * 4 * 12 * 2  # one part per layer, not two (an MLA latent): 192 bytes
CAPACITY = 2**24
STORE_KINDS = ("lmdb", "redis", "lmdb+redis")


def payload(seed: int, size: int = PAYLOAD) -> bytes:
    return torch.randint(0, 256, (size,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed)).numpy().tobytes()


def keys_of(first: int, count: int) -> list[bytes]:
    return [i.to_bytes(16, "little") for i in range(first, first + count)]


def halves(data: bytes) -> list[memoryview]:
    """`data` as two parts, the way a K block and a V block lie apart in a host pool."""
    view = memoryview(bytearray(data))
    return [view[:len(data) // 2], view[len(data) // 2:]]


@pytest.fixture
def make_store(tmp_path: Path, redis_server: RedisServer
               ) -> Iterator[Callable[[str], ValueStore]]:
    stores: list[ValueStore] = []
    codec = PageCodec(GEOMETRY, payload_bytes=PAYLOAD)

    def make(kind: str) -> ValueStore:
        lmdb_store = LmdbStore(tmp_path / uuid.uuid4().hex, CAPACITY, codec, sync=False)
        redis_store = RedisStore(redis_server.url, codec, key_prefix=f"{uuid.uuid4().hex}:")
        store = {"lmdb": lmdb_store, "redis": redis_store,
                 "lmdb+redis": TieredStore(lmdb_store, redis_store)}[kind]
        stores.extend((lmdb_store, redis_store))
        return store

    yield make
    for store in stores:
        store.close()


def test_a_payload_in_parts_is_the_value_of_its_concatenation() -> None:
    codec, key = PageCodec(GEOMETRY, payload_bytes=PAYLOAD), keys_of(0, 1)[0]
    data = payload(1)
    value = codec.encode_into(key, data)
    assert codec.encode_into(key, halves(data)) == value
    scratch = bytearray(codec.value_bytes)
    assert bytes(codec.encode_into(key, halves(data), scratch)) == value
    received = halves(bytes(PAYLOAD))
    assert codec.copy_into(key, value, received) and b"".join(received) == data
    with pytest.raises(ValueError, match="192 bytes, got 96"):
        codec.encode_into(key, halves(data)[:1])


def test_a_stated_payload_length_is_in_the_header_and_no_host_pool_takes_it() -> None:
    ours, theirs = PageCodec(GEOMETRY), PageCodec(GEOMETRY, payload_bytes=PAYLOAD)
    assert ours.value_bytes - theirs.value_bytes == GEOMETRY.payload_bytes - PAYLOAD
    key = keys_of(0, 1)[0]
    assert not ours.header_ok(theirs.encode_into(key, payload(2)))
    # Same length, another stated geometry: refused by the header, not served.
    other = PageCodec(GEOMETRY._replace(head_dim=6), payload_bytes=PAYLOAD)
    assert not theirs.copy_into(key, other.encode_into(key, payload(2)), bytearray(PAYLOAD))
    with pytest.raises(ValueError, match="no host pool holds them"):
        theirs.check_pool(None)  # type: ignore[arg-type]  # refused before the pool is read


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_values_round_trip_in_parts(make_store: Callable[[str], ValueStore], kind: str) -> None:
    store = make_store(kind)
    keys, data = keys_of(0, 3), [payload(i) for i in range(3)]
    assert store.put_values(keys, lambda i: halves(data[i])) == [True] * 3
    received = [halves(bytes(PAYLOAD)) for _ in keys]
    asked = keys_of(0, 4)  # the fourth was never stored
    served = store.get_values(asked, lambda i, value: store.codec.copy_into(
        asked[i], value, received[i]))
    assert served == [True, True, True, False]
    assert [b"".join(parts) for parts in received] == data
    assert store.batch_exists(asked) == 3
    assert store.stats()[STAT_HITS] == 3


@pytest.mark.parametrize("kind", ("lmdb", "redis"))
def test_a_value_the_taker_refuses_is_a_counted_deleted_miss(
        make_store: Callable[[str], ValueStore], kind: str) -> None:
    store = make_store(kind)
    keys = keys_of(10, 2)
    store.put_values(keys, lambda i: payload(10 + i))
    assert store.get_values(keys, lambda i, value: i == 0) == [True, False]
    assert store.stats()[STAT_CORRUPT] == 1
    assert store.batch_exists(keys) == 1 and store.batch_exists(keys[1:]) == 0


def test_a_shared_hit_is_promoted_to_the_local_part(
        make_store: Callable[[str], ValueStore]) -> None:
    store = make_store("lmdb+redis")
    assert isinstance(store, TieredStore)
    keys = keys_of(20, 2)
    store.shared.put_values(keys, lambda i: payload(20 + i))  # another server's pages
    taken: list[bytes] = []
    assert store.get_values(keys, lambda i, value: taken.append(bytes(value)) is None) == [True] * 2
    assert store.stats()[STAT_PROMOTED] == 2
    assert store.local.batch_exists(keys) == 2
    local: list[bytes] = []
    store.local.get_values(keys, lambda i, value: local.append(bytes(value)) is None)
    # a checksum's value has no random salt: the promoted value is the one taken
    assert local == taken
    assert [store.codec.decode(k, v) for k, v in zip(keys, local)] == [payload(20), payload(21)]
