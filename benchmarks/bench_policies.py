"""Cache policies side by side on a workload where they should matter: many multi-turn
sessions sharing a long system prompt, beside one-off requests that flood L1.

    sessions    `--sessions` chats, `--turns` rounds each, all starting with one
                `--system-tokens` system prompt; each round's prompt is the last one plus
                its answer and a new question, so a chat's history is its next prefix
    one-offs    after every round of every chat, `--one-offs` requests with unique prompts
                and no session: the pressure that evicts what nobody owns
    clients     `--clients` threads, each running its share of the chats one round at a
                time, so several requests wait at once (what the scheduling policy orders)

Each configuration runs the same requests in its own engine (L1 only, `--l1-tokens` tokens,
so the eviction and retention policies decide what survives):

    lpm                 the default: longest cached prefix first, no session retention
    lpm+sessions        cache.session_retention: a live chat's pages are evicted after
                        unowned ones; each chat is closed after its last round
    dfs-weight+sessions the tree-weighted depth-first order, with retention
    fcfs                arrival order, no retention

Reported per configuration: the share of session prompt tokens served from the cache, the
mean TTFT of session rounds >= 2, and the wall time of the whole run. The requests are the
same (seeded), and every configuration's greedy answers are checked against the first's.

    python -m benchmarks.bench_policies            # ~4 min on 2 CPU cores (make bench-policies)
    python -m benchmarks.bench_policies --quick
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hicache_server.config import load_config
from hicache_server.engine import Engine

REPO = Path(__file__).resolve().parent.parent

RESULTS = REPO / "benchmarks" / "results" / "policies.json"
ANSWER = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
ONE_OFF = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
CONFIGS: dict[str, dict[str, Any]] = {
    "lpm": {"server.schedule_policy": "lpm"},
    "lpm+sessions": {"server.schedule_policy": "lpm", "cache.session_retention": True},
    "dfs-weight+sessions": {"server.schedule_policy": "dfs-weight",
                            "cache.session_retention": True},
    "fcfs": {"server.schedule_policy": "fcfs"},
}
QUESTION_TOKENS = 48
ONE_OFF_TOKENS = 384


class Workload:
    """The seeded requests: each chat's questions, and the one-off prompts per round."""

    def __init__(self, args: argparse.Namespace) -> None:
        rng = random.Random(args.seed)
        self.system = [rng.randrange(3, 256) for _ in range(args.system_tokens)]
        self.questions = [[[rng.randrange(3, 256) for _ in range(QUESTION_TOKENS)]
                           for _ in range(args.turns)] for _ in range(args.sessions)]
        self.one_offs = [[[rng.randrange(3, 256) for _ in range(ONE_OFF_TOKENS)]
                          for _ in range(args.one_offs)]
                         for _ in range(args.sessions * args.turns)]


def run_config(name: str, overrides: dict[str, Any], work: Workload,
               args: argparse.Namespace) -> dict[str, Any]:
    config = {"model.device": "cpu", "cache.page_size": 16,
              "cache.max_total_tokens": args.l1_tokens, **overrides}
    answers: dict[tuple[int, int], list[int]] = {}
    rounds: list[dict[str, Any]] = []
    lock = threading.Lock()
    one_off_next = iter(range(len(work.one_offs)))
    sessions = CONFIGS[name].get("cache.session_retention", False)

    def chat(e: Engine, s: int) -> None:
        history = list(work.system)
        for turn, question in enumerate(work.questions[s]):
            prompt = history + question
            start = time.perf_counter()
            out = e.generate(input_ids=prompt, sampling_params=ANSWER,
                             session_id=f"chat-{s}" if sessions else None)
            seconds = time.perf_counter() - start
            with lock:
                answers[(s, turn)] = out["output_ids"]
                rounds.append({"turn": turn, "seconds": seconds,
                               "prompt_tokens": len(prompt),
                               "cached": out["meta_info"]["cached_tokens"]})
                batch = work.one_offs[next(one_off_next)]
            for p in batch:
                e.generate(input_ids=p, sampling_params=ONE_OFF)
            history = prompt + out["output_ids"]
        if sessions:
            e.close_session(f"chat-{s}")

    with Engine(load_config(None, config)) as e:
        start = time.perf_counter()
        threads = [threading.Thread(target=lambda c=c: [chat(e, s) for s in
                                                        range(c, args.sessions, args.clients)])
                   for c in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
    later = [r for r in rounds if r["turn"] >= 1]
    return {"wall_s": wall,
            "hit_rate": sum(r["cached"] for r in rounds) / sum(r["prompt_tokens"] for r in rounds),
            "ttft_later_rounds_s": statistics.mean(r["seconds"] for r in later),
            "answers": {f"{s}:{t}": ids for (s, t), ids in sorted(answers.items())}}


def report(result: dict[str, Any]) -> str:
    base = result["configs"]["lpm"]
    lines = [("| configuration | session prompt tokens from cache | mean latency of rounds >= 2 | "
             "wall | wall vs lpm | same answers |"), "|---|---:|---:|---:|---:|---|"]
    for name, r in result["configs"].items():
        lines.append(f"| {name} | {r['hit_rate']:.1%} | {r['ttft_later_rounds_s'] * 1000:.0f} ms "
                     f"| {r['wall_s']:.1f} s | {r['wall_s'] / base['wall_s']:.2f}x | "
                     f"{'yes' if r['answers'] == base['answers'] else 'NO'} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--one-offs", type=int, default=4)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--l1-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.sessions, args.turns, args.system_tokens = 4, 2, 128
    work = Workload(args)
    configs = {}
    for name in ["lpm", *[n for n in args.only if n != "lpm"]]:
        configs[name] = run_config(name, CONFIGS[name], work, args)
        r = configs[name]
        print(f"{name:20s} hit {r['hit_rate']:.1%}  rounds>=2 {r['ttft_later_rounds_s'] * 1000:.0f} ms"
              f"  wall {r['wall_s']:.1f} s", flush=True)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {platform.processor() or platform.system()}",
              "args": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)},
              "configs": configs}
    print()
    print(report(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
