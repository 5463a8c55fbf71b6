"""LMDB L3 on a damaged file or a full disk: the store heals or degrades, the process lives.

A data.mdb shorter than its environment says is a SIGBUS when LMDB maps a page past its end,
so every test that maps such a file runs it in a subprocess: a crash shows as a return code
(-7) instead of killing pytest. The full-disk tests mount an 8 MiB tmpfs (root only) or set
RLIMIT_FSIZE in a subprocess (anyone).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest

from tests.conftest import missing_tool
from tests.test_storage_lmdb import (
    MIN_MAP_BYTES,
    NUM_PAGES,
    REPO,
    _FaultyEnv,
    filled_pool,
    keys_of,
    open_store,
    read_back,
    read_matches,
    slots,
    write_range,
)

STORED = 200  # pages written before the file is cut: ~850 KiB of data.mdb
FRESH = 1000  # first key of the pages written after the store healed
LMDB_PAGE = 4096  # LMDB's page size on x86-64 Linux (the OS page size)
CHILD_TIMEOUT_S = 120
DISK_BYTES = 8 * 2**20  # the full disk of the tmpfs test
BIG_CAPACITY = 2**30  # max_size_bytes far above the disk: the disk fills first
BATCH = 50  # pages per batch_set in the full-disk tests (~200 KiB on disk)


# ------------------------------------------------------------------------- helpers


def run_child(func: str, *args: object, lines: int | None = None) -> Any:
    """Run `func(argv)` of this module in a fresh interpreter; its last stdout line (JSON),
    or its last `lines` lines as a list.

    Asserts that it exited 0: a SIGBUS shows as returncode -7, an uncaught error as 1.
    """
    code = f"import sys; from tests.test_storage_lmdb_faults import {func}; {func}(sys.argv[1:])"
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    assert proc.returncode == 0, (f"child {func} exited {proc.returncode} "
                                  f"(-7 is SIGBUS):\n{proc.stderr[-4000:]}")
    out = [json.loads(line) for line in proc.stdout.strip().splitlines()[-(lines or 1):]]
    return out if lines is not None else out[0]


def stored_env(path: Path) -> int:
    """A closed store at `path` holding keys [0, STORED); the size of its data.mdb."""
    store, pool = open_store(path), filled_pool()
    write_range(store, pool, 0, STORED, batch=20)
    store.close()
    return (path / "data.mdb").stat().st_size


def moved_aside(path: Path) -> tuple[Path, Path]:
    """The one data.mdb.corrupt-<stamp> in `path` and its lock.mdb with the same stamp."""
    data = sorted(path.glob("data.mdb.corrupt-*"))
    assert len(data) == 1, f"expected one moved-aside data file in {sorted(path.iterdir())}"
    lock = path / data[0].name.replace("data.mdb", "lock.mdb")
    assert lock.exists(), f"{lock.name} missing beside {data[0].name}"
    return data[0], lock


def fresh_store_works(store: Any) -> dict[str, Any]:
    """The old pages are misses, new pages round-trip; the store's stats as JSON-able data."""
    pool = filled_pool()
    old = read_back(store, pool, 0, STORED)
    write_range(store, pool, FRESH, 40, batch=20)
    fresh = read_matches(store, pool, FRESH, 40)
    stats = store.stats()
    return {"old_hits": sum(r is not None for r in old), "fresh_ok": all(fresh),
            "pages": stats["pages"], "errors_by_op": stats["errors_by_op"]}


@contextlib.contextmanager
def tmpfs(where: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of `size_bytes` mounted at `where`. Where mounting is not permitted this is a
    missing tool: a failure under CI (which runs as root and mounts), a skip elsewhere."""
    if os.geteuid() != 0:
        missing_tool("mounting a tmpfs needs root")
    where.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs",
                           str(where)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        if "permission denied" in proc.stderr.lower() or "not permitted" in proc.stderr.lower():
            missing_tool(f"mount -t tmpfs is not permitted here: {proc.stderr.strip()}")
        pytest.fail(f"mount -t tmpfs failed: {proc.stderr.strip()}")
    try:
        yield where
    finally:
        # A store left open by a failing test keeps the mount busy: detach it lazily then,
        # so that the test's own failure shows, not umount's.
        if subprocess.run(["umount", str(where)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=False)


# ------------------------------------------------------------------------- a file cut short


CUTS: dict[str, Callable[[int], int]] = {
    "8KiB": lambda size: 8192, "half": lambda size: size // 2, "tenth": lambda size: size // 10,
    "one_page_short": lambda size: size - LMDB_PAGE, "100B": lambda size: 100,
    "empty": lambda size: 0,
}


def reopen_child(argv: list[str]) -> None:
    """Subprocess body: open the store at each path of argv (whatever its file holds), use it."""
    for path in argv:
        print(f"opening {path}", file=sys.stderr, flush=True)  # names the one a SIGBUS hit
        print(json.dumps(fresh_store_works(open_store(Path(path)))), flush=True)


def test_truncated_files_are_moved_aside_and_fresh_stores_open(tmp_path: Path) -> None:
    truncated: dict[str, bytes] = {}
    for name, cut in CUTS.items():  # one child opens them all: an interpreter costs ~2 s
        path = tmp_path / name
        os.truncate(path / "data.mdb", cut(stored_env(path)))
        truncated[name] = (path / "data.mdb").read_bytes()
    outs = run_child("reopen_child", *(tmp_path / name for name in CUTS), lines=len(CUTS))
    for (name, original), out in zip(truncated.items(), outs):
        data, _ = moved_aside(tmp_path / name)
        assert data.read_bytes() == original, name  # kept as it was, for a post-mortem
        assert out["old_hits"] == 0 and out["fresh_ok"] and out["pages"] == 40, (name, out)
        assert out["errors_by_op"] == {}, name  # healed at open: no call failed


def test_an_intact_file_is_never_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "l3"
    stored_env(path)
    store, pool = open_store(path), filled_pool()
    assert all(read_matches(store, pool, 0, STORED))
    assert not list(path.glob("*.corrupt-*"))


WHILE_OPEN_CUTS = (0, 8192, STORED * LMDB_PAGE // 2)  # bytes left of data.mdb


def truncate_while_open_child(argv: list[str]) -> None:
    """Subprocess body: in each directory of argv, store pages, then cut data.mdb to
    WHILE_OPEN_CUTS[i] bytes under the open store and use it."""
    for path, cut in zip(map(Path, argv), WHILE_OPEN_CUTS):
        print(f"cutting {path} to {cut} bytes", file=sys.stderr, flush=True)
        store, pool = open_store(path), filled_pool()
        write_range(store, pool, 0, STORED, batch=20)
        os.truncate(path / "data.mdb", cut)
        first = store.batch_get(keys_of(0, 4), filled_pool(1), slots([0, 1, 2, 3]))
        print(json.dumps({"first": first, **fresh_store_works(store)}), flush=True)
        store.close()


def test_files_truncated_under_open_stores_are_a_counted_miss_then_healed(
        tmp_path: Path) -> None:
    paths = [tmp_path / f"cut_{cut}" for cut in WHILE_OPEN_CUTS]
    outs = run_child("truncate_while_open_child", *paths, lines=len(paths))
    for path, out in zip(paths, outs):
        assert out["first"] == [False] * 4, path.name  # the call that found it short: a miss
        assert out["errors_by_op"] == {"batch_get": 1}, path.name
        assert out["old_hits"] == 0 and out["fresh_ok"] and out["pages"] == 40, (path, out)
        moved_aside(path)


def test_a_panicked_environment_is_reopened(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    store, pool = open_store(tmp_path / "l3"), filled_pool()
    write_range(store, pool, 0, 8)

    class Panicked(_FaultyEnv):  # what LMDB answers after a fatal error (MDB_PANIC)
        def begin(self, **kwargs: Any) -> Any:
            raise lmdb.PanicError("mdb_txn_begin: MDB_PANIC: Update of meta page failed")

    monkeypatch.setattr(store.env, "_env", Panicked(store.env._env, gets=0))
    assert store.batch_get(keys_of(0, 8), filled_pool(1), slots(list(range(8)))) == [False] * 8
    assert all(read_matches(store, pool, 0, 8))  # the same file, reopened: nothing lost
    assert store.stats()["errors_by_op"] == {"batch_get": 1}
    assert not list((tmp_path / "l3").glob("*.corrupt-*"))  # the file was intact


# ------------------------------------------------------------------------- engine level


def engine_child(argv: list[str]) -> None:
    """Subprocess body: an engine with all three tiers on the store at argv[0] generates."""
    from tests.conftest import tiered_engine

    with tiered_engine(Path(argv[0])) as engine:
        out = engine.generate(input_ids=list(range(1, 80)),
                              sampling_params={"temperature": 0, "max_new_tokens": 4,
                                               "ignore_eos": True})
        storage = engine.stats()["tiers"].get("storage")
    print(json.dumps({"tokens": len(out["output_ids"]), "l3": storage is not None}))


def test_an_engine_on_a_truncated_store_starts_and_generates(tmp_path: Path) -> None:
    path = tmp_path / "l3"
    os.truncate(path / "data.mdb", stored_env(path) // 2)
    out = run_child("engine_child", path)
    assert out == {"tokens": 4, "l3": True}
    moved_aside(path)


def test_an_engine_whose_store_cannot_be_replaced_starts_without_l3(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from tests.conftest import tiered_engine

    with tmpfs(tmp_path / "disk", DISK_BYTES) as disk:
        path = disk / "l3"
        os.truncate(path / "data.mdb", stored_env(path) // 2)
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        with tiered_engine(path) as engine:  # the damaged file cannot be moved aside
            out = engine.generate(input_ids=list(range(1, 40)),
                                  sampling_params={"max_new_tokens": 2, "ignore_eos": True})
            assert len(out["output_ids"]) == 2
            assert "storage" not in engine.stats()["tiers"]
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert any("without L3" in r.getMessage() and str(path) in r.getMessage() for r in errors)


# ------------------------------------------------------------------------- a full disk


def fill(store: Any, batches: int) -> dict[str, Any]:
    """Write `batches` distinct batches of BATCH pages; what a full disk made of them."""
    pool = filled_pool()
    results = []
    for b in range(batches):
        first = b * BATCH  # key i holds page i % NUM_PAGES, as `read_matches` expects
        pages = [i % NUM_PAGES for i in range(first, first + BATCH)]
        results.append(store.batch_set(keys_of(first, BATCH), pool, slots(pages)))
    last = read_matches(store, pool, (batches - 1) * BATCH, BATCH)
    stats = store.stats()
    return {"stored": [all(r) for r in results], "last_hits": sum(last),
            "evicted": stats["evicted_pages"], "errors_by_op": stats["errors_by_op"],
            "pages": stats["pages"]}


def assert_kept_writing(out: dict[str, Any], batches: int) -> None:
    assert out["stored"] == [True] * batches  # every write made room and was retried
    assert out["last_hits"] == BATCH  # the latest batch is stored, not just the first ones
    assert out["evicted"] > 0 and 0 < out["pages"] < batches * BATCH
    assert sum(out["errors_by_op"].values()) > 0  # the full disk is counted


def test_a_full_tmpfs_evicts_old_pages_and_keeps_storing_new_ones(tmp_path: Path) -> None:
    batches = 3 * DISK_BYTES // (BATCH * LMDB_PAGE)  # three disks' worth
    with tmpfs(tmp_path / "disk", DISK_BYTES) as disk:
        store = open_store(disk / "l3", max_size_bytes=BIG_CAPACITY)
        out = fill(store, batches)
        store.close()
    assert_kept_writing(out, batches)


FSIZE_LIMIT = 4 * 2**20  # RLIMIT_FSIZE of the child: data.mdb may not grow past it


def file_size_limit_child(argv: list[str]) -> None:
    """Subprocess body: writes past RLIMIT_FSIZE fail with EFBIG (SIGXFSZ ignored)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, resource.RLIM_INFINITY))
    path, batches = Path(argv[0]), int(argv[1])
    store = open_store(path, max_size_bytes=BIG_CAPACITY, initial_map_bytes=MIN_MAP_BYTES)
    out = fill(store, batches)
    store.close()
    print(json.dumps({**out, "file_bytes": (path / "data.mdb").stat().st_size}))


def test_a_file_size_limit_evicts_old_pages_and_keeps_storing_new_ones(tmp_path: Path) -> None:
    batches = 3 * FSIZE_LIMIT // (BATCH * LMDB_PAGE)
    out = run_child("file_size_limit_child", tmp_path / "l3", batches)
    assert_kept_writing(out, batches)
    assert out["file_bytes"] <= FSIZE_LIMIT


def test_other_write_errors_are_not_taken_for_a_full_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store, pool = open_store(tmp_path / "l3"), filled_pool()
    write_range(store, pool, 0, 40)

    class FailingDisk(_FaultyEnv):  # EIO, as LMDB reports a short write, with room to spare
        def begin(self, **kwargs: Any) -> Any:
            if kwargs.get("write"):
                err = lmdb.Error("mdb_txn_commit: Input/output error")
                err.code = errno.EIO  # what LMDB sets; an Error built in Python has none
                raise err
            return self._env.begin(**kwargs)

    monkeypatch.setattr(store.env, "_env", FailingDisk(store.env._env, gets=0))
    assert store.batch_set(keys_of(100, 4), pool, slots([0, 1, 2, 3])) == [False] * 4
    stats = store.stats()
    assert stats["evicted_pages"] == 0 and stats["errors_by_op"] == {"batch_set": 1}
    assert all(read_matches(store, pool, 0, 40))


def test_concurrent_commits_are_never_taken_for_a_shrunk_file(tmp_path: Path) -> None:
    """A commit grows the file and then the meta page: a size read before the meta would
    look short of it (a reviewer's run saw 4-25 false "shrank" replacements)."""
    store = open_store(tmp_path)
    pool = filled_pool()
    stop = threading.Event()

    def write() -> None:
        for first in range(0, 1200, 8):
            store.batch_set(keys_of(first, 8), pool,
                            slots([k % NUM_PAGES for k in range(first, first + 8)]))

    def read() -> None:
        while not stop.is_set():
            store.batch_exists(keys_of(0, 4))

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        write()
    finally:
        stop.set()
        for t in readers:
            t.join()
    stats = store.stats()
    store.close()
    assert stats["errors_by_op"] == {} and stats["written_pages"] == 1200
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.mdb", "lock.mdb"]
