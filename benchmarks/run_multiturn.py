"""`make bench`: the multi-turn benchmark against every cache configuration, in one run.

    python -m benchmarks.run_multiturn              # ~12 min on 2 CPU cores; tables + JSON + PNG
    python -m benchmarks.run_multiturn --only thrash  # the thrash measurement alone (~2 min)

For each configuration the driver starts `python -m hicache_server.launch --port 0` on the embedded
model (reading the port from its log), runs `bench_multiturn.run_benchmark` in-process with
the same seeded workload, and stops the server (always, in a `finally`):

    no cache         --disable-radix-cache
    L1 only          the radix cache on the device tier
    L1+L2            --enable-hierarchical-cache, L2 big enough for the working set
    L1+L2+L3         the same + LMDB (wait_complete); then the server is restarted on the same
                     LMDB (cold L1 and L2) and the last round replayed, once per prefetch policy
    no reuse         prompts that share nothing: L1 only against L1+L2 and L1+L2+L3
    thrash           what a cache that never hits costs: L1 only against no cache, both up
                     at once, on round-robin chats whose working set is 4x L1 (LRU evicts
                     each history before its chat comes back), one request at a time, each
                     sent to both back to back (ABBA); per pass the median of the turns'
                     TTFT ratios
                     (`--only thrash` runs this alone; benchmarks/results/thrash.json)

L1 is a quarter of the workload's working set (the distinct tokens of every chat at the end),
so L1 alone cannot keep the chats' histories; page size 16. The machine is shared and noisy:
read the ratios against "L1 only", not the absolute times.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import ctypes
import datetime
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from typing_extensions import Self

from benchmarks import bench_multiturn as bm
from benchmarks.multiturn_report import (
    BASELINE,
    HIER,
    NO_CACHE,
    STORE,
    compare,
    goals,
    no_reuse_cost,
    print_report,
    print_thrash,
    restarts,
    thrash_cost,
    thrash_goal,
)

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
PAGE_SIZE = 16
L1_FRACTION = 0.25
# L2 holds the whole working set with this much room to spare (partial pages, answers in
# flight, write-through copies of what L1 also holds).
HOST_HEADROOM = 1.5
MIN_HOST_RATIO = 2.0  # the config's default ratio; L2 is never smaller
# Passes of the thrash workload (each ~8 s on 2 cores when the machine is quiet): enough that
# the median ratio over passes moves by less than the 5% it is judged against.
DEFAULT_THRASH_PASSES = 12
LISTENING = re.compile(r"listening on http://(\S+):(\d+)")
# The first start writes the embedded model under HICACHE_HOME (seconds); later starts load it.
STARTUP_TIMEOUT_S = 300.0
# SIGTERM drains: running requests finish and pending L3 backups are written.
GRACEFUL_STOP_S = 120.0
FORCED_STOP_S = 10.0
HTTP_TIMEOUT_S = 10.0
# A traceback from a thread (the scheduler's) means the engine is dead while HTTP still
# answers: every request would hang, so the driver kills the server and records why.
THREAD_DEATH = "Exception in thread"
# The workload flags (`add_workload_args`) a report keeps as its `workload`, in this order.
WORKLOAD_KEYS = ("num_clients", "num_rounds", "request_length", "output_length",
                 "system_prompt_length", "request_rate", "distribution", "max_parallel", "seed")
SERVER_METRICS = ("hicache:load_back_seconds_sum", "hicache:load_back_seconds_count",
                  "hicache:prefetch_seconds_sum", "hicache:prefetch_seconds_count",
                  "hicache:load_back_tokens_total", "hicache:prefetch_tokens_total")


class Config(NamedTuple):
    label: str
    flags: tuple[str, ...]


# --------------------------------------------------------------------------------- server


def _load_prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


_PRCTL = _load_prctl()
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the driver dies (even by SIGKILL)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


class ManagedProcess(abc.ABC):
    """A child process that lives as long as a `with` block: `__enter__` starts it
    (`_start`) and returns once it is ready (`_wait_ready`); `stop` (a no-op once it has
    exited) runs in `__exit__` and also when it does not come up, so that a failed start
    leaves nothing running."""

    @abc.abstractmethod
    def _start(self) -> None:
        """Launch the process; nothing to stop if this raises."""

    @abc.abstractmethod
    def _wait_ready(self) -> None:
        """Return once the process serves; raise if it exits or times out first."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop the process and wait for it; harmless when it has exited or never started."""

    def __enter__(self) -> Self:
        self._start()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Server(ManagedProcess):
    """One `hicache_server.launch` subprocess: started on a free port, stopped in `__exit__`."""

    def __init__(self, label: str, flags: Sequence[str], home: Path, log_dir: Path) -> None:
        self.label = label
        self.cmd = [sys.executable, "-m", "hicache_server.launch", "--port", "0", *flags]
        self.env = {**os.environ, "HICACHE_HOME": str(home)}
        self.log_path = log_dir / f"server-{re.sub(r'[^A-Za-z0-9]+', '_', label)}.log"
        self.port: int | None = None
        self.fatal: str | None = None
        self._ready = threading.Event()
        self._proc: subprocess.Popen | None = None

    def _start(self) -> None:
        # preexec_fn is safe here: it calls one preloaded C function and takes no lock.
        self._proc = subprocess.Popen(self.cmd, cwd=REPO, env=self.env, text=True,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE,
                                      preexec_fn=_die_with_parent)  # noqa: PLW1509
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._ready.wait(0.2):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server '{self.label}' did not start (exit code "
                                   f"{self._proc.poll()}); see {self.log_path}")

    def _read_log(self) -> None:
        """Copy stderr to the log file; find the port; kill the server if its engine dies."""
        dying = False
        with self.log_path.open("w") as log:
            for line in self._proc.stderr:
                log.write(line)
                log.flush()
                if (m := LISTENING.search(line)) and self.port is None:
                    self.port = int(m.group(2))
                    self._ready.set()
                dying = dying or line.startswith(THREAD_DEATH)
                if dying and self.fatal is None and line[:1].isalpha() and ":" in line \
                        and not line.startswith((THREAD_DEATH, "Traceback")):
                    self.fatal = line.strip()
                    self._proc.kill()  # requests would hang forever on a dead scheduler

    def stop(self) -> None:
        """SIGTERM (drain, backups), a second one if the drain hangs, then SIGKILL."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, GRACEFUL_STOP_S), (signal.SIGTERM, FORCED_STOP_S),
                            (signal.SIGKILL, FORCED_STOP_S)):
            proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(wait_s)
                break
        self._reader.join(FORCED_STOP_S)

    def get(self, path: str) -> str:
        url = f"http://127.0.0.1:{self.port}{path}"
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as resp:
            return resp.read().decode()

    def cache_stats(self) -> dict[str, Any]:
        """Tier occupancy and hits (`/admin/tiers`) and load-back/prefetch timings."""
        if self.fatal is not None or self._proc.poll() is not None:
            return {}
        try:
            tiers = json.loads(self.get("/admin/tiers"))["tiers"]
            metrics = {}
            for line in self.get("/metrics").splitlines():
                name, _, value = line.partition(" ")
                if name in SERVER_METRICS:
                    metrics[name.removeprefix("hicache:")] = float(value)
        except OSError as e:
            return {"error": str(e)}
        return {"tiers": tiers, "metrics": metrics}


# ------------------------------------------------------------------------------- sizing


class Sizing(NamedTuple):
    working_set: int  # tokens, page-aligned
    l1_tokens: int
    host_ratio: float
    largest_request: int  # prompt + output tokens of the longest request


def pages_up(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE) * PAGE_SIZE


def size_tiers(args: argparse.Namespace) -> Sizing:
    """L1 = a quarter of the working set (at least the longest request); L2 holds it all."""
    ws = pages_up(bm.working_set_tokens(args))
    largest = bm.prompt_length(args, args.num_rounds) + args.output_length
    l1 = max(pages_up(int(ws * args.l1_fraction)), pages_up(largest) + PAGE_SIZE)
    ratio = max(MIN_HOST_RATIO, math.ceil(ws * HOST_HEADROOM / l1))
    return Sizing(ws, l1, float(ratio), largest)


def base_flags(sizing: Sizing, extra: Sequence[str] = ()) -> tuple[str, ...]:
    """Every server's flags; `extra` (--server-args) come last, so they win."""
    return ("--page-size", str(PAGE_SIZE), "--max-total-tokens", str(sizing.l1_tokens),
            "--log-level", "info", *extra)


def configs(sizing: Sizing, lmdb: Path, policy: str, extra: Sequence[str] = ()
            ) -> dict[str, Config]:
    base = base_flags(sizing, extra)
    hier = (*base, "--enable-hierarchical-cache", "--hicache-ratio", str(sizing.host_ratio),
            "--hicache-storage-backend", "none")
    store = with_storage(hier, "lmdb", {"path": str(lmdb)}, policy)
    return {c.label: c for c in (Config(NO_CACHE, (*base, "--disable-radix-cache")),
                                 Config(BASELINE, base), Config(HIER, hier),
                                 Config(STORE, store))}


def with_storage(hier: Sequence[str], backend: str, extra: dict[str, Any], policy: str
                 ) -> tuple[str, ...]:
    """The L1+L2 flags `hier` (which end in `--hicache-storage-backend none`) with an L3."""
    return (*hier[:-2], "--hicache-storage-backend", backend,
            "--hicache-storage-backend-extra-config", json.dumps(extra),
            "--hicache-storage-prefetch-policy", policy)


# ----------------------------------------------------------------------------------- runs


def client_args(args: argparse.Namespace, label: str, port: int, *extra: str
                ) -> argparse.Namespace:
    argv = ["--port", str(port), "--num-clients", str(args.num_clients),
            "--num-rounds", str(args.num_rounds), "--request-length", str(args.request_length),
            "--output-length", str(args.output_length),
            "--system-prompt-length", str(args.system_prompt_length),
            "--request-rate", str(args.request_rate), "--distribution", args.distribution,
            "--max-parallel", str(args.max_parallel), "--seed", str(args.seed),
            "--stall-timeout", str(args.stall_timeout), "--label", label,
            "--log", str(args.log), *extra]
    return bm.parse_args(argv)


def bench(args: argparse.Namespace, server: Server, label: str, *extra: str) -> dict[str, Any]:
    """One client run against `server`; the summary with the server's side and any death."""
    cargs = client_args(args, label, server.port, *extra)
    result = bm.run_benchmark(cargs)
    result["server"] = server_info(server)
    result["client_command"] = shlex.join(["python", "-m", "benchmarks.bench_multiturn",
                                           *_argv_of(cargs)])
    if server.fatal:
        print(f"\n!! server '{label}' died: {server.fatal} (log: {server.log_path})",
              file=sys.stderr)
    return result


def server_info(server: Server) -> dict[str, Any]:
    """How the server ran, whether it died, and its tier stats after the run."""
    return {"command": shlex.join(server.cmd), "pid": server.pid, "log": str(server.log_path),
            "fatal": server.fatal, **server.cache_stats()}


def _argv_of(cargs: argparse.Namespace) -> list[str]:
    out = []
    for key, value in vars(cargs).items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out += [flag] if value else []
        elif value is not None and value != "":
            out += [flag, str(value)]
    return out


@contextlib.contextmanager
def served(cfg: Config, args: argparse.Namespace, label: str | None = None
           ) -> Iterator[Server]:
    with Server(label or cfg.label, cfg.flags, args.home, args.workdir) as server:
        if args.profile_dir is not None:
            with py_spy(server, args.profile_dir):
                yield server
        else:
            yield server


@contextlib.contextmanager
def py_spy(server: Server, out_dir: Path) -> Iterator[None]:
    """`py-spy record -f raw` on the server while the block runs (all threads, idle off)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    exe = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
    out = out_dir / f"{server.log_path.stem}.raw"
    spy = subprocess.Popen([exe, "record", "-f", "raw", "-o", str(out), "--pid",
                            str(server.pid), "--threads"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        with contextlib.suppress(subprocess.TimeoutExpired):
            spy.wait(FORCED_STOP_S * 3)
        if spy.poll() is None:
            spy.kill()


def run_multiturn(args: argparse.Namespace, cfgs: dict[str, Config]) -> dict[str, Any]:
    """Every configuration on the multi-turn workload; replays of the last round."""
    runs: dict[str, Any] = {}
    last = str(args.num_rounds)
    for label in (NO_CACHE, BASELINE, HIER, STORE):
        with served(cfgs[label], args) as server:
            runs[label] = bench(args, server, label)
            if label == NO_CACHE:  # same round, same arrivals, nothing cached
                runs[f"{NO_CACHE} replay"] = bench(args, server, f"{NO_CACHE} replay",
                                                   "--replay-round", last)
    source = runs[STORE]["run"]
    for policy in args.restart_policies:
        label = f"{STORE} restart ({policy})"
        cfg = configs_for_policy(cfgs, policy)
        with served(cfg, args, label) as server:
            runs[label] = bench(args, server, label, "--replay-round", last,
                                "--replay-run", source)
    return runs


def configs_for_policy(cfgs: dict[str, Config], policy: str) -> Config:
    flags = list(cfgs[STORE].flags)
    flags[flags.index("--hicache-storage-prefetch-policy") + 1] = policy
    return Config(STORE, tuple(flags))


def run_no_reuse(args: argparse.Namespace, sizing: Sizing, policy: str) -> dict[str, Any]:
    """The hierarchy's cost without its benefit: prompts that share nothing. Configurations
    alternate over `--no-reuse-repeats` passes (a fresh server and LMDB each time, so drift
    in the machine's load hits all); the best throughput of each is kept (noise only slows)."""
    runs: dict[str, Any] = {}
    for rep in range(args.no_reuse_repeats):
        cfgs = configs(sizing, args.workdir / f"lmdb-no-reuse-{rep}", policy,
                       shlex.split(args.server_args))
        for label in (BASELINE, *args.no_reuse_hierarchy):
            name = f"no reuse {label}"
            with served(cfgs[label], args, f"{name} #{rep + 1}") as server:
                run = bench(args, server, name, "--no-reuse",
                            "--num-rounds", str(args.no_reuse_rounds))
            seen = runs.get(label, {}).get("repeat_throughputs", [])
            run["repeat_throughputs"] = [*seen, run["request_throughput"]]
            if label not in runs or run["request_throughput"] > runs[label]["request_throughput"]:
                runs[label] = run
            runs[label]["repeat_throughputs"] = run["repeat_throughputs"]
    return runs


# --------------------------------------------------------------------------------- thrash
# Round-robin chats, one request at a time: between two turns of a chat the other seven
# insert at least 7 x 272 tokens, more than L1 (a quarter of the 6,528-token working set:
# 1,632) holds, so LRU has evicted its history when it comes back and every request misses.
# No system prompt: a shared one would stay hot and hit.
THRASH = "thrash"
THRASH_WORKLOAD = {"num_clients": 8, "num_rounds": 3, "request_length": 256,
                   "output_length": 16, "system_prompt_length": 0, "max_parallel": 1,
                   "request_rate": math.inf, "l1_fraction": L1_FRACTION}


def thrash_args(args: argparse.Namespace) -> argparse.Namespace:
    """The driver's flags with the thrash workload in place of the multi-turn one."""
    return argparse.Namespace(**{**vars(args), **THRASH_WORKLOAD})


def run_thrash(args: argparse.Namespace) -> dict[str, Any]:
    """L1 only against no cache on the thrash workload (`args` from `thrash_args`): both
    servers up at once (the idle one sleeps on its inbox), a warm-up pass, then
    `--thrash-passes` passes, each turn sent to both servers back to back in ABBA order
    (`bench_multiturn.run_paired`). Each pass has its own seed: tokens no earlier pass
    cached."""
    sizing = size_tiers(args)
    base = base_flags(sizing, shlex.split(args.server_args))
    cfgs = {BASELINE: Config(BASELINE, base),
            NO_CACHE: Config(NO_CACHE, (*base, "--disable-radix-cache"))}
    passes = []
    with served(cfgs[BASELINE], args, f"{THRASH} {BASELINE}") as on, \
            served(cfgs[NO_CACHE], args, f"{THRASH} {NO_CACHE}") as off:
        servers = {BASELINE: on, NO_CACHE: off}
        urls = {label: f"http://127.0.0.1:{s.port}" for label, s in servers.items()}
        for i in range(-1, args.thrash_passes):  # -1: the warm-up, not kept
            seed = args.seed + 1 + i
            cargs = client_args(argparse.Namespace(**{**vars(args), "seed": seed}),
                                THRASH, 0, "--quiet")  # port 0: run_paired has the URLs
            print(f"{THRASH}: pass {i + 1} of {args.thrash_passes}" if i >= 0
                  else f"{THRASH}: warm-up", file=sys.stderr)
            recs = asyncio.run(bm.run_paired(cargs, urls, flip=bool(i % 2)))
            if i >= 0:
                passes.append(thrash_pass(seed, recs))
        info = {label: server_info(s) for label, s in servers.items()}
    return {"sizing": sizing._asdict() | {"page_size": PAGE_SIZE}, "passes": passes,
            "servers": info}


def thrash_pass(seed: int, recs: dict[str, list[bm.Record]]) -> dict[str, Any]:
    """One pass for the report: per server TTFTs in turn order (None: failed), hit rate and
    errors; how many answers L1 only and no cache gave alike."""
    sides = {}
    for label, rs in recs.items():
        ok = [r for r in rs if r.error is None]
        sides[label] = {"ttft_s": [None if r.error else r.ttft for r in rs],
                        "hit_rate": bm.hit_rates(ok)["all"],
                        "errors": len(rs) - len(ok),
                        "error_samples": [r.error for r in rs if r.error][:bm.ERRORS_SHOWN]}
    pairs = list(zip(recs[BASELINE], recs[NO_CACHE], strict=True))
    same = sum(a.output_ids == b.output_ids for a, b in pairs) / len(pairs)
    return {"seed": seed, "same_answers": same, "sides": sides}


def thrash_report(args: argparse.Namespace, thrash: dict[str, Any]) -> dict[str, Any]:
    """benchmarks/results/thrash.json: the passes and their summary (`thrash_cost`)."""
    return {**report_stamp(), "workload": workload_of(args),
            "model": args.model or "embedded:tiny-llama", "server_args": args.server_args,
            **thrash, "summary": thrash_cost(thrash["passes"], thrash["servers"]),
            "out": _shown(args.thrash_out)}


# ---------------------------------------------------------------------------------- main


def machine() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines()
                 if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu_name(),
            "python": platform.python_version(), "platform": platform.platform()}


def gpu_name() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True, check=False)
    return out.stdout.strip() or None


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The workload, L1 sizing and HICACHE_HOME flags (also used by bench_shared_l3.py)."""
    ap.add_argument("--num-clients", type=int, default=8)
    ap.add_argument("--num-rounds", type=int, default=5)
    ap.add_argument("--request-length", type=int, default=256)
    ap.add_argument("--output-length", type=int, default=32)
    ap.add_argument("--system-prompt-length", type=int, default=512)
    ap.add_argument("--request-rate", type=float, default=math.inf)
    ap.add_argument("--distribution", choices=("poisson", "uniform"), default="poisson")
    ap.add_argument("--max-parallel", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stall-timeout", type=float, default=bm.DEFAULT_STALL_S,
                    help="seconds a stream may stay silent before its request fails")
    ap.add_argument("--l1-fraction", type=float, default=L1_FRACTION,
                    help="L1 capacity as a share of the working set")
    ap.add_argument("--model", default=None,
                    help="the model every server serves: a name (smollm2-135m-instruct), a "
                         ".gguf file or a local HF folder (default: the embedded model)")
    ap.add_argument("--server-args", default="",
                    help="more hicache-server flags for every server, e.g. "
                         "\"--dtype bfloat16\"")
    ap.add_argument("--home", type=Path, default=None,
                    help="HICACHE_HOME for the servers (default: a folder under the temp dir, "
                         "kept across runs so the embedded model is written once)")


def add_report_args(ap: argparse.ArgumentParser, name: str) -> None:
    """--out and --log, by default `name`.json and `name`_log.jsonl under benchmarks/results."""
    ap.add_argument("--out", type=Path, default=RESULTS / f"{name}.json")
    ap.add_argument("--log", type=Path, default=RESULTS / f"{name}_log.jsonl",
                    help="per-request JSONL (rewritten by each run of the driver)")


def check_workload_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit (code 2) on a bad --l1-fraction; resolve the default --home."""
    if not 0 < args.l1_fraction <= 1:
        ap.error(f"--l1-fraction must be in (0, 1], got {args.l1_fraction}")
    if args.model is not None:  # the flag hicache-server takes, ahead of --server-args
        args.server_args = shlex.join(["--model-path", args.model]) + " " + args.server_args
    args.home = args.home or Path(tempfile.gettempdir()) / "hicache-bench-home"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(ap)
    ap.add_argument("--restart-policies", nargs="+", default=["wait_complete", "timeout"],
                    choices=("best_effort", "wait_complete", "timeout"),
                    help="prefetch policies measured after the restart (the full L1+L2+L3 "
                         "run uses the first)")
    ap.add_argument("--no-reuse-hierarchy", nargs="*", choices=(HIER, STORE),
                    default=[HIER, STORE],
                    help="hierarchy configurations compared with L1 only on the no-reuse load")
    ap.add_argument("--no-reuse-rounds", type=int, default=4,
                    help="rounds of the no-reuse workload (prompts of the same lengths as the "
                         "multi-turn rounds)")
    ap.add_argument("--no-reuse-repeats", type=int, default=2,
                    help="alternating passes over the no-reuse configurations; best kept")
    ap.add_argument("--thrash-passes", type=int, default=DEFAULT_THRASH_PASSES,
                    help="passes of the thrash workload, each turn on L1 only and no cache")
    ap.add_argument("--only", choices=(THRASH,), default=None,
                    help="run only this part (the multi-turn report and log stay as they are)")
    add_report_args(ap, "multiturn")
    ap.add_argument("--thrash-out", type=Path, default=RESULTS / "thrash.json",
                    help="the thrash report (every request's TTFT)")
    ap.add_argument("--profile-dir", type=Path, default=None,
                    help="record every server with py-spy (raw stacks) into this folder")
    args = ap.parse_args(argv)
    if args.thrash_passes < 1:
        ap.error(f"--thrash-passes must be >= 1, got {args.thrash_passes}")
    if not 1 <= args.no_reuse_rounds <= args.num_rounds or args.no_reuse_repeats < 1:
        ap.error(f"--no-reuse-rounds must be in [1, --num-rounds={args.num_rounds}] (got "
                 f"{args.no_reuse_rounds}) and --no-reuse-repeats >= 1 (got "
                 f"{args.no_reuse_repeats})")
    check_workload_args(ap, args)
    return args


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    sys.exit(128 + signum)  # unwinds the `with Server` blocks: no server outlives the driver


@contextlib.contextmanager
def driver_run(args: argparse.Namespace, prefix: str, fresh_log: bool = True
               ) -> Iterator[None]:
    """Around a driver's runs (this one's, bench_shared_l3.py's, bench_router.py's): SIGTERM
    unwinds the `with` blocks, so no server, router or redis-server outlives the driver; the
    per-request log `args.log` starts empty (unless not `fresh_log`: runs that write none);
    `args.workdir` is a fresh temporary folder (`prefix`), removed when the block ends."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if fresh_log:
        args.log.parent.mkdir(parents=True, exist_ok=True)
        args.log.write_text("")
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        args.workdir = Path(tmp)
        yield


def write_report(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.only == THRASH:
        targs = thrash_args(args)
        with driver_run(targs, "hicache-thrash-", fresh_log=False):
            thrash = thrash_report(targs, run_thrash(targs))
        write_report(thrash, args.thrash_out)
        print_thrash(thrash)
        return thrash
    sizing = size_tiers(args)
    with driver_run(args, "hicache-bench-"):
        policy = args.restart_policies[0]
        runs = run_multiturn(args, configs(sizing, args.workdir / "lmdb", policy,
                                           shlex.split(args.server_args)))
        nor = run_no_reuse(args, sizing, policy)
        targs = thrash_args(args)
        thrash = thrash_report(targs, run_thrash(targs))
        report = build_report(args, sizing, runs, nor, thrash)
        _keep_server_logs(report, args.workdir)
    from benchmarks.plot_multiturn import plot_all  # matplotlib loads only once the runs are done

    report["plots"] = [_shown(p) for p in plot_all(report, args.out.parent)]
    write_report(thrash, args.thrash_out)
    write_report(report, args.out)
    print_report(report)
    print_thrash(thrash)
    return report


def report_stamp() -> dict[str, Any]:
    """When, how and where a driver ran: the first keys of every benchmark report."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join([sys.executable, *sys.argv]), "machine": machine()}


def workload_of(args: argparse.Namespace, keys: Sequence[str] = WORKLOAD_KEYS
                ) -> dict[str, Any]:
    """A report's `workload`: the values of the workload flags `keys`."""
    return {k: getattr(args, k) for k in keys}


def build_report(args: argparse.Namespace, sizing: Sizing, runs: dict[str, Any],
                 nor: dict[str, Any], thrash: dict[str, Any]) -> dict[str, Any]:
    """The multi-turn report; of the thrash measurement only its summary (the passes are in
    its own report)."""
    cmp, rst = compare(runs), restarts(runs, args.num_rounds)
    nrc = no_reuse_cost(nor)
    strip = {"records"}
    return {
        **report_stamp(),
        "workload": workload_of(args),
        "model": args.model or "embedded:tiny-llama", "server_args": args.server_args,
        "no_reuse_workload": {"num_rounds": args.no_reuse_rounds,
                              "repeats": args.no_reuse_repeats},
        "sizing": sizing._asdict() | {"page_size": PAGE_SIZE, "l1_fraction": args.l1_fraction},
        "configs": cmp, "restart": rst, "no_reuse": nrc,
        "thrash": {**thrash["summary"], "report": thrash["out"]},
        "goals": [*goals(cmp, rst, nrc), thrash_goal(thrash["summary"])],
        "runs": {k: {f: v for f, v in r.items() if f not in strip} for k, r in runs.items()},
        "no_reuse_runs": {k: {f: v for f, v in r.items() if f not in strip}
                          for k, r in nor.items()},
        "log": _shown(args.log), "out": _shown(args.out),
    }


def _shown(path: Path) -> str:
    """`path` relative to the repository when inside it."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _keep_server_logs(report: dict[str, Any], workdir: Path) -> None:
    """Server logs of servers that died are copied next to the report before cleanup."""
    for run in [*report["runs"].values(), *report["no_reuse_runs"].values()]:
        srv = run["server"]
        if srv["fatal"]:
            text = Path(srv["log"]).read_text()
            srv["log_tail"] = text.splitlines()[-40:]


if __name__ == "__main__":
    main()
