"""`make bench-vs-vllm`: hicache against vLLM, the same model, KV capacity and limits.

    python -m benchmarks.bench_vs_vllm --vllm-python .venv-vllm/bin/python    # tables + JSON
    python -m benchmarks.bench_vs_vllm --quick                                  # smoke test

Five servers, started one at a time on free loopback ports, each serving the same model
folder (default: the embedded model's) in the same dtype with the same KV bytes (both as
`--kv-cache-memory-bytes`: `--kv-tokens` of every layer's KV, which a hybrid model's split L1
spends as it needs), the same page (block) size, running-sequence limit and batched-token
budget (hicache's MAX_RUNNING_REQUESTS and MAX_BATCH_TOKENS, which vLLM gets as
`--max-num-seqs` and `--max-num-batched-tokens`):

    vLLM prefix cache     --enable-prefix-caching --enable-prompt-tokens-details
    vLLM no cache         --no-enable-prefix-caching
    hicache no cache      --disable-radix-cache
    hicache L1 only       the radix tree on the device tier
    hicache L1+L2         --enable-hierarchical-cache, L2 big enough for the working set

One client speaks OpenAI's `/v1/completions` to all of them: token-id prompts, greedy,
`ignore_eos`, streamed, `return_token_ids` (both servers send the new ids in every chunk)
and `stream_options.include_usage` (the cached prompt tokens are in the last chunk's
`usage.prompt_tokens_details.cached_tokens`). On each server, in order:

    calibration   prefill of `--prefill-tokens` uncached tokens (max_tokens 1, distinct
                  random prompts, one at a time); decode at batch 1 and at batch
                  `--decode-batch` (mean time between a stream's tokens)
    multi-turn    `bench_multiturn`'s workload (`--clients` chats x `--rounds` rounds, each
                  round's prompt the chat's history plus a new question), over /v1/completions

`--passes` passes run every server (the order reversed in every other pass, so drift in the
machine's load hits all); the tables show the median and the best pass. Ratios are
hicache / vLLM as speed: above 1 means hicache is faster. Every multi-turn answer is
compared, token by token, with the first vLLM prefix-cache pass's answer to the same chat
and round; each chat's first difference is scored by hicache's model in-process, its logit
gap between the two tokens against the near-tie threshold (`answer_ties.py`). Server logs
go to `.benchtmp/vs_vllm/`; a server that does not come up has the end of its log printed. Every server is stopped when the driver ends, also on an error,
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import math
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import numpy as np

from benchmarks import answer_ties, long_docs
from benchmarks import bench_multiturn as bm
from benchmarks import multiturn_report as mr
from benchmarks import run_multiturn as rm
from hicache_server.engine import MAX_BATCH_TOKENS, MAX_RUNNING_REQUESTS

REPO = rm.REPO
LOG_DIR = REPO / ".benchtmp" / "vs_vllm"
DEFAULT_OUT = rm.RESULTS / "vs_vllm.json"
QUICK_OUT = REPO / ".benchtmp" / "vs_vllm_quick.json"  # a smoke run never replaces results
DEFAULT_VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
HOST = "127.0.0.1"
MODEL_NAME = "bench-model"  # --served-model-name of every server; the `model` of requests
EMBEDDED_MODEL = "embedded:tiny-llama"

HICACHE, VLLM = "hicache", "vllm"
VLLM_PREFIX = "vLLM prefix cache"
VLLM_NONE = "vLLM no cache"
HI_NONE = f"hicache {mr.NO_CACHE}"
HI_L1 = f"hicache {mr.BASELINE}"
HI_L2 = f"hicache {mr.HIER}"
# The vLLM configuration each hicache one is measured against: caching against caching.
COUNTERPART = {HI_NONE: VLLM_NONE, HI_L1: VLLM_PREFIX, HI_L2: VLLM_PREFIX}

DEFAULT_KV_TOKENS = 3008  # `make bench`'s L1: a quarter of its workload's working set
DEFAULT_PAGE_SIZE = 32  # vLLM's CPU attention takes block sizes that are multiples of 32
VLLM_CPU_BLOCK_MULTIPLE = 32
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# vLLM's block pool keeps its first block as a placeholder no request uses (`null_block`),
# so it is given one block more than the KV tokens it must hold; its log then reports them.
VLLM_NULL_BLOCKS = 1
DEFAULT_PASSES = 3
DEFAULT_PREFILL_TOKENS = 2048
DEFAULT_PREFILL_REPEATS = 3  # distinct prompts per pass; their median is the pass's value
DEFAULT_DECODE_TOKENS = 64
DEFAULT_DECODE_BATCH = 8
DECODE_PROMPT_TOKENS = 128  # short: the decode steps, not the prefill, are measured
WARMUP_PROMPT_TOKENS = 64
WARMUP_MAX_TOKENS = 4
# --quick: one pass of a small workload, for a smoke test of both servers (a few minutes,
# most of it vLLM's start-up).
QUICK = {"passes": 1, "clients": 2, "rounds": 2, "system_prompt_length": 128,
         "request_length": 64, "output_length": 8, "prefill_tokens": 512,
         "prefill_repeats": 1, "decode_tokens": 16}
# Purposes of the calibration prompts: each its own random stream of the seed, so that no
# calibration prompt shares a prefix with another or with the multi-turn workload's.
PURPOSES = ("warmup", "prefill", "decode_b1", "decode_batch")
# vLLM starts in one to two minutes on 2 CPU cores (compilation included); the first start
# on a machine also fills its compile cache.
VLLM_STARTUP_TIMEOUT_S = 900.0
HEALTH_POLL_S = 1.0
HEALTH_TIMEOUT_S = 5.0
VLLM_STOP_S = 60.0
LOG_TAIL_LINES = 40
SSE_DATA = "data: "
SSE_DONE = "[DONE]"
# What each server's log says its KV holds: vLLM's count includes its null block.
VLLM_KV_LOGGED = re.compile(r"KV cache size: ([\d,]+) tokens")
HICACHE_KV_LOGGED = re.compile(r"L1 \(\w+\): (\d+) tokens")


class ServerSpec(NamedTuple):
    label: str
    engine: str  # HICACHE or VLLM
    flags: tuple[str, ...]


class Endpoint(NamedTuple):
    """A running server, as the client and the report see it."""

    base_url: str
    command: str
    log_path: Path
    kv_tokens_usable: Callable[[], int | None]  # what the server's log says, once up


# ------------------------------------------------------------------------------ servers


def model_config(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text())


def kv_cache_bytes(model_dir: Path, tokens: int, dtype: str) -> int:
    """Bytes of K and V for `tokens` tokens: layers x 2 x kv_heads x head_dim x dtype size."""
    cfg = model_config(model_dir)
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return tokens * cfg["num_hidden_layers"] * 2 * heads * head_dim * DTYPE_BYTES[dtype]


def host_ratio(args: argparse.Namespace) -> float:
    """L2 / L1 for hicache L1+L2: the whole working set (multi-turn and long documents)
    with `run_multiturn`'s headroom."""
    ws = bm.working_set_tokens(bm.workload_args(args))
    ws += long_docs.working_set_tokens(args.long_docs, args.seed) if args.long_docs else 0
    return float(max(rm.MIN_HOST_RATIO, math.ceil(ws * rm.HOST_HEADROOM / args.kv_tokens)))


def hicache_specs(args: argparse.Namespace) -> list[ServerSpec]:
    base = ("--model-path", str(args.model_path), "--dtype", args.dtype,
            "--page-size", str(args.page_size),
            # the same bytes as vLLM's (less its null block): `--kv-tokens` of every layer's
            # KV, which a hybrid model's split L1 spends as it needs (docs/architecture.md)
            "--kv-cache-memory-bytes",
            str(kv_cache_bytes(args.model_path, args.kv_tokens, args.dtype)),
            "--served-model-name", MODEL_NAME, "--log-level", "info",
            *shlex.split(args.hicache_args))
    hier = ("--enable-hierarchical-cache", "--hicache-ratio", str(host_ratio(args)),
            "--hicache-storage-backend", "none")
    return [ServerSpec(HI_NONE, HICACHE, (*base, "--disable-radix-cache")),
            ServerSpec(HI_L1, HICACHE, base), ServerSpec(HI_L2, HICACHE, (*base, *hier))]


def vllm_kv_bytes(args: argparse.Namespace) -> int:
    """vLLM's --kv-cache-memory-bytes: `--kv-tokens` usable, plus its null block."""
    tokens = args.kv_tokens + VLLM_NULL_BLOCKS * args.page_size
    return kv_cache_bytes(args.model_path, tokens, args.dtype)


def max_model_len(args: argparse.Namespace) -> int:
    """vLLM refuses to start when one request of max_model_len tokens would not fit in
    its KV cache: the KV capacity, or the model's context when that is shorter."""
    context = model_config(args.model_path).get("max_position_embeddings")
    return min(args.kv_tokens, context or args.kv_tokens)


def vllm_specs(args: argparse.Namespace) -> list[ServerSpec]:
    base = ("--model", str(args.model_path), "--served-model-name", MODEL_NAME,
            "--dtype", args.dtype, "--block-size", str(args.page_size),
            "--kv-cache-memory-bytes", str(vllm_kv_bytes(args)),
            "--max-model-len", str(max_model_len(args)), "--max-num-seqs", str(MAX_RUNNING_REQUESTS),
            "--max-num-batched-tokens", str(MAX_BATCH_TOKENS), "--seed", str(args.seed),
            "--uvicorn-log-level", "warning", *shlex.split(args.vllm_args))
    return [ServerSpec(VLLM_PREFIX, VLLM, ("--enable-prefix-caching",
                                           "--enable-prompt-tokens-details", *base)),
            ServerSpec(VLLM_NONE, VLLM, ("--no-enable-prefix-caching",
                                         "--enable-prompt-tokens-details", *base))]


def server_specs(args: argparse.Namespace) -> list[ServerSpec]:
    specs = []
    if args.only in (None, VLLM):
        specs += vllm_specs(args)
    if args.only in (None, HICACHE):
        specs += hicache_specs(args)
    if args.cached_only:
        specs = [s for s in specs if s.label not in (VLLM_NONE, HI_NONE)]
    return specs


# vLLM's CPU guide preloads tcmalloc and Intel's OpenMP (its wheel ships libiomp5); each is
# preloaded when present, so vLLM runs as its documentation sets it up. Without tcmalloc,
# glibc's malloc hands vLLM's activations back to the kernel and faults them in again: 1-3
# million page faults in a no-reuse pass of bench_vllm_connector against ~50,000 with it,
# vLLM ~16% slower, and that count moved from pass to pass by 2x.
TCMALLOC_NAME = "libtcmalloc_minimal.so.4"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu") / TCMALLOC_NAME


def vllm_preload(python: Path | None) -> list[str]:
    """The libraries vLLM's CPU guide preloads that exist here: tcmalloc (Debian's
    libtcmalloc-minimal4, installed, or unpacked into the vLLM venv's lib/ by the Makefile)
    and libiomp5 (in the vLLM venv's lib/)."""
    lib = Path(python).parent.parent / "lib" if python is not None else None
    tcmalloc = [TCMALLOC, *([lib / TCMALLOC_NAME] if lib else [])]
    libs = [next((p for p in tcmalloc if p.is_file()), None),
            lib / "libiomp5.so" if lib else None]
    return [str(p) for p in libs if p is not None and p.is_file()]


def preload_names(python: Path | None) -> list[str]:
    """What `vllm_env` preloads on this machine, by file name (for the reports)."""
    return [] if rm.gpu_name() is not None else [Path(p).name for p in vllm_preload(python)]


def preload_clause(versions: dict[str, Any]) -> str:
    """The report header's words on what vLLM preloaded: none for a run without vLLM (its
    `vllm_preload` is None)."""
    names = versions.get("vllm_preload")
    if names is None:
        return ""
    return f"; vLLM preloads {', '.join(names) or 'nothing'}"


def vllm_env(cores: int | None = None, python: Path | None = None) -> dict[str, str]:
    """vLLM's environment: OpenMP threads on every core (its default binds one of two), the
    KV size from --kv-cache-memory-bytes alone (VLLM_CPU_KVCACHE_SPACE takes whole GiB), no
    network for the model folder; on the CPU, tcmalloc and libiomp5 preloaded."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{(cores or os.cpu_count() or 1) - 1}",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if rm.gpu_name() is None:
        env["VLLM_TARGET_DEVICE"] = "cpu"
        preload = vllm_preload(python)
        if preload:
            env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [env.get("LD_PRELOAD")])])
    return env


def free_port() -> int:
    """A port free now (vLLM takes no port 0); another process could take it before vLLM
    binds, which the health wait reports as a start that failed."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    if not path.exists():
        return f"(no log at {path})"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=HEALTH_TIMEOUT_S) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


class VllmServer(rm.ManagedProcess):
    """`python -m vllm.entrypoints.openai.api_server` (its `vllm` console script does not
    run under the `vllm-cpu` distribution), in its own process group: vLLM's engine core
    and worker are its children, and stopping the group stops them all. The API server
    gets SIGTERM if the driver dies without stopping it."""

    def __init__(self, label: str, python: Path, flags: Sequence[str], log_dir: Path,
                 timeout_s: float) -> None:
        self.label, self.timeout_s = label, timeout_s
        self.port = free_port()
        self.python = python
        self.cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--host", HOST,
                    "--port", str(self.port), *flags]
        self.log_path = log_dir / f"server-{re.sub(r'[^A-Za-z0-9]+', '_', label)}.log"
        self._proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def _start(self) -> None:
        # preexec_fn is safe here: it calls one preloaded C function and takes no lock.
        with self.log_path.open("w") as log:
            self._proc = subprocess.Popen(self.cmd, cwd=REPO, env=vllm_env(python=self.python), text=True,
                                          stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=rm._die_with_parent)  # noqa: PLW1509

    def _wait_ready(self) -> None:
        """Until /health answers 200."""
        deadline = time.monotonic() + self.timeout_s
        while not healthy(self.base_url):
            code = self._proc.poll()
            if code is not None or time.monotonic() > deadline:
                why = f"exit code {code}" if code is not None else f"{self.timeout_s:g} s"
                raise ServerStartError(self.label, why, self.log_path)
            time.sleep(HEALTH_POLL_S)

    def kv_tokens_usable(self, page_size: int) -> int | None:
        """The KV tokens vLLM's log reports, less its null block."""
        logged = logged_tokens(VLLM_KV_LOGGED, self.log_path)
        return None if logged is None else logged - VLLM_NULL_BLOCKS * page_size

    def stop(self) -> None:
        """SIGTERM to the group (vLLM shuts its engine core down), SIGKILL if it hangs;
        then SIGKILL to whatever of the group is left (an engine core whose API server
        died first)."""
        proc = self._proc
        if proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(VLLM_STOP_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def logged_tokens(pattern: re.Pattern[str], log_path: Path) -> int | None:
    m = pattern.search(log_path.read_text(errors="replace")) if log_path.exists() else None
    return int(m.group(1).replace(",", "")) if m else None


class ServerStartError(RuntimeError):
    def __init__(self, label: str, why: str, log_path: Path) -> None:
        super().__init__(f"server '{label}' did not start ({why}); the end of {log_path}:\n"
                         f"{log_tail(log_path)}")


@contextlib.contextmanager
def serve(spec: ServerSpec, args: argparse.Namespace) -> Iterator[Endpoint]:
    """Start the server `spec` describes, wait for /health, stop it when the block ends."""
    if spec.engine == VLLM:
        with VllmServer(spec.label, args.vllm_python, spec.flags, args.log_dir,
                        args.startup_timeout) as v:
            yield Endpoint(v.base_url, shlex.join(v.cmd), v.log_path,
                           lambda: v.kv_tokens_usable(args.page_size))
        return
    server = rm.Server(spec.label, spec.flags, args.log_dir / "home", args.log_dir)
    try:
        server.__enter__()
    except RuntimeError:
        raise ServerStartError(spec.label, "no `listening on` line", server.log_path) from None
    try:
        base = f"http://{HOST}:{server.port}"
        if not healthy(base):
            raise ServerStartError(spec.label, "/health did not answer 200", server.log_path)
        yield Endpoint(base, shlex.join(server.cmd), server.log_path,
                       lambda: logged_tokens(HICACHE_KV_LOGGED, server.log_path))
    finally:
        server.stop()


# ------------------------------------------------------------------------------- client


def completion_body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed, greedy /v1/completions request that both servers answer alike."""
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}


def cached_by_tier(chunk: dict[str, Any]) -> dict[str, int]:
    """The usage chunk's cached prompt tokens: hicache's by tier (`sglext`), vLLM's (which
    has one tier, the device) all under "device"."""
    tiers = (chunk.get("sglext") or {}).get("cached_tokens_details")
    if tiers:
        return {t: tiers.get(t, 0) for t in bm.TIERS}
    details = chunk["usage"].get("prompt_tokens_details") or {}
    return {**dict.fromkeys(bm.TIERS, 0), "device": details.get("cached_tokens") or 0}


def take_chunk(rec: bm.Record, chunk: dict[str, Any], now: float, last: float) -> float:
    """Add one stream chunk to `rec`; the time of the last token chunk seen. `rec.itl` has
    one gap per token chunk after the first (a chunk may carry several tokens), so that
    sum(itl) is the time from the first token to the last."""
    if "error" in chunk:
        rec.error = f"error event: {chunk['error']}"
    ids = [i for c in chunk.get("choices") or () for i in c.get("token_ids") or ()]
    if ids:
        if math.isnan(rec.ttft):
            rec.ttft = now - rec.start
        else:
            rec.itl.append(now - last)
        rec.output_ids += ids
        last = now
    if chunk.get("usage"):
        rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
        rec.completion_tokens = chunk["usage"]["completion_tokens"]
        rec.cached = cached_by_tier(chunk)
    return last


async def read_stream(resp: aiohttp.ClientResponse, rec: bm.Record) -> None:
    last = rec.start
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith(SSE_DATA):
            continue
        data, now = line[len(SSE_DATA):], time.perf_counter()
        if data == SSE_DONE:
            rec.latency = now - rec.start
            return
        last = take_chunk(rec, json.loads(data), now, last)
    rec.error = rec.error or "the stream ended without [DONE]"


async def send_completion(session: aiohttp.ClientSession, base_url: str, prompt: list[int],
                          turn: bm.Turn, max_tokens: int) -> bm.Record:
    """One streamed completion; never raises (a failure is recorded in `error`)."""
    rec = bm.Record(turn.client, turn.round, start=time.perf_counter(), server=base_url)
    try:
        async with session.post(f"{base_url}/v1/completions",
                                json=completion_body(prompt, max_tokens)) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return rec
            await read_stream(resp, rec)
    except asyncio.TimeoutError:
        rec.error = f"no answer after {len(rec.output_ids)} tokens (the server hangs?)"
    except (aiohttp.ClientError, json.JSONDecodeError, KeyError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    return rec


def client_session(stall_s: float) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=bm.CONNECT_TIMEOUT_S,
                                    sock_read=stall_s)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))


async def _concurrent(base_url: str, prompts: Sequence[list[int]], max_tokens: int,
                      stall_s: float) -> list[bm.Record]:
    async with client_session(stall_s) as session:
        return list(await asyncio.gather(*(
            send_completion(session, base_url, p, bm.Turn(i, 1), max_tokens)
            for i, p in enumerate(prompts))))


def concurrent(base_url: str, prompts: Sequence[list[int]], max_tokens: int,
               stall_s: float = bm.DEFAULT_STALL_S) -> list[bm.Record]:
    """All `prompts` sent at once; their records in the same order."""
    return asyncio.run(_concurrent(base_url, prompts, max_tokens, stall_s))


class CompletionsRunner(bm.Runner):
    """`bench_multiturn.Runner` (arrivals, chats, at most max_parallel in flight) with each
    turn sent to /v1/completions instead of /generate."""

    async def _send(self, session: aiohttp.ClientSession, server: str, prompt: list[int],
                    turn: bm.Turn) -> bm.Record:
        return await send_completion(session, server, prompt, turn, self.args.output_length)


# --------------------------------------------------------------------------- measurements


def calibration_prompts(seed: int, purpose: str, count: int, length: int) -> list[list[int]]:
    """`count` random token-id prompts of `length`, the same for the same arguments."""
    rng = np.random.default_rng([seed, PURPOSES.index(purpose) + 1])
    return [rng.integers(bm.BYTE_VOCAB, size=length).tolist() for _ in range(count)]


def decode_step_s(recs: Sequence[bm.Record]) -> float | None:
    """Mean time between tokens over the streams: first token to last, over the gaps."""
    gaps = sum(len(r.output_ids) - 1 for r in recs)
    if any(r.error for r in recs) or gaps <= 0:
        return None
    return sum(sum(r.itl) for r in recs) / gaps


def calibrate(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, then the uncached prefill (median of the prompts', one at a time) and the
    decode step at batch 1 and at batch `decode_batch` (seconds)."""
    def prompts(purpose: str, count: int, length: int) -> list[list[int]]:
        return calibration_prompts(args.seed, purpose, count, length)

    warm = prompts("warmup", args.decode_batch, WARMUP_PROMPT_TOKENS)
    concurrent(base_url, warm, WARMUP_MAX_TOKENS)
    prefill = [concurrent(base_url, [p], 1)[0]
               for p in prompts("prefill", args.prefill_repeats, args.prefill_tokens)]
    b1 = concurrent(base_url, prompts("decode_b1", 1, DECODE_PROMPT_TOKENS), args.decode_tokens)
    bn = concurrent(base_url, prompts("decode_batch", args.decode_batch, DECODE_PROMPT_TOKENS),
                    args.decode_tokens)
    errors = [r.error for r in (*prefill, *b1, *bn) if r.error]
    ttfts = [r.ttft for r in prefill if not r.error]
    return {"prefill_s": statistics.median(ttfts) if ttfts else None,
            "prefill_each_s": ttfts, "prefill_cached_tokens": [sum(r.cached.values())
                                                               for r in prefill],
            "decode_b1_s": decode_step_s(b1), "decode_batch_s": decode_step_s(bn),
            "errors": errors[:bm.ERRORS_SHOWN]}


def multiturn(base_url: str, args: argparse.Namespace, label: str,
              no_reuse: bool = False) -> dict[str, Any]:
    """The multi-turn workload against one server: bench_multiturn's summary, the mean TTFT
    of rounds >= 2, and per request its chat, round, TTFT, cached tokens and answer."""
    wargs = bm.workload_args(args, label, no_reuse)
    runner = CompletionsRunner(wargs, bm.make_workload(wargs), range(1, args.rounds + 1),
                               lambda turn: base_url)
    duration = asyncio.run(runner.run())
    summary = bm.summarize(runner.records, duration, args.output_length)
    later = [r.ttft for r in runner.records if r.round >= 2 and not r.error]
    return {**summary, "ttft_after_first_s": statistics.fmean(later) if later else None,
            "records": [{"client": r.client, "round": r.round, "ttft_s": bm._num(r.ttft),
                         "prompt_tokens": r.prompt_tokens, "cached": r.cached,
                         "output_ids": r.output_ids, "error": r.error}
                        for r in sorted(runner.records, key=lambda r: (r.round, r.client))]}


def run_server(spec: ServerSpec, args: argparse.Namespace, rep: int) -> dict[str, Any]:
    """One pass on one server: start it, calibrate, run the multi-turn workload, stop it."""
    print(f"[pass {rep + 1}] {spec.label}: starting", file=sys.stderr, flush=True)
    started = time.monotonic()
    with serve(spec, args) as ep:
        startup_s = time.monotonic() - started
        print(f"[pass {rep + 1}] {spec.label}: up in {startup_s:.0f} s at {ep.base_url}; "
              "calibrating, then multi-turn", file=sys.stderr, flush=True)
        cal = calibrate(ep.base_url, args)
        mt = multiturn(ep.base_url, args, f"{spec.label} #{rep + 1}")
        docs = asyncio.run(ask_long_docs(ep.base_url, args)) if args.long_docs else None
        return {"label": spec.label, "engine": spec.engine, "pass": rep + 1,
                "command": ep.command, "log": rm._shown(ep.log_path), "startup_s": startup_s,
                "kv_tokens_usable": ep.kv_tokens_usable(), "calibration": cal,
                "multiturn": mt, "long_docs": docs}


async def ask_long_docs(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The long-document workload (`long_docs`) against one server, one question at a time."""
    async with client_session(bm.DEFAULT_STALL_S) as session:
        async def send(prompt: list[int], doc: int, index: int) -> bm.Record:
            return await send_completion(session, base_url, prompt, bm.Turn(doc, index + 1),
                                         long_docs.ANSWER_TOKENS)
        return await long_docs.run(args.long_docs, args.seed, send)


def run_all(args: argparse.Namespace, specs: Sequence[ServerSpec]) -> list[dict[str, Any]]:
    runs = []
    for rep in range(args.passes):
        for spec in specs if rep % 2 == 0 else reversed(specs):
            runs.append(run_server(spec, args, rep))
    return runs


# ------------------------------------------------------------------------------ analysis


class Spread(NamedTuple):
    """One metric of one server over the passes (None: no pass measured it)."""

    median: float | None
    min: float | None
    max: float | None
    each: list[float | None]


def spread(values: Sequence[float | None]) -> Spread:
    got = [v for v in values if v is not None]
    if not got:
        return Spread(None, None, None, list(values))
    return Spread(statistics.median(got), min(got), max(got), list(values))


# (key, where in a run, higher is better)
METRICS: tuple[tuple[str, Callable[[dict[str, Any]], float | None], bool], ...] = (
    ("prefill_s", lambda r: r["calibration"]["prefill_s"], False),
    ("decode_b1_s", lambda r: r["calibration"]["decode_b1_s"], False),
    ("decode_batch_s", lambda r: r["calibration"]["decode_batch_s"], False),
    ("request_throughput", lambda r: r["multiturn"]["request_throughput"], True),
    ("ttft_after_first_s", lambda r: r["multiturn"]["ttft_after_first_s"], False),
    ("hit_rate", lambda r: r["multiturn"]["hit_rate"]["all"], True),
    ("long_docs_ttft_s", lambda r: (r.get("long_docs") or {}).get("ttft_later_s"), False),
    ("long_docs_cached", lambda r: (r.get("long_docs") or {}).get("later_cached_share"), True),
)
HIGHER_IS_BETTER = {key: up for key, _, up in METRICS}


def speed_ratio(key: str, hicache: float | None, vllm: float | None) -> float | None:
    """hicache / vLLM as speed (above 1: hicache faster): vLLM's time over hicache's, or
    hicache's throughput over vLLM's."""
    if HIGHER_IS_BETTER[key]:
        return mr.ratio(hicache, vllm)
    return mr.ratio(vllm, hicache)


def same_tokens(run: dict[str, Any], ref: dict[str, Any]) -> tuple[int, int]:
    """(answers equal to `ref`'s for the same chat and round, answers compared)."""
    ref_ids = answer_ties.records(ref)
    pairs = [(ids, ref_ids[turn]) for turn, ids in answer_ties.records(run).items()
             if turn in ref_ids]
    return sum(a == b for a, b in pairs), len(pairs)


def summarize_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per server: every metric's spread over the passes, its ratio against its vLLM
    counterpart (medians), errors, and its answers against the reference run's."""
    labels = list(dict.fromkeys(r["label"] for r in runs))
    by_label = {k: [r for r in runs if r["label"] == k] for k in labels}
    ref = by_label.get(VLLM_PREFIX, by_label[labels[0]])[0]
    out: dict[str, Any] = {"reference": f"{ref['label']} pass {ref['pass']}", "servers": {}}
    for label, rs in by_label.items():
        metrics = {key: spread([get(r) for r in rs]) for key, get, _ in METRICS}
        same = [same_tokens(r, ref) for r in rs if r is not ref]
        out["servers"][label] = {
            "engine": rs[0]["engine"], "passes": len(rs), "metrics": metrics,
            "errors": sum(r["multiturn"]["errors"] + len(r["calibration"]["errors"])
                          for r in rs),
            "kv_tokens_usable": sorted({r["kv_tokens_usable"] for r in rs},
                                         key=lambda v: v or 0),
            "same_tokens": [sum(s[0] for s in same), sum(s[1] for s in same)]}
    for label, s in out["servers"].items():
        vs = COUNTERPART.get(label)
        other = out["servers"].get(vs, {}).get("metrics")
        s["vs"] = vs if other else None
        s["ratios"] = {key: speed_ratio(key, m.median, other[key].median) if other else None
                       for key, m in s["metrics"].items()
                       if key not in ("hit_rate", "long_docs_cached")}
        s["long_docs_same"] = long_docs_same(by_label[label], ref)
    return out


def long_docs_same(runs: Sequence[dict[str, Any]], ref: dict[str, Any]) -> list[int]:
    """[answers equal to `ref`'s for the same document and question, answers compared]
    over the long-document workload of `runs` (other than `ref` itself)."""
    if not ref.get("long_docs"):
        return [0, 0]
    want = {(r["doc"], r["question"]): r["output_ids"] for r in ref["long_docs"]["records"]}
    pairs = [(r["output_ids"], want[(r["doc"], r["question"])])
             for run in runs if run is not ref and run.get("long_docs")
             for r in run["long_docs"]["records"] if (r["doc"], r["question"]) in want]
    return [sum(a == b for a, b in pairs), len(pairs)]


# -------------------------------------------------------------------------------- tables


def fmt_spread(s: Spread, best_high: bool, fmt: Callable[[float | None], str]) -> str:
    """`median (best)`: the best pass is the lowest time or the highest throughput."""
    if s.median is None:
        return "—"
    if len([v for v in s.each if v is not None]) == 1:
        return fmt(s.median)
    return f"{fmt(s.median)} ({fmt(s.max if best_high else s.min)})"


def fmt_rate(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def _cells(srv: dict[str, Any], key: str, fmt: Callable[[float | None], str]) -> str:
    m = srv["metrics"][key]
    return (f"{fmt_spread(m, HIGHER_IS_BETTER[key], fmt)} "
            f"| {mr.fmt_x(srv['ratios'].get(key)) if srv['vs'] else ''}")


def calibration_table(summary: dict[str, Any], decode_batch: int) -> str:
    head = ("| server | prefill (ms) | vs vLLM | decode step, batch 1 (ms) | vs vLLM "
            f"| decode step, batch {decode_batch} (ms) | vs vLLM | KV tokens (log) |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, s in summary["servers"].items():
        kv = ", ".join("—" if v is None else f"{v:,}" for v in s["kv_tokens_usable"])
        lines.append(f"| {label} | {_cells(s, 'prefill_s', bm.fmt_ms)} "
                     f"| {_cells(s, 'decode_b1_s', fmt_ms1)} "
                     f"| {_cells(s, 'decode_batch_s', fmt_ms1)} | {kv} |")
    return "\n".join(lines)


def fmt_ms1(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:,.1f}"


def multiturn_table(summary: dict[str, Any]) -> str:
    head = ("| server | req/s | vs vLLM | TTFT r>=2 (ms) | vs vLLM | hit rate "
            f"| same tokens as {summary['reference']} | errors |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, s in summary["servers"].items():
        same, total = s["same_tokens"]
        lines.append(f"| {label} | {_cells(s, 'request_throughput', fmt_rate)} "
                     f"| {_cells(s, 'ttft_after_first_s', bm.fmt_ms)} "
                     f"| {fmt_spread(s['metrics']['hit_rate'], True, bm.fmt_pct)} "
                     f"| {f'{same} of {total}' if total else '—'} | {s['errors']} |")
    return "\n".join(lines)


def long_docs_table(summary: dict[str, Any]) -> str:
    head = ("| server | TTFT, questions 2-4 (ms) | vs vLLM | their prompt from a cache "
            f"| same tokens as {summary['reference']} |")
    lines = [head, "|---|---:|---:|---:|---:|"]
    for label, s in summary["servers"].items():
        same, total = s["long_docs_same"]
        lines.append(f"| {label} | {_cells(s, 'long_docs_ttft_s', bm.fmt_ms)} "
                     f"| {fmt_spread(s['metrics']['long_docs_cached'], True, bm.fmt_pct)} "
                     f"| {f'{same} of {total}' if total else '—'} |")
    return "\n".join(lines)


def print_report(report: dict[str, Any]) -> None:
    a, m, s = report["args"], report["machine"], report["summary"]
    v = report["versions"]
    engines = f"hicache vs vLLM {v['vllm']}" if v["vllm"] else "hicache (no vLLM run)"
    print(f"\n{engines}, {report['date']}: {m['cpu']}, {m['cores']} cores, GPU: "
          f"{m['gpu'] or 'none'}; {Path(a['model_path']).name} in {a['dtype']}, KV "
          f"{a['kv_tokens']:,} tokens, page {a['page_size']}, {MAX_RUNNING_REQUESTS} running, "
          f"{MAX_BATCH_TOKENS} batched tokens; {_n(a['passes'], 'pass', 'passes')}: median "
          "(best pass); vs vLLM is speed (above 1: hicache faster), no cache against vLLM "
          "no cache, the cached ones against vLLM prefix cache"
          f"{preload_clause(v)}.\n")
    print(f"Calibration: prefill of {a['prefill_tokens']:,} uncached tokens (median of "
          f"{_n(a['prefill_repeats'], 'prompt', 'prompts')}), decode of {a['decode_tokens']} "
          f"tokens after {DECODE_PROMPT_TOKENS}-token prompts; KV tokens as each log reports "
          "them (vLLM's less its null block):\n")
    print(calibration_table(s, a["decode_batch"]))
    print(f"\nMulti-turn: {a['clients']} chats x {a['rounds']} rounds, "
          f"{a['system_prompt_length']}-token shared system prompt, {a['request_length']}-token "
          f"questions, {a['output_length']}-token answers, over /v1/completions:\n")
    print(multiturn_table(s))
    if a.get("long_docs"):
        print(f"\nLong documents: {a['long_docs']} documents of "
              f"{long_docs.DOC_TOKENS[0]:,}-{long_docs.DOC_TOKENS[1]:,} tokens, "
              f"{long_docs.QUESTIONS} questions each asked round-robin one at a time, "
              f"{long_docs.ANSWER_TOKENS}-token answers:\n")
        print(long_docs_table(s))
    if report.get("ties"):
        print("\n" + answer_ties.ties_table(report["ties"], s["reference"]))
    print(f"\nJSON: {report['out']}; server logs: {rm._shown(LOG_DIR)}")


def _n(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"


# ---------------------------------------------------------------------------------- main


def venv_versions(python: Path | None) -> dict[str, str | None]:
    """torch and vLLM as installed for `python` (the vLLM venv; None: this interpreter)."""
    code = ("import importlib.metadata as m, json\n"
            "def v(*names):\n"
            "    for n in names:\n"
            "        try:\n"
            "            return m.version(n)\n"
            "        except m.PackageNotFoundError:\n"
            "            pass\n"
            "print(json.dumps({'torch': v('torch'), 'vllm': v('vllm', 'vllm-cpu')}))")
    if python is None:
        return {"torch": importlib.metadata.version("torch"), "vllm": None}
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {"torch": None, "vllm": None}
    return json.loads(out.stdout)


def model_folder(model: str | None) -> Path:
    """The HF folder both engines serve: the embedded model's (written once under
    $HICACHE_HOME), a local folder, or for a GGUF (a name or a file) the folder of its
    dequantised float32 weights, exported once beside its companion folder."""
    from hicache_server.models.gguf import export_hf_folder
    from hicache_server.models.loader import resolve_model

    source = resolve_model(model or EMBEDDED_MODEL)
    if source.gguf is None:
        return source.folder
    export = source.folder.parent / f"{source.folder.name}-hf-float32"
    return export_hf_folder(source.gguf, source.folder, export)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: one pass, 2 chats x 2 rounds, short prompts (flags given "
                         "explicitly still win)")
    ap.add_argument("--only", choices=(HICACHE, VLLM), default=None,
                    help="run one engine's servers only")
    ap.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON,
                    help="the interpreter of the venv vLLM is installed in")
    ap.add_argument("--model", "--model-path", dest="model", default=None,
                    help="a model name (smollm2-135m-instruct), a .gguf file or a local HF "
                         "folder (default: the embedded model); a GGUF is served to both "
                         "engines as the HF folder of its dequantised weights")
    ap.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="float32")
    ap.add_argument("--kv-tokens", type=int, default=DEFAULT_KV_TOKENS,
                    help="KV capacity of every server in tokens (hicache's L1)")
    ap.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE,
                    help="hicache's page size and vLLM's block size, in tokens")
    ap.add_argument("--passes", type=int, default=DEFAULT_PASSES)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--system-prompt-length", type=int, default=512)
    ap.add_argument("--request-length", type=int, default=256)
    ap.add_argument("--output-length", type=int, default=32)
    ap.add_argument("--prefill-tokens", type=int, default=DEFAULT_PREFILL_TOKENS)
    ap.add_argument("--prefill-repeats", type=int, default=DEFAULT_PREFILL_REPEATS)
    ap.add_argument("--decode-tokens", type=int, default=DEFAULT_DECODE_TOKENS)
    ap.add_argument("--decode-batch", type=int, default=DEFAULT_DECODE_BATCH)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cached-only", action="store_true",
                    help="only the servers that cache (no 'no cache' ones): a shorter run")
    ap.add_argument("--long-docs", type=int, default=0, metavar="N",
                    help="also the long-document workload: N documents of 3-6k tokens, 4 "
                         "questions each (benchmarks/long_docs.py); 0: not run")
    ap.add_argument("--vllm-args", default="", help="more flags for every vLLM server")
    ap.add_argument("--hicache-args", default="", help="more flags for every hicache server")
    ap.add_argument("--startup-timeout", type=float, default=VLLM_STARTUP_TIMEOUT_S,
                    help="seconds a vLLM server may take to answer /health")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"JSON report (default {rm._shown(DEFAULT_OUT)}; with --quick "
                         f"{rm._shown(QUICK_OUT)})")
    return ap


POSITIVE = ("kv_tokens", "page_size", "passes", "clients", "rounds", "request_length",
            "output_length", "prefill_tokens", "prefill_repeats", "decode_tokens",
            "decode_batch")


def largest_request(args: argparse.Namespace) -> int:
    """Tokens (prompt + answer) of the longest single request, and of the decode batch."""
    last = bm.prompt_length(bm.workload_args(args), args.rounds) + args.output_length
    return max(last, args.prefill_tokens + 1,
               args.decode_batch * (DECODE_PROMPT_TOKENS + args.decode_tokens),
               long_docs.longest_request(args.long_docs, args.seed))


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    bad = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in POSITIVE
           if getattr(args, k) < 1]
    if bad or args.system_prompt_length < 0 or args.long_docs < 0:
        ap.error(f"{', '.join(bad) or '--system-prompt-length or --long-docs'}: must be >= 1 "
                 "(the system prompt and long documents >= 0)")
    if args.kv_tokens % args.page_size:
        ap.error(f"--kv-tokens ({args.kv_tokens}) must be a multiple of --page-size "
                 f"({args.page_size})")
    if args.only != HICACHE and args.page_size % VLLM_CPU_BLOCK_MULTIPLE:
        ap.error(f"--page-size must be a multiple of {VLLM_CPU_BLOCK_MULTIPLE} (vLLM's CPU "
                 f"attention), got {args.page_size}")
    if args.prefill_tokens > MAX_BATCH_TOKENS:
        ap.error(f"--prefill-tokens must be <= {MAX_BATCH_TOKENS} (one step's batched "
                 f"tokens), got {args.prefill_tokens}")
    if largest_request(args) > args.kv_tokens:
        ap.error(f"--kv-tokens ({args.kv_tokens}) must hold the largest request or decode "
                 f"batch ({largest_request(args)} tokens)")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Flags; `--quick` changes the defaults (an explicit flag still wins). Exits with
    code 2 on a bad value. Does not resolve the model folder (`resolve_paths` does)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.quick:
        ap.set_defaults(**QUICK)
        args = ap.parse_args(argv)
    args.out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    check_args(ap, args)
    return args


def resolve_paths(args: argparse.Namespace) -> None:
    """The model folder (writing the embedded model when it is missing), the log folder,
    and a check that the vLLM interpreter exists when vLLM runs."""
    try:
        args.model_path = model_folder(args.model).resolve()
    except (OSError, ValueError) as e:
        raise SystemExit(f"--model {args.model}: {e}") from None
    if not (args.model_path / "config.json").is_file():
        raise SystemExit(f"--model {args.model_path}: no config.json there")
    if args.only != HICACHE and not args.vllm_python.exists():
        raise SystemExit(f"--vllm-python {args.vllm_python} does not exist: install vLLM with "
                         "`make bench-vs-vllm`, or pass --only hicache")
    args.log_dir = LOG_DIR
    args.log_dir.mkdir(parents=True, exist_ok=True)


def build_report(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    vllm = venv_versions(args.vllm_python) if args.only != HICACHE else {}
    shown = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
             if k != "log_dir"}
    return {
        **rm.report_stamp(),
        "versions": {"hicache_torch": venv_versions(None)["torch"],
                     "vllm_torch": vllm.get("torch"), "vllm": vllm.get("vllm"),
                     "vllm_preload": (preload_names(args.vllm_python)
                                      if args.only != HICACHE else None)},
        "args": shown, "limits": {"max_running": MAX_RUNNING_REQUESTS,
                                  "max_batched_tokens": MAX_BATCH_TOKENS},
        "summary": summarize_runs(runs), "runs": runs, "out": rm._shown(args.out),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, rm._exit_on_sigterm)  # unwinds: every server stops
    resolve_paths(args)
    try:
        runs = run_all(args, server_specs(args))
    except ServerStartError as e:
        raise SystemExit(str(e)) from None
    report = build_report(args, runs)
    report["ties"] = answer_ties.ties(report, bm.workload_args(args))
    rm.write_report(as_json(report), args.out)
    print_report(report)
    return report


def as_json(value: Any) -> Any:
    """`value` with every Spread as an object (json writes a NamedTuple as a list)."""
    if isinstance(value, Spread):
        return value._asdict()
    if isinstance(value, dict):
        return {k: as_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    return value


if __name__ == "__main__":
    main()
