"""The multi-turn benchmark's report: ratios against "L1 only", the goals, the cost of a
cache that thrashes, and the markdown tables `run_multiturn.py` prints (pure functions of
the runs' results, no servers).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from benchmarks.bench_multiturn import TIERS, fmt_ms, fmt_pct

# The configurations' labels: the keys of the driver's runs and the rows of the tables.
BASELINE = "L1 only"
NO_CACHE = "no cache"
HIER = "L1+L2"
STORE = "L1+L2+L3"


# ------------------------------------------------------------------------------ analysis


def ttft_after_first(run: dict[str, Any]) -> float | None:
    """Mean TTFT over the requests of rounds >= 2 (every chat has a history to reuse)."""
    vals = [r["ttft_s"] for r in run["records"] if r["round"] >= 2 and r["ttft_s"] is not None]
    return sum(vals) / len(vals) if vals else None


def round_ttft(run: dict[str, Any], rnd: int) -> float | None:
    rows = [p for p in run["per_round"] if p["round"] == rnd]
    return rows[0]["ttft_s"]["mean"] if rows else None


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def same_answers(run: dict[str, Any], ref: dict[str, Any]) -> float | None:
    """Share of requests whose greedy answer equals the no-cache run's (same chat, round)."""
    ref_ids = {(r["client"], r["round"]): r["output_ids"] for r in ref["records"]}
    pairs = [(r["output_ids"], ref_ids.get((r["client"], r["round"])))
             for r in run["records"] if not r["error"]]
    pairs = [(a, b) for a, b in pairs if b is not None]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def compare(runs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per configuration: TTFT (rounds >= 2), throughput, hit rates, and ratios vs L1 only."""
    base = runs[BASELINE]
    out = {}
    for label, run in runs.items():
        if run["replay_round"] is not None:
            continue
        t = ttft_after_first(run)
        out[label] = {"ttft_after_first_s": t, "request_throughput": run["request_throughput"],
                      "hit_rate": run["hit_rate"], "errors": run["errors"],
                      "server_died": run["server"]["fatal"],
                      "ttft_ratio": ratio(t, ttft_after_first(base)),
                      "throughput_ratio": ratio(run["request_throughput"],
                                                base["request_throughput"]),
                      "same_answers_as_no_cache": same_answers(run, runs[NO_CACHE])}
    return out


def restarts(runs: dict[str, Any], last: int) -> dict[str, dict[str, Any]]:
    """Each replay of the last round after a restart against the same round uncached."""
    in_run = round_ttft(runs[NO_CACHE], last)
    replay = runs[f"{NO_CACHE} replay"]["ttft_s"]["mean"]
    out = {}
    for label, run in runs.items():
        if run["replay_round"] is None or label.startswith(NO_CACHE):
            continue
        t = run["ttft_s"]["mean"]
        out[label] = {"ttft_s": t, "no_cache_same_round_s": in_run,
                      "no_cache_replay_s": replay, "ratio_vs_no_cache_round": ratio(t, in_run),
                      "ratio_vs_no_cache_replay": ratio(t, replay),
                      "hit_rate": run["hit_rate"], "errors": run["errors"],
                      "server_died": run["server"]["fatal"]}
    return out


def no_reuse_cost(runs: dict[str, Any]) -> dict[str, Any]:
    base = runs[BASELINE]
    return {label: {"request_throughput": r["request_throughput"],
                    "input_throughput": r["input_throughput"],
                    "ttft_mean_s": r["ttft_s"]["mean"], "hit_rate": r["hit_rate"]["all"],
                    "repeat_throughputs": r["repeat_throughputs"],
                    "errors": r["errors"], "server_died": r["server"]["fatal"],
                    "throughput_ratio": ratio(r["request_throughput"],
                                              base["request_throughput"])}
            for label, r in runs.items()}


GOAL_TTFT = 0.35        # L1+L2 TTFT (rounds >= 2) at most this times L1 only
GOAL_THROUGHPUT = 2.0   # L1+L2 request throughput at least this times L1 only
GOAL_RESTART = 0.35     # replayed round after a restart at most this times uncached
GOAL_NO_REUSE = 0.95    # no reuse: hierarchy keeps at least this share of the throughput


def goals(cmp: dict[str, Any], rst: dict[str, Any], nor: dict[str, Any]) -> list[dict]:
    """Each goal with its measured value; `met` is None when it could not be measured."""
    def goal(name: str, value: float | None, ok: bool, ok_if: str, broken: bool) -> dict:
        measurable = value is not None and not broken
        return {"goal": name, "value": value, "target": ok_if, "met": ok if measurable else None}
    hier = cmp[HIER]
    rows = [goal("L1+L2 mean TTFT (rounds >= 2) / L1 only", hier["ttft_ratio"],
                 (hier["ttft_ratio"] or math.inf) <= GOAL_TTFT, f"<= {GOAL_TTFT}",
                 _broken(hier)),
            goal("L1+L2 request throughput / L1 only", hier["throughput_ratio"],
                 (hier["throughput_ratio"] or 0) >= GOAL_THROUGHPUT, f">= {GOAL_THROUGHPUT}",
                 _broken(hier))]
    for label, r in rst.items():
        rows.append(goal(f"{label}: last-round TTFT / no cache (same round)",
                         r["ratio_vs_no_cache_round"],
                         (r["ratio_vs_no_cache_round"] or math.inf) <= GOAL_RESTART,
                         f"<= {GOAL_RESTART}", _broken(r)))
    for label, r in nor.items():
        if label != BASELINE:
            rows.append(goal(f"no reuse: {label} request throughput / L1 only",
                             r["throughput_ratio"], (r["throughput_ratio"] or 0) >= GOAL_NO_REUSE,
                             f">= {GOAL_NO_REUSE}", _broken(r) or _broken(nor[BASELINE])))
    return rows


def _broken(r: dict[str, Any]) -> bool:
    return bool(r["errors"] or r["server_died"])


GOAL_THRASH = 1.05  # thrashing L1 only: median TTFT at most this times no cache's
INTERVAL = 0.95     # the bootstrap interval of the median ratio over passes
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
MIN_BOOTSTRAP = 3   # resampling fewer values gives only their min and max: no interval


def thrash_cost(passes: list[dict[str, Any]], servers: dict[str, Any]) -> dict[str, Any]:
    """Per pass, the median over its turns of L1 only's TTFT over no cache's for the same
    turn (the same prompt, sent to one right after the other: a burst of load on the machine
    hits both); over the passes: the median of those, its min and max, and an interval of
    the median (bootstrap over passes): a cost when it lies above 1. `hit_rate` is L1 only's
    mean over the passes (near 0 when it thrashes); `broken`, an error or a dead server."""
    sides = [p["sides"] for p in passes]
    ratios = [_median(turn_ratios(s[BASELINE]["ttft_s"], s[NO_CACHE]["ttft_s"]))
              for s in sides]
    valid = [x for x in ratios if x is not None]
    hits = [s[BASELINE]["hit_rate"] for s in sides if s[BASELINE]["hit_rate"] is not None]
    broken = (any(side["errors"] for s in sides for side in s.values())
              or any(srv["fatal"] for srv in servers.values()))
    return {"passes": len(passes), "ratios": ratios,
            "median_ratio": _median(valid), "min_ratio": min(valid, default=None),
            "max_ratio": max(valid, default=None), "interval": median_interval(valid),
            "interval_level": INTERVAL, "hit_rate": float(np.mean(hits)) if hits else None,
            "max_hit_rate": max(hits, default=None),
            "same_answers": min((p["same_answers"] for p in passes), default=None),
            "broken": broken}


def turn_ratios(on: list[float | None], off: list[float | None]) -> list[float]:
    """Turn by turn, `on`'s TTFT over `off`'s (None: the request failed; the turn is left
    out)."""
    return [a / b for a, b in zip(on, off, strict=True) if a is not None and b]


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def _ok_median(values: list[float | None]) -> float | None:
    return _median([v for v in values if v is not None])


def median_interval(values: list[float]) -> list[float] | None:
    """The central `INTERVAL` of the medians of `values` resampled with replacement (None
    for fewer than MIN_BOOTSTRAP values)."""
    if len(values) < MIN_BOOTSTRAP:
        return None
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    medians = np.median(rng.choice(values, (BOOTSTRAP_RESAMPLES, len(values))), axis=1)
    tail = (1 - INTERVAL) / 2 * 100
    return [float(np.percentile(medians, tail)), float(np.percentile(medians, 100 - tail))]


def thrash_goal(t: dict[str, Any]) -> dict[str, Any]:
    """The goal row of the thrash summary `t` (`thrash_cost`)."""
    value = None if t["broken"] else t["median_ratio"]
    return {"goal": f"thrash: L1 only TTFT / no cache, turn by turn (median of "
                    f"{_passes(t['passes'])})",
            "value": value, "target": f"<= {GOAL_THRASH}",
            "met": None if value is None else value <= GOAL_THRASH}


# -------------------------------------------------------------------------------- tables


def fmt_x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}x"


def run_status(r: dict[str, Any]) -> str:
    if r["server_died"]:
        return f"server died: {r['server_died']}"
    return f"{r['errors']} errors" if r["errors"] else "ok"


def hit_cells(h: dict[str, float | None]) -> str:
    """The cells `| hit rate | device | host | storage |` of the tables (without the outer
    bars): the hit rate over all tiers, then each tier's."""
    return " | ".join(fmt_pct(h[t]) for t in ("all", *TIERS))


def tiers_text(s: dict[str, Any]) -> str:
    """A report's `sizing` of L1 and L2 in words."""
    return f"L1 {s['l1_tokens']:,} tokens, L2 {s['host_ratio']:g}x L1"


def intro(report: dict[str, Any], title: str, setup: str, cores_note: str = "") -> str:
    """A report's first paragraph: `title`, the date and the workload, `setup` (sizing and
    what else the driver varies), the machine (`cores_note` after the core count)."""
    w, m = report["workload"], report["machine"]
    return (f"\n{title}, {report['date']}: {w['num_clients']} chats x {w['num_rounds']} rounds, "
            f"{w['request_length']}-token questions, {w['output_length']}-token answers, "
            f"{w['system_prompt_length']}-token shared system prompt; {setup}; {m['cpu']}, "
            f"{m['cores']} cores{cores_note}, GPU: {m['gpu'] or 'none'}.\n")


def config_table(cmp: dict[str, Any]) -> str:
    head = ("| configuration | TTFT r>=2 (ms) | vs L1 only | req/s | vs L1 only | hit rate "
            "| device | host | storage | same answers as no cache | status |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for label, r in cmp.items():
        lines.append(f"| {label} | {fmt_ms(r['ttft_after_first_s'])} | {fmt_x(r['ttft_ratio'])} "
                     f"| {r['request_throughput']:.3f} | {fmt_x(r['throughput_ratio'])} "
                     f"| {hit_cells(r['hit_rate'])} | {fmt_pct(r['same_answers_as_no_cache'])} "
                     f"| {run_status(r)} |")
    return "\n".join(lines)


def rounds_table(runs: dict[str, Any]) -> str:
    labels = [k for k, r in runs.items() if r["replay_round"] is None]
    lines = ["| round | " + " | ".join(f"{k} TTFT (ms)" for k in labels) + " |",
             "|---:|" + "---:|" * len(labels)]
    rounds = sorted({p["round"] for r in runs.values() for p in r["per_round"]})
    for rnd in rounds:
        cells = [fmt_ms(round_ttft(runs[k], rnd)) for k in labels]
        lines.append(f"| {rnd} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def restart_table(rst: dict[str, Any], last: int) -> str:
    head = (f"| replay of round {last} | TTFT (ms) | no cache, round {last} in the run (ms) "
            "| ratio | no cache, same replay (ms) | ratio | hit rate | storage hits | status |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for label, r in rst.items():
        lines.append(f"| {label} | {fmt_ms(r['ttft_s'])} | {fmt_ms(r['no_cache_same_round_s'])} "
                     f"| {fmt_x(r['ratio_vs_no_cache_round'])} | {fmt_ms(r['no_cache_replay_s'])} "
                     f"| {fmt_x(r['ratio_vs_no_cache_replay'])} | {fmt_pct(r['hit_rate']['all'])} "
                     f"| {fmt_pct(r['hit_rate']['storage'])} | {run_status(r)} |")
    return "\n".join(lines)


def no_reuse_table(nor: dict[str, Any]) -> str:
    head = ("| no reuse | req/s (best) | each pass | input tok/s | vs L1 only | TTFT mean (ms) "
            "| hit rate | status |")
    lines = [head, "|---|---:|---|---:|---:|---:|---:|---|"]
    for label, r in nor.items():
        passes = ", ".join(f"{t:.3f}" for t in r["repeat_throughputs"])
        lines.append(f"| {label} | {r['request_throughput']:.3f} | {passes} "
                     f"| {r['input_throughput']:,.0f} | {fmt_x(r['throughput_ratio'])} "
                     f"| {fmt_ms(r['ttft_mean_s'])} | {fmt_pct(r['hit_rate'])} | {run_status(r)} |")
    return "\n".join(lines)


def goals_table(rows: list[dict]) -> str:
    lines = ["| goal | measured | target | met |", "|---|---:|---|---|"]
    for g in rows:
        met = "not measured" if g["met"] is None else ("yes" if g["met"] else "no")
        lines.append(f"| {g['goal']} | {fmt_x(g['value'])} | {g['target']} | {met} |")
    return "\n".join(lines)


def thrash_table(report: dict[str, Any]) -> str:
    """One row per pass of the thrash report, in the order they ran."""
    head = ("| pass | L1 only median TTFT (ms) | no cache median TTFT (ms) "
            "| L1 only / no cache (median over turns) | L1 only hit rate | same answers "
            "| errors |")
    lines = [head, "|---:|---:|---:|---:|---:|---:|---|"]
    for i, (p, x) in enumerate(zip(report["passes"], report["summary"]["ratios"]), 1):
        on, off = p["sides"][BASELINE], p["sides"][NO_CACHE]
        errors = ", ".join(f"{label}: {s['errors']}" for label, s in p["sides"].items()
                           if s["errors"]) or "0"
        lines.append(f"| {i} | {fmt_ms(_ok_median(on['ttft_s']))} "
                     f"| {fmt_ms(_ok_median(off['ttft_s']))} "
                     f"| {fmt_x(x)} | {fmt_pct(on['hit_rate'])} | {fmt_pct(p['same_answers'])} "
                     f"| {errors} |")
    return "\n".join(lines)


def thrash_line(t: dict[str, Any]) -> str:
    """The thrash summary `t` in one sentence."""
    lo, hi = t["interval"] or (None, None)
    goal = thrash_goal(t)
    met = "not measured" if goal["met"] is None else ("met" if goal["met"] else "not met")
    if lo is None:
        interval = f"too few passes for an interval (at least {MIN_BOOTSTRAP})"
    else:
        verdict = (f"above 1: a cost of {lo - 1:.1%} to {hi - 1:.1%}" if lo > 1
                   else "it holds 1: no cost told from noise")
        interval = (f"{t['interval_level']:.0%} bootstrap interval of the median {_x3(lo)} "
                    f"to {_x3(hi)}; {verdict}")
    return (f"L1 only / no cache over {_passes(t['passes'])}: median "
            f"{_x3(t['median_ratio'])} (passes {_x3(t['min_ratio'])} to {_x3(t['max_ratio'])}; "
            f"{interval}); L1 only hit rate {fmt_pct(t['hit_rate'])} (at most "
            f"{fmt_pct(t['max_hit_rate'])} in a pass); goal {goal['target']}: {met}")


def _passes(n: int) -> str:
    return f"{n} pass" if n == 1 else f"{n} passes"


def _x3(v: float | None) -> str:
    return "—" if v is None else f"{v:.3f}x"


def print_thrash(report: dict[str, Any]) -> None:
    w, s, m = report["workload"], report["sizing"], report["machine"]
    print(f"\nThrashing L1, {report['date']}: {w['num_clients']} chats x {w['num_rounds']} "
          f"rounds round-robin, each turn sent to both servers back to back, one request at "
          f"a time, {w['request_length']}-token questions, "
          f"{w['output_length']}-token answers; working set {s['working_set']:,} tokens, "
          f"{s['working_set'] / s['l1_tokens']:.1f}x L1 ({s['l1_tokens']:,} tokens); model "
          f"{report['model']}; {m['cpu']}, {m['cores']} cores, GPU: {m['gpu'] or 'none'}.\n")
    print(thrash_table(report))
    dead = [f"{label}: {srv['fatal']}" for label, srv in report["servers"].items() if srv["fatal"]]
    print(f"\n{thrash_line(report['summary'])}" + (f"; server died: {dead}" if dead else ""))
    print(f"\nJSON: {report['out']}")


def print_report(report: dict[str, Any]) -> None:
    s, last = report["sizing"], report["workload"]["num_rounds"]
    print(intro(report, "Multi-turn benchmark",
                f"model {report.get('model', 'embedded:tiny-llama')}, working set "
                f"{s['working_set']:,} tokens, {tiers_text(s)}"))
    print(config_table(report["configs"]))
    print("\nMean TTFT per round:\n")
    print(rounds_table(report["runs"]))
    print(f"\nRestart on the same LMDB (cold L1 and L2), round {last} replayed:\n")
    print(restart_table(report["restart"], last))
    print(f"\nNo reuse (every prompt distinct, {report['no_reuse_workload']['num_rounds']} "
          f"rounds, best of {report['no_reuse_workload']['repeats']} alternating passes):\n")
    print(no_reuse_table(report["no_reuse"]))
    print("\nGoals:\n")
    print(goals_table(report["goals"]))
    print(f"\nJSON: {report['out']}; plots: {', '.join(report['plots'])}")
