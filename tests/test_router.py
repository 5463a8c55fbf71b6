"""SGLang's router (sglang-router, its own venv `.venv-router`: `make router-venv`) in front
of two real hicache servers on loopback: every generation route through it, the same greedy
tokens as a server asked directly, `cache_aware` keeping a conversation on one server, the
routes the router calls on its workers all answered, and a dead worker failing only its own
requests. Skips when `.venv-router` is missing. Also `/get_load`, which the router polls.

Everything started here (two servers, two routers) is stopped when the module ends, also on
a failure (context managers in a module fixture); ports are free ones picked at start."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from conftest import missing_tool

from benchmarks import bench_router as br
from benchmarks import run_multiturn as rm

PAGE = 16
MAX_NEW = 8
TIMEOUT_S = 120.0  # one CPU request through the router; a hang fails the test, not CI
SEED = 18
FIRST_PROMPT = 160  # round 1 of a test conversation: ten full pages
QUESTION = 32  # round 2 adds this many tokens after round 1's answer
ASCII = (32, 127)  # printable ASCII: one token per character, text and ids alike
# Access-log lines of the servers: `"GET /get_load HTTP/1.1" 404`.
ACCESS = re.compile(r'"(GET|POST|PUT|DELETE) (\S+) HTTP/[\d.]+" (\d{3})')


@pytest.fixture(scope="module")
def router_installed() -> None:
    """`make test` creates .venv-router: skip without it, fail under CI."""
    if not br.ROUTER_PYTHON.exists():
        missing_tool(f"sglang-router is not installed ({br.ROUTER_PYTHON} is missing); "
                     "run `make router-venv` to create .venv-router")


class Fleet(NamedTuple):
    servers: list[rm.Server]
    urls: list[str]
    routers: dict[str, br.Router]  # policy -> router in front of both servers


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[rm.Server], Path]]:
    logs = tmp_path_factory.mktemp("router_logs")
    home = Path(os.environ["HICACHE_HOME"])
    flags = ("--page-size", str(PAGE), "--max-total-tokens", "4096", "--log-level", "info")
    with ExitStack() as stack:
        yield [stack.enter_context(rm.Server(f"worker {i}", flags, home, logs))
               for i in range(2)], logs


@pytest.fixture(scope="module")
def fleet(router_installed: None, servers: tuple[list[rm.Server], Path]) -> Iterator[Fleet]:
    procs, logs = servers
    urls = [f"http://127.0.0.1:{s.port}" for s in procs]
    with ExitStack() as stack:
        routers = {p: stack.enter_context(br.Router(urls, p, logs))
                   for p in (br.ROUND_ROBIN, br.CACHE_AWARE)}
        yield Fleet(procs, urls, routers)


# ---------------------------------------------------------------------------------- HTTP


class Answer(NamedTuple):
    status: int
    body: Any  # the JSON object; for a stream, the list of its events' objects


def post(base: str, path: str, body: dict[str, Any]) -> Answer:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            text = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as e:
        return Answer(e.code, e.read().decode())
    if body.get("stream"):
        events = [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]", text[-300:]
        return Answer(status, [json.loads(e) for e in events[:-1]])
    return Answer(status, json.loads(text))


def get(base: str, path: str) -> Any:
    with urllib.request.urlopen(base + path, timeout=TIMEOUT_S) as resp:
        return json.loads(resp.read())


def greedy(**fields: Any) -> dict[str, Any]:
    return {"sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}, **fields}


def openai(**fields: Any) -> dict[str, Any]:
    """sglang-router requires `model` on the OpenAI routes (a 422 of its own without); any
    name reaches the one model served."""
    return {"model": "any", "max_tokens": MAX_NEW, "temperature": 0, **fields}


def tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def output(path: str, ans: Answer) -> Any:
    """What a greedy answer said, stream or not, in a form to compare."""
    assert ans.status == 200, ans.body
    body = ans.body
    if path == "/generate":
        return (body[-1] if isinstance(body, list) else body)["output_ids"]
    if isinstance(body, list):  # OpenAI chunks: the text (or delta content) added up
        parts = [c["choices"][0].get("text") or c["choices"][0].get("delta", {})
                 .get("content") or "" for c in body if c.get("choices")]
        return "".join(parts)
    choice = body["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


CHAT = [{"role": "user", "content": "Which tier is the fastest?"}]
CASES = {
    "generate text": ("/generate", greedy(text="Hello, router")),
    "generate input_ids": ("/generate", greedy(input_ids=[72, 101, 108, 108, 111, 33])),
    "generate stream": ("/generate", greedy(text="Hello, stream", stream=True)),
    "completions text": ("/v1/completions", openai(prompt="Once upon a time")),
    "completions stream": ("/v1/completions", openai(prompt="Once upon", stream=True)),
    "chat": ("/v1/chat/completions", openai(messages=CHAT)),
    "chat stream": ("/v1/chat/completions", openai(messages=CHAT, stream=True)),
}


# --------------------------------------------------------------------------------- tests


def test_get_load_counts_running_requests_and_their_tokens(
        servers: tuple[list[rm.Server], Path]) -> None:
    base = f"http://127.0.0.1:{servers[0][0].port}"
    assert get(base, "/get_load") == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0,
                                       "num_tokens": 0}]
    prompt = tokens(64, random.Random(SEED))
    seen: list[dict[str, int]] = []
    worker = threading.Thread(target=post, args=(base, "/generate", {
        "input_ids": prompt, "sampling_params": {"max_new_tokens": 48, "temperature": 0,
                                                 "ignore_eos": True}}))
    worker.start()
    while worker.is_alive():
        seen.append(get(base, "/get_load")[0])
        time.sleep(0.05)
    worker.join()
    busy = [s for s in seen if s["num_reqs"] + s["num_waiting_reqs"] == 1]
    assert busy, seen
    assert all(len(prompt) <= s["num_tokens"] <= len(prompt) + 48 for s in busy)
    assert get(base, "/get_load")[0]["num_reqs"] == 0


@pytest.mark.parametrize("case", list(CASES))
def test_each_route_through_the_router_answers_as_a_server_directly(fleet: Fleet,
                                                                    case: str) -> None:
    path, body = CASES[case]
    direct = output(path, post(fleet.urls[0], path, body))
    for policy, router in fleet.routers.items():
        for _ in range(2):  # round_robin: once on each server
            assert output(path, post(router.url, path, body)) == direct, policy


def test_token_id_completions_are_refused_by_the_router_not_the_server(fleet: Fleet) -> None:
    """sglang-router 0.3 parses `/v1/completions`' prompt as text only (a 422 of its own);
    a server asked directly serves it. /generate's `input_ids` is the way through."""
    body = openai(prompt=[72, 101, 108, 108, 111])
    assert post(fleet.urls[0], "/v1/completions", body).status == 200
    ans = post(fleet.routers[br.ROUND_ROBIN].url, "/v1/completions", body)
    if ans.status == 200:  # a later router that passes ids through: then they must match
        assert output("/v1/completions", ans) == output(
            "/v1/completions", post(fleet.urls[0], "/v1/completions", body))
    else:
        assert ans.status == 422 and "prompt" in ans.body, ans


def _conversations(base: str, rng: random.Random, n: int, as_text: bool
                   ) -> list[tuple[int, int]]:
    """`n` two-round conversations through `base`: (round-1 prompt tokens, round-2 cached
    tokens) each. Text prompts are bytes < 128 (one token per character)."""
    out = []
    for _ in range(n):
        first = [rng.randrange(*ASCII) for _ in range(FIRST_PROMPT)]
        def ask(ids: list[int]) -> dict[str, Any]:
            field = {"text": bytes(ids).decode()} if as_text else {"input_ids": ids}
            ans = post(base, "/generate", greedy(**field))
            assert ans.status == 200, ans.body
            return ans.body
        r1 = ask(first)
        history = first + [t for t in r1["output_ids"] if ASCII[0] <= t < ASCII[1]]
        r2 = ask(history + [rng.randrange(*ASCII) for _ in range(QUESTION)])
        out.append((r1["meta_info"]["prompt_tokens"], r2["meta_info"]["cached_tokens"]))
    return out


@pytest.mark.parametrize("as_text", [False, True], ids=["input_ids", "text"])
def test_cache_aware_sends_the_second_round_where_the_first_went(fleet: Fleet,
                                                                 as_text: bool) -> None:
    """A new conversation matches nothing and goes to the least loaded worker (one at a
    time: always the same one, sglang-router breaks ties by order); its second round
    matches the first in the router's tree and follows it."""
    rng = random.Random(SEED + as_text)
    aware = _conversations(fleet.routers[br.CACHE_AWARE].url, rng, 3, as_text)
    for prompt, cached in aware:  # all of round 1's full pages found on the server
        assert cached >= prompt // PAGE * PAGE, aware
    # round_robin puts round 2 on the other server: nothing of round 1 is cached there
    rr = _conversations(fleet.routers[br.ROUND_ROBIN].url, rng, 2, as_text)
    assert all(cached == 0 for _, cached in rr), rr


def test_the_router_finds_every_route_it_calls_on_a_worker(fleet: Fleet) -> None:
    """sglang-router registers workers with /health, /server_info, /model_info (its
    fallback /get_model_info), polls /get_load, and forwards /flush_cache to each."""
    flushed = get_json_post(fleet.routers[br.CACHE_AWARE].url, "/flush_cache")
    assert flushed.get("workers_flushed") == 2, flushed
    workers = get(fleet.routers[br.ROUND_ROBIN].url, "/workers")["workers"]
    assert sorted(w["url"] for w in workers) == sorted(fleet.urls)
    assert all(w["is_healthy"] for w in workers)
    model = get(fleet.urls[0], "/v1/models")["data"][0]["id"]
    assert {w["model_id"] for w in workers} == {model}
    # the router asks each worker's /get_load and reads its num_tokens (-1: no answer)
    loads = get(fleet.routers[br.ROUND_ROBIN].url, "/get_loads")["workers"]
    assert sorted(w["worker"] for w in loads) == sorted(fleet.urls)
    assert all(w["load"] == 0 for w in loads), loads
    calls = set()
    for server in fleet.servers:
        for m in ACCESS.finditer(server.log_path.read_text()):
            calls.add((m.group(1), m.group(2).split("?")[0], int(m.group(3))))
    paths = {p for _, p, _ in calls}
    assert {"/health", "/server_info", "/model_info", "/get_load", "/flush_cache"} <= paths, calls
    assert not [c for c in calls if c[2] == 404], calls


def get_json_post(base: str, path: str) -> dict[str, Any]:
    ans = post(base, path, {})
    assert ans.status == 200, ans.body
    return ans.body


def test_a_dead_worker_fails_only_its_own_requests(fleet: Fleet) -> None:
    """Runs last: it kills worker 1. Worker 0 keeps serving through the router, with the
    same answers; a request the router sent to the dead worker fails fast, with a 5xx."""
    router = fleet.routers[br.ROUND_ROBIN].url
    path, body = CASES["generate input_ids"]
    want = output(path, post(fleet.urls[0], path, body))
    fleet.servers[1]._proc.send_signal(signal.SIGKILL)
    fleet.servers[1]._proc.wait(10)
    answers = []
    for _ in range(6):
        started = time.monotonic()
        answers.append(post(router, path, body))
        assert time.monotonic() - started < TIMEOUT_S / 2
    ok = [a for a in answers if a.status == 200]
    assert len(ok) >= 3, answers  # worker 0's turns at least
    assert all(output(path, a) == want for a in ok)
    assert all(500 <= a.status < 600 for a in answers if a.status != 200), answers
    assert output(path, post(fleet.urls[0], path, body)) == want
