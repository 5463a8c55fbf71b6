"""Stored page format: version 2 (xxh3) written, version 1 (xxh64) still served, garbage never."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from hicache.kernels.layouts import LAYER_FIRST, PAGE_FIRST
from hicache.memory.device import slots_of
from hicache.memory.host import HostKVPool
from hicache.storage.backends.lmdb_store import MIN_MAP_BYTES, LmdbStore
from hicache.storage.page_format import (
    DTYPE_CODES,
    FORMAT_VERSION,
    HEADER_BYTES,
    READABLE_VERSIONS,
    PageCodec,
    PageGeometry,
    copy_bytes,
)

LAYERS, HEADS, DIM, PAGE = 2, 2, 4, 4  # 256 B of float32 payload per page
NUM_PAGES = 4
GEOMETRY = PageGeometry(LAYERS, HEADS, DIM, PAGE, torch.float32)
CODEC = PageCodec(GEOMETRY)
V1_HEADER = struct.Struct("<4sHIIIIBxQQ8x")  # the version-1 header, as version 1 packed it
VERSION_OFFSET, CHECKSUM_OFFSET, RESERVED = 4, 32, range(40, 48)


def payload_of(seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (CODEC.payload_bytes,), generator=gen,
                         dtype=torch.uint8).numpy().tobytes()


def value_with(payload: bytes, version: int, checksum: int, codec: PageCodec = CODEC) -> bytes:
    g = codec.geometry
    return V1_HEADER.pack(b"HKV1", version, g.num_layers, g.kv_heads, g.head_dim, g.page_size,
                          DTYPE_CODES[g.dtype], len(payload), checksum) + payload


def v1_value(payload: bytes, codec: PageCodec = CODEC) -> bytes:
    """A value as version 1 wrote it: checksum xxh64."""
    return value_with(payload, 1, xxhash.xxh64_intdigest(payload), codec)


def pool(layout: str) -> HostKVPool:
    return HostKVPool(NUM_PAGES, PAGE, LAYERS, HEADS, DIM, torch.float32, layout,
                      check_available=False)


def page_bytes(host: HostKVPool, page: int) -> bytes:
    return host.get_page(page).reshape(-1).view(torch.uint8).numpy().tobytes()


def test_v1_builder_matches_what_version_1_wrote() -> None:
    codec = PageCodec(PageGeometry(2, 1, 2, 1, torch.float16))
    payload = bytes(range(codec.payload_bytes))
    # The header version-1 code (commit 2534a83) wrote for this payload.
    golden = bytes.fromhex("484b563101000200000001000000020000000100000002001000000000000000"
                           "f76941b82fefb6440000000000000000")
    assert v1_value(payload, codec)[:HEADER_BYTES] == golden


def test_version_2_round_trip() -> None:
    payload = payload_of(1)
    value = CODEC.encode_into(payload)
    assert FORMAT_VERSION == 2 and READABLE_VERSIONS == {1, 2}
    assert value == value_with(payload, 2, xxhash.xxh3_64_intdigest(payload))
    assert CODEC.header_ok(value) and bytes(CODEC.check(value)) == payload
    scratch = bytearray(CODEC.value_bytes)
    assert bytes(CODEC.encode_into(payload, scratch)) == value and bytes(scratch) == value
    with pytest.raises(ValueError, match="buffer of"):
        CODEC.encode_into(payload, bytearray(CODEC.value_bytes - 1))


@pytest.mark.parametrize("layout", [PAGE_FIRST, LAYER_FIRST])
@pytest.mark.parametrize("version", [1, 2])
def test_every_readable_version_is_served_byte_identically(layout: str, version: int) -> None:
    payload = payload_of(version)
    value = v1_value(payload) if version == 1 else CODEC.encode_into(payload)
    assert CODEC.header_ok(value) and bytes(CODEC.check(memoryview(value))) == payload
    host = pool(layout)
    host.buffer.zero_()
    assert CODEC.value_writer(host)(memoryview(value), 2) is True
    assert page_bytes(host, 2) == payload
    assert all(page_bytes(host, p) == bytes(CODEC.payload_bytes) for p in (0, 1, 3))


def rejected(value: bytes) -> bool:
    """Whether every reader refuses `value`: check, and the writers of both layouts."""
    hosts = [pool(PAGE_FIRST), pool(LAYER_FIRST)]
    return (CODEC.check(value) is None
            and not any(CODEC.value_writer(host)(value, 0) for host in hosts))


@pytest.mark.parametrize(("version", "digest"), [
    (1, xxhash.xxh3_64_intdigest), (2, xxhash.xxh64_intdigest)])
def test_a_checksum_of_the_other_version_is_rejected(version: int,
                                                      digest: Callable[[bytes], int]) -> None:
    payload = payload_of(3)
    value = value_with(payload, version, digest(payload))
    assert CODEC.header_ok(value) and rejected(value)


@pytest.mark.parametrize("version", [0, 3, 0x101, 0xFFFF])
def test_unknown_versions_are_rejected(version: int) -> None:
    payload = payload_of(4)
    for digest in (xxhash.xxh64_intdigest, xxhash.xxh3_64_intdigest):
        value = value_with(payload, version, digest(payload))
        assert not CODEC.header_ok(value) and rejected(value)


@pytest.mark.parametrize("version", [1, 2])
def test_a_flipped_payload_byte_is_rejected(version: int) -> None:
    payload = payload_of(5)
    good = v1_value(payload) if version == 1 else CODEC.encode_into(payload)
    for offset in (HEADER_BYTES, HEADER_BYTES + 77, len(good) - 1):
        value = bytearray(good)
        value[offset] ^= 0x01
        assert rejected(bytes(value))


@given(version=st.sampled_from(sorted(READABLE_VERSIONS)), seed=st.integers(0, 2**16),
       flips=st.dictionaries(st.integers(0, CODEC.value_bytes - 1), st.integers(1, 255),
                             min_size=1, max_size=8))
def test_random_corruption_never_yields_data(version: int, seed: int,
                                             flips: dict[int, int]) -> None:
    payload = payload_of(seed)
    value = bytearray(v1_value(payload) if version == 1 else CODEC.encode_into(payload))
    for offset, mask in flips.items():
        value[offset] ^= mask
    if set(flips) <= set(RESERVED):  # the reserved bytes are not checked: the page is intact
        assert bytes(CODEC.check(bytes(value))) == payload
    else:
        assert rejected(bytes(value))


def test_copy_bytes_refuses_a_size_mismatch_and_writer_a_page_out_of_range() -> None:
    with pytest.raises(ValueError, match="copy of 1 bytes"):
        copy_bytes(bytearray(4), b"x")  # numpy alone would broadcast it
    with pytest.raises(IndexError, match="out of range"):
        CODEC.value_writer(pool(PAGE_FIRST))(CODEC.encode_into(payload_of(0)), -1)


def test_lmdb_store_serves_a_version_1_value(tmp_path: Path) -> None:
    path, key, payload = tmp_path / "l3", b"k" * 16, payload_of(6)
    store = LmdbStore(path, 2 * MIN_MAP_BYTES, CODEC)
    store.close()
    with lmdb.open(str(path), max_dbs=2) as env:  # a page an older server stored, raw
        db = env.open_db(b"pages")
        with env.begin(write=True, db=db) as txn:
            txn.put(key, v1_value(payload))
    store = LmdbStore(path, 2 * MIN_MAP_BYTES, CODEC)
    host = pool(PAGE_FIRST)
    assert store.batch_get([key], host, slots_of(torch.tensor([1]), PAGE)) == [True]
    assert page_bytes(host, 1) == payload
    stats = store.stats()
    assert (stats["hits"], stats["corrupt_pages"], stats["pages"]) == (1, 0, 1)
    store.close()
