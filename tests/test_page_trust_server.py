"""A stored page is served only under its own key, through the real server on a real Redis
(issue 55's repro): two unrelated prompts answered and backed up, the server stopped, the
stored values rotated among the keys, a fresh server: not one storage-hit token, the answers
those of recomputation, every swapped page counted corrupt. Without a secret (the checksum),
with the fleet secret's MAC, with encryption; and a server of another secret hits nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from conftest import app_client
from http_helpers import PAGE, backed_up
from redis_fixtures import RedisServer, require_redis_server

from hicache.config_storage import SECRET_ENV
from hicache_server.config import load_config
from hicache_server.engine import Engine

# Two unrelated prompts of 8 full pages each: their stored values have the same length.
PROMPTS = ([(7 * i) % 250 for i in range(8 * PAGE)], [(11 * i + 3) % 250 for i in range(8 * PAGE)])
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
SECRETS = {"checksum": None, "mac": "a" * 64, "encrypted": "a" * 64}
OTHER_SECRET = "b" * 64
KEY_PREFIX = "trust:"
HIT_TOKENS = 'hicache:cached_tokens_total{tier="storage"}'
CORRUPT = "hicache:storage_corrupt_pages_total"


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    require_redis_server()
    with RedisServer.start(tmp_path / "redis") as server:
        yield server


@asynccontextmanager
async def serving(redis: RedisServer, encrypt: bool) -> AsyncIterator[TestClient]:
    """A fresh CPU server: L1 + L2 + L3 on `redis`, prefetches waited for, hits fetched
    whole (the test counts the tokens L3 serves)."""
    config = load_config(None, {
        "cache.max_total_tokens": 2048, "cache.hierarchical": True, "model.device": "cpu",
        "storage.backend": "redis", "storage.redis.url": redis.url,
        "storage.redis.key_prefix": KEY_PREFIX, "storage.encrypt": encrypt,
        "storage.prefetch_policy": "wait_complete", "storage.prefetch_threshold": 32,
        "storage.overlap": False})
    with Engine(config) as engine:
        async with app_client(engine, admin=True) as client:
            yield client


async def generate(client: TestClient, ids: list[int]) -> dict[str, Any]:
    resp = await client.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY})
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def storage_stats(client: TestClient) -> tuple[int, int]:
    """(storage hit tokens, corrupt pages) from /metrics."""
    text = await (await client.get("/metrics")).text()
    found = {}
    for line in text.splitlines():
        for name in (HIT_TOKENS, CORRUPT):
            if line.startswith(name + " "):
                found[name] = int(float(line.split()[-1]))
    return found[HIT_TOKENS], found[CORRUPT]


def rotate_values(redis: RedisServer) -> int:
    """Move each stored value to the next key (all values have one length): how many."""
    client = redis.client()
    names = sorted(client.scan_iter(match=f"{KEY_PREFIX}*"))
    values = [client.get(name) for name in names]
    assert len({len(v) for v in values}) == 1
    for name, value in zip(names, values[-1:] + values[:-1]):
        client.set(name, value)
    return len(names)


@pytest.mark.parametrize("protection", sorted(SECRETS))
async def test_swapped_pages_are_never_served(redis: RedisServer, protection: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    if SECRETS[protection] is None:
        monkeypatch.delenv(SECRET_ENV, raising=False)
    else:
        monkeypatch.setenv(SECRET_ENV, SECRETS[protection])
    encrypt = protection == "encrypted"
    async with serving(redis, encrypt) as client:
        answers = [(await generate(client, ids))["output_ids"] for ids in PROMPTS]
        await backed_up(client, sum(len(ids) for ids in PROMPTS))
        # the control: the same server, L1 and L2 emptied, reads its pages back from L3
        resp = await client.post("/admin/flush", json={"tiers": ["device", "host"]})
        assert resp.status == 200
        again = await generate(client, PROMPTS[0])
        assert again["meta_info"]["cached_tokens_details"]["storage"] >= 7 * PAGE
        assert again["output_ids"] == answers[0]
    assert rotate_values(redis) >= 14
    async with serving(redis, encrypt) as client:
        served = [await generate(client, ids) for ids in PROMPTS]
        assert [r["meta_info"]["cached_tokens_details"]["storage"] for r in served] == [0, 0]
        assert [r["output_ids"] for r in served] == answers  # recomputed, as at first
        hit_tokens, corrupt = await storage_stats(client)
        assert hit_tokens == 0 and corrupt >= 2  # each prompt's first page at least


async def test_a_server_of_another_secret_hits_nothing(redis: RedisServer,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRETS["mac"])
    async with serving(redis, False) as client:
        answer = (await generate(client, PROMPTS[0]))["output_ids"]
        await backed_up(client, len(PROMPTS[0]))
    keys_a = set(redis.client().scan_iter(match=f"{KEY_PREFIX}*"))
    monkeypatch.setenv(SECRET_ENV, OTHER_SECRET)
    async with serving(redis, False) as client:
        served = await generate(client, PROMPTS[0])
        assert served["meta_info"]["cached_tokens_details"]["storage"] == 0
        assert served["output_ids"] == answer
        await backed_up(client, len(PROMPTS[0]))
    keys_b = set(redis.client().scan_iter(match=f"{KEY_PREFIX}*")) - keys_a
    # another secret, other keys: nothing of one fleet can even be looked up by the other
    assert len(keys_b) == len(keys_a) >= 7
