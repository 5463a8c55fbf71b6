"""The event loop only waits: a chat message's template and tokenization run off the loop,
so /health answers while they run. Shown by order, not by time: the tokenizer is held
(a gate) until /health has answered, which a loop blocked in it could never do. How long
/health waits in practice is measured by `python -m benchmarks.bench_event_loop`."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import app_client, small_engine

from hicache_server.engine import Engine
from hicache_server.models.named import DEFAULT_MODEL

MESSAGE_CHARS = 1_000_000  # far past SmolLM2's context: tokenized, then refused
HOLD_LIMIT_S = 30.0  # how long the gate holds at most: a liveness bound, never a measure


class HeldTokenizer:
    """The engine's tokenizer, its `encode` held at a gate until `release` is set;
    records each calling thread, and whether the gate ever gave up waiting."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.entered, self.release = threading.Event(), threading.Event()
        self.threads: list[int] = []
        self.gave_up = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode(self, text: str, **kw: Any) -> list[int]:
        self.threads.append(threading.get_ident())
        self.entered.set()
        self.gave_up |= not self.release.wait(HOLD_LIMIT_S)
        return self.inner.encode(text, **kw)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield from small_engine(**{"model.path": DEFAULT_MODEL})


async def test_health_answers_while_a_chat_message_is_tokenized(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    held = HeldTokenizer(engine.tokenizer)
    monkeypatch.setattr(engine, "tokenizer", held)
    loop_thread = threading.get_ident()
    body = json.dumps({"messages": [{"role": "user", "content": "a" * MESSAGE_CHARS}],
                       "max_tokens": 1})
    async with app_client(engine) as client:
        post = asyncio.ensure_future(client.post(
            "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}))
        assert await asyncio.to_thread(held.entered.wait, HOLD_LIMIT_S)
        health = await client.get("/health")  # the tokenizer is still held here
        held.release.set()
        resp = await post
        refusal = (await resp.json())["error"]["message"]
    assert health.status == 200
    assert not held.gave_up, "the loop could not answer /health while the tokenizer ran"
    assert held.threads and loop_thread not in held.threads
    assert resp.status == 400 and "the model's context is" in refusal
