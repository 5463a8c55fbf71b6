"""One request never takes the server down: sampling at extreme parameters, a fault while
serving one request, a scheduler that dies anyway, text that is not Unicode, header bytes that
are not UTF-8, clients that leave before the first token or send their body a byte at a time,
and SIGTERM the moment the listener is up."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

import hicache_server.scheduler.tokens as scheduler_module
from hicache_server import launch
from hicache_server.config import load_config
from hicache_server.engine import Engine, EngineClosed
from hicache_server.http import create_app
from hicache_server.inbox import SchedulerStopped
from hicache_server.request import SamplingParams
from hicache_server.sampling import sample_row
from tests.conftest import app_client, tiered_engine_in

PROMPT = "The fault of one request is its own. " * 4  # 148 byte tokens
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
# Values that overflowed float32 in softmax(logits / temperature) or underflowed top_p * sum
# and killed the scheduler thread ("probability tensor contains either inf, nan or < 0").
TINY_TEMPERATURES = (1e-300, 5e-324, 1e-40, 1e-6)
TINY_TOP_P = (1e-300, 1e-46)
POISON_SEED = 666  # the request the injected sampling fault hits
ADMIN_KEY = "s3cret"
WAIT_S = 30.0


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    yield from tiered_engine_in(tmp_path_factory, "faults_lmdb")


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[TestClient]:
    async with app_client(engine, admin=True, admin_key=ADMIN_KEY) as c:  # then waits for idle
        yield c


def greedy_ids(engine: Engine, text: str = PROMPT) -> list[int]:
    return engine.generate(text, sampling_params=GREEDY)["output_ids"]


def assert_healthy(engine: Engine) -> None:
    """The scheduler runs, and no lock, reservation or slot was left behind."""
    assert engine.alive()
    engine.flush_cache(("device",))
    tree = engine.cache.tree
    engine.scheduler.call(tree.check_integrity).result()
    assert tree.protected_size() == 0
    alloc = engine.cache.device_pool.allocator
    assert alloc.available_size() == alloc.total_size()


# ------------------------------------------------------------------------------ sampling


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_a_tiny_temperature_is_greedy(engine: Engine, temperature: float) -> None:
    out = engine.generate(PROMPT, sampling_params={**GREEDY, "temperature": temperature})
    assert out["meta_info"]["finish_reason"] == "length"
    assert out["output_ids"] == greedy_ids(engine)
    assert engine.alive()


@pytest.mark.parametrize("top_p", TINY_TOP_P)
def test_a_tiny_top_p_keeps_the_most_likely_token(engine: Engine, top_p: float) -> None:
    params = {**GREEDY, "temperature": 1.0, "top_p": top_p, "seed": 3}
    out = engine.generate(PROMPT, sampling_params=params)
    assert out["output_ids"] == greedy_ids(engine)
    assert engine.alive()


def test_sample_row_never_raises_on_a_broken_row() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.5, top_k=5)
    gen = torch.Generator().manual_seed(0)
    for row in (torch.tensor([0.0, math.inf, 1.0]), torch.tensor([math.nan, 2.0, 1.0]),
                torch.full((4,), -math.inf), torch.tensor([1e38, 3e38, -3e38])):
        token = sample_row(row, params, gen)
        assert 0 <= token < row.numel()
    assert sample_row(torch.tensor([0.0, 9.0, 1.0]), SamplingParams(temperature=1e-5 * 1.01,
                                                                    top_p=1e-46), gen) == 1


async def test_tiny_values_through_both_http_routes(client: TestClient) -> None:
    for temperature in TINY_TEMPERATURES:
        resp = await client.post("/generate", json={
            "text": PROMPT, "sampling_params": {**GREEDY, "temperature": temperature}})
        assert resp.status == 200, await resp.text()
        resp = await client.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 4, "temperature": temperature, "top_p": 1e-300})
        assert resp.status == 200, await resp.text()
    assert (await client.get("/health")).status == 200


# ------------------------------------------------------------- one request's fault is its own


@pytest.fixture
def poisoned_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling raises for the request seeded POISON_SEED, as a bug would."""
    real = scheduler_module.sample_row

    def sample(row: torch.Tensor, params: Any, generator: torch.Generator) -> int:
        if params.seed == POISON_SEED:
            raise RuntimeError("injected sampling fault")
        return real(row, params, generator)

    monkeypatch.setattr(scheduler_module, "sample_row", sample)


def test_a_sampling_fault_fails_only_its_request(engine: Engine, poisoned_sampling: None
                                                 ) -> None:
    expected = greedy_ids(engine)
    errors = engine.stats()["counters"]["request_errors"]
    results: dict[str, dict] = {}

    def run(name: str, params: dict) -> None:
        results[name] = engine.generate(PROMPT, sampling_params=params)

    threads = [threading.Thread(target=run, args=(f"ok{i}", GREEDY)) for i in range(3)]
    threads.append(threading.Thread(target=run, args=("bad", {
        **GREEDY, "temperature": 1.0, "seed": POISON_SEED})))
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    bad = results.pop("bad")["meta_info"]
    assert bad["finish_reason"] == "error" and "injected sampling fault" in bad["error"]
    assert all(r["output_ids"] == expected for r in results.values()) and len(results) == 3
    assert engine.stats()["counters"]["request_errors"] == errors + 1
    assert_healthy(engine)


async def test_a_failed_request_is_a_json_500_and_the_server_goes_on(
        client: TestClient, engine: Engine, poisoned_sampling: None) -> None:
    bad = {"text": PROMPT, "sampling_params": {**GREEDY, "temperature": 1.0,
                                               "seed": POISON_SEED}}
    resp = await client.post("/generate", json=bad)
    assert resp.status == 500
    body = await resp.json()
    assert body["error"]["type"] == "internal_error"
    assert "injected sampling fault" in body["error"]["message"]
    resp = await client.post("/generate", json={**bad, "stream": True})  # fails at token 1
    assert resp.status == 500 and "injected" in (await resp.json())["error"]["message"]
    resp = await client.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 4, "temperature": 1.0, "seed": POISON_SEED})
    assert resp.status == 500
    ok = await client.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY})
    assert ok.status == 200
    metrics = await (await client.get("/metrics")).text()
    assert re.search(r"^hicache:request_errors_total [1-9]", metrics, re.MULTILINE)
    assert (await client.get("/health")).status == 200


def test_a_fault_mid_stream_ends_that_stream_with_an_error_event(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    real = scheduler_module.sample_row
    calls = {"n": 0}

    def sample(row: torch.Tensor, params: Any, generator: torch.Generator) -> int:
        if params.seed == POISON_SEED:
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected fault at the third token")
        return real(row, params, generator)

    monkeypatch.setattr(scheduler_module, "sample_row", sample)

    async def go() -> str:
        async with TestClient(TestServer(create_app(engine))) as c:
            resp = await c.post("/generate", json={"text": PROMPT, "stream": True,
                                                   "sampling_params": {**GREEDY, "seed":
                                                                       POISON_SEED,
                                                                       "temperature": 1.0}})
            assert resp.status == 200
            return await resp.text()

    text = asyncio.run(go())
    events = text.strip().split("\n\n")
    # the two tokens (one event, when they came while the client read), the error, DONE
    assert events[-1] == "data: [DONE]" and len(events) in (3, 4)
    assert '"error"' in events[-2] and "third token" in events[-2]
    assert_healthy(engine)


def test_a_fault_while_finishing_still_ends_the_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A release that raises used to leave the request running, decoded every step past its
    max_new_tokens (a reviewer saw 538 tokens for 4), and answered 200."""
    cfg = load_config(None, {"cache.max_total_tokens": 1024, "model.device": "cpu"})
    with Engine(cfg) as engine:
        sched = engine.scheduler
        real = sched.kv.release
        broken = {"left": 1}

        def release(req: Any, keep_cache: bool) -> None:
            if req.input.params.seed == POISON_SEED and broken["left"]:
                broken["left"] -= 1
                raise RuntimeError("injected release fault")
            real(req, keep_cache)

        monkeypatch.setattr(sched.kv, "release", release)
        out = engine.generate(PROMPT, sampling_params={**GREEDY, "seed": POISON_SEED})
        meta = out["meta_info"]
        assert meta["finish_reason"] == "error" and "injected release fault" in meta["error"]
        assert meta["completion_tokens"] <= GREEDY["max_new_tokens"]
        assert sched.num_unfinished() == 0 and engine.alive()
        assert engine.generate(PROMPT, sampling_params=GREEDY)["meta_info"][
            "finish_reason"] == "length"


def test_an_admission_fault_releases_its_locks(engine: Engine,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    engine.generate(PROMPT, sampling_params=GREEDY)
    engine.flush_cache(("device",))  # the prompt is on L2 only: admission loads it back
    tree = engine.cache.tree

    def broken(node: Any) -> Any:
        raise RuntimeError("injected load-back fault")

    monkeypatch.setattr(tree, "init_load_back", broken)
    out = engine.generate(PROMPT, sampling_params=GREEDY)["meta_info"]
    assert out["finish_reason"] == "error" and "load-back" in out["error"]
    monkeypatch.undo()
    assert engine.generate(PROMPT, sampling_params=GREEDY)["output_ids"] == greedy_ids(engine)
    assert_healthy(engine)


# ------------------------------------------------------------------ text and header bytes


LONE_SURROGATE = '"a\\ud800b"'  # JSON text: a high surrogate with no low one after it


def bad(template: str) -> str:
    """A JSON body with LONE_SURROGATE where `template` says BAD."""
    return template.replace("BAD", LONE_SURROGATE)


async def test_lone_surrogates_are_400_in_every_text_field(client: TestClient) -> None:
    bodies = [
        bad('{"text": BAD}'),
        bad('{"text": "ok", "sampling_params": {"stop": [BAD]}}'),
        bad('{"text": "ok", "extra_key": BAD}'),
        bad('{"text": "ok", "cache_salt": BAD}'),
    ]
    for body in bodies:
        resp = await client.post("/generate", data=body,
                                 headers={"Content-Type": "application/json"})
        assert resp.status == 400, (body, await resp.text())
        assert "not valid Unicode" in (await resp.json())["error"]["message"]
    for body in (bad('{"prompt": BAD}'),
                 bad('{"prompt": "ok", "stop": BAD}')):
        resp = await client.post("/v1/completions", data=body)
        assert resp.status == 400, (body, await resp.text())
    for body in (bad('{"prompt": "ok", "model": BAD, "max_tokens": 1}'),
                 bad('{"prompt": "ok", "user": BAD, "max_tokens": 1}')):
        resp = await client.post("/v1/completions", data=body)  # names only, never encoded
        assert resp.status == 200, (body, await resp.text())
    resp = await client.post("/admin/flush", data=bad('{"tiers": [BAD]}'),
                             headers={"Authorization": f"Bearer {ADMIN_KEY}",
                                      "Content-Type": "application/json"})
    assert resp.status == 400


async def raw_request(port: int, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """Send bytes as they are (no client library normalises them); status and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + body)
    await writer.drain()
    response = await reader.read()
    writer.close()
    status_line, _, rest = response.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


async def test_header_bytes_that_are_not_utf8_are_a_4xx(client: TestClient) -> None:
    port = client.server.port
    for auth in (b"Bearer \xff\xfe", b"Bearer s3cret\xc3", b"\xff"):
        status, body = await raw_request(port, b"GET /admin/tiers HTTP/1.1\r\nHost: x\r\n"
                                         b"Connection: close\r\nAuthorization: " + auth
                                         + b"\r\n\r\n")
        assert status in (401, 403), body
        assert b'"error"' in body
    status, _ = await raw_request(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: "
                                  b"close\r\nX-Forwarded-For: \xff\xfe\r\nUser-Agent: \x80\r\n\r\n")
    assert status == 200


# ----------------------------------------------------------------- clients that misbehave


async def test_a_body_that_never_arrives_is_a_408(engine: Engine) -> None:
    async with TestClient(TestServer(create_app(engine, body_timeout_s=0.3))) as c:
        status, body = await raw_request(c.server.port, b"POST /generate HTTP/1.1\r\nHost: x"
                                         b"\r\nContent-Length: 100\r\n\r\n", b'{"text": "a')
    assert status == 408 and b"did not arrive within 0.3 s" in body


# ------------------------------------------------------------------ the scheduler dies anyway


def kill_scheduler(engine: Engine) -> None:
    """Make the loop's next step raise, as a broken invariant would."""
    def boom() -> None:
        raise AssertionError("injected scheduler fault")

    engine.scheduler.step = boom  # type: ignore[method-assign]


def test_a_dead_scheduler_fails_everything_pending_and_refuses_new_work() -> None:
    cfg = load_config(None, {"cache.max_total_tokens": 1024, "model.device": "cpu"})
    engine = Engine(cfg)
    died = threading.Event()
    engine.on_fatal = lambda exc: died.set()
    try:
        kill_scheduler(engine)
        assert died.wait(WAIT_S)
        assert not engine.alive()  # already while `on_fatal` runs
        engine._thread.join(WAIT_S)
        assert isinstance(engine.fatal_error, AssertionError)
        with pytest.raises(EngineClosed):
            engine.generate("hello", sampling_params=GREEDY)
        with pytest.raises(EngineClosed):
            engine.stats()
        late = engine.scheduler.call(lambda: 1)  # nothing reads the inbox any more
        with pytest.raises(SchedulerStopped):
            late.result(timeout=WAIT_S)
    finally:
        engine.shutdown()  # returns at once: no drain on a dead loop


def test_a_request_waiting_when_the_scheduler_dies_gets_an_error() -> None:
    cfg = load_config(None, {"cache.max_total_tokens": 1024, "model.device": "cpu"})
    engine = Engine(cfg)
    try:
        blocked = threading.Event()
        release = threading.Event()

        def hold() -> None:  # keeps the loop busy while the request queues behind it
            blocked.set()
            release.wait(WAIT_S)

        engine.scheduler.call(hold)
        assert blocked.wait(WAIT_S)
        result: dict[str, Any] = {}
        t = threading.Thread(target=lambda: result.update(engine.generate(
            "hello", sampling_params=GREEDY)))
        t.start()
        deadline = time.monotonic() + WAIT_S
        while engine.scheduler.inbox.empty() and time.monotonic() < deadline:
            threading.Event().wait(0.01)  # until the request queues behind `hold`
        kill_scheduler(engine)
        release.set()
        t.join(WAIT_S)
        assert "meta_info" in result, "generate raised instead of returning an error"
        assert result["meta_info"]["finish_reason"] == "error"
        assert "scheduler stopped" in result["meta_info"]["error"]
    finally:
        engine.shutdown()


class ListeningPort(logging.Handler):
    """Catches the port from `hicache-server listening on ...` (port 0 asks for any)."""

    def __init__(self) -> None:
        super().__init__()
        self.port: int | None = None
        self.ready = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        match = re.search(r"listening on http://127\.0\.0\.1:(\d+)", record.getMessage())
        if match:
            self.port = int(match.group(1))
            self.ready.set()


def serve_in_process(engine: Engine, cfg: Any, after_listening: Any) -> int:
    """`launch.serve` on this (main) thread; `after_listening(port)` runs on another once
    the listener is up. The exit code."""
    catcher = ListeningPort()
    logging.getLogger("hicache.server").addHandler(catcher)
    logging.getLogger("hicache.server").setLevel(logging.INFO)

    def run_after() -> None:
        completed = False
        try:
            if catcher.ready.wait(WAIT_S):
                after_listening(catcher.port)
                completed = True
        finally:
            if not completed:  # never leave the server (and the test) running
                os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=run_after)
    thread.start()
    try:
        return asyncio.run(launch.serve(engine, cfg))
    finally:
        thread.join(WAIT_S)
        logging.getLogger("hicache.server").removeHandler(catcher)


def test_server_exits_70_when_its_scheduler_dies() -> None:
    cfg = load_config(None, {"cache.max_total_tokens": 1024, "model.device": "cpu",
                             "server.port": 0})
    engine = Engine(cfg)
    try:
        code = serve_in_process(engine, cfg, lambda port: kill_scheduler(engine))
        assert code == launch.EXIT_SCHEDULER_DIED == 70
    finally:
        engine.shutdown()


def test_sigterm_right_after_the_listener_opens_drains(monkeypatch: pytest.MonkeyPatch) -> None:
    """The handlers are in place before the port accepts: the signal drains, exit 0."""
    handler_at_listen: list[Any] = []
    real_start = web.TCPSite.start

    async def start(site: web.TCPSite) -> None:
        handler_at_listen.append(signal.getsignal(signal.SIGTERM))
        await real_start(site)

    monkeypatch.setattr(web.TCPSite, "start", start)
    cfg = load_config(None, {"cache.max_total_tokens": 1024, "model.device": "cpu",
                             "server.port": 0})
    engine = Engine(cfg)
    try:
        code = serve_in_process(engine, cfg, lambda port: os.kill(os.getpid(), signal.SIGTERM))
        assert code == launch.EXIT_OK
        assert handler_at_listen and handler_at_listen[0] is not signal.SIG_DFL
    finally:
        engine.shutdown()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def test_an_idle_connection_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "IDLE_CONNECTION_TIMEOUT_S", 0.5)
    cfg = load_config(None, {"cache.max_total_tokens": 1024, "model.device": "cpu",
                             "server.port": 0})
    engine = Engine(cfg)
    closed: list[bytes] = []

    def idle_then_stop(port: int) -> None:
        async def idle() -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /hea")  # a request line that never ends
            await writer.drain()
            data = await asyncio.wait_for(reader.read(), WAIT_S)  # b"" once the server closes
            writer.close()
            return data

        closed.append(asyncio.run(idle()))
        os.kill(os.getpid(), signal.SIGTERM)

    try:
        assert serve_in_process(engine, cfg, idle_then_stop) == launch.EXIT_OK
        assert closed == [b""]
    finally:
        engine.shutdown()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def test_a_client_that_leaves_before_the_first_token_is_no_error(
        caplog: pytest.LogCaptureFixture) -> None:
    """Through the real server set-up (aiohttp's test server cancels handlers instead): the
    handler finds the client gone when it prepares the stream; that is an info line and an
    aborted request, not an unhandled error with a 500."""
    caplog.set_level(logging.INFO)
    cfg = load_config(None, {"cache.max_total_tokens": 2048, "model.device": "cpu",
                             "server.port": 0})
    engine = Engine(cfg)
    body = ('{"text": "%s", "stream": true, "sampling_params": {"max_new_tokens": 200}}'
            % ("x" * 1800)).encode()  # a prefill long enough to hang up during

    def hang_up_then_stop(port: int) -> None:
        async def hang_up() -> None:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
            writer.close()  # before the prefill has ended

        asyncio.run(hang_up())
        for _ in range(int(WAIT_S / 0.05)):
            if any("went away" in r.getMessage() for r in caplog.records):
                break
            threading.Event().wait(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    try:
        assert serve_in_process(engine, cfg, hang_up_then_stop) == launch.EXIT_OK
        messages = [r.getMessage() for r in caplog.records]
        assert any("went away" in m for m in messages), messages
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], messages
        assert not any('" 500 ' in m for m in messages), messages
        # aborted at its first token, not run to its 200th
        assert engine.scheduler.counters.generated_tokens < 200
    finally:
        engine.shutdown()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
