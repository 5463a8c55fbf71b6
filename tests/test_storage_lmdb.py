"""L3 LMDB backend, stored page format and backend registry (CPU, tmp_path, small pools)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch
import xxhash
from typing_extensions import Self

from hicache.config_storage import LmdbConfig
from hicache.kernels.layouts import LAYER_FIRST, PAGE_FIRST
from hicache.memory.device import slots_of
from hicache.memory.host import HostKVPool
from hicache.storage.backends import (
    create_backend,
    lmdb_file,
    register_backend,
    registered_backends,
)
from hicache.storage.backends.lmdb_store import MIN_MAP_BYTES, LmdbStore
from hicache.storage.page_format import (
    HEADER_BYTES,
    VALUE_OVERHEAD,
    PageCodec,
    PageGeometry,
    dtype_from_name,
)

REPO = Path(__file__).resolve().parents[1]
LAYERS, HEADS, DIM, PAGE = 4, 2, 8, 4  # 2 KiB of float32 payload per page
NUM_PAGES = 32
GEOMETRY = PageGeometry(LAYERS, HEADS, DIM, PAGE, torch.float32)
CAPACITY = 16 * MIN_MAP_BYTES


def filled_pool(seed: int = 0, layout: str = PAGE_FIRST,
                dtype: torch.dtype = torch.float32) -> HostKVPool:
    pool = HostKVPool(NUM_PAGES, PAGE, LAYERS, HEADS, DIM, dtype, layout, check_available=False)
    gen = torch.Generator().manual_seed(seed)
    for page in range(NUM_PAGES):
        pool.set_page(page, torch.randn(GEOMETRY.page_shape, generator=gen).to(dtype))
    return pool


def keys_of(first: int, count: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(b"page %d" % i) for i in range(first, first + count)]


def slots(pages: list[int]) -> torch.Tensor:
    return slots_of(torch.tensor(pages, dtype=torch.int64), PAGE)


def open_store(path: Path, dtype: torch.dtype = torch.float32, **kw: Any) -> LmdbStore:
    kw.setdefault("max_size_bytes", CAPACITY)
    return LmdbStore(path, codec=PageCodec(GEOMETRY._replace(dtype=dtype)), **kw)


def page_bytes(pool: HostKVPool, page: int) -> bytes:
    return pool.get_page(page).reshape(-1).view(torch.uint8).numpy().tobytes()


def write_range(store: LmdbStore, pool: HostKVPool, first: int, count: int,
                batch: int = 16) -> None:
    """Key i holds page i % NUM_PAGES of `pool`."""
    for start in range(first, first + count, batch):
        n = min(batch, first + count - start)
        pages = [i % NUM_PAGES for i in range(start, start + n)]
        assert store.batch_set(keys_of(start, n), pool, slots(pages)) == [True] * n


def read_back(store: LmdbStore, src: HostKVPool, first: int, count: int) -> list[bool | None]:
    """Read keys first.. into a fresh pool: None per miss, else whether the bytes are exact."""
    dst = HostKVPool(NUM_PAGES, PAGE, LAYERS, HEADS, DIM, src.dtype, check_available=False)
    out: list[bool | None] = []
    for start in range(first, first + count, NUM_PAGES):
        n = min(NUM_PAGES, first + count - start)
        got = store.batch_get(keys_of(start, n), dst, slots(list(range(n))))
        out += [page_bytes(dst, j) == page_bytes(src, (start + j) % NUM_PAGES) if ok else None
                for j, ok in enumerate(got)]
    return out


def read_matches(store: LmdbStore, src: HostKVPool, first: int, count: int) -> list[bool]:
    """True per key served with exactly the bytes `write_range` stored."""
    return [r is True for r in read_back(store, src, first, count)]


# ------------------------------------------------------------------------- page format


def test_codec_round_trip_and_garbage_never_raises() -> None:
    codec, key = PageCodec(GEOMETRY), keys_of(0, 1)[0]
    payload = bytes(range(256)) * (codec.payload_bytes // 256)
    value = codec.encode_into(key, memoryview(payload))
    assert len(value) == VALUE_OVERHEAD + len(payload) and value[:4] == b"HKV1"
    assert codec.decode(key, value) == payload
    assert codec.decode(key, memoryview(value)) == payload
    gen = torch.Generator().manual_seed(1)
    for size in (0, 1, 3, HEADER_BYTES - 1, HEADER_BYTES, len(value) - 1, len(value),
                 len(value) + 1):
        noise = torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8)
        assert codec.decode(key, noise.numpy().tobytes()) is None
    with pytest.raises(ValueError, match="payload"):
        codec.encode_into(key, payload[:-1])
    assert dtype_from_name("torch.bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="allowed"):
        dtype_from_name("complex64")


# ------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(("src_layout", "dst_layout", "dtype"), [
    (PAGE_FIRST, PAGE_FIRST, torch.float32), (LAYER_FIRST, LAYER_FIRST, torch.float32),
    (PAGE_FIRST, LAYER_FIRST, torch.bfloat16), (LAYER_FIRST, PAGE_FIRST, torch.float16),
])
def test_round_trip_is_byte_identical(tmp_path: Path, src_layout: str, dst_layout: str,
                                      dtype: torch.dtype) -> None:
    src = filled_pool(3, src_layout, dtype)
    dst = HostKVPool(NUM_PAGES, PAGE, LAYERS, HEADS, DIM, dtype, dst_layout,
                     check_available=False)
    store = open_store(tmp_path / "l3", dtype)
    keys = keys_of(0, 8)
    assert store.batch_set(keys, src, slots([5, 6, 7, 8, 1, 2, 3, 4])) == [True] * 8
    assert store.batch_get(keys, dst, slots([10, 11, 12, 13, 20, 21, 22, 23])) == [True] * 8
    for s, d in zip([5, 6, 7, 8, 1, 2, 3, 4], [10, 11, 12, 13, 20, 21, 22, 23]):
        assert page_bytes(dst, d) == page_bytes(src, s)
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["written_pages"], stats["pages"]) == (8, 0, 8, 8)
    store.close()
    reopened = open_store(tmp_path / "l3", dtype)  # restart: same bytes back
    assert reopened.batch_get(keys[:1], dst, slots([0])) == [True]
    assert page_bytes(dst, 0) == page_bytes(src, 5)


def test_batch_exists_counts_consecutive_hits_only(tmp_path: Path) -> None:
    store, pool = open_store(tmp_path / "l3"), filled_pool()
    keys = keys_of(0, 6)
    store.batch_set(keys[:3] + keys[4:5], pool, slots([0, 1, 2, 3]))
    assert store.batch_exists(keys) == 3
    assert store.batch_exists(keys[3:]) == 0
    assert store.batch_exists(keys[4:5]) == 1
    assert store.batch_exists([]) == 0
    assert store.batch_get(keys[2:5], filled_pool(9), slots([0, 1, 2])) == [True, False, True]


def test_set_of_existing_keys_is_skipped(tmp_path: Path) -> None:
    store, pool = open_store(tmp_path / "l3"), filled_pool()
    keys = keys_of(0, 4)
    store.batch_set(keys, pool, slots([0, 1, 2, 3]))
    before = store.stats()
    other = filled_pool(seed=77)  # different bytes under the same keys: must not overwrite
    assert store.batch_set(keys, other, slots([0, 1, 2, 3])) == [True] * 4
    after = store.stats()
    assert after["written_pages"] == before["written_pages"] == 4
    assert after["skipped_pages"] == 4 and after["pages"] == 4
    assert read_matches(store, pool, 0, 4) == [True] * 4


def test_wrong_arguments_raise(tmp_path: Path) -> None:
    store, pool = open_store(tmp_path / "l3"), filled_pool()
    with pytest.raises(ValueError, match="host slot indices"):
        store.batch_set(keys_of(0, 2), pool, slots([0]))
    wrong = HostKVPool(4, PAGE, LAYERS, HEADS, DIM * 2, torch.float32, check_available=False)
    with pytest.raises(ValueError, match="geometry"):
        store.batch_get(keys_of(0, 1), wrong, slots([0]))


# ------------------------------------------------------------------------- corruption


def _payload(value: bytes) -> bytes:
    return value[HEADER_BYTES:HEADER_BYTES + PageCodec(GEOMETRY).payload_bytes]


def _other_geometry(value: bytes) -> bytes:  # a valid value of another model, same size
    codec = PageCodec(GEOMETRY._replace(kv_heads=4, head_dim=4))
    return codec.encode_into(keys_of(1, 1)[0], _payload(value))


def _other_dtype(value: bytes) -> bytes:
    geometry = GEOMETRY._replace(dtype=torch.float16, head_dim=2 * DIM)
    return PageCodec(geometry).encode_into(keys_of(1, 1)[0], _payload(value))


def _other_namespace(value: bytes) -> bytes:  # this geometry, another model's namespace
    codec = PageCodec(GEOMETRY, namespace=b"another model")
    return codec.encode_into(keys_of(1, 1)[0], _payload(value))


def _other_key(value: bytes) -> bytes:  # a good value of page 0, moved under page 1's key
    return PageCodec(GEOMETRY).encode_into(keys_of(0, 1)[0], _payload(value))


def _flip(offset: int) -> Callable[[bytes], bytes]:
    def flip(value: bytes) -> bytes:
        out = bytearray(value)
        out[offset] ^= 0x10
        return bytes(out)
    return flip


CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    "payload_bit": _flip(HEADER_BYTES + 100), "last_byte": _flip(-1), "tag": _flip(-3),
    "salt": _flip(40), "version": _flip(4), "truncated": lambda v: v[:-1],
    "header_only": lambda v: v[:HEADER_BYTES], "extended": lambda v: v + b"\0",
    "empty": lambda v: b"", "magic": lambda v: b"XKV1" + v[4:], "geometry": _other_geometry,
    "dtype": _other_dtype, "namespace": _other_namespace, "moved": _other_key,
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corrupt_value_is_a_counted_deleted_miss(tmp_path: Path, name: str) -> None:
    path, pool = tmp_path / "l3", filled_pool()
    keys = keys_of(0, 3)
    store = open_store(path)
    store.batch_set(keys, pool, slots([0, 1, 2]))
    store.close()
    with lmdb.open(str(path), max_dbs=2) as env:  # a raw second writer, store closed
        db = env.open_db(b"pages")
        with env.begin(write=True, db=db) as txn:
            txn.put(keys[1], CORRUPTIONS[name](txn.get(keys[1])))
    store = open_store(path)
    dst = filled_pool(5)
    assert store.batch_get(keys, dst, slots([0, 1, 2])) == [True, False, True]
    assert page_bytes(dst, 0) == page_bytes(pool, 0) and page_bytes(dst, 2) == page_bytes(pool, 2)
    stats = store.stats()
    assert (stats["corrupt_pages"], stats["hits"], stats["misses"], stats["pages"]) == (1, 2, 1, 2)
    assert store.batch_exists(keys[1:2]) == 0  # deleted, so the next backup rewrites it
    store.batch_set(keys[1:2], pool, slots([1]))
    assert read_matches(store, pool, 0, 3) == [True] * 3


# ------------------------------------------------------------------------- capacity


def test_map_grows_past_its_initial_size(tmp_path: Path) -> None:
    store, pool = open_store(tmp_path / "l3", initial_map_bytes=MIN_MAP_BYTES), filled_pool()
    write_range(store, pool, 0, 600, batch=50)  # ~2.4 MiB on disk (one 4 KiB page each)
    stats = store.stats()
    assert stats["map_bytes"] >= 4 * MIN_MAP_BYTES and stats["evicted_pages"] == 0
    assert stats["pages"] == 600 and all(read_matches(store, pool, 0, 600))


def test_capacity_is_what_the_disk_can_hold_when_that_is_less(tmp_path: Path,
                                                               monkeypatch) -> None:
    """The reported capacity is the configured bound, or the data file plus the room left
    on its filesystem when that is less (a small disk under a 32 GB bound)."""
    store, pool = open_store(tmp_path / "l3", max_size_bytes=9 * MIN_MAP_BYTES), filled_pool()
    write_range(store, pool, 0, 20, batch=20)
    assert store.stats()["capacity_bytes"] == 9 * MIN_MAP_BYTES  # this disk has the room
    file_bytes = (tmp_path / "l3" / "data.mdb").stat().st_size
    monkeypatch.setattr(lmdb_file, "room_bytes", lambda path: MIN_MAP_BYTES)
    stats = store.stats()
    assert stats["capacity_bytes"] == file_bytes + MIN_MAP_BYTES < 9 * MIN_MAP_BYTES
    assert stats["configured_capacity_bytes"] == 9 * MIN_MAP_BYTES
    monkeypatch.setattr(lmdb_file, "room_bytes", lambda path: 100 * MIN_MAP_BYTES)
    assert store.stats()["capacity_bytes"] == 9 * MIN_MAP_BYTES  # never past the bound
    store.close()


def _data_file(path: Path) -> os.stat_result:
    return (path / "data.mdb").stat()


def test_prefault_extends_the_file_sparsely_and_the_store_works_as_before(tmp_path: Path) -> None:
    """A prefaulted store's data.mdb reaches `prefault_bytes` past its last page without
    taking disk; pages written into that tail, across a reopen, read back exactly."""
    path, pool = tmp_path / "l3", filled_pool()
    store = open_store(path, prefault_bytes=4 * MIN_MAP_BYTES)
    head = store.stats()["high_water_bytes"]
    assert store.prefaulted_bytes == store.stats()["prefaulted_bytes"] == 4 * MIN_MAP_BYTES
    assert _data_file(path).st_size == head + 4 * MIN_MAP_BYTES
    assert _data_file(path).st_blocks * 512 < 2 * MIN_MAP_BYTES  # a hole, not written
    assert store.stats()["capacity_bytes"] == CAPACITY  # the hole is no disk in use
    write_range(store, pool, 0, 600, batch=50)  # ~2.4 MiB: inside the tail
    assert _data_file(path).st_size == head + 4 * MIN_MAP_BYTES
    assert store.stats()["errors"] == 0 and all(read_matches(store, pool, 0, 600))
    store.close()
    assert lmdb_file.damage(path) is None
    again = open_store(path, prefault_bytes=4 * MIN_MAP_BYTES)  # the tail past the new head
    high = again.stats()["high_water_bytes"]
    assert high > 2 * MIN_MAP_BYTES and _data_file(path).st_size == high + 4 * MIN_MAP_BYTES
    write_range(again, pool, 600, 900, batch=50)  # into the tail and past it
    assert again.stats()["errors"] == 0 and again.stats()["pages"] == 1500
    assert all(read_matches(again, pool, 0, 1500))
    again.close()
    env = lmdb.open(str(path), max_dbs=2, readonly=True)  # LMDB itself reads it whole
    with env.begin(db=env.open_db(b"pages", create=False)) as txn:
        assert txn.stat()["entries"] == 1500
    env.close()


def _thread_write_bytes() -> int:
    """Bytes this thread has sent toward the disk (Linux's per-task I/O accounting)."""
    with open("/proc/thread-self/io", encoding="ascii") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("write_bytes:"))


def test_pages_written_into_a_prefaulted_tail_go_to_disk_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages of 1.47 MB (SmolLM2's, as the vLLM connector stores them), one synced
    transaction each, into a prefaulted tail: the disk is sent about what they hold. A tail
    cached by readahead's large folios had each sync write back its neighbours' folio too
    (100 pages: 2.2x; 800: 5.7x)."""
    codec = PageCodec(PageGeometry(30, 3, 64, 32, torch.float32))
    count = 100
    # the whole tail, whatever the page cache holds now (MemFree counts none of it)
    monkeypatch.setattr(lmdb_file, "free_memory_bytes", lambda: 4 << 30)
    store = LmdbStore(tmp_path / "l3", codec=codec, max_size_bytes=1 << 30,
                      prefault_bytes=256 << 20)
    assert store.prefaulted_bytes == 256 << 20
    payload = bytes(codec.payload_bytes)
    keys = keys_of(0, count)
    before = _thread_write_bytes()
    for key in keys:
        assert store.put_values([key], lambda _: [payload]) == [True]
    sent = _thread_write_bytes() - before
    store.close()
    assert sent < 1.25 * count * codec.value_bytes


def test_prefault_stays_inside_the_bound_the_room_and_free_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def tail(name: str, **kw: Any) -> int:
        store = open_store(tmp_path / name, **kw)
        stats, done = store.stats(), store.prefaulted_bytes
        store.close()
        assert _data_file(tmp_path / name).st_size == stats["high_water_bytes"] + done
        return done

    assert tail("bound", max_size_bytes=2 * MIN_MAP_BYTES, prefault_bytes=100 * MIN_MAP_BYTES) \
        < 2 * MIN_MAP_BYTES  # the file never passes the map's bound
    monkeypatch.setattr(lmdb_file, "room_bytes", lambda path: MIN_MAP_BYTES // 2)
    assert tail("room", prefault_bytes=8 * MIN_MAP_BYTES) <= MIN_MAP_BYTES // 2
    monkeypatch.undo()
    monkeypatch.setattr(lmdb_file, "free_memory_bytes", lambda: 2 * MIN_MAP_BYTES)
    assert tail("memory", prefault_bytes=8 * MIN_MAP_BYTES) == MIN_MAP_BYTES  # half of it


def test_prefault_never_shrinks_a_longer_file_and_its_failure_only_logs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    path, pool = tmp_path / "l3", filled_pool()
    store = open_store(path)
    write_range(store, pool, 0, 40)
    store.close()
    long = _data_file(path).st_size + 16 * MIN_MAP_BYTES  # as another process's prefault left it
    os.truncate(path / "data.mdb", long)
    store = open_store(path, prefault_bytes=MIN_MAP_BYTES)
    assert _data_file(path).st_size == long and store.prefaulted_bytes == MIN_MAP_BYTES
    store.close()

    def refuse(fd: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "ftruncate", refuse)
    caplog.set_level(logging.WARNING, logger="hicache.storage.backends.lmdb_store")
    store = open_store(tmp_path / "other", prefault_bytes=MIN_MAP_BYTES)
    assert store.prefaulted_bytes == 0 and "no prefault" in caplog.text
    write_range(store, pool, 0, 40)
    assert all(read_matches(store, pool, 0, 40)) and store.stats()["errors"] == 0
    store.close()


def test_capacity_bound_evicts_least_recently_used(tmp_path: Path) -> None:
    capacity = 2 * MIN_MAP_BYTES  # ~480 pages
    path, pool = tmp_path / "l3", filled_pool()
    store = open_store(path, max_size_bytes=capacity, initial_map_bytes=MIN_MAP_BYTES)
    write_range(store, pool, 0, 200, batch=20)
    assert all(read_matches(store, pool, 0, 40))  # refresh the 40 oldest
    end = 200
    while store.stats()["evicted_pages"] < 100:  # rounds of ~51 pages: stops at <= 153
        write_range(store, pool, end, 20, batch=20)
        end += 20
        assert end < 1000, "the capacity bound never evicted"
    stats = store.stats()
    assert stats["evicted_pages"] <= 160 and stats["errors"] == 0
    assert stats["map_bytes"] <= capacity and stats["bytes"] <= capacity
    assert (path / "data.mdb").stat().st_size <= capacity
    assert all(read_matches(store, pool, 0, 40))  # refreshed after 40..199 were written
    # Oldest first; the 20 pages of one batch share one stamp, so the last round may take
    # any of its batch.
    evicted = stats["evicted_pages"]
    old = read_matches(store, pool, 40, 160)
    whole, partial = evicted // 20 * 20, -(-evicted // 20) * 20
    assert old.count(False) == evicted and not any(old[:whole]) and all(old[partial:])
    assert all(read_matches(store, pool, 200, end - 200))


# ------------------------------------------------------------------------- processes


def child_main(argv: list[str]) -> None:
    """Subprocess body: write keys [first, first+count), reading back as it goes."""
    path, first, count = argv[0], int(argv[1]), int(argv[2])
    store, pool = open_store(Path(path), initial_map_bytes=MIN_MAP_BYTES), filled_pool()
    for start in range(first, first + count, 20):
        write_range(store, pool, start, 20, batch=20)
        assert all(read_matches(store, pool, start, 20))
        if start % 100 == 0:  # what the other process has written by now reads back exactly
            assert False not in read_back(store, pool, 0, 900)
    stats = store.stats()
    store.close()
    print(json.dumps({k: stats[k] for k in ("errors", "corrupt_pages", "written_pages")}))


def _spawn(path: Path, first: int, count: int) -> subprocess.Popen[str]:
    code = "import sys; from tests.test_storage_lmdb import child_main; child_main(sys.argv[1:])"
    return subprocess.Popen([sys.executable, "-c", code, str(path), str(first), str(count)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_processes_share_one_path_and_pages_persist(tmp_path: Path) -> None:
    path = tmp_path / "shared"
    children = [_spawn(path, 0, 600), _spawn(path, 300, 600)]  # keys 300..599 written by both
    results = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["errors"] == 0 and r["corrupt_pages"] == 0 for r in results)
    assert sum(r["written_pages"] for r in results) == 900  # each key stored exactly once
    store, pool = open_store(path), filled_pool()  # a third process: restart persistence
    assert all(read_matches(store, pool, 0, 900)) and store.stats()["pages"] == 900


def test_threads_read_and_write_while_the_map_grows(tmp_path: Path) -> None:
    store, pool = open_store(tmp_path / "l3", initial_map_bytes=MIN_MAP_BYTES), filled_pool()
    write_range(store, pool, 0, 32)
    failures: list[str] = []

    def reader() -> None:
        for _ in range(40):
            if not all(read_matches(store, pool, 0, 32)) or store.batch_exists(keys_of(0, 32)) != 32:
                failures.append("reader")

    thread = threading.Thread(target=reader)
    thread.start()
    write_range(store, pool, 32, 700, batch=25)
    for _ in range(20):
        store.stats()
    thread.join()
    assert failures == [] and store.stats()["errors"] == 0
    assert all(read_matches(store, pool, 0, 732))


@pytest.mark.parametrize("layout", [PAGE_FIRST, LAYER_FIRST])
def test_fetch_threads_read_disjoint_pages_at_once(tmp_path: Path, layout: str) -> None:
    """Several fetch workers call batch_get at once, each into its own host pages (their
    copies run with the GIL released); each gets exactly its bytes."""
    store, src = open_store(tmp_path / "l3"), filled_pool(4)
    write_range(store, src, 0, NUM_PAGES)
    dst = HostKVPool(NUM_PAGES, PAGE, LAYERS, HEADS, DIM, torch.float32, layout,
                     check_available=False)
    halves = [list(range(NUM_PAGES // 2)), list(range(NUM_PAGES // 2, NUM_PAGES))]
    served: list[list[bool]] = []

    def fetch(pages: list[int]) -> None:
        for _ in range(20):
            served.append(store.batch_get(keys_of(pages[0], len(pages)), dst, slots(pages)))

    threads = [threading.Thread(target=fetch, args=(pages,)) for pages in halves]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(served) == 40 and all(all(s) for s in served)
    assert all(page_bytes(dst, p) == page_bytes(src, p) for p in range(NUM_PAGES))
    assert store.stats()["hits"] == 40 * NUM_PAGES // 2


# ------------------------------------------------------------------------- maintenance


def test_delete_and_clear(tmp_path: Path) -> None:
    store, pool = open_store(tmp_path / "l3"), filled_pool()
    write_range(store, pool, 0, 10)
    assert store.delete(keys_of(0, 3) + keys_of(100, 2)) == 3
    assert store.batch_exists(keys_of(0, 10)) == 0 and store.batch_exists(keys_of(3, 7)) == 7
    assert store.clear() == 7
    assert store.batch_exists(keys_of(3, 1)) == 0 and store.stats()["pages"] == 0
    assert store.clear() == 0


class _FaultyTxn:
    def __init__(self, txn: Any, budget: list[int]) -> None:
        self._txn, self._budget = txn, budget

    def __enter__(self) -> Self:
        self._txn.__enter__()
        return self

    def __exit__(self, *exc: object) -> Any:
        return self._txn.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._txn, name)
        if name not in ("get", "put", "delete", "drop"):
            return method

        def failing(*args: Any, **kwargs: Any) -> Any:
            self._budget[0] -= 1
            if self._budget[0] < 0:
                raise lmdb.DiskError("injected I/O error")
            return method(*args, **kwargs)
        return failing


class _FaultyEnv:
    """Wraps the store's environment: every transaction fails after `gets` operations."""

    def __init__(self, env: lmdb.Environment, gets: int) -> None:
        self._env, self._gets = env, gets

    def begin(self, **kwargs: Any) -> _FaultyTxn:
        return _FaultyTxn(self._env.begin(**kwargs), [self._gets])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


def test_faults_become_counted_misses_never_exceptions(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    store, pool = open_store(tmp_path / "l3"), filled_pool()
    write_range(store, pool, 0, 4)
    monkeypatch.setattr(store.env, "_env", _FaultyEnv(store.env._env, gets=2))
    caplog.set_level(logging.WARNING, logger="hicache.storage.backends.lmdb_store")
    assert store.batch_exists(keys_of(0, 4)) == 2  # hits before the fault count
    assert store.batch_get(keys_of(0, 4), filled_pool(1), slots([0, 1, 2, 3]))[2:] == [False] * 2
    assert store.batch_get(keys_of(0, 4), filled_pool(1), slots([0, 1, 2, 3]))[2:] == [False] * 2
    assert store.batch_set(keys_of(10, 4), pool, slots([0, 1, 2, 3])) == [False] * 4
    assert store.delete(keys_of(0, 4)) == 0
    monkeypatch.setattr(store.env, "_env", _FaultyEnv(store.env._env._env, gets=0))
    assert store.clear() == 0
    assert store.stats()["errors"] == 6
    assert sum("batch_get" in r.getMessage() for r in caplog.records) == 1  # rate-limited
    monkeypatch.undo()
    assert store.batch_exists(keys_of(10, 4)) == 0  # the failed set stored nothing
    assert store.batch_exists(keys_of(0, 4)) == 4


def test_close_is_idempotent_and_later_calls_are_misses(tmp_path: Path) -> None:
    store, pool = open_store(tmp_path / "l3"), filled_pool()
    write_range(store, pool, 0, 2)
    assert_closed_twice_then_misses(store, pool)


def assert_closed_twice_then_misses(store, pool) -> None:
    """A store closed twice answers every later call with a miss, counting no error."""
    store.close()
    store.close()
    assert store.batch_exists(keys_of(0, 2)) == 0
    assert store.batch_get(keys_of(0, 2), pool, slots([0, 1])) == [False, False]
    assert store.batch_set(keys_of(0, 2), pool, slots([0, 1])) == [False, False]
    assert store.stats()["errors"] == 0


# ------------------------------------------------------------------------- registry


def test_registry(tmp_path: Path) -> None:
    codec = PageCodec(GEOMETRY)
    assert create_backend("none", {}, codec) is None
    store = create_backend("lmdb", LmdbConfig(path=str(tmp_path / "a"), max_size_gb=0.01), codec)
    assert isinstance(store, LmdbStore) and store.stats()["capacity_bytes"] == 9 * MIN_MAP_BYTES
    mapping = create_backend("lmdb", {"path": str(tmp_path / "b"), "sync": False}, codec)
    assert isinstance(mapping, LmdbStore)
    with pytest.raises(ValueError, match="registered: none, lmdb"):
        create_backend("nfs", {}, codec)
    with pytest.raises(ValueError, match="allowed: path, max_size_gb, prefault_gb, sync"):
        create_backend("lmdb", {"path": str(tmp_path / "c"), "mapsize": 1}, codec)
    with pytest.raises(ValueError, match="already registered"):
        register_backend("lmdb", lambda config, codec: mapping)
    assert registered_backends()[0] == "none"
