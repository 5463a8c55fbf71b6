"""vLLM's CPU build with HiCacheConnector inside (`make test-integrations`: vLLM in .venv-vllm,
SmolLM2-135M-Instruct in float32): a restarted server answers from hicache's L3 with the
tokens of vLLM without the connector, its L3 hits loaded within their step (the default);
a corrupted stored page is recomputed, never served; two servers share their pages through
one Redis; a request given up on during an asynchronous L3 load costs nothing.

Every server is a real `vllm.entrypoints.openai.api_server` (`--enforce-eager`: the same
kernels, without minutes of compilation per start); `usage.prompt_tokens_details.
cached_tokens` is vLLM's count of the prompt tokens it did not compute (its own prefix cache
and the connector's; after a restart its own is empty).
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest
import redis

REPO = Path(__file__).resolve().parents[2]

from redis_fixtures import RedisServer, require_redis_server

from benchmarks import bench_vs_vllm as bv
from benchmarks.bench_l3_overlap import proxy_process
from benchmarks.bench_vllm_connector import lmdb_pages
from hicache.pages import window_start

pytestmark = pytest.mark.integrations

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
MODEL = "smollm2-135m-instruct"
BLOCK = 128  # vLLM's CPU block size (its default)
PROMPT_TOKENS = 1500
HIT_TOKENS = (PROMPT_TOKENS - 1) // BLOCK * BLOCK  # whole blocks, short of the last token
PAGES_PER_PROMPT = HIT_TOKENS // BLOCK
ANSWER_TOKENS = 8
START_TIMEOUT_S = 600.0
WRITE_TIMEOUT_S = 60.0  # L3 writes run beside serving: wait for them before a restart
KV_BYTES = 200_000_000
L2_TEST_KV_BYTES = 20 * 128 * 46_080  # 20 blocks of 128 tokens (46,080 bytes a token)
L2_TEST_MAX_LEN = 2048  # vLLM refuses to start with less KV than one request this long
# 11 pages of 5.9 MB through a 20 MB/s link: a load of ~3 s, given up on after 1 s
SLOW_LINK_BYTES_PER_S = 20e6
ABORT_AFTER_S = 1.0
SEED = 0


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(SEED)
    return [[rng.randrange(100, 20000) for _ in range(PROMPT_TOKENS)] for _ in range(n)]


def connector_config(extra: dict[str, Any]) -> str:
    return json.dumps({"kv_connector": "HiCacheConnector",
                       "kv_connector_module_path": "hicache.integrations.vllm",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": extra})


def server(log_dir: Path, label: str, extra: dict[str, Any] | None,
           kv_bytes: int = KV_BYTES, max_len: int = 4096,
           model: Path | None = None) -> bv.VllmServer:
    if not VLLM_PYTHON.exists():
        pytest.skip("vLLM is not installed: `make test-integrations` installs it")
    model = model or bv.model_folder(MODEL)
    flags = ["--model", str(model), "--served-model-name", "smol", "--dtype", "float32",
             "--kv-cache-memory-bytes", str(kv_bytes), "--max-model-len", str(max_len),
             "--enable-prompt-tokens-details", "--enforce-eager", "--seed", str(SEED),
             "--uvicorn-log-level", "warning"]
    if extra is not None:
        flags += ["--kv-transfer-config", connector_config(extra)]
    return bv.VllmServer(label, VLLM_PYTHON, flags, log_dir, START_TIMEOUT_S)


def completion(base_url: str, prompt: list[int], timeout_s: float = 300) -> dict[str, Any]:
    """vLLM's answer to `prompt`, greedy, with each token's logprob."""
    body = {"model": "smol", "prompt": prompt, "max_tokens": ANSWER_TOKENS, "temperature": 0,
            "logprobs": 0}
    req = urllib.request.Request(f"{base_url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.load(resp)


def complete(base_url: str, prompt: list[int], timeout_s: float = 300) -> tuple[list[str], int]:
    """(the greedy answer's text pieces, vLLM's cached prompt tokens)."""
    out = completion(base_url, prompt, timeout_s)
    tokens = out["choices"][0]["logprobs"]["tokens"]
    return tokens, out["usage"]["prompt_tokens_details"]["cached_tokens"]


def wait_for(count: Any, want: int) -> None:
    """Until `count()` reaches `want` (the connector's L3 writes, behind serving)."""
    deadline = time.monotonic() + WRITE_TIMEOUT_S
    while count() < want:
        assert time.monotonic() < deadline, f"L3 holds {count()} pages, not {want}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="module")
def reference(log_dir: Path) -> list[list[str]]:
    """vLLM's answers without the connector."""
    with server(log_dir, "vllm-alone", None) as s:
        return [complete(s.base_url, p)[0] for p in prompts(3)]


@pytest.fixture
def l3(tmp_path: Path) -> Iterator[dict[str, Any]]:
    yield {"host_size_gb": 0.1, "storage_backend": "lmdb",
           "lmdb": {"path": str(tmp_path / "l3")}}


def test_a_restarted_server_answers_from_l3_with_vllms_tokens(
        log_dir: Path, reference: list[list[str]], l3: dict[str, Any]) -> None:
    path = Path(l3["lmdb"]["path"])
    with server(log_dir, "connector-first", l3) as s:
        for p, ref in zip(prompts(2), reference):
            assert complete(s.base_url, p) == (ref, 0)
        wait_for(lambda: lmdb_pages(path), 2 * PAGES_PER_PROMPT)
    with server(log_dir, "connector-restarted", l3) as s:
        for p, ref in zip(prompts(2), reference):
            assert complete(s.base_url, p) == (ref, HIT_TOKENS)


def test_a_corrupted_page_is_recomputed_never_served(
        log_dir: Path, reference: list[list[str]], l3: dict[str, Any]) -> None:
    path = Path(l3["lmdb"]["path"])
    with server(log_dir, "connector-to-corrupt", l3) as s:
        assert complete(s.base_url, prompts(1)[0]) == (reference[0], 0)
        wait_for(lambda: lmdb_pages(path), PAGES_PER_PROMPT)
    with lmdb.open(str(path), max_dbs=2, map_size=1 << 33) as env:  # every page: a bit flipped
        db = env.open_db(b"pages")
        with env.begin(write=True, db=db) as txn:
            for key, value in list(txn.cursor()):
                flipped = bytearray(value)
                flipped[-1] ^= 0x10
                txn.put(key, bytes(flipped))
    with server(log_dir, "connector-corrupted", l3) as s:
        # vLLM counts the planned load in cached_tokens even when it recomputes it: the
        # answer and the connector's report tell
        assert complete(s.base_url, prompts(1)[0])[0] == reference[0]
        assert complete(s.base_url, prompts(2)[1]) == (reference[1], 0)  # still serving
        log = s.log_path.read_text(errors="replace")
        # the bad values were dropped as they were read, and the blocks vLLM computed
        # again stored anew
        wait_for(lambda: lmdb_pages(path), 2 * PAGES_PER_PROMPT)
    assert f"{PAGES_PER_PROMPT} of {PAGES_PER_PROMPT} L3 pages could not be loaded" in log
    with server(log_dir, "connector-healed", l3) as s:
        assert complete(s.base_url, prompts(1)[0]) == (reference[0], HIT_TOKENS)


def test_two_servers_share_pages_through_one_redis(
        log_dir: Path, reference: list[list[str]], tmp_path: Path) -> None:
    require_redis_server()
    with RedisServer.start(tmp_path) as rs:
        shared = {"host_size_gb": 0.1, "storage_backend": "redis", "redis": {"url": rs.url}}
        client = redis.Redis.from_url(rs.url)
        with server(log_dir, "redis-a", shared) as a, server(log_dir, "redis-b", shared) as b:
            assert complete(a.base_url, prompts(1)[0]) == (reference[0], 0)
            wait_for(lambda: client.dbsize(), PAGES_PER_PROMPT)
            assert complete(b.base_url, prompts(1)[0]) == (reference[0], HIT_TOKENS)
            assert complete(b.base_url, prompts(2)[1]) == (reference[1], 0)
            wait_for(lambda: client.dbsize(), 2 * PAGES_PER_PROMPT)
            assert complete(a.base_url, prompts(2)[1]) == (reference[1], HIT_TOKENS)


def kv_usage(base_url: str) -> float:
    """vLLM's `kv_cache_usage_perc`: the share of its blocks that requests hold."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("vllm:kv_cache_usage_perc")))


def test_prefixes_vllm_evicted_come_back_from_l2_layer_by_layer(
        log_dir: Path, reference: list[list[str]]) -> None:
    """A KV of 20 blocks: each 12-block prompt evicts the one before it from vLLM's own
    prefix cache, and the first comes back from hicache's host memory."""
    with server(log_dir, "connector-l2", {"host_size_gb": 0.5, "storage_backend": "none"},
                kv_bytes=L2_TEST_KV_BYTES, max_len=L2_TEST_MAX_LEN) as s:
        for p, ref in zip(prompts(3), reference):
            assert complete(s.base_url, p) == (ref, 0)
        assert complete(s.base_url, prompts(1)[0]) == (reference[0], HIT_TOKENS)
        log = s.log_path.read_text(errors="replace")
    assert "loads land layer by layer from now on" in log


def test_a_request_aborted_while_its_l3_load_is_in_flight_costs_nothing(
        log_dir: Path, reference: list[list[str]], tmp_path: Path) -> None:
    """Its L3 pages come through a slow link (the load takes seconds) and load
    asynchronously (`l3_step_load_mb` 0); the client gives up during the load. vLLM holds
    the request's blocks until the connector reports the load done, then frees them: the
    server goes on answering, right, and holds no block after."""
    require_redis_server()
    with RedisServer.start(tmp_path) as rs:
        direct = {"host_size_gb": 0.1, "storage_backend": "redis", "redis": {"url": rs.url},
                  "l3_step_load_mb": 0}
        with server(log_dir, "abort-fill", direct) as s:
            assert complete(s.base_url, prompts(1)[0]) == (reference[0], 0)
            wait_for(lambda: redis.Redis.from_url(rs.url).dbsize(), PAGES_PER_PROMPT)
        port = int(rs.url.rsplit(":", 1)[1].split("/")[0])
        with proxy_process(port, SLOW_LINK_BYTES_PER_S) as slow_port:
            slow = {**direct, "redis": {"url": f"redis://127.0.0.1:{slow_port}/0"}}
            with server(log_dir, "abort-slow", slow) as s:
                with pytest.raises(TimeoutError):
                    complete(s.base_url, prompts(1)[0], timeout_s=ABORT_AFTER_S)
                assert complete(s.base_url, prompts(2)[1]) == (reference[1], 0)
                started = time.monotonic()
                assert complete(s.base_url, prompts(1)[0]) == (reference[0], HIT_TOKENS)
                # the link's bound, not a speed: the same load again outlasts the time
                # the client gave the first, which was given up on during its load
                assert time.monotonic() - started > ABORT_AFTER_S
                assert kv_usage(s.base_url) == 0.0
                log = s.log_path.read_text(errors="replace")
    assert "Traceback" not in log


# A hybrid model: random-weight Gemma 3 (tests/test_gemma3_tiers.py: six layers, two of full
# attention, four of a 40-token window), which vLLM serves with its hybrid KV cache manager:
# three groups of two layers (full, window, window), each group's blocks its own.
GEMMA_GROUPS = 3
GEMMA_MAX_LEN = 2048  # its max_position_embeddings
GEMMA_WINDOW = 40
# L3 by kind: the full group's unit of every block, a window group's only of the blocks a
# query at the prompt's end reads (here the last: 1,369 of 1,408 lies in block 10 of 11)
GEMMA_WINDOW_PAGES = PAGES_PER_PROMPT - window_start(HIT_TOKENS, GEMMA_WINDOW, BLOCK) // BLOCK
GEMMA_PAGES = PAGES_PER_PROMPT + (GEMMA_GROUPS - 1) * GEMMA_WINDOW_PAGES
GEMMA_VOCAB = 256  # the byte tokenizer's bytes (its vocabulary: 300)
LOGPROB_TOLERANCE = 1e-3  # the same KV read in one chunk or two: float32 sums reordered
HMA_OFF = "Turning off hybrid kv cache manager"  # vLLM's warning when a connector lacks HMA


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_gemma3_tiers import write_random_gemma3
    return write_random_gemma3(tmp_path_factory.mktemp("gemma3"))


def answer(base_url: str, prompt: list[int]) -> tuple[list[str], list[float], int]:
    """(tokens, their logprobs, vLLM's cached prompt tokens)."""
    out = completion(base_url, prompt)
    logprobs = out["choices"][0]["logprobs"]
    return (logprobs["tokens"], logprobs["token_logprobs"],
            out["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_gemma3_keeps_vllms_hybrid_manager_and_replays_from_l3(
        log_dir: Path, gemma3: Path, l3: dict[str, Any]) -> None:
    """vLLM keeps its hybrid manager with the connector (it subclasses SupportsHMA); a
    restarted server loads the prompt's full and window units from L3 and answers with the
    tokens (and logprobs) of vLLM without the connector."""
    rng = random.Random(SEED)
    prompt = [rng.randrange(GEMMA_VOCAB) for _ in range(PROMPT_TOKENS)]
    path = Path(l3["lmdb"]["path"])
    with server(log_dir, "gemma3-alone", None, max_len=GEMMA_MAX_LEN, model=gemma3) as s:
        tokens, logprobs, _ = answer(s.base_url, prompt)
    with server(log_dir, "gemma3-first", l3, max_len=GEMMA_MAX_LEN, model=gemma3) as s:
        assert answer(s.base_url, prompt)[::2] == (tokens, 0)
        wait_for(lambda: lmdb_pages(path), GEMMA_PAGES)
        log = s.log_path.read_text(errors="replace")
    assert HMA_OFF not in log and f"{GEMMA_GROUPS} KV cache group(s)" in log
    with server(log_dir, "gemma3-restarted", l3, max_len=GEMMA_MAX_LEN,
                model=gemma3) as s:
        again, again_logprobs, cached = answer(s.base_url, prompt)
        log = s.log_path.read_text(errors="replace")
    assert (again, cached) == (tokens, HIT_TOKENS)
    assert again_logprobs == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE)
    assert HMA_OFF not in log and "could not be loaded" not in log
