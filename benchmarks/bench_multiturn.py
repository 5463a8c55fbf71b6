"""Multi-turn chat serving benchmark against a running hicache-server (the shape of SGLang's
`benchmark/hicache/bench_multiturn.py`, on token ids instead of a tokenizer).

    python -m benchmarks.bench_multiturn --port 30000            # prints tables, logs JSONL

`--num-clients` chats run concurrently (at most `--max-parallel` requests in flight); each
chat asks `--num-rounds` questions of `--request-length` random byte tokens, one after the
other, and its history (an optional shared system prompt, every earlier question and the
server's answers, i.e. its `output_ids`) is the prefix of its next prompt. Requests leave
a ready queue at `--request-rate` per second (`inf`: as fast as the clients allow). The
workload comes from `--seed` alone, so every server configuration sees the same questions.

`--no-reuse` sends prompts of the same lengths that share nothing (the hierarchy's cost
without its benefit); `--replay-round N` sends only round N, rebuilding each chat's history
from the answers of an earlier full run recorded in the log (restart measurements).

Per request: TTFT (send -> first SSE event with a token), ITL (gaps between token events),
latency (send -> `[DONE]`), and the final event's prompt and cached tokens per tier.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import numpy as np
from tqdm import tqdm

# The embedded model's byte tokens (ids 256..259 are bos/eos/pad/unk): any id below this is
# valid for it and is ordinary text for a real byte-level vocabulary too.
BYTE_VOCAB = 256
TIERS = ("device", "host", "storage")
PERCENTILES = {"median": 50, "p90": 90, "p99": 99}
SSE_DATA = "data: "
SSE_DONE = "[DONE]"
CONNECT_TIMEOUT_S = 30
# A request may wait in the server's queue behind other prompts' CPU prefill before its first
# byte; a stream silent for longer than this (`--stall-timeout`) counts as a hung server.
DEFAULT_STALL_S = 180.0
DEFAULT_LOG = Path("benchmarks/results/multiturn_log.jsonl")
# Arrivals use their own generator (seed + this), so changing the rate never changes tokens.
ARRIVAL_SEED_OFFSET = 1
ERRORS_SHOWN = 3


class Turn(NamedTuple):
    client: int
    round: int  # 1-based


# Where a turn is sent: a server's base URL ("http://host:port"). The default sends every
# turn to --host:--port; a driver with several servers passes its own.
Route = Callable[[Turn], str]


def single_server(args: argparse.Namespace) -> Route:
    base = f"http://{args.host}:{args.port}"
    return lambda turn: base


# ------------------------------------------------------------------------------ workload


@dataclass
class Workload:
    """Every token the clients will send, derived from the seed; `history` grows as answers
    arrive (multi-turn only)."""

    system: list[int]
    questions: list[list[list[int]]]  # [client][round - 1] -> question tokens
    no_reuse: bool
    history: list[list[int]] = field(default_factory=list)

    def prompt(self, turn: Turn) -> list[int]:
        q = self.questions[turn.client][turn.round - 1]
        return q if self.no_reuse else self.history[turn.client] + q

    def answer(self, turn: Turn, prompt: list[int], output_ids: list[int]) -> None:
        if not self.no_reuse:
            self.history[turn.client] = prompt + output_ids


def signature(args: argparse.Namespace) -> dict[str, Any]:
    """What fixes the tokens of a workload (answers aside)."""
    keys = ("seed", "num_clients", "num_rounds", "request_length", "output_length",
            "system_prompt_length", "no_reuse")
    return {k: getattr(args, k) for k in keys}


def prompt_length(args: argparse.Namespace, rnd: int) -> int:
    """Tokens in round `rnd`'s prompt: system + earlier rounds (question + answer) + question."""
    per_round = args.request_length + args.output_length
    return args.system_prompt_length + (rnd - 1) * per_round + args.request_length


def working_set_tokens(args: argparse.Namespace) -> int:
    """Distinct tokens across all chats once every round is answered (the shared system
    prompt counted once): what a cache must hold to serve every prefix."""
    per_client = args.num_rounds * (args.request_length + args.output_length)
    return args.system_prompt_length + args.num_clients * per_client


def make_workload(args: argparse.Namespace) -> Workload:
    rng = np.random.default_rng(args.seed)

    def tokens(n: int) -> list[int]:
        return rng.integers(BYTE_VOCAB, size=n).tolist()

    system = tokens(args.system_prompt_length)
    if args.no_reuse:  # whole prompts of the multi-turn lengths, nothing shared
        questions = [[tokens(prompt_length(args, r)) for r in range(1, args.num_rounds + 1)]
                     for _ in range(args.num_clients)]
    else:
        questions = [[tokens(args.request_length) for _ in range(args.num_rounds)]
                     for _ in range(args.num_clients)]
    return Workload(system, questions, args.no_reuse,
                    [list(system) for _ in range(args.num_clients)])


def load_answers(log: Path, sig: dict[str, Any], run: str | None
                 ) -> tuple[str, dict[Turn, list[int]]]:
    """The output ids of the latest full run of this workload in `log` (or of run `run`)."""
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    full = [r for r in records if r.get("kind") == "request" and r["workload"] == sig
            and r["replay_round"] is None and not r.get("error")]
    if run is None and full:
        run = full[-1]["run"]
    answers = {Turn(r["client"], r["round"]): r["output_ids"] for r in full if r["run"] == run}
    if not answers:
        raise SystemExit(f"--replay-round: no full run of this workload ({sig}) in {log}"
                         + (f" with run id {run!r}" if run else "") + "; run all rounds first")
    return run, answers


def replay_history(wl: Workload, answers: dict[Turn, list[int]], rnd: int) -> None:
    """Rebuild every chat's history up to round `rnd` from recorded answers."""
    for c in range(len(wl.history)):
        for r in range(1, rnd):
            turn = Turn(c, r)
            if turn not in answers:
                raise SystemExit(f"--replay-round {rnd}: the log lacks client {c}'s round {r}")
            wl.answer(turn, wl.prompt(turn), answers[turn])


# ------------------------------------------------------------------------------ requests


@dataclass
class Record:
    client: int
    round: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    ttft: float = math.nan
    latency: float = math.nan
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    error: str | None = None
    server: str = ""  # the base URL the request went to


def payload(prompt: list[int], args: argparse.Namespace) -> dict[str, Any]:
    return {"input_ids": prompt, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": args.output_length,
                                "ignore_eos": True}}


async def send(session: aiohttp.ClientSession, url: str, prompt: list[int], turn: Turn,
               args: argparse.Namespace) -> Record:
    """One streamed /generate; never raises (a failure is recorded in `error`)."""
    rec = Record(turn.client, turn.round, start=time.perf_counter())
    try:
        async with session.post(url, json=payload(prompt, args)) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return rec
            await read_events(resp, rec)
    except asyncio.TimeoutError:
        rec.error = (f"no answer for {args.stall_timeout:g} s after {len(rec.output_ids)} "
                     "tokens (the server hangs?)")
    except (aiohttp.ClientError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def read_events(resp: aiohttp.ClientResponse, rec: Record) -> None:
    last = rec.start
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith(SSE_DATA):
            continue
        data = line[len(SSE_DATA):]
        now = time.perf_counter()
        if data == SSE_DONE:
            rec.latency = now - rec.start
            return
        event = json.loads(data)
        if len(event["output_ids"]) > len(rec.output_ids):  # a token event
            if math.isnan(rec.ttft):
                rec.ttft = now - rec.start
            else:
                rec.itl.append(now - last)
            last = now
        rec.output_ids = event["output_ids"]
        meta = event["meta_info"]
        rec.prompt_tokens, rec.completion_tokens = meta["prompt_tokens"], meta["completion_tokens"]
        rec.cached = {t: meta["cached_tokens_details"].get(t, 0) for t in TIERS}
    rec.error = "the stream ended without [DONE]"


class Runner:
    """Ready queue -> arrival pacing -> at most `max_parallel` requests in flight; a chat's
    next round joins the queue when its answer arrives; `route` picks each turn's server."""

    def __init__(self, args: argparse.Namespace, wl: Workload, rounds: Sequence[int],
                 route: Route | None = None) -> None:
        self.args, self.wl, self.rounds = args, wl, list(rounds)
        self.route = route or single_server(args)
        self.arrivals = np.random.default_rng(args.seed + ARRIVAL_SEED_OFFSET)
        self.records: list[Record] = []
        self.t0 = time.perf_counter()  # reset when the run starts
        self.remaining = args.num_clients * len(self.rounds)
        self.bar = tqdm(total=self.remaining, desc=args.label or "multiturn", file=sys.stderr,
                        disable=args.quiet)

    def gap(self) -> float:
        rate = self.args.request_rate
        if math.isinf(rate):
            return 0.0
        if self.args.distribution == "poisson":
            return float(self.arrivals.exponential(1.0 / rate))
        return float(self.arrivals.uniform(0.0, 2.0 / rate))  # mean 1/rate, as SGLang's

    async def run(self) -> float:
        """Serve every turn; the wall time from the first send to the last answer."""
        self.ready: asyncio.Queue[Turn | None] = asyncio.Queue()
        self.slots = asyncio.Semaphore(self.args.max_parallel)
        for c in range(self.args.num_clients):
            self.ready.put_nowait(Turn(c, self.rounds[0]))
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S,
                                        sock_read=self.args.stall_timeout)
        self.t0 = time.perf_counter()
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            tasks = await self._dispatch(session)
            await asyncio.gather(*tasks)
        self.bar.close()
        return time.perf_counter() - self.t0

    async def _dispatch(self, session: aiohttp.ClientSession) -> list[asyncio.Task]:
        tasks: list[asyncio.Task] = []
        while self.remaining > 0:
            turn = await self.ready.get()
            if turn is None:  # a chat failed and dropped its later rounds
                continue
            self.remaining -= 1
            await self.slots.acquire()
            tasks.append(asyncio.create_task(self._turn(session, turn)))
            await asyncio.sleep(self.gap())
        return tasks

    async def _send(self, session: aiohttp.ClientSession, server: str, prompt: list[int],
                    turn: Turn) -> Record:
        """One turn's request and its measurements (over /generate)."""
        return await send(session, f"{server}/generate", prompt, turn, self.args)

    async def _turn(self, session: aiohttp.ClientSession, turn: Turn) -> None:
        prompt = self.wl.prompt(turn)
        server = self.route(turn)
        try:
            rec = await self._send(session, server, prompt, turn)
        finally:
            self.slots.release()
        rec.server = server
        self.records.append(rec)
        self.bar.update()
        later = self.rounds[self.rounds.index(turn.round) + 1:]
        if rec.error is not None:
            self.remaining -= len(later)
            self.ready.put_nowait(None)
        elif later:
            self.wl.answer(turn, prompt, rec.output_ids)
            self.ready.put_nowait(Turn(turn.client, later[0]))


# -------------------------------------------------------------------------- paired runs


def round_robin(args: argparse.Namespace) -> list[Turn]:
    """Every turn of the workload, round by round, the chats in order within a round."""
    return [Turn(c, r) for r in range(1, args.num_rounds + 1) for c in range(args.num_clients)]


async def run_paired(args: argparse.Namespace, urls: dict[str, str], flip: bool = False
                     ) -> dict[str, list[Record]]:
    """Every turn of the workload `args` (`round_robin`) on each server of `urls` (label ->
    base URL), back to back, one request in flight at a time: turn j goes to the servers in
    `urls`' order when j is even (odd if `flip`), in reverse otherwise (ABBA), so that the
    machine's load drifting hits every server alike. Each server's chats grow from its own
    answers. Per label, the records in turn order."""
    wls = {label: make_workload(args) for label in urls}
    recs: dict[str, list[Record]] = {label: [] for label in urls}
    order = list(urls)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S,
                                    sock_read=args.stall_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for j, turn in enumerate(round_robin(args)):
            for label in order if (j + flip) % 2 == 0 else order[::-1]:
                prompt = wls[label].prompt(turn)
                rec = await send(session, f"{urls[label]}/generate", prompt, turn, args)
                rec.server = urls[label]
                recs[label].append(rec)
                if rec.error is None:
                    wls[label].answer(turn, prompt, rec.output_ids)
    return recs


# ------------------------------------------------------------------------------- metrics


def stats(values: Sequence[float]) -> dict[str, float | None]:
    """Mean and percentiles of `values` (None for all when empty)."""
    arr = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    if arr.size == 0:
        return {"mean": None, **dict.fromkeys(PERCENTILES)}
    return {"mean": float(arr.mean()),
            **{k: float(np.percentile(arr, p)) for k, p in PERCENTILES.items()}}


def hit_rates(recs: Sequence[Record]) -> dict[str, float | None]:
    """Cached prompt tokens over prompt tokens: overall and per tier."""
    prompt = sum(r.prompt_tokens for r in recs)
    if prompt == 0:
        return {"all": None, **dict.fromkeys(TIERS)}
    by_tier = {t: sum(r.cached[t] for r in recs) / prompt for t in TIERS}
    return {"all": sum(by_tier.values()), **by_tier}


def summarize(recs: Sequence[Record], duration: float, output_length: int) -> dict[str, Any]:
    """`short_outputs`: answers with fewer tokens than asked (with ignore_eos: a bug)."""
    ok = [r for r in recs if r.error is None]
    return {
        "requests": len(ok),
        "errors": len(recs) - len(ok),
        "error_samples": [r.error for r in recs if r.error][:ERRORS_SHOWN],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else None,
        "input_throughput": sum(r.prompt_tokens for r in ok) / duration if duration else None,
        "output_throughput": (sum(r.completion_tokens for r in ok) / duration
                              if duration else None),
        "ttft_s": stats([r.ttft for r in ok]),
        "itl_s": stats([g for r in ok for g in r.itl]),
        "latency_s": stats([r.latency for r in ok]),
        "hit_rate": hit_rates(ok),
        "short_outputs": sum(1 for r in ok if r.completion_tokens != output_length),
        "per_round": [per_round(rnd, [r for r in ok if r.round == rnd])
                      for rnd in sorted({r.round for r in ok})],
    }


def per_round(rnd: int, recs: Sequence[Record]) -> dict[str, Any]:
    return {"round": rnd, "requests": len(recs),
            "prompt_tokens_mean": float(np.mean([r.prompt_tokens for r in recs])),
            "ttft_s": stats([r.ttft for r in recs]), "latency_s": stats([r.latency for r in recs]),
            "hit_rate": hit_rates(recs)}


# ----------------------------------------------------------------------------------- log


def write_log(path: Path, run: str, args: argparse.Namespace, recs: Sequence[dict[str, Any]],
              summary: dict[str, Any]) -> None:
    """Append one line per request (with its answer, for replays) and one summary line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    base = {"run": run, "label": args.label, "workload": signature(args),
            "replay_round": args.replay_round}
    with path.open("a") as f:
        for r in sorted(recs, key=lambda r: (r["round"], r["client"])):
            f.write(json.dumps({"kind": "request", **base, **r}) + "\n")
        f.write(json.dumps({"kind": "summary", **base, **summary}) + "\n")


def _record_json(r: Record, t0: float) -> dict[str, Any]:
    """One request for the log; `start_s` is its send time from the start of the run."""
    return {"client": r.client, "round": r.round, "start_s": r.start - t0,
            "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.completion_tokens, "cached": r.cached,
            "ttft_s": _num(r.ttft), "latency_s": _num(r.latency),
            "itl_mean_s": float(np.mean(r.itl)) if r.itl else None,
            "output_ids": r.output_ids, "error": r.error, "server": r.server}


def _num(x: float) -> float | None:
    return None if math.isnan(x) else x


# ---------------------------------------------------------------------------------- main


def run_benchmark(args: argparse.Namespace, route: Route | None = None) -> dict[str, Any]:
    """Run the workload `args` describes against the server; the summary (also logged).

    `route` sends each turn to the server it names (default: --host:--port for all). The
    summary holds `run` (this run's id in the log), and `records`: per request client,
    round, tokens, cached tokens per tier, TTFT, latency, `output_ids` and `server`.
    """
    wl = make_workload(args)
    rounds = list(range(1, args.num_rounds + 1))
    source = None
    if args.replay_round is not None:
        source, answers = load_answers(args.log, signature(args), args.replay_run)
        replay_history(wl, answers, args.replay_round)
        rounds = [args.replay_round]
    runner = Runner(args, wl, rounds, route)
    duration = asyncio.run(runner.run())
    summary = summarize(runner.records, duration, args.output_length)
    run = f"{args.label or 'multiturn'}-{time.strftime('%Y%m%dT%H%M%S')}-{time.time_ns() % 10**6}"
    records = [_record_json(r, runner.t0) for r in runner.records]
    write_log(args.log, run, args, records, summary)
    return {"run": run, "label": args.label, "workload": signature(args),
            "replay_round": args.replay_round, "replay_source": source, **summary,
            "records": records}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--num-clients", type=int, default=8, help="concurrent chats")
    ap.add_argument("--num-rounds", type=int, default=5, help="questions per chat")
    ap.add_argument("--request-length", type=int, default=256, help="tokens per question")
    ap.add_argument("--output-length", type=int, default=32, help="tokens per answer")
    ap.add_argument("--system-prompt-length", type=int, default=512,
                    help="tokens of a system prompt shared by every chat (0: none)")
    ap.add_argument("--request-rate", type=float, default=math.inf,
                    help="requests per second leaving the ready queue (inf: no pacing)")
    ap.add_argument("--distribution", choices=("poisson", "uniform"), default="poisson",
                    help="gaps between arrivals: exponential, or uniform on [0, 2/rate]")
    ap.add_argument("--max-parallel", type=int, default=8, help="requests in flight at most")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-reuse", action="store_true",
                    help="prompts of the same lengths that share no prefix")
    ap.add_argument("--replay-round", type=int, default=None, metavar="N",
                    help="send only round N, histories rebuilt from a full run in --log")
    ap.add_argument("--replay-run", default=None, metavar="RUN",
                    help="the run id in --log whose answers --replay-round uses "
                         "(default: the latest full run of the same workload)")
    ap.add_argument("--label", default="", help="a name for this run in the log and tables")
    ap.add_argument("--log", type=Path, default=DEFAULT_LOG,
                    help="JSONL file appended with one line per request and a summary")
    ap.add_argument("--stall-timeout", type=float, default=DEFAULT_STALL_S,
                    help="seconds a stream may stay silent before the request counts as failed")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    positive = ("num_clients", "num_rounds", "request_length", "output_length", "max_parallel")
    bad = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in positive
           if getattr(args, k) < 1]
    if bad:
        ap.error(f"{', '.join(bad)}: must be >= 1")
    if args.request_rate <= 0 or args.system_prompt_length < 0:
        ap.error(f"--request-rate must be > 0 (got {args.request_rate}) and "
                 f"--system-prompt-length >= 0 (got {args.system_prompt_length})")
    if args.replay_round is not None and not 1 <= args.replay_round <= args.num_rounds:
        ap.error(f"--replay-round must be in [1, {args.num_rounds}], got {args.replay_round}")
    return args


def workload_args(args: argparse.Namespace, label: str = "",
                  no_reuse: bool = False) -> argparse.Namespace:
    """This module's arguments for a driver's multi-turn workload, from the driver's own
    (`clients`, `rounds`, `request_length`, `output_length`, `system_prompt_length`, `seed`:
    bench_vs_vllm's and bench_vllm_connector's, kept in their reports); `no_reuse`: prompts
    of the same lengths that share nothing."""
    return parse_args([
        "--num-clients", str(args.clients), "--num-rounds", str(args.rounds),
        "--request-length", str(args.request_length), "--output-length", str(args.output_length),
        "--system-prompt-length", str(args.system_prompt_length),
        "--max-parallel", str(args.clients), "--seed", str(args.seed), "--label", label,
        "--quiet", *(["--no-reuse"] if no_reuse else [])])


# -------------------------------------------------------------------------------- report


def fmt_ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:,.0f}"


def fmt_pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.1%}"


def summary_table(s: dict[str, Any]) -> str:
    lines = ["| metric | mean | median | p90 | p99 |", "|---|---:|---:|---:|---:|"]
    for key, label in (("ttft_s", "TTFT (ms)"), ("itl_s", "ITL (ms)"),
                       ("latency_s", "latency (ms)")):
        st = s[key]
        lines.append(f"| {label} | {fmt_ms(st['mean'])} | {fmt_ms(st['median'])} | "
                     f"{fmt_ms(st['p90'])} | {fmt_ms(st['p99'])} |")
    return "\n".join(lines)


def rounds_table(s: dict[str, Any]) -> str:
    head = ("| round | requests | prompt tokens | TTFT mean (ms) | TTFT p90 (ms) | hit rate "
            "| device | host | storage |")
    lines = [head, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in s["per_round"]:
        h = r["hit_rate"]
        lines.append(f"| {r['round']} | {r['requests']} | {r['prompt_tokens_mean']:,.0f} | "
                     f"{fmt_ms(r['ttft_s']['mean'])} | {fmt_ms(r['ttft_s']['p90'])} | "
                     f"{fmt_pct(h['all'])} | {fmt_pct(h['device'])} | {fmt_pct(h['host'])} | "
                     f"{fmt_pct(h['storage'])} |")
    return "\n".join(lines)


def print_summary(s: dict[str, Any]) -> None:
    h = s["hit_rate"]
    print(f"{s['requests']} requests in {s['duration_s']:.1f} s ({s['errors']} errors): "
          f"{s['request_throughput']:.2f} req/s, {s['input_throughput']:,.0f} input tok/s, "
          f"{s['output_throughput']:,.1f} output tok/s; hit rate {fmt_pct(h['all'])} "
          f"(device {fmt_pct(h['device'])}, host {fmt_pct(h['host'])}, storage "
          f"{fmt_pct(h['storage'])})\n")
    print(summary_table(s))
    print()
    print(rounds_table(s))
    for err in s["error_samples"]:
        print(f"error: {err}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    result = run_benchmark(parse_args(argv))
    print_summary(result)
    return result


if __name__ == "__main__":
    main()
