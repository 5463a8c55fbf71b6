"""Radix tree micro-benchmark: hicache's RadixCache against a naive first-generation tree.

A seeded multi-turn chat trace is served by both trees with the same operations (match, lock,
allocate with eviction, insert, unlock); the hit tokens of every request must be identical, so
the speed comparison is between two implementations of one semantics. A second part times a
one-page `evict` on trees of growing size to show whether its cost grows with the tree.

    python -m benchmarks.bench_radix            # defaults; prints markdown, writes JSON

Times are the minimum over `--repeats` runs (timeit's rule: noise only ever adds time); the
two trees run alternately in one process, so read the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import heapq
import itertools
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from hicache.tree.radix import MatchResult, RadixCache

# Token ids are drawn uniformly from a Llama-2-sized vocabulary.
VOCAB = 32_000
# Evict-cost scaling: tree sizes in tokens, timed evicts per size, tokens per filler sequence
# (a multiple of every page size benchmarked, so each filler is one whole leaf).
SCALING_SIZES = (1_000, 10_000, 100_000)
SCALING_EVICTS = 200
SCALING_SEQ_TOKENS = 64
P99 = 99

Key = tuple[int, ...]
_EMPTY = torch.empty(0, dtype=torch.int64)


# ------------------------------------------------------------------------------ allocator


class PageAllocator:
    """Stack of free device pages; hands out token slot indices, page-aligned.

    Slot `s` lives in page `s // page_size`; `free` takes whole pages' slots back. The stack
    is a tensor, so alloc and free cost a few tensor ops, not a Python loop per page: the
    allocator's cost is the same for both trees and should not drown them.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self._stack = torch.arange(num_pages, dtype=torch.int64)  # [0, _top) are free
        self._top = num_pages
        self._offsets = torch.arange(page_size, dtype=torch.int64)

    def free_pages(self) -> int:
        return self._top

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for `num_tokens` rounded up to whole pages, or None when short."""
        n = self.pages_for(num_tokens)
        if n > self._top:
            return None
        self._top -= n
        pages = self._stack[self._top:self._top + n]
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)

    def free(self, indices: torch.Tensor) -> None:
        pages = indices[::self.page_size] // self.page_size
        self._stack[self._top:self._top + len(pages)] = pages
        self._top += len(pages)


# ---------------------------------------------------------------------------- naive tree


class NaiveNode:
    __slots__ = ("children", "id", "key", "last_access_time", "lock_ref", "parent", "value")
    _ids = itertools.count()

    def __init__(self, parent: NaiveNode | None = None, key: Key = (),
                 value: torch.Tensor | None = None) -> None:
        self.id = next(NaiveNode._ids)
        self.parent = parent
        self.children: dict[Key, NaiveNode] = {}  # keyed by first page, searched by scanning
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access_time = time.monotonic()


class NaiveRadixCache:
    """The baseline: a radix tree written the way SGLang's first version was.

    Children are found by scanning `children.values()` and comparing the first page token by
    token; prefixes are compared with a per-token Python loop, rounded down to whole pages;
    `evict` collects every leaf of the tree into a heap on each call. Same semantics as
    `RadixCache` for match / insert / evict / lock / unlock / total_size (LRU, whole leaves,
    a parent that becomes a leaf is a candidate in the same call). No `extra_key` namespaces:
    the first version predates them.
    """

    def __init__(self, allocator: Any = None, page_size: int = 1) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.root = NaiveNode()
        self.root.lock_ref = 1

    def _aligned(self, key: Sequence[int]) -> Key:
        return tuple(key[:len(key) // self.page_size * self.page_size])

    def _prefix_len(self, edge: Key, key: Key, pos: int) -> int:
        n, limit = 0, min(len(edge), len(key) - pos)
        while n < limit and edge[n] == key[pos + n]:
            n += 1
        return n // self.page_size * self.page_size

    def _find_child(self, node: NaiveNode, key: Key, pos: int) -> NaiveNode | None:
        for child in node.children.values():
            if self._prefix_len(child.key[:self.page_size], key, pos) == self.page_size:
                return child
        return None

    def _descend(self, key: Key, stop_on_partial: bool) -> tuple[NaiveNode, int, list]:
        """Walk `key` from the root, splitting the edge a match ends in; touch the path."""
        now = time.monotonic()
        node, pos, values = self.root, 0, []
        while pos < len(key):
            child = self._find_child(node, key, pos)
            if child is None:
                break
            n = self._prefix_len(child.key, key, pos)
            partial = n < len(child.key)
            if partial:
                child = self._split(child, n)
            child.last_access_time = now
            values.append(child.value)
            node, pos = child, pos + n
            if partial and stop_on_partial:
                break
        return node, pos, values

    def match_prefix(self, key: Sequence[int], extra_key: str | None = None) -> MatchResult:
        if extra_key is not None:
            raise ValueError(f"the naive tree has no namespaces, got extra_key={extra_key!r}")
        node, _, values = self._descend(self._aligned(key), stop_on_partial=True)
        return MatchResult(torch.cat(values) if values else _EMPTY, node, node, 0)

    def insert(self, key: Sequence[int], value: torch.Tensor | None = None) -> int:
        key = self._aligned(key)
        if value is None:
            value = torch.tensor(key, dtype=torch.int64)
        node, pos, _ = self._descend(key, stop_on_partial=False)
        if pos < len(key):
            leaf = NaiveNode(node, key[pos:], value[pos:len(key)].clone())
            node.children[key[pos:pos + self.page_size]] = leaf
        return pos

    def _split(self, child: NaiveNode, n: int) -> NaiveNode:
        new = NaiveNode(child.parent, child.key[:n], child.value[:n])
        new.lock_ref = child.lock_ref
        new.last_access_time = child.last_access_time
        child.parent.children[child.key[:self.page_size]] = new
        child.key, child.value, child.parent = child.key[n:], child.value[n:], new
        new.children[child.key[:self.page_size]] = child
        return new

    def _collect_leaves(self) -> list[NaiveNode]:
        leaves, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        return leaves

    def evict(self, num_tokens: int) -> int:
        heap = [(n.last_access_time, n.id, n) for n in self._collect_leaves()]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if node.lock_ref > 0:
                continue
            if self.allocator is not None:
                self.allocator.free(node.value)
            freed += len(node.key)
            parent = node.parent
            del parent.children[node.key[:self.page_size]]
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return freed

    def inc_lock_ref(self, node: NaiveNode) -> int:
        delta = 0
        while node is not self.root:
            delta -= len(node.key) if node.lock_ref == 0 else 0
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: NaiveNode) -> int:
        delta = 0
        while node is not self.root:
            delta += len(node.key) if node.lock_ref == 1 else 0
            node.lock_ref -= 1
            node = node.parent
        return delta

    def total_size(self) -> int:
        stack, total = [self.root], 0
        while stack:
            node = stack.pop()
            total += len(node.key)
            stack.extend(node.children.values())
        return total


TREES: dict[str, type] = {"naive": NaiveRadixCache, "ours": RadixCache}


# ---------------------------------------------------------------------------------- trace


class Request(NamedTuple):
    prompt: Key  # history + question: what is matched
    full: Key    # prompt + answer: what is inserted when the request finishes


class Trace(NamedTuple):
    requests: list[Request]
    unique_tokens: int  # distinct prefix tokens in the whole trace


def make_trace(args: argparse.Namespace) -> Trace:
    """Round-robin multi-turn chats over one shared system prompt, seeded."""
    rng = np.random.default_rng(args.seed)
    system = tuple(rng.integers(VOCAB, size=args.system_tokens).tolist())
    history = [system] * args.conversations
    requests = []
    for _ in range(args.turns):
        for c in range(args.conversations):
            question = tuple(rng.integers(VOCAB, size=args.turn_tokens).tolist())
            answer = tuple(rng.integers(VOCAB, size=args.turn_tokens // 2).tolist())
            prompt = history[c] + question
            history[c] = prompt + answer
            requests.append(Request(prompt, history[c]))
    unique = len(system) + sum(len(h) - len(system) for h in history)
    return Trace(requests, unique)


class TraceRun(NamedTuple):
    total_s: float
    match_insert_s: float
    evict_s: list[float]   # one entry per evict call
    evict_freed: list[int]
    hits: list[int]        # matched tokens per request


class _Recorder:
    def __init__(self) -> None:
        self.match_insert_s = 0.0
        self.evict_s: list[float] = []
        self.evict_freed: list[int] = []
        self.hits: list[int] = []


def _allocate(tree: Any, alloc: PageAllocator, num_tokens: int, rec: _Recorder) -> torch.Tensor:
    short = alloc.pages_for(num_tokens) - alloc.free_pages()
    if short > 0:
        t0 = time.perf_counter()
        freed = tree.evict(short * alloc.page_size)
        rec.evict_s.append(time.perf_counter() - t0)
        rec.evict_freed.append(freed)
    slots = alloc.alloc(num_tokens)
    if slots is None:
        raise RuntimeError(f"budget too small: {num_tokens} tokens needed, "
                           f"{alloc.free_pages()} pages free after eviction")
    return slots


def _serve(tree: Any, alloc: PageAllocator, req: Request, rec: _Recorder) -> None:
    t0 = time.perf_counter()
    m = tree.match_prefix(req.prompt)
    rec.match_insert_s += time.perf_counter() - t0
    hit = len(m.device_indices)
    tree.inc_lock_ref(m.last_device_node)
    value = torch.cat((m.device_indices, _allocate(tree, alloc, len(req.full) - hit, rec)))
    t0 = time.perf_counter()
    present = tree.insert(req.full, value)
    rec.match_insert_s += time.perf_counter() - t0
    aligned = len(req.full) // alloc.page_size * alloc.page_size
    alloc.free(value[hit:present])  # duplicates of what the tree already holds
    alloc.free(value[aligned:])     # the partial last page the tree does not keep
    tree.dec_lock_ref(m.last_device_node)
    rec.hits.append(hit)


def run_trace(name: str, trace: Trace, page_size: int, budget_tokens: int) -> TraceRun:
    alloc = PageAllocator(budget_tokens // page_size, page_size)
    tree = TREES[name](allocator=alloc, page_size=page_size)
    rec = _Recorder()
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for req in trace.requests:
            _serve(tree, alloc, req, rec)
        total = time.perf_counter() - t0
    finally:
        gc.enable()
    return TraceRun(total, rec.match_insert_s, rec.evict_s, rec.evict_freed, rec.hits)


def check_same(runs: dict[str, TraceRun], page_size: int) -> None:
    """Both trees must have served the same hits and evictions, request by request."""
    a, b = runs["naive"], runs["ours"]
    bad = next((i for i, (x, y) in enumerate(zip(a.hits, b.hits)) if x != y), None)
    assert bad is None, f"page {page_size}: request {bad} hit {a.hits[bad]} vs {b.hits[bad]}"
    assert a.hits == b.hits and a.evict_freed == b.evict_freed, f"page {page_size}: differ"


def summarise(run: TraceRun, trace: Trace) -> dict[str, float | int | None]:
    n = len(trace.requests)
    ev = np.array(run.evict_s) * 1e6
    return {
        "trace_s": run.total_s,
        "requests_per_s": n / run.total_s,
        "match_insert_ops_per_s": 2 * n / run.match_insert_s,
        "evict_calls": len(ev),
        "evict_mean_us": float(ev.mean()) if len(ev) else None,
        "evict_p99_us": float(np.percentile(ev, P99)) if len(ev) else None,
        "hit_rate": sum(run.hits) / sum(len(r.prompt) for r in trace.requests),
    }


def speedups(naive: dict, ours: dict) -> dict[str, float | None]:
    """naive/ours for times, ours/naive for rates: > 1 means ours is faster."""
    def ratio(num: float | None, den: float | None) -> float | None:
        return num / den if num and den else None
    return {
        "trace_s": ratio(naive["trace_s"], ours["trace_s"]),
        "requests_per_s": ratio(ours["requests_per_s"], naive["requests_per_s"]),
        "match_insert_ops_per_s": ratio(ours["match_insert_ops_per_s"],
                                        naive["match_insert_ops_per_s"]),
        "evict_mean_us": ratio(naive["evict_mean_us"], ours["evict_mean_us"]),
        "evict_p99_us": ratio(naive["evict_p99_us"], ours["evict_p99_us"]),
    }


# ------------------------------------------------------------------------ evict scaling


def _random_seq(rng: np.random.Generator) -> Key:
    return tuple(rng.integers(VOCAB, size=SCALING_SEQ_TOKENS).tolist())


def evict_cost(name: str, page_size: int, tokens: int, seed: int) -> tuple[list[float], list]:
    """Per-call seconds of one-page evicts on a tree held at ~`tokens` tokens.

    The tree is filled with random sequences (one leaf each); after every timed evict one new
    sequence is inserted, untimed, so the size stays put.
    """
    rng = np.random.default_rng(seed)
    tree = TREES[name](page_size=page_size)
    for _ in range(-(-tokens // SCALING_SEQ_TOKENS)):
        tree.insert(_random_seq(rng))
    times, freed = [], []
    gc.collect()
    gc.disable()
    try:
        for _ in range(SCALING_EVICTS):
            t0 = time.perf_counter()
            freed.append(tree.evict(page_size))
            times.append(time.perf_counter() - t0)
            tree.insert(_random_seq(rng))
    finally:
        gc.enable()
    return times, freed


def run_scaling(page_sizes: Sequence[int], sizes: Sequence[int], seed: int) -> list[dict]:
    rows = []
    jobs = [(p, s) for p in page_sizes for s in sizes]
    for page_size, tokens in tqdm(jobs, desc="evict scaling", file=sys.stderr):
        row: dict[str, Any] = {"page_size": page_size, "tree_tokens": tokens}
        freed = {}
        for name in TREES:
            times, freed[name] = evict_cost(name, page_size, tokens, seed)
            row[f"{name}_mean_us"] = float(np.mean(times) * 1e6)
            row[f"{name}_p99_us"] = float(np.percentile(times, P99) * 1e6)
        assert freed["naive"] == freed["ours"], f"evict scaling differs at {page_size}/{tokens}"
        row["speedup"] = row["naive_mean_us"] / row["ours_mean_us"]
        rows.append(row)
    return rows


def growth(rows: list[dict], page_size: int, name: str) -> float:
    """Mean evict time on the largest tree over the smallest."""
    mine = [r for r in rows if r["page_size"] == page_size]
    return mine[-1][f"{name}_mean_us"] / mine[0][f"{name}_mean_us"]


# --------------------------------------------------------------------------------- report


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def _ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}x"


TRACE_ROWS: tuple[tuple[str, str, str], ...] = (
    ("trace_s", "trace time (s)", ".3f"),
    ("requests_per_s", "requests/s", ",.0f"),
    ("match_insert_ops_per_s", "match+insert ops/s", ",.0f"),
    ("evict_mean_us", "evict mean (µs)", ",.1f"),
    ("evict_p99_us", "evict p99 (µs)", ",.1f"),
)


def trace_table(results: list[dict]) -> str:
    lines = ["| page size | metric | naive | ours | speed-up vs naive |",
             "|---:|---|---:|---:|---:|"]
    for r in results:
        p, nv, us, sp = r["page_size"], r["naive"], r["ours"], r["speedup"]
        for key, label, spec in TRACE_ROWS:
            lines.append(f"| {p} | {label} | {_fmt(nv[key], spec)} | {_fmt(us[key], spec)} "
                         f"| {_ratio(sp[key])} |")
        lines.append(f"| {p} | evict calls | {nv['evict_calls']} | {us['evict_calls']} | |")
        lines.append(f"| {p} | hit rate | {nv['hit_rate']:.1%} | {us['hit_rate']:.1%} "
                     "| identical |")
    return "\n".join(lines)


def scaling_table(rows: list[dict]) -> str:
    head = "| page size | tokens in tree | naive µs/evict | ours µs/evict | speed-up vs naive |"
    lines = [head, "|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['page_size']} | {r['tree_tokens']:,} | {r['naive_mean_us']:,.1f} "
                     f"| {r['ours_mean_us']:,.1f} | {_ratio(r['speedup'])} |")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    model = platform.processor() or "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform()}


# ----------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--turn-tokens", type=int, default=256, help="question tokens per turn; "
                    "the answer is half as long")
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--budget-frac", type=float, default=0.25,
                    help="device budget as a fraction of the trace's unique tokens")
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=10, help="trace runs per tree; min is kept")
    ap.add_argument("--scaling-sizes", type=int, nargs="+", default=list(SCALING_SIZES),
                    help="tree sizes (tokens) for the evict-cost scaling")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/radix.json"))
    args = ap.parse_args(argv)
    if args.repeats < 1 or not 0 < args.budget_frac <= 1:
        ap.error(f"--repeats must be >= 1 (got {args.repeats}) and --budget-frac in (0, 1] "
                 f"(got {args.budget_frac})")
    bad = [p for p in args.page_sizes if p < 1 or SCALING_SEQ_TOKENS % p]
    if bad:
        ap.error(f"--page-sizes {bad}: each must divide {SCALING_SEQ_TOKENS}")
    return args


def bench_trace(trace: Trace, page_size: int, budget: int, repeats: int,
                progress: Callable[[], None]) -> dict[str, Any]:
    best: dict[str, TraceRun] = {}
    for _ in range(repeats):
        for name in TREES:  # alternate, so drift in machine load hits both
            run = run_trace(name, trace, page_size, budget)
            if name not in best or run.total_s < best[name].total_s:
                best[name] = run
            progress()
    check_same(best, page_size)
    naive, ours = summarise(best["naive"], trace), summarise(best["ours"], trace)
    return {"page_size": page_size, "naive": naive, "ours": ours,
            "speedup": speedups(naive, ours)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    trace = make_trace(args)
    budget = int(args.budget_frac * trace.unique_tokens)
    bar = tqdm(total=len(args.page_sizes) * args.repeats * len(TREES), desc="trace",
               file=sys.stderr)
    results = [bench_trace(trace, p, budget, args.repeats, lambda: bar.update())
               for p in args.page_sizes]
    bar.close()
    scaling = run_scaling(args.page_sizes, args.scaling_sizes, args.seed)
    report = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "trace": {"requests": len(trace.requests), "unique_tokens": trace.unique_tokens,
                  "budget_tokens": budget, "identical_hits": True},
        "timing": f"min of {args.repeats} runs per tree, trees alternated, gc off while timed",
        "results": results,
        "evict_scaling": {"evicts_per_size": SCALING_EVICTS, "evict_tokens": "one page",
                          "leaf_tokens": SCALING_SEQ_TOKENS, "rows": scaling,
                          "growth_largest_over_smallest": {
                              f"page_{p}": {n: growth(scaling, p, n) for n in TREES}
                              for p in args.page_sizes}},
    }
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def print_report(report: dict[str, Any]) -> None:
    t, m = report["trace"], report["machine"]
    print(f"Radix tree benchmark: {t['requests']} requests, {t['unique_tokens']:,} unique "
          f"tokens, budget {t['budget_tokens']:,} tokens; {m['cpu']}, {m['cores']} cores; "
          f"{report['timing']}; hit tokens identical for every request.\n")
    print(trace_table(report["results"]))
    sc = report["evict_scaling"]
    print(f"\nEvict cost vs tree size ({sc['evicts_per_size']} one-page evicts, "
          f"{sc['leaf_tokens']}-token leaves):\n")
    print(scaling_table(sc["rows"]))
    for page, g in sc["growth_largest_over_smallest"].items():
        print(f"\n{page}: evict time largest/smallest tree: naive {g['naive']:.1f}x, "
              f"ours {g['ours']:.1f}x", end="")
    print()


if __name__ == "__main__":
    main()
