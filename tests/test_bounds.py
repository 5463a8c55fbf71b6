"""Bounds on what a client can make the server hold (issue 55, point 5), through the real
server on loopback: a full waiting queue answers 429 with Retry-After (the scheduler held at
a gate while the queue fills, so the order is fixed, not timed); a streaming client that
stops reading is dropped and its request aborted, its KV unlocked, while others are served;
prompt logprobs past the cap are a 400 naming it; the unknown field names warned about are
bounded."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from conftest import WAIT_S, hold_scheduler, small_engine, submit_all
from http_helpers import error_of

from hicache_server.engine import Engine, QueueFull
from hicache_server.http import create_app, fields, streaming
from hicache_server.http.fields import WarnedNames
from hicache_server.http.state import Handler

QUEUED = 2  # server.max_queued_requests of this module's engine
WRITE_TIMEOUT_S = 0.5  # server.stream_write_timeout_s of this module's engine
MAX_PROMPT_LOGPROBS = 64  # server.max_prompt_logprobs of this module's engine
# Socket buffers of the stalled stream's two ends (bytes; the kernel doubles them): small,
# so that the server's writes wait for the reader after a few tokens' events.
STALL_BUFFER_BYTES = 4096
# The stalled request's output: far more tokens than its events take to fill the buffers
# (/generate's events carry the whole output so far and here its top-20 logprobs, ~1 KB a
# token each), so it is still running when its reader is dropped.
STALL_TOKENS = 1500
POLL_S = 0.02
PROMPT = "The quick brown fox jumps over the lazy dog"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield from small_engine(**{"server.max_queued_requests": QUEUED,
                               "server.stream_write_timeout_s": WRITE_TIMEOUT_S,
                               "server.max_prompt_logprobs": MAX_PROMPT_LOGPROBS})


@web.middleware
async def small_send_buffer(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The server's end of each connection with a small send buffer, as on a slow link."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STALL_BUFFER_BYTES)
    return await handler(request)


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[TestClient]:
    app = create_app(engine)
    app.middlewares.append(small_send_buffer)
    async with TestClient(TestServer(app)) as c:
        yield c
    engine.flush_cache(())  # waits until no request runs: the next test starts idle


async def until(condition: Callable[[], bool], what: str) -> None:
    """Poll `condition` (a liveness bound, never a measure of time)."""
    for _ in range(int(WAIT_S / POLL_S)):
        if condition():
            return
        await asyncio.sleep(POLL_S)
    raise AssertionError(f"never: {what}")


def generate(max_new_tokens: int = 2, **fields_: Any) -> dict[str, Any]:
    return {"text": PROMPT, "sampling_params": {"max_new_tokens": max_new_tokens, **GREEDY},
            **fields_}


def requests_seen(engine: Engine) -> int:
    return engine.cache_stats().requests.requests


def idle(engine: Engine) -> bool:
    load = engine.load()
    return load["num_reqs"] + load["num_waiting_reqs"] == 0


# ------------------------------------------------------------------------ the queue


async def test_a_full_queue_answers_429_with_retry_after(client: TestClient,
                                                         engine: Engine) -> None:
    gate = hold_scheduler(engine)  # nothing is admitted: what is handed in stays queued
    try:
        held = [asyncio.ensure_future(client.post("/generate", json=generate()))
                for _ in range(QUEUED)]
        await until(lambda: engine.scheduler.inbox.queued() == QUEUED, "the queue filled")
        refused = await client.post("/generate", json=generate())
        streamed = await client.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 2, "stream": True, **GREEDY})
        queued_after = engine.scheduler.inbox.queued()
    finally:
        gate.set()
    message = await error_of(refused, 429)
    assert (await refused.json())["error"]["type"] == "rate_limit_error"
    assert refused.headers["Retry-After"] == "1"
    assert f"({QUEUED} requests waiting to run" in message and "--max-queued-requests" in message
    assert await error_of(streamed, 429) == message  # refused before any event is sent
    assert streamed.headers["Retry-After"] == "1"
    assert queued_after == QUEUED  # nothing was queued for the refused ones
    for resp in await asyncio.gather(*held):
        assert resp.status == 200 and len((await resp.json())["output_ids"]) == 2
    again = await client.post("/generate", json=generate())  # admitted ones left the queue
    assert again.status == 200 and engine.scheduler.inbox.queued() == 0


async def test_n_choices_are_queued_all_or_none(client: TestClient, engine: Engine) -> None:
    """`n` past the places left: a 429, and the choices already queued never run; `n` past
    the whole queue: a 400 (no retry could ever fit it)."""
    before = engine.cache_stats().requests
    gate = hold_scheduler(engine)
    try:
        first = asyncio.ensure_future(client.post("/generate", json=generate()))
        await until(lambda: engine.scheduler.inbox.queued() == 1, "one place taken")
        resp = await client.post("/generate", json=generate(
            sampling_params={"max_new_tokens": 2, "n": QUEUED, **GREEDY}))
    finally:
        gate.set()
    await error_of(resp, 429)
    assert (await first).status == 200
    await until(lambda: engine.scheduler.inbox.queued() == 0, "the queue emptied")
    await asyncio.to_thread(engine.flush_cache, ())  # the aborted choice has ended
    after = engine.cache_stats().requests
    assert after.generated_tokens - before.generated_tokens == 2  # the first one's alone
    assert after.requests - before.requests == QUEUED  # the first, and choice 0 aborted
    too_many = await error_of(await client.post("/generate", json=generate(
        sampling_params={"max_new_tokens": 2, "n": QUEUED + 1, **GREEDY})), 400)
    assert f"{QUEUED + 1} sequences" in too_many and f": {QUEUED})" in too_many


async def test_the_engine_queues_all_n_choices_or_none(engine: Engine) -> None:
    """`Engine.generate` and `async_generate` with one place left and n = 2: QueueFull, and
    the choice that was queued is aborted before it runs."""
    before = engine.cache_stats().requests
    two = {"max_new_tokens": 2, "n": QUEUED, **GREEDY}
    calls = (lambda: asyncio.to_thread(engine.generate, PROMPT, sampling_params=two),
             lambda: engine.async_generate(PROMPT, sampling_params=two))  # on this loop
    for call in calls:
        gate = hold_scheduler(engine)
        try:
            one = submit_all(engine, [engine.make_request(PROMPT, sampling_params={
                "max_new_tokens": 2, **GREEDY})])
            with pytest.raises(QueueFull, match="--max-queued-requests"):
                await call()
        finally:
            gate.set()
        assert len(one[0].result(WAIT_S)["output_ids"]) == 2
        await until(lambda: engine.scheduler.inbox.queued() == 0, "the queue emptied")
    await asyncio.to_thread(engine.flush_cache, ())  # the aborted choices have ended
    after = engine.cache_stats().requests
    assert after.generated_tokens - before.generated_tokens == 2 * 2  # the single ones only
    assert after.requests - before.requests == 2 * 2  # each single one, each choice 0


# --------------------------------------------------------------- a stalled stream


def stalled_reader(port: int, body: dict[str, Any]) -> socket.socket:
    """A client that sends a streaming request and never reads (a small receive window)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, STALL_BUFFER_BYTES)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    return sock


async def test_a_stalled_reader_is_dropped_and_its_request_aborted(
        client: TestClient, engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    before = engine.cache_stats().requests
    body = generate(STALL_TOKENS, stream=True, return_logprob=True, top_logprobs_num=20,
                    return_text_in_logprobs=True)
    with caplog.at_level(logging.WARNING, logger="hicache_server.http.streaming"):
        sock = await asyncio.to_thread(stalled_reader, client.server.port, body)
        try:
            await until(lambda: requests_seen(engine) > before.requests, "the request came")
            await until(lambda: idle(engine), "the request ended")
            # the server goes on serving others, streams included
            plain = await client.post("/generate", json=generate())
            stream = await client.post("/generate", json=generate(4, stream=True))
            events = (await stream.text()).split("\n\n")
        finally:
            sock.close()
    after = engine.cache_stats()
    generated = after.requests.generated_tokens - before.generated_tokens
    assert generated - 2 - 4 < STALL_TOKENS  # the stalled one stopped short: aborted
    assert after.device.protected_tokens == 0  # its KV is unlocked
    dropped = [r.getMessage() for r in caplog.records if "dropping the client" in r.getMessage()]
    assert len(dropped) == 1 and f"{WRITE_TIMEOUT_S:g} s" in dropped[0]
    assert plain.status == 200 and stream.status == 200
    assert events[-2] == "data: [DONE]" and len(json.loads(events[-3][6:])["output_ids"]) == 4


# ------------------------------------------------------------- prompt logprobs


async def test_prompt_logprobs_past_the_cap_are_a_400_naming_it(client: TestClient) -> None:
    ids = list(range(10, 14))  # 4 positions from 0: 4 x (top + 1) entries
    ask = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, **GREEDY},
           "return_logprob": True, "logprob_start_len": 0}
    message = await error_of(await client.post("/generate", json={
        **ask, "top_logprobs_num": 20}), 400)
    assert f"= {4 * 21} entries" in message and f"limit of {MAX_PROMPT_LOGPROBS}" in message
    assert "`top_logprobs_num`" in message and "--max-prompt-logprobs" in message
    n = await error_of(await client.post("/generate", json={
        **ask, "top_logprobs_num": 8, "sampling_params": {"max_new_tokens": 1, "n": QUEUED,
                                                          **GREEDY}}), 400)
    assert (f"4 prompt positions x (8 `top_logprobs_num` + 1) x {QUEUED} `sampling_params.n` "
            f"= {4 * 9 * QUEUED} entries") in n
    echo = await error_of(await client.post("/v1/completions", json={
        "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 20, **GREEDY}), 400)
    assert "`logprobs`" in echo and f"limit of {MAX_PROMPT_LOGPROBS}" in echo
    within = await client.post("/generate", json={**ask, "top_logprobs_num": 15})  # 64
    body = await within.json()
    assert within.status == 200 and len(body["meta_info"]["input_top_logprobs"]) == 4
    later = await client.post("/generate", json={**ask, "top_logprobs_num": 20,
                                                 "logprob_start_len": 1})  # 3 x 21 = 63
    assert later.status == 200


# ---------------------------------------------------------- unknown field names


def test_warned_names_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    warned = WarnedNames(limit=3, name_chars=8)
    with caplog.at_level(logging.WARNING, logger="hicache_server.http.fields"):
        for i in range(10):
            warned.warn_once(f"x{i}", "POST /generate")
        warned.warn_once("x1", "POST /generate")  # known: silent
        warned.warn_once("y" * 10_000, "POST /generate")  # full: silent
    lines = [r.getMessage() for r in caplog.records]
    assert warned.names == {"x0", "x1", "x2"} and warned.full
    assert len(lines) == 4 and "new ones are ignored without a warning" in lines[-1]
    short = WarnedNames(limit=2, name_chars=8)
    short.warn_once("z" * 10_000, "POST /generate")
    short.warn_once("z" * 20_000, "POST /generate")  # the same once cut: warned once
    assert short.names == {"zzzzzzzz..."}


async def test_a_client_inventing_field_names_grows_no_set(
        client: TestClient, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    warned = WarnedNames(limit=2)
    monkeypatch.setattr(fields, "WARNED", warned)
    with caplog.at_level(logging.WARNING, logger="hicache_server.http.fields"):
        for i in range(5):
            resp = await client.post("/generate", json=generate(1, **{f"made_up_{i}": i}))
            assert resp.status == 200
    assert warned.names == {"made_up_0", "made_up_1"}
    assert sum("made_up" in r.getMessage() for r in caplog.records) == 2


def test_a_large_event_is_written_in_pieces_each_with_its_own_timeout() -> None:
    """The write timeout measures a reader that takes nothing: a megabyte event read by a
    slow link is written in pieces of aiohttp's buffer size, each given the whole timeout."""
    pieces: list[bytes] = []

    class Recorder:
        async def write(self, data: memoryview) -> None:
            pieces.append(bytes(data))

    event = bytes(range(256)) * (5 * streaming.WRITE_PIECE_BYTES // 256 + 3)
    asyncio.run(streaming._write(Recorder(), event, 1.0))  # type: ignore[arg-type]
    assert b"".join(pieces) == event and len(pieces) == 6
    assert all(len(p) <= streaming.WRITE_PIECE_BYTES for p in pieces)
