"""Stored page format v3: served only under its own key and namespace, in every protection;
versions 1 and 2 (which cannot prove their key) and garbage never."""

from __future__ import annotations

import struct
from pathlib import Path

import lmdb
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.kernels.layouts import LAYER_FIRST, PAGE_FIRST
from hicache.memory.device import slots_of
from hicache.memory.host import HostKVPool
from hicache.storage.backends.lmdb_store import MIN_MAP_BYTES, LmdbStore
from hicache.storage.page_format import (
    DTYPE_CODES,
    FORMAT_VERSION,
    HEADER_BYTES,
    VALUE_OVERHEAD,
    PageCodec,
    PageGeometry,
)
from hicache.storage.page_seal import TAG_BYTES, FleetKeys, Protection, copy_bytes

LAYERS, HEADS, DIM, PAGE = 2, 2, 4, 4  # 256 B of float32 payload per page
NUM_PAGES = 4
GEOMETRY = PageGeometry(LAYERS, HEADS, DIM, PAGE, torch.float32)
NAMESPACE = b'{"model":"test"}'
KEY, OTHER_KEY = b"k" * 16, b"j" * 16
SECRET = b"s" * 32
# One codec per protection: no secret (checksum), the secret's MAC, encrypted.
CODECS = {
    Protection.CHECKSUM: PageCodec(GEOMETRY, namespace=NAMESPACE),
    Protection.MAC: PageCodec(GEOMETRY, namespace=NAMESPACE, keys=FleetKeys(SECRET)),
    Protection.ENCRYPTED: PageCodec(GEOMETRY, namespace=NAMESPACE,
                                    keys=FleetKeys(SECRET, encrypt=True)),
}
CODEC = CODECS[Protection.CHECKSUM]
OLD_HEADER = struct.Struct("<4sHIIIIBxQQ8x")  # versions 1 and 2: a checksum of the payload


def payload_of(seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (CODEC.payload_bytes,), generator=gen,
                         dtype=torch.uint8).numpy().tobytes()


def old_value(payload: bytes, version: int) -> bytes:
    """A value as versions 1 (xxh64) and 2 (xxh3_64) wrote it: header, then the payload."""
    digest = xxhash.xxh64_intdigest if version == 1 else xxhash.xxh3_64_intdigest
    g = GEOMETRY
    return OLD_HEADER.pack(b"HKV1", version, g.num_layers, g.kv_heads, g.head_dim,
                           g.page_size, DTYPE_CODES[g.dtype], len(payload),
                           digest(payload)) + payload


def pool(layout: str) -> HostKVPool:
    return HostKVPool(NUM_PAGES, PAGE, LAYERS, HEADS, DIM, torch.float32, layout,
                      check_available=False)


def page_bytes(host: HostKVPool, page: int) -> bytes:
    return host.get_page(page).reshape(-1).view(torch.uint8).numpy().tobytes()


def test_version_3_checksum_value_is_pinned() -> None:
    """The exact bytes v3 writes without a secret (a change here strands every stored page)."""
    codec = PageCodec(PageGeometry(2, 1, 2, 1, torch.float16), namespace=b"golden")
    value = codec.encode_into(bytes(16), bytes(range(codec.payload_bytes)))
    assert value[:HEADER_BYTES] == bytes.fromhex(
        "484b5631030002000000010000000200000001000000020010000000000000000000000000000000"
        "0000000000000000")
    assert value[-TAG_BYTES:] == bytes.fromhex("8cf22e0c6f29e6b4ff4557d1db9f9d33")
    assert FORMAT_VERSION == 3 and HEADER_BYTES % 16 == 0


@pytest.mark.parametrize("protection", list(Protection))
@pytest.mark.parametrize("layout", [PAGE_FIRST, LAYER_FIRST])
def test_round_trip_in_every_protection_and_layout(protection: Protection, layout: str) -> None:
    codec, payload = CODECS[protection], payload_of(1)
    value = codec.encode_into(KEY, payload)
    assert len(value) == codec.value_bytes == VALUE_OVERHEAD + len(payload)
    assert value[23] == protection  # the header names it
    # encrypted: the payload is not in the value; otherwise it is, at HEADER_BYTES
    assert (payload in value) == (protection != Protection.ENCRYPTED)
    assert codec.decode(KEY, value) == payload
    scratch = bytearray(codec.value_bytes)
    assert codec.decode(KEY, codec.encode_into(KEY, payload, scratch)) == payload
    with pytest.raises(ValueError, match="buffer of"):
        codec.encode_into(KEY, payload, bytearray(codec.value_bytes - 1))
    host = pool(layout)
    host.buffer.zero_()
    assert codec.value_writer(host)(KEY, memoryview(value), 2) is True
    assert page_bytes(host, 2) == payload
    assert all(page_bytes(host, p) == bytes(codec.payload_bytes) for p in (0, 1, 3))


def rejected(codec: PageCodec, value: bytes, key: bytes = KEY) -> bool:
    """Whether every reader refuses `value` under `key`: decode, and both layouts' writers."""
    hosts = [pool(PAGE_FIRST), pool(LAYER_FIRST)]
    return (codec.decode(key, value) is None
            and not any(codec.value_writer(host)(key, value, 0) for host in hosts))


@pytest.mark.parametrize("protection", list(Protection))
def test_a_value_under_another_key_or_namespace_is_rejected(protection: Protection) -> None:
    codec = CODECS[protection]
    value = codec.encode_into(KEY, payload_of(2))
    assert rejected(codec, value, OTHER_KEY)
    elsewhere = PageCodec(GEOMETRY, namespace=b'{"model":"other"}',
                          keys=None if protection == Protection.CHECKSUM else FleetKeys(
                              SECRET, protection == Protection.ENCRYPTED))
    assert rejected(elsewhere, value)


@pytest.mark.parametrize("protection", [Protection.MAC, Protection.ENCRYPTED])
def test_another_secret_or_protection_is_rejected(protection: Protection) -> None:
    value = CODECS[protection].encode_into(KEY, payload_of(3))
    other_secret = PageCodec(GEOMETRY, namespace=NAMESPACE,
                             keys=FleetKeys(b"t" * 32, protection == Protection.ENCRYPTED))
    assert rejected(other_secret, value)
    assert all(rejected(codec, value) for p, codec in CODECS.items() if p != protection)


@pytest.mark.parametrize("protection", [Protection.MAC, Protection.ENCRYPTED])
def test_a_forged_tag_is_rejected(protection: Protection) -> None:
    """Whoever lacks the secret can rewrite the payload and the tag, never make them agree;
    a value re-tagged as a checksum (no secret) is refused by a reader that has one."""
    codec, payload = CODECS[protection], payload_of(4)
    forged = bytearray(codec.encode_into(KEY, payload))
    forged[HEADER_BYTES:HEADER_BYTES + len(payload)] = payload_of(5)
    assert rejected(codec, bytes(forged))
    as_checksum = bytearray(CODEC.encode_into(KEY, payload_of(5)))
    as_checksum[23] = protection  # a well-formed v3 checksum value claiming the protection
    assert rejected(codec, bytes(as_checksum))


@pytest.mark.parametrize("version", [1, 2])
def test_versions_1_and_2_are_rejected(version: int) -> None:
    old = old_value(payload_of(6), version)
    for codec in CODECS.values():
        assert not codec.header_ok(old) and rejected(codec, old)
    # also when padded to a v3 value's length (the header's version still refuses it)
    assert rejected(CODEC, old + bytes(TAG_BYTES))


@pytest.mark.parametrize("protection", list(Protection))
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16),
       flips=st.dictionaries(st.integers(0, CODEC.value_bytes - 1), st.integers(1, 255),
                             min_size=1, max_size=8))
def test_any_flipped_byte_is_rejected(protection: Protection, seed: int,
                                      flips: dict[int, int]) -> None:
    """Every byte of a v3 value is covered: header, salt, payload, tag."""
    codec = CODECS[protection]
    value = bytearray(codec.encode_into(KEY, payload_of(seed)))
    for offset, mask in flips.items():
        value[offset] ^= mask
    assert rejected(codec, bytes(value))


@pytest.mark.parametrize("cut", [0, 1, HEADER_BYTES, CODEC.value_bytes - 1])
def test_short_and_long_values_are_rejected(cut: int) -> None:
    value = CODEC.encode_into(KEY, payload_of(7))
    assert rejected(CODEC, value[:cut]) and rejected(CODEC, value + b"\0")


def test_copy_bytes_refuses_a_size_mismatch_and_writer_a_page_out_of_range() -> None:
    with pytest.raises(ValueError, match="copy of 1 bytes"):
        copy_bytes(bytearray(4), b"x")  # numpy alone would broadcast it
    with pytest.raises(IndexError, match="out of range"):
        CODEC.value_writer(pool(PAGE_FIRST))(KEY, CODEC.encode_into(KEY, payload_of(0)), -1)


def test_lmdb_store_misses_a_version_2_value_and_deletes_it(tmp_path: Path) -> None:
    """An upgrade starts cold: a page an older server stored is a miss, counted, deleted."""
    path = tmp_path / "l3"
    LmdbStore(path, 2 * MIN_MAP_BYTES, CODEC).close()
    with lmdb.open(str(path), max_dbs=2) as env:  # a page an older server stored, raw
        db = env.open_db(b"pages")
        with env.begin(write=True, db=db) as txn:
            txn.put(KEY, old_value(payload_of(8), 2))
    store = LmdbStore(path, 2 * MIN_MAP_BYTES, CODEC)
    host = pool(PAGE_FIRST)
    assert store.batch_get([KEY], host, slots_of(torch.tensor([1]), PAGE)) == [False]
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["corrupt_pages"], stats["pages"]) == (0, 1, 1, 0)
    store.close()
