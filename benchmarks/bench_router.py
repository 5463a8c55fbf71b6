"""`make bench-router`: two hicache servers behind a router, routing policies side by side.

    python -m benchmarks.bench_router            # ~8 min on 2 CPU cores; tables + JSON

Every configuration runs two `hicache_server.launch` processes with the hierarchical cache of
`run_multiturn.py`'s L1+L2 (the same L1 and L2 sizes, page size 16, the embedded model) and
one router in front of them, and sends the seeded multi-turn workload of `bench_multiturn.py`
(streamed `/generate` on token ids, greedy) to the router alone:

    round_robin          sglang-router, each request to the next worker in turn
    cache_aware          sglang-router's approximate radix tree of what it sent where: a
                         request goes where its longest prefix went (a new one, matching less
                         than 30%, to the least loaded), unless the loads are too uneven
    cache_aware+balance  the same with --balance-abs-threshold 4 (default 64, which 8 chats
                         never reach): it spills to the other worker when one runs 4 more
    event                hicache_server.router: the servers publish KV events (which
                         pages each tier holds) and the proxy routes to the longest match;
                         run only when the servers accept `--kv-events-config`

each with private L1+L2 only, and with both servers on one shared Redis L3 (a loopback
redis-server the driver starts, `wait_complete` prefetch). Hit rates by tier are the
servers' own `/metrics` (`hicache:cached_tokens_total`, summed over both, after minus
before). sglang-router lives in its own venv (`.venv-router`, `make router-venv`): it pins
its own fastapi and pydantic. The driver stops everything it started when it ends, also on
Ctrl-C, SIGTERM or an error. The machine is shared and noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks import bench_multiturn as bm
from benchmarks import multiturn_report as mr
from benchmarks import run_multiturn as rm
from benchmarks.redis_servers import RedisServer

ROUTER_VENV = rm.REPO / ".venv-router"
ROUTER_PYTHON = ROUTER_VENV / "bin" / "python"
EVENT_ROUTER = "hicache_server.router"  # run as `python -m`
NUM_SERVERS = 2
ROUND_ROBIN = "round_robin"
CACHE_AWARE = "cache_aware"
CACHE_AWARE_BALANCED = "cache_aware+balance"
EVENT = "event"
POLICIES = (ROUND_ROBIN, CACHE_AWARE, CACHE_AWARE_BALANCED, EVENT)
# sglang-router's flags for each of its policies here. cache_aware leaves its prefix tree for
# the least loaded worker only when the loads (requests in flight) differ by more than
# --balance-abs-threshold (default 64) and the largest is over --balance-rel-threshold (1.5)
# times the smallest: at 8 chats that never happens, so the "+balance" variant lowers the
# first to 4.
BALANCE_ABS = 4
ROUTER_POLICY_FLAGS = {
    ROUND_ROBIN: ("--policy", "round_robin"),
    CACHE_AWARE: ("--policy", "cache_aware"),
    CACHE_AWARE_BALANCED: ("--policy", "cache_aware", "--balance-abs-threshold",
                           str(BALANCE_ABS)),
}
PRIVATE = "L1+L2"
SHARED = "L1+L2 + shared Redis"
STORAGES = (PRIVATE, SHARED)
BASELINE = (ROUND_ROBIN, PRIVATE)
PREFETCH_POLICY = "wait_complete"
# The router registers its workers in the background once started (a /health, /server_info
# and /model_info each); on this machine it is ready within a few seconds.
ROUTER_READY_TIMEOUT_S = 60.0
ROUTER_STOP_S = 10.0
POLL_S = 0.2
HTTP_TIMEOUT_S = 10.0
CACHED_METRIC = "hicache:cached_tokens_total"
PROMPT_METRIC = "hicache:prompt_tokens_total"
REQUESTS_METRIC = "hicache:requests_total"
DEFAULT_ROUNDS = 4  # 8 chats x 4 rounds: each configuration's run ~40 s on 2 cores
# The workload flags the report records: run_multiturn's without request_rate and distribution.
WORKLOAD_KEYS = tuple(k for k in rm.WORKLOAD_KEYS if k not in ("request_rate", "distribution"))
# The flag the event policy needs; a server that exits at start with code 2 lacks it.
KV_EVENTS_FLAG = "--kv-events-config"
FLAG_REJECTED = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, timeout: float = HTTP_TIMEOUT_S) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


# --------------------------------------------------------------------------------- router


class Router(rm.ManagedProcess):
    """One router subprocess on 127.0.0.1 (a free port) in front of `worker_urls`, stopped
    in `__exit__`: sglang-router (`policy` one of its policies) or, for `policy="event"`,
    `hicache_server.router` (then `event_endpoints` lists each worker's KV events endpoint)."""

    def __init__(self, worker_urls: Sequence[str], policy: str, log_dir: Path,
                 event_endpoints: Sequence[str] = ()) -> None:
        self.worker_urls, self.policy = list(worker_urls), policy
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"router-{policy}-{self.port}.log"
        if policy == EVENT:
            self.cmd = [sys.executable, "-m", EVENT_ROUTER, "--port", str(self.port),
                        "--workers", *self.worker_urls, "--events", *event_endpoints]
        else:
            self.cmd = [str(ROUTER_PYTHON), "-m", "sglang_router.launch_router",
                        "--worker-urls", *self.worker_urls, *ROUTER_POLICY_FLAGS[policy],
                        "--host", "127.0.0.1", "--port", str(self.port),
                        # its Prometheus exporter binds 0.0.0.0:29000 unless told otherwise
                        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                        "--log-level", "info"]
        self._proc: subprocess.Popen | None = None

    def _start(self) -> None:
        if self.policy != EVENT and not ROUTER_PYTHON.exists():
            raise RuntimeError(f"sglang-router is not installed: {ROUTER_PYTHON} is missing; "
                               "run `make router-venv`")
        log = self.log_path.open("w")
        # preexec_fn is safe here: it calls one preloaded C function and takes no lock.
        self._proc = subprocess.Popen(self.cmd, cwd=rm.REPO, stdin=subprocess.DEVNULL,
                                      stdout=log, stderr=subprocess.STDOUT,
                                      preexec_fn=rm._die_with_parent)  # noqa: PLW1509
        log.close()

    def _wait_ready(self) -> None:
        """Until every worker is registered and healthy (`/readiness` of sglang-router, or
        `/health` of the event router, which answers once it has subscribed)."""
        deadline = time.monotonic() + ROUTER_READY_TIMEOUT_S
        path = "/health" if self.policy == EVENT else "/readiness"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            with contextlib.suppress(OSError, ValueError):
                body = http_json(self.url + path, timeout=2)
                if body.get("healthy_workers") == len(self.worker_urls):
                    return
            time.sleep(POLL_S)
        raise RuntimeError(f"router ({self.policy}) not ready with {len(self.worker_urls)} "
                           f"workers (exit code {self._proc.poll()}); see {self.log_path}")

    def stop(self) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(ROUTER_STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(ROUTER_STOP_S)

    def log_tail(self, lines: int = 40) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()[-lines:]


# -------------------------------------------------------------------------------- metrics


def server_counters(server: rm.Server) -> dict[str, float]:
    """The cache counters of one server's /metrics: requests, prompt tokens, cached tokens
    per tier (`tier` label)."""
    out: dict[str, float] = {}
    for line in server.get("/metrics").splitlines():
        name, _, value = line.partition(" ")
        if name.startswith(CACHED_METRIC + "{"):
            tier = name.split('tier="', 1)[1].split('"', 1)[0]
            out[tier] = float(value)
        elif name in (PROMPT_METRIC, REQUESTS_METRIC):
            out[name.removeprefix("hicache:").removesuffix("_total")] = float(value)
    return out


def counter_delta(before: Sequence[dict[str, float]], after: Sequence[dict[str, float]]
                  ) -> dict[str, Any]:
    """Both servers' counters, after minus before: summed, and requests per server."""
    keys = sorted({k for d in after for k in d})
    per = [{k: a.get(k, 0.0) - b.get(k, 0.0) for k in keys} for b, a in zip(before, after)]
    total = {k: sum(p[k] for p in per) for k in keys}
    prompt = total.get("prompt_tokens", 0.0)
    hits = {t: (total.get(t, 0.0) / prompt if prompt else None) for t in bm.TIERS}
    all_hits = sum(v for v in hits.values() if v is not None) if prompt else None
    return {"prompt_tokens": prompt, "cached_tokens": {t: total.get(t, 0.0) for t in bm.TIERS},
            "hit_rate": {"all": all_hits, **hits},
            "requests_per_server": [int(p.get("requests", 0)) for p in per]}


def stuck_rate(records: Sequence[dict[str, Any]], page: int = rm.PAGE_SIZE) -> float | None:
    """Share of the requests of rounds >= 2 that found their chat's previous prompt in L1 or
    L2 of the server they reached, i.e. landed where the previous round was served."""
    prev = {(r["client"], r["round"]): r["prompt_tokens"] for r in records if not r["error"]}
    later = [r for r in records if r["round"] >= 2 and not r["error"]
             and (r["client"], r["round"] - 1) in prev]
    if not later:
        return None
    stuck = [r for r in later if r["cached"]["device"] + r["cached"]["host"]
             >= prev[(r["client"], r["round"] - 1)] // page * page]
    return len(stuck) / len(later)


# ----------------------------------------------------------------------------------- runs


def events_config(port: int, replay_port: int) -> str:
    return json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{port}",
                       "replay_endpoint": f"tcp://*:{replay_port}", "topic": ""})


def server_flags(args: argparse.Namespace, sizing: rm.Sizing, storage: str,
                 redis_url: str | None) -> tuple[str, ...]:
    hier = rm.configs(sizing, args.workdir, PREFETCH_POLICY,
                      shlex.split(args.server_args))[mr.HIER].flags
    if storage == SHARED:
        return rm.with_storage(hier, "redis", {"url": redis_url}, PREFETCH_POLICY)
    return hier


@contextlib.contextmanager
def shared_storage(args: argparse.Namespace, storage: str, name: str) -> Iterator[str | None]:
    """A fresh redis-server for the shared configuration (its URL), nothing otherwise."""
    if storage != SHARED:
        yield None
        return
    with RedisServer.start(args.workdir / f"redis-{name}") as redis:
        yield redis.url


def run_config(args: argparse.Namespace, sizing: rm.Sizing, policy: str, storage: str
               ) -> dict[str, Any]:
    """Two fresh servers (and a fresh Redis), a router of `policy`, the workload through it."""
    label = f"{policy} / {storage}"
    name = f"{policy}-{'redis' if storage == SHARED else 'private'}"
    with contextlib.ExitStack() as stack:
        redis_url = stack.enter_context(shared_storage(args, storage, name))
        flags = server_flags(args, sizing, storage, redis_url)
        endpoints: list[str] = []
        servers = []
        for i in range(NUM_SERVERS):
            extra: tuple[str, ...] = ()
            if policy == EVENT:
                pub, replay = free_port(), free_port()
                extra = (KV_EVENTS_FLAG, events_config(pub, replay))
                endpoints.append(f"tcp://127.0.0.1:{pub},tcp://127.0.0.1:{replay}")
            server = rm.Server(f"{name} server {i}", (*flags, *extra), args.home, args.workdir)
            pin(server, i, args.cores_per_server)
            servers.append(stack.enter_context(server))
        urls = [f"http://127.0.0.1:{s.port}" for s in servers]
        router = stack.enter_context(Router(urls, policy, args.workdir, endpoints))
        before = [server_counters(s) for s in servers]
        result = bm.run_benchmark(rm.client_args(args, label, router.port),
                                  lambda turn: router.url)
        result["counters"] = counter_delta(before, [server_counters(s) for s in servers])
        result["servers"] = [rm.server_info(s) for s in servers]
        result["router"] = {"command": shlex.join(router.cmd), "log_tail": router.log_tail(8)}
        if policy == EVENT:  # how often a match decided, per server; events and gaps
            result["router"]["stats"] = http_json(router.url + "/stats")
    result["label"], result["policy"], result["storage"] = label, policy, storage
    return result


def pin(server: rm.Server, index: int, cores: int) -> None:
    """Give server `index` cores of its own (`taskset`, and as many torch threads), as each
    server of a fleet has its own machine or GPU; 0 leaves it on every core. Without this,
    two servers on one small CPU slow each other down and a policy that sends everything to
    one server looks faster than it would be on two machines."""
    if cores == 0:
        return
    first = index * cores % (os.cpu_count() or 1)
    cpus = ",".join(str((first + k) % (os.cpu_count() or 1)) for k in range(cores))
    server.cmd = ["taskset", "-c", cpus, *server.cmd]
    server.env = {**server.env, "OMP_NUM_THREADS": str(cores)}


def events_supported(args: argparse.Namespace) -> str | None:
    """None when a server starts with `--kv-events-config`; else why the event policy is
    not run (the flag is rejected: the publisher is not in this build)."""
    flags = (*rm.base_flags(rm.Sizing(0, 1024, 2.0, 0)), "--enable-hierarchical-cache",
             KV_EVENTS_FLAG, events_config(free_port(), free_port()))
    try:
        with rm.Server("kv-events probe", flags, args.home, args.workdir):
            return None
    except RuntimeError:
        log = (args.workdir / "server-kv_events_probe.log").read_text(errors="replace")
        last = [ln for ln in log.splitlines() if ln.strip()][-1:] or ["(empty log)"]
        return f"the server does not start with {KV_EVENTS_FLAG}: {last[0]}"


def run_all(args: argparse.Namespace, sizing: rm.Sizing) -> tuple[dict[str, Any], dict]:
    skipped: dict[str, str] = {}
    policies = [p for p in args.policies if p != EVENT]
    if EVENT in args.policies:
        why = events_supported(args)
        if why is None:
            policies.append(EVENT)
        else:
            skipped[EVENT] = why
            print(f"!! event policy not run: {why}", file=sys.stderr)
    runs: dict[str, Any] = {}
    for storage in args.storages:
        for policy in policies:
            runs[f"{policy} / {storage}"] = run_config(args, sizing, policy, storage)
    return runs, skipped


# ------------------------------------------------------------------------------ analysis


def summary(run: dict[str, Any]) -> dict[str, Any]:
    died = [s["fatal"] for s in run["servers"] if s["fatal"]]
    return {"policy": run["policy"], "storage": run["storage"],
            "ttft_r2_mean_s": mr.ttft_after_first(run),
            "request_throughput": run["request_throughput"],
            "hit_rate": run["counters"]["hit_rate"],
            "requests_per_server": run["counters"]["requests_per_server"],
            "stuck_rate": stuck_rate(run["records"]), "errors": run["errors"],
            "server_died": "; ".join(died) or None}


def compare(runs: dict[str, Any]) -> dict[str, Any]:
    """Each configuration against round_robin without Redis, and whether every greedy answer
    equals the baseline's (same chat, round)."""
    base_key = " / ".join(BASELINE)
    rows = {k: summary(r) for k, r in runs.items()}
    base = rows.get(base_key)
    for key, row in rows.items():
        row["ttft_vs_baseline"] = mr.ratio(row["ttft_r2_mean_s"],
                                           base["ttft_r2_mean_s"] if base else None)
        row["throughput_vs_baseline"] = mr.ratio(row["request_throughput"],
                                                 base["request_throughput"] if base else None)
        row["same_answers"] = mr.same_answers(runs[key], runs[base_key]) if base else None
    return {"baseline": base_key, "configs": rows}


def table(cmp: dict[str, Any]) -> str:
    head = ("| policy | storage | TTFT r>=2 mean (ms) | vs rr | req/s | vs rr | hit rate "
            "| device | host | storage | r>=2 found their previous prompt in L1/L2 | requests per "
            "server | same answers | status |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for c in cmp["configs"].values():
        lines.append(
            f"| {c['policy']} | {c['storage']} | {mr.fmt_ms(c['ttft_r2_mean_s'])} "
            f"| {mr.fmt_x(c['ttft_vs_baseline'])} | {c['request_throughput']:.3f} "
            f"| {mr.fmt_x(c['throughput_vs_baseline'])} | {mr.hit_cells(c['hit_rate'])} "
            f"| {mr.fmt_pct(c['stuck_rate'])} | {', '.join(map(str, c['requests_per_server']))} "
            f"| {mr.fmt_pct(c['same_answers'])} | {mr.run_status(c)} |")
    return "\n".join(lines)


def print_report(report: dict[str, Any]) -> None:
    pinned = f" ({report['cores_per_server'] or 'all'} pinned per server)"
    print(mr.intro(report, "Two servers behind a router",
                   f"per server {mr.tiers_text(report['sizing'])}; "
                   f"sglang-router {report['router_version']}", pinned))
    print(table(report))
    for policy, why in report["not_run"].items():
        print(f"\n{policy}: not run ({why})")
    print(f"\nJSON: {report['out']}; per-request log: {report['log']}")


# ---------------------------------------------------------------------------------- main


def router_version() -> str | None:
    if not ROUTER_PYTHON.exists():
        return None
    code = "import importlib.metadata as m; print(m.version('sglang-router'))"
    out = subprocess.run([str(ROUTER_PYTHON), "-c", code], capture_output=True, text=True,
                         check=False)
    return out.stdout.strip() or None


def default_cores() -> int:
    have = os.cpu_count() or 1
    return max(1, have // NUM_SERVERS) if have >= NUM_SERVERS and shutil.which("taskset") else 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    rm.add_workload_args(ap)
    ap.set_defaults(num_rounds=DEFAULT_ROUNDS)
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    ap.add_argument("--storages", nargs="+", choices=STORAGES, default=list(STORAGES))
    ap.add_argument("--cores-per-server", type=int, default=default_cores(),
                    help="CPU cores pinned to each server (taskset; 0: no pinning); default 1 "
                         "per server when the machine has a core for each, else 0")
    rm.add_report_args(ap, "router")
    args = ap.parse_args(argv)
    rm.check_workload_args(ap, args)
    if set(args.policies) - {EVENT} and not ROUTER_PYTHON.exists():
        ap.error(f"sglang-router is not installed ({ROUTER_PYTHON} is missing): run "
                 "`make router-venv`, or pass --policies event")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    sizing = rm.size_tiers(args)
    with rm.driver_run(args, "hicache-router-"):  # SIGTERM unwinds: servers, routers, redis
        runs, not_run = run_all(args, sizing)
    report = {
        **rm.report_stamp(), "router_version": router_version(),
        "cores_per_server": args.cores_per_server,
        "workload": rm.workload_of(args, WORKLOAD_KEYS),
        "sizing": sizing._asdict() | {"page_size": rm.PAGE_SIZE,
                                      "prefetch_policy": PREFETCH_POLICY},
        **compare(runs), "not_run": not_run,
        "runs": {k: {f: v for f, v in r.items() if f != "records"} for k, r in runs.items()},
        "log": rm._shown(args.log), "out": rm._shown(args.out),
    }
    rm.write_report(report, args.out)
    print_report(report)
    return report


if __name__ == "__main__":
    main()
