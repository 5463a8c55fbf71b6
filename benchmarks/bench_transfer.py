"""Page transfer micro-benchmark: D->H gather and H->D scatter of scattered KV pages.

For each model geometry and page size it moves N pages (K and V of every layer) between a
device pool and a host pool, with each backend of `hicache.kernels.transfer_kv`, and compares them in the
same run with:

    contiguous      one `copy_` of the same number of bytes between two contiguous tensors
                    (device -> pinned host on a GPU): the memory-bandwidth limit
    token_select    a plain token-index copy: per layer and K/V, `index_select` (D->H) or
                    `index_copy_` (H->D) of the pages' token slots, to or from a contiguous
                    host region (so one-sided: the host side is never scattered)

Device pages are a random permutation (no long runs). Host pages are either one contiguous run
(`--host-pages contiguous`: a freshly allocated block) or scattered too (`scattered`: a
fragmented host pool). Results are GB/s and the ratio to `contiguous` (best of `--repeats`,
interleaved so noise hits every method alike); a markdown table is printed and JSON written.

    python -m benchmarks.bench_transfer                       # the default sweep, ~3 min on 2 cores
    python -m benchmarks.bench_transfer --geometries tiny --page-sizes 16 --repeats 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from hicache.kernels.transfer_kv import LAYER_FIRST, PAGE_FIRST, d2h_pages, h2d_pages


class Geometry(NamedTuple):
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype


GEOMETRIES = {
    "tiny": Geometry(8, 2, 64, torch.float32),  # the embedded model (docs/architecture.md)
    "llama3-8b": Geometry(32, 8, 128, torch.bfloat16),  # Meta-Llama-3-8B config.json
}
DEFAULT_TARGET_MB = 512  # bytes moved per case when --num-pages is not given
POOL_FACTOR = 2  # each pool holds this many times the pages moved, so the pages are scattered
SEED = 0
GOAL_RATIO = 0.7  # the goal at page size >= 16, relative to `contiguous`
_MB = 1 << 20


class Case(NamedTuple):
    geometry: str
    page_size: int
    direction: str  # "d2h" | "h2d"
    host_pages: str  # "contiguous" | "scattered"
    num_pages: int
    bytes: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-pages", type=int, default=None,
                   help=f"pages per case (default: sized to move ~{DEFAULT_TARGET_MB} MB)")
    p.add_argument("--target-mb", type=int, default=DEFAULT_TARGET_MB,
                   help="bytes per case when --num-pages is not given")
    p.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    p.add_argument("--host-pages", nargs="+", default=["contiguous", "scattered"],
                   choices=["contiguous", "scattered"])
    p.add_argument("--layout", default=PAGE_FIRST, choices=[PAGE_FIRST, LAYER_FIRST])
    p.add_argument("--backends", nargs="+", default=None,
                   help="default: reference direct, plus cuda when a GPU and CuPy are present")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice); 1 is steadier on a "
                        "shared machine, where a preempted worker stalls every parallel op")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall: perf_counter; cpu: this thread's CPU time (needs --threads 1 "
                        "and a CPU run), which leaves out time spent preempted by other "
                        "processes")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/transfer.json"))
    return p.parse_args(argv)


def default_backends() -> list[str]:
    backends = ["reference", "direct"]
    if torch.cuda.is_available():
        try:
            import cupy  # noqa: F401 - probing the optional dependency
            backends.append("cuda")
        except ImportError:
            print("CUDA is available but CuPy is not: skipping the cuda backend", file=sys.stderr)
    return backends


# ---------------------------------------------------------------------------------------------
# One case: pools, page lists, the callables to time


class Pools(NamedTuple):
    k: list[torch.Tensor]  # L x [num_slots, kv_heads, head_dim]
    v: list[torch.Tensor]
    host: torch.Tensor  # the host layout
    device_pages: torch.Tensor
    host_pages: torch.Tensor


def make_pools(g: Geometry, page_size: int, n: int, host_pattern: str, layout: str,
               device: torch.device) -> Pools:
    gen = torch.Generator().manual_seed(SEED)
    pool_pages = POOL_FACTOR * n
    slots = pool_pages * page_size
    k = [torch.rand(slots, g.kv_heads, g.head_dim, device=device).to(g.dtype)
         for _ in range(g.num_layers)]
    v = [torch.rand(slots, g.kv_heads, g.head_dim, device=device).to(g.dtype)
         for _ in range(g.num_layers)]
    slab = (page_size, g.kv_heads, g.head_dim)
    shape = ((pool_pages, g.num_layers, 2, *slab) if layout == PAGE_FIRST
             else (g.num_layers, 2, pool_pages, *slab))
    host = torch.zeros(shape, dtype=g.dtype, pin_memory=device.type == "cuda")
    device_pages = torch.randperm(pool_pages, generator=gen)[:n]
    if host_pattern == "contiguous":
        start = int(torch.randint(0, pool_pages - n + 1, (1,), generator=gen))
        host_pages = torch.arange(start, start + n)
    else:
        host_pages = torch.randperm(pool_pages, generator=gen)[:n]
    return Pools(k, v, host, device_pages, host_pages)


def contiguous_copy(nbytes: int, direction: str, device: torch.device) -> Callable[[], None]:
    """One copy_ of `nbytes` between two contiguous tensors: the bandwidth limit."""
    pin = device.type == "cuda"
    dev = torch.rand(nbytes // 4, device=device)
    host = torch.rand(nbytes // 4).pin_memory() if pin else torch.rand(nbytes // 4)
    if direction == "d2h":
        return lambda: host.copy_(dev, non_blocking=pin)
    return lambda: dev.copy_(host, non_blocking=pin)


def token_select(p: Pools, page_size: int, direction: str) -> Callable[[], None]:
    """Per layer and K/V, gather (D->H, `index_select`) or scatter (H->D, `index_copy_`) the
    pages' token slots with a token index list, against a contiguous host region of the same
    total size (one `[tokens, kv_heads, head_dim]` slab per layer and K/V)."""
    offsets = torch.arange(page_size)
    slots = (p.device_pages[:, None] * page_size + offsets).flatten().to(p.k[0].device)
    bufs = p.k + p.v
    on_gpu = p.k[0].is_cuda
    host = torch.empty((len(bufs), slots.numel(), *p.k[0].shape[1:]), dtype=p.k[0].dtype,
                       pin_memory=on_gpu)  # [2 * layers, tokens, kv_heads, head_dim]

    def d2h() -> None:
        for b, slab in zip(bufs, host):
            if on_gpu:
                slab.copy_(b.index_select(0, slots), non_blocking=True)
            else:
                torch.index_select(b, 0, slots, out=slab)

    def h2d() -> None:
        for b, slab in zip(bufs, host):
            b.index_copy_(0, slots, slab.to(b.device, non_blocking=True))

    return d2h if direction == "d2h" else h2d


def backend_fn(p: Pools, page_size: int, direction: str, layout: str,
               backend: str) -> Callable[[], None]:
    if direction == "d2h":
        return lambda: d2h_pages(p.k, p.v, p.host, layout, p.device_pages, p.host_pages,
                                 page_size, backend=backend)
    return lambda: h2d_pages(p.host, layout, p.k, p.v, p.host_pages, p.device_pages, page_size,
                             backend=backend)


def time_interleaved(fns: dict[str, Callable[[], None]], repeats: int, device: torch.device,
                     clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds per call of each fn; one warm-up, then `repeats` rounds over all fns in turn.

    Each round starts one fn further along, so no fn always runs right after the same other
    one (the fn after a big contiguous copy pays for its dirty cache lines).
    """
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for fn in fns.values():
        fn()
        sync()
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[name]
            sync()
            t0 = clock()
            fn()
            sync()
            times[name].append(clock() - t0)
    return times


def run_case(args: argparse.Namespace, geometry: str, page_size: int, host_pattern: str,
             backends: list[str], device: torch.device) -> list[dict]:
    g = GEOMETRIES[geometry]
    chunk_bytes = page_size * g.kv_heads * g.head_dim * g.dtype.itemsize
    page_bytes = 2 * g.num_layers * chunk_bytes  # one page, K and V of every layer
    n = args.num_pages or max(1, args.target_mb * _MB // page_bytes)
    pools = make_pools(g, page_size, n, host_pattern, args.layout, device)
    rows: list[dict] = []
    for direction in ("d2h", "h2d"):
        case = Case(geometry, page_size, direction, host_pattern, n, n * page_bytes)
        fns = {"contiguous": contiguous_copy(case.bytes, direction, device)}
        fns.update({b: backend_fn(pools, page_size, direction, args.layout, b) for b in backends})
        fns["token_select"] = token_select(pools, page_size, direction)
        clock = time.thread_time if args.clock == "cpu" else time.perf_counter
        times = time_interleaved(fns, args.repeats, device, clock)
        base = min(times["contiguous"])
        for method, ts in times.items():
            rows.append({**case._asdict(), "method": method, "best_s": min(ts),
                         "median_s": statistics.median(ts),
                         "gbps": case.bytes / min(ts) / 1e9, "ratio": base / min(ts)})
        print(f"  {geometry} page={page_size} {direction} host={host_pattern}: "
              + ", ".join(f"{r['method']} {r['ratio']:.2f}" for r in rows[-len(times):]),
              file=sys.stderr, flush=True)
        del fns, times
    return rows


# ---------------------------------------------------------------------------------------------
# Reporting


def markdown_table(rows: list[dict], methods: list[str]) -> str:
    head = ["geometry", "page", "dir", "host pages", "MB", "contiguous GB/s",
            *[m for m in methods if m != "contiguous"]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = sorted({(r["geometry"], r["page_size"], r["direction"], r["host_pages"])
                   for r in rows}, key=lambda k: (k[0], k[1], k[3], k[2]))
    for key in keys:
        by = {r["method"]: r for r in rows
              if (r["geometry"], r["page_size"], r["direction"], r["host_pages"]) == key}
        first = next(iter(by.values()))
        cells = [*map(str, key[:2]), key[2], key[3], f"{first['bytes'] / _MB:.0f}",
                 f"{by['contiguous']['gbps']:.1f}"]
        cells += [f"{by[m]['gbps']:.1f} ({by[m]['ratio']:.2f})" if m in by else "-"
                  for m in methods if m != "contiguous"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def guidance(rows: list[dict], backends: list[str]) -> list[str]:
    """Per page size, the backend with the best geometric-mean ratio over all its cases."""
    out = []
    for page_size in sorted({r["page_size"] for r in rows}):
        score = {}
        for b in backends:
            ratios = [r["ratio"] for r in rows if r["method"] == b and r["page_size"] == page_size]
            score[b] = statistics.geometric_mean(ratios) if ratios else 0.0
        best = max(score, key=score.__getitem__)
        others = ", ".join(f"{b} {s:.2f}" for b, s in score.items() if b != best)
        out.append(f"page {page_size}: use {best!r} (geo-mean ratio {score[best]:.2f}; {others})")
    return out


def goal_summary(rows: list[dict]) -> str:
    """The worst ratio at page size >= 16, per host-page pattern, of the backend that
    `host.io_backend: kernel` runs: the CUDA kernel when it ran, else the torch reference."""
    methods = {r["method"] for r in rows}
    backend = "cuda" if "cuda" in methods else "reference"
    parts = []
    for pattern in sorted({r["host_pages"] for r in rows}):
        ratios = [r["ratio"] for r in rows if r["method"] == backend
                  and r["page_size"] >= 16 and r["host_pages"] == pattern]
        if ratios:
            met = "met" if min(ratios) >= GOAL_RATIO else "missed"
            parts.append(f"host pages {pattern}: min {min(ratios):.2f} ({met})")
    return f"goal {backend} >= {GOAL_RATIO} x contiguous at page >= 16: " + "; ".join(parts)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass  # no procfs: fall back to what platform knows
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.clock == "cpu" and (args.threads != 1 or torch.cuda.is_available()):
        raise SystemExit("--clock cpu needs --threads 1 and no GPU (it times this thread only)")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    load_start = os.getloadavg()[0]  # a shared machine's load explains much of the noise
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backends = args.backends or default_backends()
    rows: list[dict] = []
    for geometry in args.geometries:
        for page_size in args.page_sizes:
            for host_pattern in args.host_pages:
                rows += run_case(args, geometry, page_size, host_pattern, backends, device)
    methods = ["contiguous", *backends, "token_select"]
    table = markdown_table(rows, methods)
    advice = guidance(rows, backends)
    goal = goal_summary(rows)
    print(table)
    print()
    print("\n".join(advice))
    print(goal)
    report = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": cpu_model(), "cores": os.cpu_count(),
        "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "layout": args.layout, "repeats": args.repeats, "threads": torch.get_num_threads(),
        "clock": args.clock, "timing": "best of repeats, interleaved, rotating order",
        "loadavg_1min": {"start": load_start, "end": os.getloadavg()[0]},
        "results": rows, "table": table, "guidance": advice, "goal": goal,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
