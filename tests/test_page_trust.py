"""The fleet secret: where it comes from (a file or the environment, never shown), what it
keys (the page hash root, every page's MAC, encryption), and what a page of another secret,
a forged one or a flipped ciphertext bit is in the stores: a counted, deleted miss."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import lmdb
import pytest
import torch
from redis_fixtures import RedisServer, require_redis_server

from hicache.config import ConfigError
from hicache.config_storage import MIN_SECRET_BYTES, SECRET_ENV, StorageConfig, storage_secret
from hicache.integrations.store_sections import fleet_keys as extra_fleet_keys
from hicache.memory.host import HostKVPool
from hicache.storage.backends.base import STAT_CORRUPT, STAT_HITS
from hicache.storage.backends.lmdb_store import MIN_MAP_BYTES, LmdbStore
from hicache.storage.backends.redis_store import RedisStore
from hicache.storage.backends.tiered_store import STAT_PROMOTED, TieredStore
from hicache.storage.open import fleet_keys, page_hasher
from hicache.storage.page_format import HEADER_BYTES, PageCodec, PageGeometry
from hicache.storage.page_seal import FleetKeys, Protection

LAYERS, HEADS, DIM, PAGE = 2, 2, 8, 4
GEOMETRY = PageGeometry(LAYERS, HEADS, DIM, PAGE, torch.float32)
NAMESPACE = b'{"model":"trust"}'
SECRET = "x" * MIN_SECRET_BYTES


@pytest.fixture(autouse=True)
def no_secret_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)


def codec(secret: bytes | None = SECRET.encode(), encrypt: bool = False) -> PageCodec:
    keys = None if secret is None else FleetKeys(secret, encrypt)
    return PageCodec(GEOMETRY, namespace=NAMESPACE, keys=keys)


def pool(seed: int = 0) -> HostKVPool:
    host = HostKVPool(8, PAGE, LAYERS, HEADS, DIM, torch.float32, check_available=False)
    host.buffer.copy_(torch.randn(host.buffer.shape, generator=torch.Generator().manual_seed(seed)))
    return host


def slots(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)])


def keys_of(count: int) -> list[bytes]:
    return [bytes([i]) * 16 for i in range(count)]


def page_bytes(host: HostKVPool, page: int) -> bytes:
    return host.get_page(page).reshape(-1).view(torch.uint8).numpy().tobytes()


# ------------------------------------------------------------------------- the secret


def test_the_secret_comes_from_the_file_else_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert storage_secret(StorageConfig()) is None
    monkeypatch.setenv(SECRET_ENV, SECRET + "\n")
    assert storage_secret(StorageConfig()) == SECRET.encode()
    path = tmp_path / "secret"
    path.write_text("f" * 64 + "\n")  # `openssl rand -hex 32 > FILE`
    path.chmod(0o600)
    assert storage_secret(StorageConfig(secret_file=str(path))) == b"f" * 64  # the file wins
    binary = bytes(range(1, 32)) + b" "  # `openssl rand 32 > FILE` may end in whitespace
    path.write_bytes(binary)
    assert storage_secret(StorageConfig(secret_file=str(path))) == binary


def test_a_short_or_unreadable_secret_stops_start_up_without_showing_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    short = "s3cr3t-but-short"
    monkeypatch.setenv(SECRET_ENV, short)
    with pytest.raises(ConfigError, match=f"{SECRET_ENV}.*16 bytes.*at least 32") as err:
        storage_secret(StorageConfig())
    assert short not in str(err.value)
    path = tmp_path / "secret"
    path.write_text(short)
    with pytest.raises(ConfigError, match="storage.secret_file.*16 bytes") as err:
        storage_secret(StorageConfig(secret_file=str(path)))
    assert short not in str(err.value)
    with pytest.raises(ConfigError, match="storage.secret_file: cannot read"):
        storage_secret(StorageConfig(secret_file=str(tmp_path / "absent")))


def test_a_secret_file_others_can_read_is_warned_about(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "secret"
    path.write_text(SECRET)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        assert storage_secret(StorageConfig(secret_file=str(path))) == SECRET.encode()
    assert "chmod 600" in caplog.text and SECRET not in caplog.text


def test_encrypt_without_a_secret_is_a_config_error_naming_both_settings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=f"storage.encrypt.*storage.secret_file.*{SECRET_ENV}"):
        StorageConfig(encrypt=True)
    monkeypatch.setenv(SECRET_ENV, SECRET)
    assert StorageConfig(encrypt=True).encrypt
    with pytest.raises(ConfigError, match="--x encrypt: expected a boolean"):
        extra_fleet_keys("--x", {"encrypt": "yes"})
    keys = extra_fleet_keys("--x", {"encrypt": True})
    assert keys is not None and keys.protection == Protection.ENCRYPTED
    assert SECRET not in repr(keys)


# ------------------------------------------------------------------------- in the stores


def lmdb_store(path: Path, c: PageCodec) -> LmdbStore:
    return LmdbStore(path, 4 * MIN_MAP_BYTES, c, sync=False)


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_page_of_another_secret_is_a_counted_deleted_miss(tmp_path: Path,
                                                            encrypt: bool) -> None:
    keys, src = keys_of(3), pool(1)
    store = lmdb_store(tmp_path / "l3", codec(b"a" * 32, encrypt))
    assert store.batch_set(keys, src, slots([0, 1, 2])) == [True] * 3
    store.close()
    other = lmdb_store(tmp_path / "l3", codec(b"b" * 32, encrypt))
    assert other.batch_get(keys, pool(2), slots([0, 1, 2])) == [False] * 3
    stats = other.stats()
    assert (stats[STAT_HITS], stats[STAT_CORRUPT], stats["pages"]) == (0, 3, 0)
    other.close()


def test_pages_swapped_between_keys_in_lmdb_are_misses(tmp_path: Path) -> None:
    """Pages 0 and 1 trade values (both good pages of this model, secret and namespace)."""
    keys, src = keys_of(3), pool(3)
    store = lmdb_store(tmp_path / "l3", codec())
    store.batch_set(keys, src, slots([0, 1, 2]))
    store.close()
    with lmdb.open(str(tmp_path / "l3"), max_dbs=2) as env, env.begin(
            write=True, db=env.open_db(b"pages")) as txn:
        first, second = bytes(txn.get(keys[0])), bytes(txn.get(keys[1]))
        txn.put(keys[0], second)
        txn.put(keys[1], first)
    store = lmdb_store(tmp_path / "l3", codec())
    dst = pool(4)
    assert store.batch_get(keys, dst, slots([0, 1, 2])) == [False, False, True]
    assert page_bytes(dst, 2) == page_bytes(src, 2)
    assert store.stats()[STAT_CORRUPT] == 2
    store.close()


@pytest.mark.parametrize("offset", [HEADER_BYTES, HEADER_BYTES + 333, -1, 40])
def test_a_flipped_ciphertext_bit_is_a_miss(tmp_path: Path, offset: int) -> None:
    keys, src, c = keys_of(2), pool(5), codec(encrypt=True)
    store = lmdb_store(tmp_path / "l3", c)
    store.batch_set(keys, src, slots([0, 1]))
    store.close()
    with lmdb.open(str(tmp_path / "l3"), max_dbs=2) as env, env.begin(
            write=True, db=env.open_db(b"pages")) as txn:
        value = bytearray(txn.get(keys[1]))
        assert page_bytes(src, 1) not in value  # ciphertext: the KV is not in the store
        value[offset] ^= 0x04
        txn.put(keys[1], bytes(value))
    store = lmdb_store(tmp_path / "l3", c)
    dst = pool(6)
    assert store.batch_get(keys, dst, slots([0, 1])) == [True, False]
    assert page_bytes(dst, 0) == page_bytes(src, 0)
    store.close()


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    require_redis_server()
    with RedisServer.start(tmp_path / "redis") as server:
        yield server.url


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_shared_hit_is_promoted_decrypted_and_sealed_again(tmp_path: Path, redis_url: str,
                                                             encrypt: bool) -> None:
    """lmdb+redis: a page only Redis holds is served and written to LMDB, which serves it
    next: the promotion stores the payload, never a ciphertext as a payload."""
    c, keys, src = codec(encrypt=encrypt), keys_of(2), pool(7)
    shared = RedisStore(redis_url, c, key_prefix=f"{uuid.uuid4().hex}:")
    shared.batch_set(keys, src, slots([0, 1]))  # another server's pages
    store = TieredStore(lmdb_store(tmp_path / "l3", c), shared)
    received = [bytearray(c.payload_bytes) for _ in keys]
    assert store.get_values(keys, lambda i, v: c.copy_into(keys[i], v, received[i])) == [True] * 2
    assert store.stats()[STAT_PROMOTED] == 2
    again = [bytearray(c.payload_bytes) for _ in keys]
    assert store.local.get_values(keys, lambda i, v: c.copy_into(keys[i], v, again[i])) == \
        [True] * 2
    assert [bytes(p) for p in again] == [page_bytes(src, 0), page_bytes(src, 1)]
    store.close()


def test_the_server_hasher_is_keyed_by_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """`page_hasher` (the L3 keys, the KV events' hashes) is rooted in the secret."""
    model = SimpleNamespace(dtype=torch.float32, fingerprint="fp", geometry=(2, 2, 8))

    def config(encrypt: bool = False) -> SimpleNamespace:
        return SimpleNamespace(cache=SimpleNamespace(page_size=PAGE),
                               storage=StorageConfig(encrypt=encrypt))

    tokens = list(range(2 * PAGE))
    plain = page_hasher(config(), model).hash_pages(tokens)  # type: ignore[arg-type]
    assert fleet_keys(config()) is None  # type: ignore[arg-type]
    monkeypatch.setenv(SECRET_ENV, SECRET)
    mac = page_hasher(config(), model).hash_pages(tokens)  # type: ignore[arg-type]
    encrypted = page_hasher(config(True), model).hash_pages(tokens)  # type: ignore[arg-type]
    monkeypatch.setenv(SECRET_ENV, "y" * MIN_SECRET_BYTES)
    other = page_hasher(config(), model).hash_pages(tokens)  # type: ignore[arg-type]
    assert len({tuple(keys) for keys in (plain, mac, encrypted, other)}) == 4
