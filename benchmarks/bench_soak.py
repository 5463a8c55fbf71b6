"""Soak: one `hicache-server` (L1 + L2 + LMDB) under steady multi-turn load for a bounded
time, its memory sampled throughout, to tell a plateau from a slow leak.

    python -m benchmarks.bench_soak                      # 20 minutes, 8 clients
    python -m benchmarks.bench_soak --minutes 60 --clients 16

Clients chat in rounds over a few shared system prompts (so the tree, L2 and LMDB all churn:
every tier fills and evicts within the first minutes), stream half of their answers, hang
up mid-stream on one request in twenty, and sample at a tiny temperature on one in ten. Every
`--sample-s` seconds the driver reads the server's /proc status (anonymous RSS: Python and
torch heaps; file-backed RSS: the mapped LMDB file and shared libraries; shared memory) and
/admin/tiers. The run ends by itself after `--minutes`, stops the server with SIGTERM and
writes benchmarks/results/soak.json and a table: RSS per phase and the growth rate over the
last half and the last quarter of the run, in MB per minute.

The tiers themselves are allocated once at start-up (L1 and L2 are fixed-size pools, LMDB is
bounded by `max_size_gb`), so what grows is the interpreter's heap (allocator arenas and
caches) and the page cache's share of the mapped LMDB file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks import run_multiturn as rm

RESULTS = rm.RESULTS
MB = 2**20
PAGE_SIZE = 16
L1_TOKENS = 4096          # small, so that L1 evicts to L2 within seconds
LMDB_MAX_GB = 0.25        # small, so that LMDB reaches its bound and evicts during the run
SYSTEM_PROMPTS = 4        # chats share these prefixes (few-shot templates, RAG documents)
SYSTEM_TOKENS = 384
USER_TOKENS = 48
ANSWER_TOKENS = 24
ROUNDS_PER_CHAT = 6       # then the client starts a new chat (its old one goes cold)
STREAM_SHARE = 0.5
HANG_UP_SHARE = 0.05      # requests whose client leaves after its first event
TINY_TEMPERATURE_SHARE = 0.1
TINY_TEMPERATURE = 1e-40  # below the greedy floor: exercises the sampling guard
REQUEST_TIMEOUT_S = 120.0
STATUS_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")
BYTE_VOCAB = 256          # the embedded model's byte tokens


def proc_status(pid: int) -> dict[str, int]:
    """The memory lines of /proc/<pid>/status, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in STATUS_FIELDS:
            out[name] = int(value.split()[0]) * 1024  # kB
    return out


class Counts:
    def __init__(self) -> None:
        self.done = self.failed = self.hung_up = 0
        self.lock = threading.Lock()

    def add(self, field: str) -> None:
        with self.lock:
            setattr(self, field, getattr(self, field) + 1)


async def one_request(session: aiohttp.ClientSession, url: str, ids: list[int],
                      rng: random.Random, counts: Counts) -> list[int]:
    """One generation; its output ids (empty when it was cut short or failed)."""
    params: dict[str, Any] = {"max_new_tokens": ANSWER_TOKENS, "ignore_eos": True,
                              "temperature": 0}
    if rng.random() < TINY_TEMPERATURE_SHARE:
        params["temperature"] = TINY_TEMPERATURE
    stream = rng.random() < STREAM_SHARE
    body = {"input_ids": ids, "sampling_params": params, "stream": stream}
    try:
        async with session.post(f"{url}/generate", json=body) as resp:
            if resp.status != 200:
                counts.add("failed")
                return []
            if not stream:
                counts.add("done")
                return (await resp.json())["output_ids"]
            if rng.random() < HANG_UP_SHARE:
                await resp.content.readuntil(b"\n\n")
                counts.add("hung_up")
                return []  # leaving the block closes the connection mid-stream
            last: list[int] = []
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    last = json.loads(line[len(b"data: "):])["output_ids"]
            counts.add("done")
            return last
    except (aiohttp.ClientError, TimeoutError):
        counts.add("failed")
        return []


async def client(url: str, seed: int, deadline: float, counts: Counts,
                 systems: Sequence[list[int]]) -> None:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < deadline:
            history = list(rng.choice(systems))
            for _ in range(ROUNDS_PER_CHAT):
                if time.monotonic() >= deadline:
                    return
                history += [rng.randrange(BYTE_VOCAB) for _ in range(USER_TOKENS)]
                answer = await one_request(session, url, history, rng, counts)
                history += answer or [rng.randrange(BYTE_VOCAB) for _ in range(ANSWER_TOKENS)]


def sampler(server: rm.Server, stop: threading.Event, every_s: float, t0: float,
            counts: Counts, samples: list[dict[str, Any]]) -> None:
    while True:
        entry: dict[str, Any] = {"t_s": round(time.monotonic() - t0, 1),
                                 **proc_status(server.pid), "requests": counts.done}
        try:
            tiers = json.loads(server.get("/admin/tiers"))["tiers"]
            entry["used_tokens"] = {t: v["used"] for t, v in tiers.items()}
            entry["storage_errors"] = tiers.get("storage", {}).get("errors", 0)
        except OSError as e:
            entry["tiers_error"] = str(e)
        samples.append(entry)
        if stop.wait(every_s):
            return


def rate_mb_per_min(samples: Sequence[dict[str, Any]], field: str, since_s: float) -> float:
    """Least-squares slope of `field` over the samples from `since_s` on, MB per minute."""
    pts = [(s["t_s"] / 60, s[field] / MB) for s in samples if s["t_s"] >= since_s and field in s]
    if len(pts) < 2:
        return float("nan")
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    var = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / var if var else float("nan")


def at(samples: Sequence[dict[str, Any]], t_s: float) -> dict[str, Any]:
    """The first sample at or after `t_s` (the last one if none)."""
    return next((s for s in samples if s["t_s"] >= t_s), samples[-1])


def summarize(samples: Sequence[dict[str, Any]], duration_s: float) -> dict[str, Any]:
    phases = {"start": samples[0], "1 min": at(samples, 60),
              "half": at(samples, duration_s / 2), "end": samples[-1]}
    fields = ("VmRSS", "RssAnon", "RssFile", "RssShmem")
    return {
        "mb": {name: {f: round(s.get(f, 0) / MB, 1) for f in fields} | {"t_s": s["t_s"]}
               for name, s in phases.items()},
        "mb_per_min_last_half": {f: round(rate_mb_per_min(samples, f, duration_s / 2), 2)
                                 for f in fields},
        "mb_per_min_last_quarter": {f: round(rate_mb_per_min(samples, f, duration_s * 0.75), 2)
                                    for f in fields},
        "peak_rss_mb": round(max(s.get("VmHWM", 0) for s in samples) / MB, 1),
    }


def table(summary: dict[str, Any], counts: dict[str, int]) -> str:
    rows = ["| phase | t (s) | RSS MB | anon (heap) MB | file-backed MB | shmem MB |",
            "|---|---:|---:|---:|---:|---:|"]
    for name, s in summary["mb"].items():
        rows.append(f"| {name} | {s['t_s']:.0f} | {s['VmRSS']:.1f} | {s['RssAnon']:.1f} | "
                    f"{s['RssFile']:.1f} | {s['RssShmem']:.1f} |")
    for label, key in (("growth, last half", "mb_per_min_last_half"),
                       ("growth, last quarter", "mb_per_min_last_quarter")):
        r = summary[key]
        rows.append(f"| {label} (MB/min) | | {r['VmRSS']:+.2f} | {r['RssAnon']:+.2f} | "
                    f"{r['RssFile']:+.2f} | {r['RssShmem']:+.2f} |")
    rows.append(f"\nrequests: {counts['done']} done, {counts['hung_up']} hung up mid-stream, "
                f"{counts['failed']} failed; peak RSS {summary['peak_rss_mb']:.1f} MB")
    return "\n".join(rows)


def server_flags(lmdb: Path) -> list[str]:
    extra = json.dumps({"path": str(lmdb), "max_size_gb": LMDB_MAX_GB})
    return ["--enable-hierarchical-cache", "--page-size", str(PAGE_SIZE),
            "--max-total-tokens", str(L1_TOKENS), "--device", "cpu",
            "--hicache-storage-backend", "lmdb",
            "--hicache-storage-backend-extra-config", extra]


async def drive(url: str, args: argparse.Namespace, deadline: float, counts: Counts) -> None:
    rng = random.Random(args.seed)
    systems = [[rng.randrange(BYTE_VOCAB) for _ in range(SYSTEM_TOKENS)]
               for _ in range(SYSTEM_PROMPTS)]
    await asyncio.gather(*(client(url, args.seed * 1000 + i, deadline, counts, systems)
                           for i in range(args.clients)))


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="hicache-soak-"))
    counts, samples = Counts(), []
    duration_s = args.minutes * 60
    with rm.Server("soak", server_flags(work / "lmdb"), work / "home", work) as server:
        t0 = time.monotonic()
        stop = threading.Event()
        sampling = threading.Thread(target=sampler, args=(server, stop, args.sample_s, t0,
                                                          counts, samples), daemon=True)
        sampling.start()
        try:
            asyncio.run(drive(f"http://127.0.0.1:{server.port}", args, t0 + duration_s,
                              counts))
        finally:
            stop.set()
            sampling.join()
        metrics = server.get("/metrics")
    errors = [line for line in metrics.splitlines()
              if line.startswith(("hicache:request_errors_total", "hicache:storage_errors"))]
    summary = summarize(samples, duration_s)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": rm.machine(),
              "args": vars(args), "server_flags": server_flags(Path("<tmp>/lmdb")),
              "requests": {"done": counts.done, "hung_up": counts.hung_up,
                           "failed": counts.failed},
              "error_metrics": errors, "summary": summary, "samples": samples,
              "server_log": str(server.log_path)}
    return report


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0, help="length of the run")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--sample-s", type=float, default=10.0, help="memory sampling interval")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.clients < 1 or args.sample_s <= 0:
        ap.error("--minutes and --sample-s must be > 0 and --clients >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    report = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(table(report["summary"], report["requests"]))
    print("\n".join(report["error_metrics"]))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
