"""vLLM alone against vLLM with HiCacheConnector (and, for the restart, vLLM's own reference
connector, ExampleConnector), side by side in one run, every server with the same flags and
KV size (`make bench-vllm-connector`):

    restart     three prompts of --restart-tokens computed, the server stopped and started
                again over its store, the prompts replayed: one token each, its latency
                (and time to first token); replay / vLLM alone (computing them) and replay /
                first pass per connector, cached tokens, tokens; hicache twice: its L3 hits
                loaded within their step (its default) and all asynchronously
                (l3_step_load_mb 0, the connector's first design); --restart-passes
                passes, the connectors' order turned each pass, their prompts pooled
    multi-turn  bench_vs_vllm's chats (--clients x --rounds) against a KV of --kv-tokens,
                several times smaller than the chats' working set, --multiturn-passes
                alternating passes: req/s, TTFT of rounds >= 2, cached share, answers
                against vLLM alone's
    no reuse    the same chats with prompts of the same lengths sharing nothing, each
                server fresh (its own L3), --no-reuse-passes alternating passes: req/s
                with the connector over without (what its saves cost the serving path)

vLLM runs `--enforce-eager` by default (the same kernels for every server, without minutes
of compilation per start) and with the libraries vLLM's CPU guide preloads (tcmalloc,
libiomp5: `bench_vs_vllm.vllm_preload`; the report names those it found). Each goal is
judged on both the median over the median and the median of the pairs' ratios. --probes picks
some of the three (e.g. `--probes restart`). JSON: benchmarks/results/vllm_connector.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lmdb

from benchmarks import bench_vs_vllm as bv
from benchmarks import run_multiturn as rm

OUT = rm.RESULTS / "vllm_connector.json"
MODEL = "smollm2-135m-instruct"
F32_BYTES = 4
HMA_OFF = "Turning off hybrid kv cache manager"  # vLLM's warning, in a server's log
ALONE, HICACHE, EXAMPLE = "vLLM alone", "vLLM + HiCacheConnector", "vLLM + ExampleConnector"
HICACHE_ASYNC = "vLLM + HiCacheConnector, L3 loads async"
PROBES = ("restart", "multiturn", "no-reuse")
WARMUP_TOKENS = 64
WRITE_TIMEOUT_S = 120.0
WRITES_SETTLED_S = 3.0  # L3's page count unchanged this long: the first pass's writes are in
GOAL_RESTART = 0.15
GOAL_NO_REUSE = 0.97
GOAL_MULTITURN = 1.5


def connector(name: str, module: str, extra: dict[str, Any]) -> str:
    return json.dumps({"kv_connector": name, "kv_connector_module_path": module,
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": extra})


def flags(args: argparse.Namespace, kv_transfer: str | None) -> list[str]:
    out = ["--model", str(args.model_path), "--served-model-name", bv.MODEL_NAME,
           "--dtype", "float32", "--block-size", str(args.block_size),
           "--kv-cache-memory-bytes", str((args.kv_tokens + args.block_size)
                                          * kv_bytes_per_token(args.model_path)),
           "--max-model-len", str(args.kv_tokens), "--enable-prefix-caching",
           "--enable-prompt-tokens-details", "--seed", "0",
           "--uvicorn-log-level", "warning", *shlex.split(args.vllm_args)]
    return out + (["--kv-transfer-config", kv_transfer] if kv_transfer else [])


def kv_bytes_per_token(folder: Path) -> int:
    """One token's K and V over every layer in float32, from the model folder's config (as
    if every layer kept every token: vLLM's hybrid manager fits more tokens of a model
    with sliding windows in the same bytes). SmolLM2-135M: 46,080."""
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return (config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim
            * F32_BYTES)


def start(args: argparse.Namespace, label: str, kv_transfer: str | None) -> bv.VllmServer:
    print(f"{label}: starting", file=sys.stderr, flush=True)
    return bv.VllmServer(label, args.vllm_python, flags(args, kv_transfer), args.log_dir,
                         bv.VLLM_STARTUP_TIMEOUT_S)


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 20000) for _ in range(length)] for _ in range(n)]


def one_by_one(base_url: str, batch: list[list[int]]) -> list[dict[str, Any]]:
    """Each prompt alone, one token asked: latency, cached tokens, the token."""
    bv.concurrent(base_url, prompts(99, 1, WARMUP_TOKENS), 1)  # first-request costs
    out = []
    for p in batch:
        rec = bv.concurrent(base_url, [p], 1)[0]
        out.append({"latency_s": rec.latency, "ttft_s": rec.ttft,
                    "cached": rec.cached.get("device", 0), "token": rec.output_ids,
                    "error": rec.error})
    return out


def lmdb_pages(path: Path) -> int:
    """Pages in the LMDB store at `path`, read beside the server that writes it (0 while
    it grows the map: the callers poll)."""
    if not (path / "data.mdb").exists():
        return 0
    try:
        with lmdb.open(str(path), max_dbs=2, readonly=True) as env:
            db = env.open_db(b"pages", create=False)  # its own transaction: may see it too
            with env.begin(db=db) as txn:
                return txn.stat(db)["entries"]
    except lmdb.MapResizedError:  # the writer grew the map since this opened: ask again
        return 0


def restart(args: argparse.Namespace, label: str, kv_transfer: str,
            stored: Callable[[], int] | None) -> dict[str, Any]:
    """First pass, stop, start again over the same store, replay."""
    batch = prompts(1, 3, args.restart_tokens)
    with start(args, label, kv_transfer) as s:
        first = one_by_one(s.base_url, batch)
        # hicache stores a value per KV cache group of each page, a window group's only near
        # each prompt's end (L3 by kind): its writes are done when the count stops growing
        count = None if stored is None else settled(stored)
    with start(args, f"{label} (restarted)", kv_transfer) as s:
        replay = one_by_one(s.base_url, batch)
        log = s.log_path.read_text(errors="replace")
    # vLLM turns its hybrid KV cache manager off for a connector that lacks SupportsHMA
    return {"first": first, "replay": replay, "hybrid_manager_off": [HMA_OFF in log],
            "l3_values": [] if count is None else [count]}  # hicache's, after the first pass


def settled(stored: Callable[[], int]) -> int:
    """L3's value count once it stops growing (hicache writes L3 beside serving)."""
    deadline = time.monotonic() + WRITE_TIMEOUT_S
    count, still_since = stored(), time.monotonic()
    while time.monotonic() - still_since < WRITES_SETTLED_S and time.monotonic() < deadline:
        time.sleep(0.2)
        if (now := stored()) != count:
            count, still_since = now, time.monotonic()
    return count


def multiturn(args: argparse.Namespace, label: str, kv_transfer: str | None,
              no_reuse: bool = False) -> dict[str, Any]:
    """The multi-turn chats (`no_reuse`: sharing nothing) on a server of their own."""
    with start(args, label, kv_transfer) as s:
        return bv.multiturn(s.base_url, args, label, no_reuse)


def hicache(path: Path, host_gb: float, **extra: Any) -> str:
    """HiCacheConnector over the LMDB store at `path`."""
    return connector("HiCacheConnector", "hicache.integrations.vllm",
                     {"host_size_gb": host_gb, "storage_backend": "lmdb",
                      "lmdb": {"path": str(path)}, **extra})


def restarts(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The restart probe, --restart-passes times: vLLM alone, then each connector over a
    store of its own, in an order that turns each pass (a machine that drifts is shared);
    every pass's prompts pooled."""
    def connectors(n: int) -> list[tuple[str, str, Any]]:
        example = tmp / f"example-{n}"
        example.mkdir()
        hi, hi_async = tmp / f"hicache-l3-{n}", tmp / f"hicache-l3-async-{n}"
        return [(HICACHE, hicache(hi, args.host_gb), lambda: lmdb_pages(hi)),
                (HICACHE_ASYNC, hicache(hi_async, args.host_gb, l3_step_load_mb=0),
                 lambda: lmdb_pages(hi_async)),
                (EXAMPLE, connector(
                    "ExampleConnector",
                    "vllm.distributed.kv_transfer.kv_connector.v1.example_connector",
                    {"shared_storage_path": str(example)}), None)]  # writes in its step

    out: dict[str, Any] = {ALONE: []}
    for n in range(args.restart_passes):
        with start(args, ALONE, None) as s:
            out[ALONE] += one_by_one(s.base_url, prompts(1, 3, args.restart_tokens))
        each = connectors(n)
        for name, kv, stored in each[n % len(each):] + each[:n % len(each)]:
            run = restart(args, name, kv, stored)
            row = out.setdefault(name, {"first": [], "replay": [], "hybrid_manager_off": [],
                                        "l3_values": []})
            for key in row:
                row[key] += run[key]
    return out


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if "restart" in args.probes:
        result["restart"] = restarts(args, tmp)

    # pairs of passes in ABBA order (alone first, then the connector first, ...): a machine
    # that drifts over the run is shared by both sides, not charged to whichever runs second
    def pairs(passes: int, what: str, no_reuse: bool) -> dict[str, list[dict[str, Any]]]:
        runs: dict[str, list[dict[str, Any]]] = {ALONE: [], HICACHE: []}
        for n in range(passes):
            for name in ((ALONE, HICACHE) if n % 2 == 0 else (HICACHE, ALONE)):
                kv = None if name == ALONE else hicache(tmp / f"hicache-l3-{what}{n}",
                                                        args.host_gb)
                runs[name].append(multiturn(args, name, kv, no_reuse=no_reuse))
        return runs

    if "multiturn" in args.probes:
        mt = pairs(args.multiturn_passes, "mt", False)
        result["serving"] = {name: {"multiturn": runs[0]} for name, runs in mt.items()}
        result["multiturn_more"] = {name: runs[1:] for name, runs in mt.items()}
    if "no-reuse" in args.probes:
        result["no_reuse"] = pairs(args.no_reuse_passes, "nr", True)
    return result


def median(values: list[float]) -> float:
    return statistics.median(values)


def _median_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return median(known) if known else None


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The probes `result` holds, summarized."""
    out: dict[str, Any] = {}
    if "restart" in result:
        out.update(summarize_restart(result["restart"]))
    if "serving" in result:
        out.update(summarize_multiturn(result))
    if "no_reuse" in result:
        out.update(summarize_no_reuse(result["no_reuse"]))
    return out


def summarize_restart(r: dict[str, Any]) -> dict[str, Any]:
    alone = median([x["latency_s"] for x in r[ALONE]])
    tokens = [x["token"] for x in r[ALONE]]
    rows = {}
    for name in (n for n in r if n != ALONE):
        first = median([x["latency_s"] for x in r[name]["first"]])
        replay = median([x["latency_s"] for x in r[name]["replay"]])
        rows[name] = {"first_s": first, "replay_s": replay, "replay_over_alone": replay / alone,
                      "replay_over_first": replay / first,
                      "cached": [x["cached"] for x in r[name]["replay"]],
                      "same_tokens": [x["token"] for x in r[name]["replay"]] == tokens,
                      "hybrid_manager_off": any(r[name].get("hybrid_manager_off", [])),
                      "l3_values": r[name].get("l3_values", [])}
    return {"alone_restart_s": alone, "restart": rows}


def summarize_multiturn(result: dict[str, Any]) -> dict[str, Any]:
    s = result["serving"]
    more = result.get("multiturn_more", {})  # passes after the first (older JSON: none)
    runs = {name: [s[name]["multiturn"], *more.get(name, [])] for name in s}
    # every connector pass's answers against vLLM alone's first pass
    compared = [bv.same_tokens({"multiturn": run}, s[ALONE]) for run in runs[HICACHE]]
    same, total = sum(c[0] for c in compared), sum(c[1] for c in compared)
    mt = {name: {"req_s": median([r["request_throughput"] for r in rs]),
                 "req_s_each": [r["request_throughput"] for r in rs],
                 "ttft_after_first_s": _median_or_none([r["ttft_after_first_s"] for r in rs]),
                 "hit_rate": s[name]["multiturn"]["hit_rate"]["all"],
                 "errors": sum(r["errors"] for r in rs)} for name, rs in runs.items()}
    return {"multiturn": mt, "multiturn_ratio": mt[HICACHE]["req_s"] / mt[ALONE]["req_s"],
            "multiturn_pair_ratios": [c / a for c, a in zip(mt[HICACHE]["req_s_each"],
                                                            mt[ALONE]["req_s_each"])],
            "same_multiturn_tokens": [same, total]}


def summarize_no_reuse(no_reuse: dict[str, Any]) -> dict[str, Any]:
    nr = {name: {"req_s": [p["request_throughput"] for p in passes],
                 "errors": sum(p["errors"] for p in passes)}
          for name, passes in no_reuse.items()}
    return {"no_reuse": nr,
            "no_reuse_ratio": median(nr[HICACHE]["req_s"]) / median(nr[ALONE]["req_s"]),
            "no_reuse_pair_ratios": [c / a for c, a in zip(nr[HICACHE]["req_s"],
                                                           nr[ALONE]["req_s"])]}


def report(summary: dict[str, Any], args: argparse.Namespace, preload: list[str]) -> str:
    lines = [f"vLLM preloads {', '.join(preload) or 'nothing'}"]
    if "restart" in summary:
        lines += report_restart(summary, args)
    if "multiturn" in summary:
        lines += report_multiturn(summary, args)
    if "no_reuse" in summary:
        lines += report_no_reuse(summary, args)
    return "\n".join(lines)


def report_restart(summary: dict[str, Any], args: argparse.Namespace) -> list[str]:
    lines = ["", (f"restart: three {args.restart_tokens}-token prompts, one token each; vLLM "
             f"alone computes them in {summary['alone_restart_s'] * 1000:.0f} ms (median)"), "",
             ("| connector | first pass | replay after restart | replay / first pass | "
              "replay / vLLM alone | goal | cached tokens | same tokens |"),
             "|---|---:|---:|---:|---:|---|---|---|"]
    for name, row in summary["restart"].items():
        goal = (f"<= {GOAL_RESTART} {'met' if row['replay_over_alone'] <= GOAL_RESTART else 'not met'}"
                if name == HICACHE else "-")
        over_first = row.get("replay_over_first", row["replay_s"] / row["first_s"])
        off = " (vLLM's hybrid KV cache manager off)" if row.get("hybrid_manager_off") else ""
        lines.append(f"| {name}{off} | {row['first_s'] * 1000:.0f} ms | {row['replay_s'] * 1000:.0f} ms"
                     f" | {over_first:.3f} | {row['replay_over_alone']:.3f} | {goal} | "
                     f"{row['cached']} | {'yes' if row['same_tokens'] else 'NO'} |")
    return lines


def report_multiturn(summary: dict[str, Any], args: argparse.Namespace) -> list[str]:
    lines = ["", (f"multi-turn: {args.clients} chats x {args.rounds} rounds, KV "
             f"{args.kv_tokens} tokens"), "",
             "| server | req/s | TTFT rounds >= 2 | cached share | errors |",
             "|---|---:|---:|---:|---:|"]
    for name, m in summary["multiturn"].items():
        ttft = m["ttft_after_first_s"]
        lines.append(f"| {name} | {m['req_s']:.3f} | "
                     f"{'-' if ttft is None else f'{ttft * 1000:.0f} ms'} | "
                     f"{(m['hit_rate'] or 0) * 100:.1f}% | {m['errors']} |")
    same, compared = summary["same_multiturn_tokens"]
    ratio, mt_pairs = summary["multiturn_ratio"], summary["multiturn_pair_ratios"]
    mt_met = min(ratio, median(mt_pairs)) >= GOAL_MULTITURN
    return lines + ["", (
        f"multi-turn req/s with the connector / alone ({len(mt_pairs)} pairs of passes in "
        f"ABBA order, the table's req/s their median): {ratio:.2f}x, median over median; pair "
        f"by pair " + ", ".join(f"{x:.2f}x" for x in mt_pairs) + f", median "
        f"{median(mt_pairs):.2f}x (goal >= {GOAL_MULTITURN}, both: "
        f"{'met' if mt_met else 'not met'}); {same} of {compared} answers the same as "
        "vLLM alone's")]


def report_no_reuse(summary: dict[str, Any], args: argparse.Namespace) -> list[str]:
    nr, pairs = summary["no_reuse_ratio"], summary["no_reuse_pair_ratios"]
    nr_met = min(nr, median(pairs)) >= GOAL_NO_REUSE
    return [(f"no reuse (the chats sharing nothing, {args.no_reuse_passes} pairs of passes in "
             f"ABBA order, fresh servers): {nr:.2f}x vLLM alone's req/s, median over median; "
             f"pair by pair " + ", ".join(f"{x:.2f}x" for x in pairs) + f", median "
             f"{median(pairs):.2f}x (goal >= {GOAL_NO_REUSE}, both: "
             f"{'met' if nr_met else 'not met'}); req/s of each pass: " + "; ".join(
                 f"{name} " + ", ".join(f"{x:.3f}" for x in row["req_s"])
                 for name, row in summary["no_reuse"].items()))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", type=Path, default=bv.DEFAULT_VLLM_PYTHON)
    ap.add_argument("--kv-tokens", type=int, default=3008)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--host-gb", type=float, default=2.0)
    ap.add_argument("--restart-tokens", type=int, default=1500)
    ap.add_argument("--restart-passes", type=int, default=1)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--system-prompt-length", type=int, default=512)
    ap.add_argument("--request-length", type=int, default=256)
    ap.add_argument("--output-length", type=int, default=32)
    ap.add_argument("--multiturn-passes", type=int, default=2)
    ap.add_argument("--no-reuse-passes", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-args", default="--enforce-eager")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--model", default=MODEL,
                    help=f"a registry model name or a folder (default {MODEL})")
    ap.add_argument("--probes", nargs="+", choices=PROBES, default=list(PROBES),
                    help="which probes to run (default: all)")
    args = ap.parse_args()
    args.model_path = bv.model_folder(args.model).resolve()
    args.log_dir = rm.REPO / ".benchtmp" / "vllm_connector"
    args.log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-vllm-connector-") as tmp:
        result = run(args, Path(tmp))
    summary = summarize(result)
    preload = bv.preload_names(args.vllm_python)
    print(report(summary, args, preload))
    args.out.write_text(json.dumps({
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {platform.processor() or platform.system()}",
        "model": args.model, "vllm_preload": preload,
        "args": {k: str(v) for k, v in vars(args).items()},
        "summary": summary, "runs": result}, indent=1, default=str))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
