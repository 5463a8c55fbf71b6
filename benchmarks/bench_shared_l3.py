"""`make bench-shared-l3`: two servers on one Redis against two servers with private LMDBs.

    python -m benchmarks.bench_shared_l3            # ~2.5 min on 2 CPU cores; tables + JSON

Both configurations run two `hicache_server.launch` processes with the hierarchical cache of
`run_multiturn.py`'s L1+L2+L3 (the same L1 and L2 sizes, page size 16, prefetch policy
wait_complete, the embedded model) on the same seeded multi-turn workload, and route round r
of chat c to server (c + r) % 2: from round 2 on, every request lands on the server that did
not serve the chat's previous round, so the newest part of its history (last question and
answer) was computed elsewhere.

    private LMDB    each server its own LMDB: the other server's pages are out of reach
    shared Redis    both servers on one redis-server the driver starts on 127.0.0.1 (a free
                    port, no persistence): a page either server backed up is a hit for both

Each configuration runs `--repeats` times on fresh storage (new LMDBs, a new redis-server),
the two alternating; the tables pool the requests of all passes. The driver stops everything
it started (servers and redis-server) when it ends, also on Ctrl-C, SIGTERM or an error. The
machine is shared and noisy: read the ratio shared / private, not the absolute times.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import bench_multiturn as bm
from benchmarks import multiturn_report as mr
from benchmarks import run_multiturn as rm
from benchmarks.redis_servers import RedisServer

NUM_SERVERS = 2
POLICY = "wait_complete"
PRIVATE = "private LMDB"
SHARED = "shared Redis"
ROUTING = "round r of chat c -> server (c + r) % 2"
# Passes over both configurations: one pass of the default workload takes ~50 s on 2 cores,
# and single passes on a shared machine disagree by more than the effect measured.
DEFAULT_REPEATS = 3


# ------------------------------------------------------------------------------ routing


def turn_server(turn: bm.Turn, num_servers: int = NUM_SERVERS) -> int:
    """The index of the server that serves `turn` (`turn.round` is 1-based)."""
    return (turn.client + turn.round) % num_servers


def alternating(base_urls: Sequence[str]) -> bm.Route:
    """A route for `run_benchmark`: each turn to `base_urls[turn_server(turn)]`."""
    urls = list(base_urls)
    return lambda turn: urls[turn_server(turn, len(urls))]


# ----------------------------------------------------------------------------------- runs


def run_config(args: argparse.Namespace, label: str, flags: Sequence[Sequence[str]]
               ) -> dict[str, Any]:
    """Start one server per entry of `flags`, run the workload across them, stop them."""
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(rm.Server(f"{label} server {i}", f, args.home,
                                                 args.workdir)) for i, f in enumerate(flags)]
        route = alternating([f"http://127.0.0.1:{s.port}" for s in servers])
        result = bm.run_benchmark(rm.client_args(args, label, servers[0].port), route)
        result["servers"] = [rm.server_info(s) for s in servers]
    for server in result["servers"]:
        if server["fatal"]:  # the log goes with the temporary folder: keep its end
            server["log_tail"] = Path(server["log"]).read_text().splitlines()[-40:]
            print(f"\n!! a server of '{label}' died: {server['fatal']} (log: {server['log']})",
                  file=sys.stderr)
    return result


def run_pass(args: argparse.Namespace, sizing: rm.Sizing, label: str, rep: int
             ) -> dict[str, Any]:
    """One configuration on fresh storage: a new LMDB per server, or a new redis-server
    (started here, stopped when the pass ends)."""
    hier = rm.configs(sizing, args.workdir, POLICY, shlex.split(args.server_args))[mr.HIER].flags
    name = f"{label} #{rep + 1}"
    if label == PRIVATE:
        return run_config(args, name, [
            rm.with_storage(hier, "lmdb", {"path": str(args.workdir / f"lmdb-{rep}-{i}")},
                            POLICY) for i in range(NUM_SERVERS)])
    with RedisServer.start(args.workdir / f"redis-{rep}") as redis:
        result = run_config(args, name, [rm.with_storage(hier, "redis", {"url": redis.url},
                                                         POLICY)] * NUM_SERVERS)
        client = redis.client()
        try:
            result["redis"] = {"keys": client.dbsize(),
                               "used_memory": client.info("memory")["used_memory"]}
        finally:
            client.close()
    return result


def run_all(args: argparse.Namespace, sizing: rm.Sizing) -> dict[str, list[dict[str, Any]]]:
    """`--repeats` passes, the order of the two configurations swapped in every other pass
    so that drift in the machine's load hits both."""
    runs: dict[str, list[dict[str, Any]]] = {PRIVATE: [], SHARED: []}
    for rep in range(args.repeats):
        for label in (PRIVATE, SHARED) if rep % 2 == 0 else (SHARED, PRIVATE):
            runs[label].append(run_pass(args, sizing, label, rep))
    return runs


# ------------------------------------------------------------------------------ analysis


def as_records(runs: Sequence[dict[str, Any]]) -> list[bm.Record]:
    """The answered requests of every pass, as the client's records."""
    def num(x: float | None) -> float:
        return math.nan if x is None else x
    return [bm.Record(r["client"], r["round"], r["prompt_tokens"], r["completion_tokens"],
                      cached=r["cached"], ttft=num(r["ttft_s"]), latency=num(r["latency_s"]))
            for run in runs for r in run["records"] if not r["error"]]


def later_rounds(recs: Sequence[bm.Record]) -> dict[str, Any]:
    """TTFT and hit rate by tier over the requests of rounds >= 2 (the ones whose history
    was partly computed on the other server)."""
    return bm.per_round(0, [r for r in recs if r.round >= 2])


def config_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One configuration over all its passes: requests pooled, throughput over the summed
    duration, and each pass's mean TTFT (rounds >= 2) to show the spread."""
    recs = as_records(runs)
    later = later_rounds(recs)
    duration = sum(r["duration_s"] for r in runs)
    died = [s["fatal"] for r in runs for s in r["servers"] if s["fatal"]]
    return {"passes": len(runs), "requests_after_first": later["requests"],
            "ttft_mean_s": later["ttft_s"]["mean"], "ttft_p50_s": later["ttft_s"]["median"],
            "pass_ttft_mean_s": [later_rounds(as_records([r]))["ttft_s"]["mean"] for r in runs],
            "hit_rate": later["hit_rate"],
            "request_throughput": sum(r["requests"] for r in runs) / duration,
            "input_throughput": sum(r["input_throughput"] * r["duration_s"] for r in runs)
            / duration,
            "errors": sum(r["errors"] for r in runs), "server_died": "; ".join(died) or None,
            "per_round": [_round(bm.per_round(rnd, [r for r in recs if r.round == rnd]))
                          for rnd in sorted({r.round for r in recs})]}


def _round(p: dict[str, Any]) -> dict[str, Any]:
    return {"round": p["round"], "prompt_tokens_mean": p["prompt_tokens_mean"],
            "ttft_mean_s": p["ttft_s"]["mean"], "ttft_p50_s": p["ttft_s"]["median"],
            "hit_rate": p["hit_rate"]}


def shared_vs_private(shared: dict[str, Any], private: dict[str, Any]) -> dict[str, Any]:
    """Ratios shared / private of two `config_summary` results: below 1 is faster for TTFT."""
    by_round = {p["round"]: p for p in private["per_round"]}
    return {"ttft_mean": mr.ratio(shared["ttft_mean_s"], private["ttft_mean_s"]),
            "ttft_p50": mr.ratio(shared["ttft_p50_s"], private["ttft_p50_s"]),
            "pass_ttft_mean": [mr.ratio(s, p) for s, p in zip(shared["pass_ttft_mean_s"],
                                                              private["pass_ttft_mean_s"])],
            "request_throughput": mr.ratio(shared["request_throughput"],
                                           private["request_throughput"]),
            "per_round": [{"round": p["round"],
                           "ttft_mean": mr.ratio(p["ttft_mean_s"],
                                                 by_round.get(p["round"], {}).get("ttft_mean_s")),
                           "ttft_p50": mr.ratio(p["ttft_p50_s"],
                                                by_round.get(p["round"], {}).get("ttft_p50_s"))}
                          for p in shared["per_round"]]}


def compare(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Both configurations, their ratios, and the share of answers (every pass of both)
    equal to the first private pass's answer for the same chat and round."""
    cfgs = {label: config_summary(r) for label, r in runs.items()}
    ref, *others = runs[PRIVATE]
    pooled = {"records": [r for run in [*others, *runs[SHARED]] for r in run["records"]]}
    return {"configs": cfgs, "shared_vs_private": shared_vs_private(cfgs[SHARED], cfgs[PRIVATE]),
            "same_answers": mr.same_answers(pooled, ref)}


# -------------------------------------------------------------------------------- tables


def _hits(h: dict[str, float | None]) -> str:
    return " / ".join(mr.fmt_pct(h[t]) for t in bm.TIERS)


def config_table(cmp: dict[str, Any]) -> str:
    head = ("| configuration | TTFT r>=2 mean (ms) | TTFT r>=2 p50 (ms) | each pass, mean (ms) "
            "| req/s | input tok/s | hit rate r>=2 | device | host | storage | status |")
    lines = [head, "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for label, c in cmp["configs"].items():
        passes = ", ".join(mr.fmt_ms(t) for t in c["pass_ttft_mean_s"])
        lines.append(f"| {label} | {mr.fmt_ms(c['ttft_mean_s'])} | {mr.fmt_ms(c['ttft_p50_s'])} "
                     f"| {passes} | {c['request_throughput']:.3f} "
                     f"| {c['input_throughput']:,.0f} | {mr.hit_cells(c['hit_rate'])} "
                     f"| {mr.run_status(c)} |")
    r = cmp["shared_vs_private"]
    passes = ", ".join(mr.fmt_x(x) for x in r["pass_ttft_mean"])
    lines.append(f"| shared / private | {mr.fmt_x(r['ttft_mean'])} | {mr.fmt_x(r['ttft_p50'])} "
                 f"| {passes} | {mr.fmt_x(r['request_throughput'])} | | | | | | |")
    return "\n".join(lines)


def rounds_table(cmp: dict[str, Any]) -> str:
    head = ("| round | prompt tokens | private TTFT mean / p50 (ms) "
            "| shared TTFT mean / p50 (ms) | shared / private (mean, p50) "
            "| private hits device / host / storage | shared hits device / host / storage |")
    lines = [head, "|---:|---:|---:|---:|---:|---:|---:|"]
    private = {p["round"]: p for p in cmp["configs"][PRIVATE]["per_round"]}
    ratios = {p["round"]: p for p in cmp["shared_vs_private"]["per_round"]}
    for s in cmp["configs"][SHARED]["per_round"]:
        p, r = private.get(s["round"]), ratios[s["round"]]
        p_ttft = f"{mr.fmt_ms(p['ttft_mean_s'])} / {mr.fmt_ms(p['ttft_p50_s'])}" if p else "—"
        lines.append(f"| {s['round']} | {s['prompt_tokens_mean']:,.0f} | {p_ttft} "
                     f"| {mr.fmt_ms(s['ttft_mean_s'])} / {mr.fmt_ms(s['ttft_p50_s'])} "
                     f"| {mr.fmt_x(r['ttft_mean'])}, {mr.fmt_x(r['ttft_p50'])} "
                     f"| {_hits(p['hit_rate']) if p else '—'} | {_hits(s['hit_rate'])} |")
    return "\n".join(lines)


def print_report(report: dict[str, Any]) -> None:
    setup = (f"per server {mr.tiers_text(report['sizing'])}, prefetch {POLICY}; "
             f"{report['repeats']} passes per configuration")
    print(mr.intro(report, f"Two servers, {ROUTING}", setup))
    print(config_table(report))
    print("\nPer round:\n")
    print(rounds_table(report))
    print(f"\nSame answers in both configurations: {mr.fmt_pct(report['same_answers'])}")
    print(f"JSON: {report['out']}; per-request log: {report['log']}")


# ---------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    rm.add_workload_args(ap)
    ap.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                    help="passes over both configurations (order swapped every other pass); "
                         "requests are pooled over the passes")
    rm.add_report_args(ap, "shared_l3")
    args = ap.parse_args(argv)
    rm.check_workload_args(ap, args)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def build_report(args: argparse.Namespace, sizing: rm.Sizing,
                 runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return {
        **rm.report_stamp(), "routing": ROUTING, "repeats": args.repeats,
        "workload": rm.workload_of(args),
        "sizing": sizing._asdict() | {"page_size": rm.PAGE_SIZE, "l1_fraction": args.l1_fraction,
                                      "prefetch_policy": POLICY},
        **compare(runs),
        "runs": {k: [{f: v for f, v in r.items() if f != "records"} for r in passes]
                 for k, passes in runs.items()},
        "log": rm._shown(args.log), "out": rm._shown(args.out),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    sizing = rm.size_tiers(args)
    with rm.driver_run(args, "hicache-shared-l3-"):  # SIGTERM unwinds: servers and redis stop
        report = build_report(args, sizing, run_all(args, sizing))
    rm.write_report(report, args.out)
    print_report(report)
    return report


if __name__ == "__main__":
    main()
