"""The HTTP API through aiohttp's test client: shapes, streaming, every bad input, fuzzing."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hicache_server.config import load_config
from hicache_server.engine import Engine
from hicache_server.http import begin_shutdown, create_app
from hicache_server.http.discovery import served_model_name

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
LONG_PROMPT = "abc" * 40  # 120 byte tokens: 7 full pages of 16, cacheable
SMALL_BODY_LIMIT = 1024


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    lmdb = tmp_path_factory.mktemp("http_lmdb")
    cfg = load_config(None, {"cache.max_total_tokens": 2048, "cache.hierarchical": True,
                             "storage.backend": "lmdb", "storage.lmdb.path": str(lmdb),
                             "model.device": "cpu"})
    with Engine(cfg) as e:
        yield e


def wait_idle(engine: Engine) -> None:
    """Until no request runs: a request left running by an abandoned stream would call back
    into this test's event loop after it closed."""
    engine.flush_cache(())


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(create_app(engine))) as c:
        yield c
    wait_idle(engine)


async def assert_error(resp: ClientResponse, status: int, words: str = "") -> str:
    """The response is `status` with the JSON error shape; its message contains `words`."""
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    body = await resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code"}
    assert body["error"]["code"] == status and body["error"]["type"]
    assert words.lower() in body["error"]["message"].lower()
    return body["error"]["message"]


async def sse_events(resp: ClientResponse) -> list[Any]:
    """The `data:` payloads of a stream, JSON-decoded; `[DONE]` must end it."""
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    blocks = (await resp.text()).split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]"
    assert all(b.startswith("data: ") for b in blocks[:-1])
    return [json.loads(b[len("data: "):]) for b in blocks[:-2]]


def check_result(result: dict[str, Any], prompt_tokens: int, max_new: int) -> None:
    meta = result["meta_info"]
    assert set(result) == {"text", "output_ids", "meta_info"}
    assert meta["prompt_tokens"] == prompt_tokens
    assert meta["completion_tokens"] == len(result["output_ids"]) <= max_new
    assert set(meta["cached_tokens_details"]) == {"device", "host", "storage"}
    assert meta["cached_tokens"] == sum(meta["cached_tokens_details"].values())
    assert meta["finish_reason"] in ("stop", "length")


# ---------------------------------------------------------------------------- /generate


async def test_generate_text_and_input_ids_agree(client: TestClient, engine: Engine) -> None:
    by_text = await (await client.post("/generate", json={
        "text": "Hello", "sampling_params": GREEDY})).json()
    ids = engine.tokenizer.encode("Hello")
    by_ids = await (await client.post("/generate", json={
        "input_ids": ids, "sampling_params": GREEDY})).json()
    check_result(by_text, len(ids), 6)
    assert by_ids["output_ids"] == by_text["output_ids"] and len(by_ids["output_ids"]) == 6
    assert by_text["meta_info"]["finish_reason"] == "length"


async def test_greedy_is_deterministic_and_cached(client: TestClient) -> None:
    body = {"text": LONG_PROMPT + "determinism", "sampling_params": GREEDY}
    first = await (await client.post("/generate", json=body)).json()
    second = await (await client.post("/generate", json=body)).json()
    assert first["output_ids"] == second["output_ids"]
    assert second["meta_info"]["cached_tokens"] >= 112  # 7 pages of the repeated prompt


async def test_generate_stream(client: TestClient) -> None:
    body = {"text": "stream me", "sampling_params": GREEDY}
    whole = await (await client.post("/generate", json=body)).json()
    events = await sse_events(await client.post("/generate", json={**body, "stream": True}))
    assert 1 <= len(events) <= 6  # one per token, or fewer when tokens came while it read
    sent = 0
    for ev in events:  # the full text so far, as SGLang streams it
        n = ev["meta_info"]["completion_tokens"]
        assert ev["output_ids"] == whole["output_ids"][:n] and n > sent
        assert (ev["meta_info"]["finish_reason"] is None) == (n < 6)
        sent = n
    assert events[-1]["text"] == whole["text"]
    assert events[-1]["meta_info"]["finish_reason"] == "length"


async def test_client_going_away_mid_stream(client: TestClient, engine: Engine,
                                            caplog: pytest.LogCaptureFixture) -> None:
    resp = await client.post("/generate", json={
        "text": "bye", "stream": True,
        "sampling_params": {"max_new_tokens": 48, "ignore_eos": True}})
    assert (await resp.content.readuntil(b"\n\n")).startswith(b"data: {")
    resp.close()  # drops the connection with the stream half read
    with caplog.at_level(logging.INFO):
        await asyncio.get_running_loop().run_in_executor(None, wait_idle, engine)
        assert (await client.get("/health")).status == 200
        again = await client.post("/generate", json={"text": "hi", "sampling_params": GREEDY})
        assert again.status == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# ----------------------------------------------------------------------- /v1/completions


async def test_completions_shape_and_cached_usage(client: TestClient, engine: Engine) -> None:
    body = {"model": "anything", "prompt": LONG_PROMPT + "openai", "max_tokens": 5,
            "temperature": 0, "seed": 1, "user": "u", "ignore_eos": True}
    first = await (await client.post("/v1/completions", json=body)).json()
    second = await (await client.post("/v1/completions", json=body)).json()
    assert set(first) == {"id", "object", "created", "model", "choices", "usage", "sglext"}
    assert first["object"] == "text_completion" and first["model"] == served_model_name(engine)
    choice = first["choices"][0]
    assert choice == {"index": 0, "text": choice["text"], "finish_reason": "length",
                      "logprobs": None}
    usage = second["usage"]
    assert usage["completion_tokens"] == 5 and usage["prompt_tokens"] == 126
    assert usage["total_tokens"] == 131
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert second["choices"][0]["text"] == choice["text"]


async def test_completions_default_max_tokens_is_16(client: TestClient) -> None:
    out = await (await client.post("/v1/completions", json={
        "prompt": [104, 105], "temperature": 0, "ignore_eos": True})).json()
    assert out["usage"]["completion_tokens"] == 16


async def test_completions_stream_deltas_add_up(client: TestClient) -> None:
    body = {"prompt": "abc" * 20, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = await (await client.post("/v1/completions", json=body)).json()
    chunks = await sse_events(await client.post("/v1/completions", json={
        **body, "stream": True, "stream_options": {"include_usage": True}}))
    *text_chunks, usage_chunk = chunks
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1 and usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 12


async def test_completions_stream_never_sends_a_stop_string(client: TestClient) -> None:
    body = {"prompt": "abc" * 20, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    text = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]["text"]
    stop = next((text[i:i + 2] for i in range(4, len(text) - 1)
                 if text[i:i + 2].isascii() and text[i:i + 2].isprintable()), None)
    assert stop is not None, "the seeded model's greedy output should hold a printable pair"
    cut = await (await client.post("/v1/completions", json={**body, "stop": stop})).json()
    chunks = await sse_events(await client.post("/v1/completions", json={
        **body, "stop": stop, "stream": True}))
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed == cut["choices"][0]["text"] == text[:text.find(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


# ------------------------------------------------------------------ models, health, load


async def test_models_and_health(client: TestClient, engine: Engine) -> None:
    models = await (await client.get("/v1/models")).json()
    assert models["object"] == "list" and len(models["data"]) == 1
    assert models["data"][0]["id"] == served_model_name(engine)  # the embedded folder
    assert models["data"][0]["object"] == "model"
    health = await client.get("/health")
    assert health.status == 200 and await health.json() == {"status": "ok"}


async def test_32_concurrent_clients(client: TestClient) -> None:
    async def one(i: int) -> dict[str, Any]:
        if i % 2:
            resp = await client.post("/generate", json={
                "text": f"client {i % 4} " * 8, "sampling_params": GREEDY})
        else:
            resp = await client.post("/v1/completions", json={
                "prompt": f"client {i % 4} " * 8, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True})
        assert resp.status == 200
        return await resp.json()

    results = await asyncio.gather(*(one(i) for i in range(32)))
    for i, r in enumerate(results):
        if i % 2:
            check_result(r, 72, 6)
        else:
            assert r["usage"]["completion_tokens"] == 6 and r["usage"]["prompt_tokens"] == 72
    same = [r["output_ids"] for i, r in enumerate(results) if i % 4 == 1]
    assert all(ids == same[0] for ids in same)  # greedy: batching does not change tokens


# --------------------------------------------------------------------------- bad input

TOO_LONG_FOR_CONTEXT = [65] * 9000   # the context is 8192
TOO_LONG_FOR_L1 = [65] * 3000        # within the context, over the 2048-token L1

BAD_GENERATE = [
    (b"{", "not valid JSON"), (b"[1, 2]", "JSON object"), (b"", "empty"),
    (b'"text"', "JSON object"), (b"\xff\xfe", "not valid JSON"), (b"[" * 100_000, "JSON"),
    ({"text": 5}, "text"), ({"input_ids": "abc"}, "input_ids"), ({"input_ids": [1, "a"]},
                                                                  "input_ids"),
    ({"input_ids": [True]}, "input_ids"), ({"text": "a", "input_ids": [1]}, "exactly one"),
    ({}, "exactly one"), ({"text": "a", "sampling_params": [1]}, "sampling_params"),
    ({"text": "a", "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "a", "sampling_params": {"top_p": 1.5}}, "top_p"),
    ({"text": "a", "sampling_params": {"top_k": 0}}, "top_k"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 1.5}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 4000}}, "L1"),
    ({"text": "a", "sampling_params": {"stop": [""]}}, "stop"),
    ({"text": "a", "sampling_params": {"ignore_eos": "yes"}}, "ignore_eos"),
    ({"text": "a", "sampling_params": {"n": 0}}, "n"),  # an unknown field is ignored
    ({"text": "a", "stream": "yes"}, "stream"), ({"text": "a", "extra_key": 5}, "extra_key"),
    ({"text": "a", "extra_key": "x", "cache_salt": "y"}, "at most one"),
    ({"text": "a", "lora_path": "adapter"}, "lora_path"), ({"text": ""}, "empty"),
    ({"input_ids": []}, "empty"), ({"input_ids": TOO_LONG_FOR_CONTEXT}, "context"),
    ({"input_ids": TOO_LONG_FOR_L1}, "L1"), ({"input_ids": [260]}, "vocabulary"),
    ({"input_ids": [-1]}, "vocabulary"),
]
BAD_COMPLETIONS = [
    ({}, "prompt"), ({"prompt": 5}, "prompt"), ({"prompt": ["a", 5]}, "prompt"),
    ({"prompt": [[1], []]}, "empty"), ({"prompt": "a", "max_tokens": "x"}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "temperature": -1}, "temperature"), ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "stream": 1}, "stream"), ({"prompt": "a", "model": 5}, "model"),
    ({"prompt": "a", "stop": 5}, "stop"), ({"prompt": ""}, "empty"),
    ({"prompt": [999]}, "vocabulary"), ({"prompt": "a", "echo": 1}, "echo"),
    ({"prompt": "a", "stream_options": {"include_usage": 1}}, "include_usage"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
]


def _send(client: TestClient, path: str, body: Any) -> Any:
    if isinstance(body, bytes):
        return client.post(path, data=body)
    return client.post(path, json=body)


@pytest.mark.parametrize(("body", "words"), BAD_GENERATE)
async def test_bad_generate_is_400(client: TestClient, body: Any, words: str) -> None:
    await assert_error(await _send(client, "/generate", body), 400, words)


@pytest.mark.parametrize(("body", "words"), BAD_COMPLETIONS)
async def test_bad_completion_is_400(client: TestClient, body: Any, words: str) -> None:
    message = await assert_error(await _send(client, "/v1/completions", body), 400, words)
    assert "sampling_params" not in message  # OpenAI's field names, not the engine's


async def test_unknown_route_and_wrong_method(client: TestClient) -> None:
    await assert_error(await client.get("/nope"), 404, "no route")
    await assert_error(await client.post("/v1/embeddings", json={}), 404)
    resp = await client.get("/generate")
    await assert_error(resp, 405, "allowed: POST")
    assert resp.headers["Allow"] == "POST"
    await assert_error(await client.post("/health"), 405)


async def test_oversize_body_is_413(engine: Engine) -> None:
    app = create_app(engine, max_body_bytes=SMALL_BODY_LIMIT)
    async with TestClient(TestServer(app)) as c:
        big = {"input_ids": [65] * SMALL_BODY_LIMIT}
        await assert_error(await c.post("/generate", json=big), 413, str(SMALL_BODY_LIMIT))
        ok = await c.post("/generate", json={"text": "ok", "sampling_params": GREEDY})
        assert ok.status == 200


async def test_shutting_down_is_503(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    app = create_app(engine)
    async with TestClient(TestServer(app)) as c:
        monkeypatch.setattr(engine, "_accepting", False)  # what Engine.shutdown sets first
        await assert_error(await c.post("/generate", json={"text": "a"}), 503, "shutting")
        monkeypatch.undo()
        begin_shutdown(app)
        await assert_error(await c.get("/health"), 503, "shutting down")
        await assert_error(await c.post("/generate", json={"text": "a"}), 503)
        await assert_error(await c.post("/v1/completions", json={"prompt": "a"}), 503)
        await assert_error(await c.get("/metrics"), 503)


# ----------------------------------------------------------------------------- fuzzing

SMALL_INTS = st.integers(-3, 12) | st.sampled_from([2**31, 2**63, 10**20, -(2**63)])
JSON = st.recursive(
    st.none() | st.booleans() | SMALL_INTS | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)
NOT_NULL = JSON.filter(lambda v: v is not None)


def mostly(valid: st.SearchStrategy, other: st.SearchStrategy = JSON) -> st.SearchStrategy:
    """`valid` three times in four, else `other`: most fuzzed requests get far enough to
    test the checks after the first."""
    return st.one_of(valid, valid, valid, other)


def merged(*parts: st.SearchStrategy) -> st.SearchStrategy:
    return st.tuples(*parts).map(lambda ds: {k: v for d in ds for k, v in d.items()})


VALID_IDS = st.lists(st.integers(0, 259), min_size=1, max_size=24)
TEXT = st.text(min_size=1, max_size=24)
# Never null: a valid request must stay short (the default would generate 128 tokens).
MAX_NEW = mostly(st.integers(1, 8), SMALL_INTS | NOT_NULL)
COMMON = {"temperature": mostly(st.floats(0, 2)), "top_p": mostly(st.floats(0.01, 1)),
          "stop": mostly(st.text(min_size=1, max_size=3)), "seed": mostly(st.integers(0, 99)),
          "stream": mostly(st.booleans())}
SAMPLING = st.fixed_dictionaries(
    {"max_new_tokens": MAX_NEW},
    optional={**{k: v for k, v in COMMON.items() if k != "stream"},
              "top_k": mostly(st.sampled_from([-1, 1, 5])), "ignore_eos": mostly(st.booleans())})
GENERATE_BODY = merged(
    st.one_of(st.fixed_dictionaries({"text": mostly(TEXT)}),
              st.fixed_dictionaries({"input_ids": mostly(VALID_IDS)}),
              st.fixed_dictionaries({}, optional={"text": JSON, "input_ids": JSON})),
    st.fixed_dictionaries({"sampling_params": mostly(SAMPLING, NOT_NULL)},
                          optional={"stream": COMMON["stream"],
                                    "extra_key": mostly(st.text(max_size=4)),
                                    "cache_salt": mostly(st.text(max_size=4))}))
COMPLETION_BODY = st.fixed_dictionaries(
    {"prompt": mostly(TEXT | VALID_IDS)},
    optional={**COMMON, "max_tokens": mostly(st.integers(1, 8)), "n": mostly(st.just(1)),
              "model": mostly(st.text(max_size=8)), "user": mostly(st.text(max_size=8))})
ANY_BODY = (st.tuples(st.just("/generate"), GENERATE_BODY | JSON)
            | st.tuples(st.just("/v1/completions"), COMPLETION_BODY | JSON))


@settings(max_examples=50, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                  HealthCheck.too_slow])
@given(case=ANY_BODY)
async def test_random_json_is_never_a_5xx(client: TestClient, case: tuple[str, Any]) -> None:
    path, body = case
    resp = await client.post(path, data=json.dumps(body))
    text = await resp.text()
    assert resp.status < 500, text
    event(f"{path} {resp.status}")
    if resp.status >= 400:
        await assert_error(resp, resp.status)
    assert (await client.get("/health")).status == 200
