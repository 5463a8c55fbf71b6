"""L3 storage micro-benchmark: LmdbStore batch set/get against plain files, same bytes.

For each geometry and page size, the same host pages (page_first, random bytes) are written
and read back by:

    seq        one sequential file, os.write per page, one fdatasync at the end; read back
               through a fresh descriptor with os.readv into the host pages
    file/page  SGLang's HiCacheFile: one file per page written as `numpy.tofile(tmp)` then
               `os.replace(tmp, final)`, no fsync; read with open(buffering=0).readinto.
               "durable" adds an fdatasync of every file, for the durability of seq
    lmdb       LmdbStore.batch_set / batch_get in batches of `--batch-pages`; `sync=False`
               then one env sync at the end (the durability of seq; "no sync": without
               it), and the default `sync=True` (a data flush per batch commit) for reference.
               Warm reads also by 2 threads at once, each over its half of the pages (as
               several fetch workers read), each on one OpenMP thread as storage threads run

Reads are timed cold (the file's page cache dropped with fdatasync + POSIX_FADV_DONTNEED,
LMDB's environment reopened so nothing is mapped) and warm (the same read again). The LMDB
map is pre-sized: a long-running store has already grown. Every read is checked
byte-identical after timing. GB/s are from the fastest of `--repeats` runs, methods
alternated in each run. Ratios are the median over runs of two methods timed in the same
run: this machine is shared and noisy, so read the ratios. The two goals of the L3 read/write
issue are printed on their own: a warm get (the better of 1 and 2 threads) >= 0.7x the warm
sequential read, and a set (sync=False + one env sync) >= 0.8x the sequential write.

    python -m benchmarks.bench_storage            # defaults; prints markdown, writes JSON
    python -m benchmarks.bench_storage --redis    # + Redis (one node, a 3-node cluster) rows
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any, NamedTuple

import lmdb
import numpy as np
import torch
import xxhash

from benchmarks.redis_servers import RedisClusterNodes, RedisServer
from hicache.memory.device import slots_of
from hicache.memory.host import HostKVPool
from hicache.storage.backends.lmdb_store import LmdbStore
from hicache.storage.page_format import PageCodec, PageGeometry
from hicache.storage.page_seal import TAG_BYTES, copy_parts
from hicache.threads import one_openmp_thread

REPO = Path(__file__).resolve().parents[1]
# (num_layers, kv_heads, head_dim, dtype): the embedded default model and Llama-3-8B.
GEOMETRIES = {
    "embedded": (8, 2, 64, torch.float32),
    "llama3-8b": (32, 8, 128, torch.bfloat16),
}
# Pages per backend call: SGLang's HiCache moves storage pages in batches of 128.
BATCH_PAGES = 128
GET_THREADS = 2  # fetch workers reading at once in the threaded warm get (one per core here)
MB = 2**20
GB = 1e9  # throughput is reported in decimal GB/s
MAP_SLACK_BYTES = 64 * MB  # LMDB map beyond the payload: headers, tree, free pages

Seconds = float


class Case(NamedTuple):
    geometry: str
    page_size: int
    num_pages: int
    page_bytes: int


def make_pool(geometry: PageGeometry, num_pages: int, seed: int | None) -> HostKVPool:
    pool = HostKVPool(num_pages, geometry.page_size, geometry.num_layers, geometry.kv_heads,
                      geometry.head_dim, geometry.dtype, check_available=True)
    raw = pool.buffer.view(-1).view(torch.uint8)  # [num_pages * page_bytes]
    if seed is None:
        raw.zero_()
    else:
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8,
                                generator=torch.Generator().manual_seed(seed)))
    return pool


def drop_cache(path: Path) -> None:
    """Evict a file's pages from the page cache (they must be clean: fdatasync first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn: Callable[[], object]) -> Seconds:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ------------------------------------------------------------------------------ methods


def seq_write(path: Path, pool: HostKVPool) -> Seconds:
    def run() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for page in range(pool.num_pages):
                view = pool.page_buffer(page)
                while view:
                    view = view[os.write(fd, view):]
            os.fdatasync(fd)
        finally:
            os.close(fd)
    return timed(run)


def seq_read(path: Path, pool: HostKVPool) -> Seconds:
    def run() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            for page in range(pool.num_pages):
                if os.readv(fd, [pool.page_buffer(page)]) != pool.page_bytes:
                    raise OSError(f"short read of page {page} from {path}")
        finally:
            os.close(fd)
    return timed(run)


def fpp_write(folder: Path, pool: HostKVPool, keys: list[bytes]) -> Seconds:
    folder.mkdir(parents=True, exist_ok=True)

    def run() -> None:  # as sglang HiCacheFile.set: tofile(tmp) + os.replace, no fsync
        for page, key in enumerate(keys):
            final = folder / f"{key.hex()}.bin"
            tmp = folder / f"{key.hex()}.bin.tmp.{os.getpid()}"
            np.frombuffer(pool.page_buffer(page), dtype=np.uint8).tofile(tmp)
            os.replace(tmp, final)
    return timed(run)


def fpp_sync(folder: Path, keys: list[bytes]) -> Seconds:
    """fdatasync every page file: what file/page needs for the durability of seq."""
    def run() -> None:
        for key in keys:
            fd = os.open(folder / f"{key.hex()}.bin", os.O_RDONLY)
            os.fdatasync(fd)
            os.close(fd)
    return timed(run)


def fpp_read(folder: Path, pool: HostKVPool, keys: list[bytes]) -> Seconds:
    def run() -> None:  # as sglang HiCacheFile.get
        for page, key in enumerate(keys):
            with open(folder / f"{key.hex()}.bin", "rb", buffering=0) as f:
                if f.readinto(pool.page_buffer(page)) != pool.page_bytes:
                    raise OSError(f"short read of {key.hex()}")
    return timed(run)


def batches(keys: list[bytes], page_size: int, batch: int,
            first_page: int = 0) -> list[tuple[list[bytes], torch.Tensor]]:
    """(keys, host slots) per batch call: key i goes to host page first_page + i."""
    out = []
    for start in range(0, len(keys), batch):
        pages = torch.arange(first_page + start, first_page + min(len(keys), start + batch),
                             dtype=torch.int64)
        out.append((keys[start:start + batch], slots_of(pages, page_size)))
    return out


def split_work(keys: list[bytes], page_size: int, batch: int, parts: int) -> list[list]:
    """`parts` disjoint runs of batches, each over its share of the keys and host pages."""
    bounds = [len(keys) * i // parts for i in range(parts + 1)]
    return [batches(keys[lo:hi], page_size, batch, first_page=lo)
            for lo, hi in pairwise(bounds)]


def open_lmdb(folder: Path, codec: PageCodec, total: int, sync: bool) -> LmdbStore:
    size = total + MAP_SLACK_BYTES
    return LmdbStore(folder, size, codec, sync=sync, initial_map_bytes=size)


def lmdb_set(store: LmdbStore, pool: HostKVPool, work: list) -> Seconds:
    def run() -> None:
        for keys, slots in work:
            if not all(store.batch_set(keys, pool, slots)):
                raise RuntimeError(f"batch_set failed: {store.stats()}")
    return timed(run)


def lmdb_get(store: LmdbStore, pool: HostKVPool, work: list) -> Seconds:
    def run() -> None:
        for keys, slots in work:
            if not all(store.batch_get(keys, pool, slots)):
                raise RuntimeError(f"batch_get missed: {store.stats()}")
    return timed(run)


def lmdb_get_threads(store: LmdbStore, pool: HostKVPool, parts: list[list]) -> Seconds:
    """One thread per part of `split_work`, all reading at once; the time from their common
    start (threads started and set up before it) until all are done."""
    errors: list[RuntimeError] = []
    start = threading.Barrier(len(parts) + 1)

    def worker(work: list) -> None:
        one_openmp_thread()
        start.wait()
        try:
            lmdb_get(store, pool, work)
        except RuntimeError as err:
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(work,)) for work in parts]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - began
    if errors:
        raise errors[0]
    return seconds


# ------------------------------------------------------------------------------ one case


def same_bytes(a: HostKVPool, b: HostKVPool) -> bool:
    return torch.equal(a.buffer.view(-1).view(torch.uint8), b.buffer.view(-1).view(torch.uint8))


def run_case(case: Case, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    layers, heads, dim, dtype = GEOMETRIES[case.geometry]
    geometry = PageGeometry(layers, heads, dim, case.page_size, dtype)
    codec, total = PageCodec(geometry), case.num_pages * case.page_bytes
    src = make_pool(geometry, case.num_pages, seed=args.seed)
    dst = make_pool(geometry, case.num_pages, seed=None)
    keys = [xxhash.xxh3_128_digest(b"%d" % i) for i in range(case.num_pages)]
    work = batches(keys, case.page_size, args.batch_pages)
    halves = split_work(keys, case.page_size, args.batch_pages, GET_THREADS)
    runs: list[dict[str, Seconds]] = []

    def keep(name: str, seconds: Seconds, check: bool = False) -> None:
        runs[-1][name] = seconds
        if check and not same_bytes(src, dst):
            raise AssertionError(f"{name}: bytes read differ from bytes written")
        dst.buffer.view(-1).view(torch.uint8).zero_()

    for _ in range(args.repeats):
        runs.append({})
        run_dir = Path(tempfile.mkdtemp(dir=tmp))
        seq, fpp, db, db_sync = (run_dir / n for n in ("seq.bin", "files", "lmdb", "lmdb-sync"))
        keep("seq_write", seq_write(seq, src))
        written = fpp_write(fpp, src, keys)
        keep("fpp_write", written)
        keep("fpp_write_durable", written + fpp_sync(fpp, keys))
        store = open_lmdb(db, codec, total, sync=False)
        written = lmdb_set(store, src, work)
        keep("lmdb_set_nosync", written)
        keep("lmdb_set", written + timed(store.sync_to_disk))
        store.close()
        store = open_lmdb(db_sync, codec, total, sync=True)
        keep("lmdb_set_sync_commit", lmdb_set(store, src, work))
        store.close()
        drop_cache(seq)
        keep("seq_read_cold", seq_read(seq, dst), check=True)
        keep("seq_read_warm", seq_read(seq, dst), check=True)
        for key in keys:
            drop_cache(fpp / f"{key.hex()}.bin")
        keep("fpp_read_cold", fpp_read(fpp, dst, keys), check=True)
        keep("fpp_read_warm", fpp_read(fpp, dst, keys), check=True)
        drop_cache(db / "data.mdb")
        store = open_lmdb(db, codec, total, sync=False)
        keep("lmdb_get_cold", lmdb_get(store, dst, work), check=True)
        keep("lmdb_get_warm", lmdb_get(store, dst, work), check=True)
        keep("lmdb_get_warm_2t", lmdb_get_threads(store, dst, halves), check=True)
        store.close()
        shutil.rmtree(run_dir)
    best = {name: min(run[name] for run in runs) for name in runs[0]}
    return {**case._asdict(), "total_bytes": total,
            "gb_per_s": {name: total / s / GB for name, s in best.items()},
            "seconds_per_run": runs, "profile": profile(src, dst, codec, work, tmp, total)}


def profile(src: HostKVPool, dst: HostKVPool, codec: PageCodec, work: list, tmp: Path,
            total: int) -> dict[str, float]:
    """Where a warm LMDB read spends its time, in GB/s of payload per step."""
    pages = range(src.num_pages)

    def rate(fn: Callable[[], object]) -> float:
        return total / min(timed(fn) for _ in range(3)) / GB

    def copy_all() -> None:
        for p in pages:
            dst.page_buffer(p)[:] = src.page_buffer(p)

    def hash_all(digest: Callable[[memoryview], int]) -> Callable[[], None]:
        return lambda: [digest(src.page_buffer(p)) for p in pages]

    scratch = bytearray(codec.value_bytes)

    def encode_all() -> None:  # as batch_set encodes: into one reused buffer
        for p in pages:
            codec.encode_into(b"k" * 16, src.page_buffer(p), scratch)

    folder = Path(tempfile.mkdtemp(dir=tmp))
    unchecked = PageCodec(codec.geometry)  # same format, the tag's check switched off
    unchecked.seal.open_into = _copy_unchecked  # type: ignore[method-assign]
    store = open_lmdb(folder, unchecked, total, sync=False)
    lmdb_set(store, src, work)
    lmdb_get(store, dst, work)  # map the file in
    out = {"memcpy": rate(copy_all), "xxh64": rate(hash_all(xxhash.xxh64_intdigest)),
           "xxh3_64": rate(hash_all(xxhash.xxh3_64_intdigest)), "encode": rate(encode_all),
           "lmdb_get_warm_unverified": rate(lambda: lmdb_get(store, dst, work))}
    store.close()
    shutil.rmtree(folder)
    return out


def _copy_unchecked(binding: bytes, salt: bytes, sealed: memoryview,
                    parts: Sequence[memoryview]) -> bool:
    """A checksum seal's read without its check: the copy alone."""
    copy_parts(sealed[:-TAG_BYTES], parts)
    return True


# ------------------------------------------------------------------------------ report


def machine(tmp: Path) -> dict[str, Any]:
    model = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    fs = subprocess.run(["df", "-T", str(tmp)], capture_output=True, text=True,
                        check=False).stdout
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "lmdb": f"py-lmdb {lmdb.__version__}, LMDB "
            f"{'.'.join(map(str, lmdb.version()))}", "platform": platform.platform(),
            "filesystem": " ".join(fs.splitlines()[-1].split()[:2]) if fs else "unknown"}


RATIOS = {  # name: (numerator, denominator), each pair at the same durability
    "set/seq": ("lmdb_set", "seq_write"),
    "set/file-page durable": ("lmdb_set", "fpp_write_durable"),
    "set/file-page no sync": ("lmdb_set_nosync", "fpp_write"),
    "get cold/seq": ("lmdb_get_cold", "seq_read_cold"),
    "get cold/file-page": ("lmdb_get_cold", "fpp_read_cold"),
    "get warm/seq": ("lmdb_get_warm", "seq_read_warm"),
    "get warm 2 threads/seq": ("lmdb_get_warm_2t", "seq_read_warm"),
    "get warm/file-page": ("lmdb_get_warm", "fpp_read_warm"),
}
GOALS = {"set/seq": 0.8, "set/file-page durable": 1.0, "set/file-page no sync": 1.0,
         "get cold/seq": 1.0, "get cold/file-page": 1.0, "get warm/seq": 0.7,
         "get warm 2 threads/seq": 0.7, "get warm/file-page": 1.0}
# The two goals: a read of page-cache-resident pages at 0.7x one sequential read of
# the same bytes, with as many fetch threads as help (1 or 2 here); a set at 0.8x a
# sequential write of the same durability.
HEADLINE_GOALS = {"get warm/seq, best of 1-2 threads": 0.7, "set/seq": 0.8}


def add_ratios(result: dict[str, Any]) -> None:
    """Throughput ratios: the median over runs of the pair timed side by side in one run
    (slow phases of a shared machine hit both sides of a pair alike)."""
    runs = result["seconds_per_run"]
    result["ratios"] = {name: statistics.median(run[b] / run[a] for run in runs)
                        for name, (a, b) in RATIOS.items()}
    result["goals_met"] = {name: result["ratios"][name] >= goal for name, goal in GOALS.items()}
    best_get = statistics.median(run["seq_read_warm"] / min(run["lmdb_get_warm"],
                                                            run["lmdb_get_warm_2t"])
                                 for run in runs)
    result["headline"] = {"get warm/seq, best of 1-2 threads": best_get,
                          "set/seq": result["ratios"]["set/seq"]}
    result["headline_met"] = {name: result["headline"][name] >= goal
                              for name, goal in HEADLINE_GOALS.items()}


def tables(results: list[dict[str, Any]]) -> str:
    def row(r: dict[str, Any], cols: Sequence[str]) -> str:
        g = r["gb_per_s"]
        head = f"| {r['geometry']} | {r['page_size']} | {r['page_bytes'] // 1024} | "
        return head + " | ".join(f"{g[c]:.2f}" for c in cols) + " |"

    write_cols = ("seq_write", "lmdb_set", "lmdb_set_sync_commit", "fpp_write_durable",
                  "lmdb_set_nosync", "fpp_write")
    read_cols = ("seq_read_cold", "lmdb_get_cold", "fpp_read_cold", "seq_read_warm",
                 "lmdb_get_warm", "lmdb_get_warm_2t", "fpp_read_warm")
    lines = [
        ("Writes, GB/s. Durable: seq = one fdatasync at the end, lmdb set = sync=False + one "
        "env sync at the end, lmdb sync/commit = sync=True (data flush per batch), file/page "
        "durable = + fdatasync of every file. Not durable: lmdb no sync, file/page as SGLang "
        "(tmp + rename, no fsync)."), "",
        ("| geometry | page | KiB/page | seq+fdatasync | lmdb set | lmdb sync/commit "
        "| file/page durable | lmdb no sync | file/page |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [row(r, write_cols) for r in results]
    lines += [
        "", "Reads, GB/s (cold: page cache dropped; warm: read again)", "",
        ("| geometry | page | KiB/page | seq cold | lmdb get cold | file/page cold "
        "| seq warm | lmdb get warm | lmdb get warm 2 threads | file/page warm |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [row(r, read_cols) for r in results]
    lines += ["", "Goals (* = met): " + "; ".join(f"{n} >= {g}" for n, g in
                                                  HEADLINE_GOALS.items()), "",
              "| geometry | page | " + " | ".join(HEADLINE_GOALS) + " |",
              "|---|---|" + "---|" * len(HEADLINE_GOALS)]
    for r in results:
        cells = [f"{r['headline'][n]:.2f}{'*' if r['headline_met'][n] else ''}"
                 for n in HEADLINE_GOALS]
        lines.append(f"| {r['geometry']} | {r['page_size']} | " + " | ".join(cells) + " |")
    lines += ["", "Ratios (goal in brackets; * = met)", "",
              "| geometry | page | " + " | ".join(f"{n} [{GOALS[n]}]" for n in RATIOS) + " |",
              "|---|---|" + "---|" * len(RATIOS)]
    for r in results:
        cells = [f"{r['ratios'][n]:.2f}{'*' if r['goals_met'][n] else ''}" for n in RATIOS]
        lines.append(f"| {r['geometry']} | {r['page_size']} | " + " | ".join(cells) + " |")
    lines += ["", "Where the time goes, GB/s per step over the same pages (profile)", "",
              ("| geometry | page | memcpy | xxh64 | xxh3_64 | encode | lmdb get warm "
              "unverified | lmdb get warm |"), "|---|---|---|---|---|---|---|---|"]
    for r in results:
        p = r["profile"]
        lines.append(f"| {r['geometry']} | {r['page_size']} | {p['memcpy']:.2f} | "
                     f"{p['xxh64']:.2f} | {p['xxh3_64']:.2f} | {p['encode']:.2f} | "
                     f"{p['lmdb_get_warm_unverified']:.2f} | "
                     f"{r['gb_per_s']['lmdb_get_warm']:.2f} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=GEOMETRIES)
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--total-mb", type=int, default=256, help="bytes of pages per case (MiB)")
    ap.add_argument("--batch-pages", type=int, default=BATCH_PAGES)
    ap.add_argument("--repeats", type=int, default=5,
                    help="runs per case: GB/s from the fastest, ratios the median of pairs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tmp-dir", type=Path, default=REPO / ".hicache" / "bench-storage",
                    help="scratch folder; keep it on the filesystem under test")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "storage.json")
    ap.add_argument("--redis", action="store_true",
                    help="also time RedisStore on loopback redis-servers it starts (needs "
                         "redis-server and redis-cli on PATH)")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    args.tmp_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=args.tmp_dir))
    results = []
    try:
        for name in args.geometries:
            layers, heads, dim, dtype = GEOMETRIES[name]
            for page_size in args.page_sizes:
                page_bytes = PageGeometry(layers, heads, dim, page_size, dtype).payload_bytes
                case = Case(name, page_size, max(1, args.total_mb * MB // page_bytes), page_bytes)
                print(f"{name} page {page_size}: {case.num_pages} pages of "
                      f"{page_bytes // 1024} KiB", file=sys.stderr, flush=True)
                results.append(run_case(case, args, tmp))
                add_ratios(results[-1])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(args.tmp_dir),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "timing": f"{args.repeats} runs, methods alternated in each; GB/s: fastest run; "
                  "ratios: median over runs of the two methods' times in the same run",
        "results": results,
        "goals_met_everywhere": {n: all(r["goals_met"][n] for r in results) for n in GOALS},
        "headline_met_everywhere": {n: all(r["headline_met"][n] for r in results)
                                    for n in HEADLINE_GOALS},
    }
    report["table"] = tables(results)
    if args.redis:
        report["redis"] = redis_results(args)
        report["table"] += "\n\n" + redis_table(report["redis"])
    m = report["machine"]
    print(f"L3 storage benchmark: {m['cpu']}, {m['cores']} cores, {m['filesystem']}; "
          f"{args.total_mb} MiB per case, batches of {args.batch_pages} pages; "
          f"{report['timing']}.\n")
    print(report["table"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


# ------------------------------------------------------------------------------ --redis

REDIS_METHODS = ("lmdb", "redis", "redis cluster")


def redis_results(args: argparse.Namespace) -> list[dict[str, Any]]:
    """`--redis`: the same pages through `batch_set` / `batch_get` of LmdbStore (sync=False,
    warm reads: the fair peer of an in-memory store), RedisStore on one loopback
    redis-server, and on a 3-node loopback Redis Cluster; the servers are started here (no
    persistence) and stopped after. Per method: GB/s of payload (fastest run) and ms per
    batch call (median over every batch of every run); methods alternate in each run."""
    from hicache.storage.backends.redis_store import RedisStore

    tmp = Path(tempfile.mkdtemp(dir=args.tmp_dir))
    rows = []
    try:
        with RedisServer.start(tmp / "redis") as server, \
                RedisClusterNodes.start(tmp / "cluster") as nodes:
            for name in args.geometries:
                layers, heads, dim, dtype = GEOMETRIES[name]
                for page_size in args.page_sizes:
                    codec = PageCodec(PageGeometry(layers, heads, dim, page_size, dtype))
                    num_pages = max(1, args.total_mb * MB // codec.payload_bytes)
                    print(f"redis: {name} page {page_size}: {num_pages} pages",
                          file=sys.stderr, flush=True)

                    def open_store(method: str, c: PageCodec = codec,
                                   n: int = num_pages) -> LmdbStore | RedisStore:
                        if method == "lmdb":
                            folder = Path(tempfile.mkdtemp(dir=tmp))
                            return open_lmdb(folder, c, n * c.value_bytes, sync=False)
                        url = server.url if method == "redis" else nodes.url
                        return RedisStore(url, c, cluster=method != "redis")

                    rows.append(redis_case(name, codec, num_pages, open_store, args))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def time_batches(call: Callable[[list[bytes], torch.Tensor], list[bool]],
                 work: list) -> list[Seconds]:
    """Seconds of each batch call; RuntimeError when one does not serve every page."""
    out = []
    for keys, slots in work:
        start = time.perf_counter()
        if not all(call(keys, slots)):
            raise RuntimeError(f"a batch of {len(keys)} pages was not fully served")
        out.append(time.perf_counter() - start)
    return out


def redis_case(name: str, codec: PageCodec, num_pages: int,
               open_store: Callable[[str], Any], args: argparse.Namespace) -> dict[str, Any]:
    geometry = codec.geometry
    src = make_pool(geometry, num_pages, seed=args.seed)
    dst = make_pool(geometry, num_pages, seed=None)
    keys = [xxhash.xxh3_128_digest(b"redis %d" % i) for i in range(num_pages)]
    work = batches(keys, geometry.page_size, args.batch_pages)
    times: dict[str, dict[str, list[list[Seconds]]]] = {
        m: {"set": [], "get": []} for m in REDIS_METHODS}
    for _ in range(args.repeats):
        for method in REDIS_METHODS:
            store = open_store(method)
            store.clear()
            times[method]["set"].append(time_batches(
                lambda k, s, st=store: st.batch_set(k, src, s), work))
            dst.buffer.view(-1).view(torch.uint8).zero_()
            times[method]["get"].append(time_batches(
                lambda k, s, st=store: st.batch_get(k, dst, s), work))
            if not same_bytes(src, dst):
                raise AssertionError(f"{method}: bytes read differ from bytes written")
            store.clear()
            store.close()
    total = num_pages * geometry.payload_bytes
    methods = {}
    for method, ops in times.items():
        methods[method] = {f"{op}_gb_per_s": total / min(map(sum, runs)) / GB
                           for op, runs in ops.items()}
        methods[method].update({f"{op}_ms_per_batch": 1e3 * statistics.median(
            t for run in runs for t in run) for op, runs in ops.items()})
    return {"geometry": name, "page_size": geometry.page_size,
            "page_bytes": geometry.payload_bytes, "num_pages": num_pages,
            "batch_pages": min(args.batch_pages, num_pages), "methods": methods}


def redis_table(rows: list[dict[str, Any]]) -> str:
    lines = [("Redis on loopback next to LMDB (sync=False, warm), same pages and batches: "
              "GB/s (fastest run) and ms per batch call (median)"), "",
             ("| geometry | page | KiB/page | pages/batch | store | set GB/s | get GB/s "
              "| set ms/batch | get ms/batch |"), "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for method, m in r["methods"].items():
            lines.append(f"| {r['geometry']} | {r['page_size']} | {r['page_bytes'] // 1024} | "
                         f"{r['batch_pages']} | {method} | {m['set_gb_per_s']:.2f} | "
                         f"{m['get_gb_per_s']:.2f} | {m['set_ms_per_batch']:.1f} | "
                         f"{m['get_ms_per_batch']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
