"""Small helpers for tests of the admin routes, on a client from `conftest.app_client`:

    message = await error_of(resp, 403)       the status and SGLang's error body; the message
    shown = await tiers(client)               GET /admin/tiers, its shape checked: per tier
    await backed_up(client, tokens)           until L3 holds `tokens` and no copy is in flight
"""

from __future__ import annotations

import asyncio

from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient

PAGE = 16  # cache.page_size by default; the engines these tests build keep it
SETTLE_TIMEOUT_S = 10.0  # a bound: a passing run's backups of a few pages land well within it
SETTLE_POLL_S = 0.05  # how often `backed_up` looks


async def error_of(resp: ClientResponse, status: int = 400) -> str:
    """The message of an error answer with `status` (SGLang's `{"error": {...}}`)."""
    assert resp.status == status, await resp.text()
    body = await resp.json()
    assert body["error"]["code"] == status and body["error"]["type"]
    return body["error"]["message"]


async def tiers(client: TestClient) -> dict[str, dict[str, int]]:
    """GET /admin/tiers: each tier's stats, in tokens."""
    resp = await client.get("/admin/tiers")
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["unit"] == "tokens" and body["page_size"] == PAGE
    return body["tiers"]


async def backed_up(client: TestClient, tokens: int) -> None:
    """Until storage holds `tokens` and no copy is in flight. A request that matches a node
    whose L1->L2 write is still in flight loses most of its L3 backup (reported to the
    engine's owner), so these tests let each backup land first."""
    for _ in range(int(SETTLE_TIMEOUT_S / SETTLE_POLL_S)):
        shown = await tiers(client)
        if shown["storage"]["used"] >= tokens and shown["host"]["protected"] == 0:
            return
        await asyncio.sleep(SETTLE_POLL_S)
    raise AssertionError(f"storage never held {tokens} tokens: {shown}")
