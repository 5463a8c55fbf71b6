"""The event loop only waits: while a ~1 M-character chat message is rendered, tokenized
(SmolLM2's real tokenizer: ~0.7 s) and refused as too long, /health still answers at once.
Before the work moved off the loop (and `HFTokenizer.encode` stopped holding the GIL),
/health waited 0.4-0.95 s here; the bound is 50 ms, the issue's (52) own."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest
from conftest import app_client, small_engine

from hicache_server.engine import Engine
from hicache_server.models.named import DEFAULT_MODEL

MESSAGE_CHARS = 1_000_000
PROBE_GAP_S = 0.005  # a client asking /health every 5 ms
HEALTH_BOUND_S = 0.050
SETTLE_S = 0.05  # probes before and after the big request


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield from small_engine(**{"model.path": DEFAULT_MODEL})


async def test_health_answers_while_a_huge_chat_message_is_tokenized(engine: Engine) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "a" * MESSAGE_CHARS}],
                       "max_tokens": 1})
    async with app_client(engine) as client:
        done, waits = asyncio.Event(), []

        async def probe() -> None:
            # what a client polling every PROBE_GAP_S waits beyond its own sleep: a block of
            # the loop counts whether it falls in the request or in the sleep before it
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(PROBE_GAP_S)
                resp = await client.get("/health")
                assert resp.status == 200
                now = time.perf_counter()
                waits.append(now - last - PROBE_GAP_S)
                last = now

        prober = asyncio.ensure_future(probe())
        await asyncio.sleep(SETTLE_S)
        resp = await client.post("/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
        refusal = (await resp.json())["error"]["message"]
        await asyncio.sleep(SETTLE_S)
        done.set()
        await prober
    assert resp.status == 400 and "the model's context is" in refusal
    assert len(waits) > 2 * SETTLE_S / PROBE_GAP_S / 2  # probes ran throughout
    assert max(waits) < HEALTH_BOUND_S, f"/health waited {max(waits) * 1e3:.0f} ms"
