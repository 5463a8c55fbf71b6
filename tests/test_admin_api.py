"""Admin routes: flushing each tier for real, tier stats, SGLang aliases, and access control."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from conftest import app_client, tiered_engine_in
from http_helpers import PAGE, backed_up, error_of, tiers

from hicache_server.engine import Engine
from hicache_server.http import AdminDenied, add_admin_routes, check_admin_access, is_loopback

KEY = "s3cret-admin-key"
PROMPT = [(7 * i) % 250 for i in range(8 * PAGE)]  # 8 full pages
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
FIELDS = {"capacity", "used", "evictable", "protected", "hits"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    yield from tiered_engine_in(tmp_path_factory, "admin_lmdb")


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[TestClient]:
    async with app_client(engine, admin=True, wait_idle=False) as c:
        yield c


async def generate(client: TestClient, **extra: Any) -> dict[str, Any]:
    resp = await client.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY,
                                                **extra})
    assert resp.status == 200
    return await resp.json()


async def flush(client: TestClient, body: Any = None) -> dict[str, int]:
    resp = await client.post("/admin/flush", json=body) if body is not None else \
        await client.post("/admin/flush")
    assert resp.status == 200, await resp.text()
    return (await resp.json())["freed"]


# ----------------------------------------------------------------------------- flushing


async def test_tiers_shape(client: TestClient) -> None:
    shown = await tiers(client)
    assert set(shown) == {"device", "host", "storage"}
    faults = shown["storage"].pop("errors_by_op")
    assert isinstance(faults, dict) and shown["storage"].pop("errors") == sum(faults.values())
    model = shown["storage"].pop("cost_model")
    decisions = {"split_prefetches", "head_tokens", "recomputed_hits", "recomputed_hit_tokens"}
    assert decisions <= set(model) and all(model[k] >= 0 for k in decisions)
    assert set(model) - decisions <= {"prefill_tokens_per_s", "fetch_bandwidth_bytes_per_s",
                                      "fetch_latency_s", "prefill_observations",
                                      "fetch_observations", "race_time_factor",
                                      "race_observations"}
    for tier in shown.values():
        assert set(tier) == FIELDS and all(isinstance(v, int) and v >= 0 for v in tier.values())
        assert tier["used"] <= tier["capacity"]
    assert shown["device"]["capacity"] == 2048 and shown["host"]["capacity"] == 4096
    assert shown["storage"]["capacity"] > shown["host"]["capacity"]


async def test_flush_tier_by_tier_moves_the_hits_down(client: TestClient) -> None:
    await flush(client)
    await generate(client)
    await backed_up(client, len(PROMPT))
    assert (await generate(client))["meta_info"]["cached_tokens_details"]["device"] > 0
    freed = await flush(client, {"tiers": ["device"]})
    assert set(freed) == {"device"} and freed["device"] >= len(PROMPT) - PAGE
    after = await tiers(client)
    assert after["device"]["used"] == 0 and after["host"]["used"] > 0
    assert (await generate(client))["meta_info"]["cached_tokens_details"]["host"] > 0
    freed = await flush(client, {"tiers": ["device", "host"]})
    assert freed["device"] > 0 and freed["host"] > 0
    assert (await tiers(client))["storage"]["used"] > 0
    assert (await generate(client))["meta_info"]["cached_tokens_details"]["storage"] > 0
    freed = await flush(client)  # the default: all three
    assert set(freed) == {"device", "host", "storage"} and freed["storage"] > 0
    emptied = await tiers(client)
    assert all(emptied[t]["used"] == 0 for t in emptied)


async def test_flush_waits_for_running_requests(client: TestClient) -> None:
    await flush(client)
    resp = await client.post("/generate", json={
        "input_ids": PROMPT, "stream": True,
        "sampling_params": {"max_new_tokens": 32, "ignore_eos": True}})
    assert (await resp.content.readuntil(b"\n\n")).startswith(b"data: ")
    freed = await flush(client, {"tiers": ["device"]})
    # The request finished (and gave its pages to the tree) before the flush ran.
    assert freed["device"] >= len(PROMPT)
    rest = await resp.text()
    assert '"finish_reason":"length"' in rest and rest.endswith("data: [DONE]\n\n")


async def test_sglang_aliases(client: TestClient) -> None:
    await generate(client)
    resp = await client.post("/flush_cache")
    assert resp.status == 200
    assert set((await resp.json())["freed"]) == {"device", "host"}
    assert (await tiers(client))["storage"]["used"] > 0
    resp = await client.post("/hicache/storage-backend/clear")
    assert resp.status == 200 and (await resp.json())["freed"]["storage"] > 0
    assert (await tiers(client))["storage"]["used"] == 0


@pytest.mark.parametrize(("body", "words"), [
    ({"tiers": ["gpu"]}, "unknown tier"), ({"tiers": "device"}, "array"),
    ({"tiers": [1]}, "array"), ({"tiers": []}, "empty"), ({"tier": ["device"]}, "unknown"),
    ([1], "JSON object")])
async def test_bad_flush_is_400(client: TestClient, body: Any, words: str) -> None:
    assert words in await error_of(await client.post("/admin/flush", json=body), 400)


async def test_admin_routes_are_405_and_404_json(client: TestClient) -> None:
    await error_of(await client.get("/admin/flush"), 405)
    await error_of(await client.get("/admin/nothing"), 404)


# ------------------------------------------------------------------------------- access


@pytest.mark.parametrize(("remote", "loopback"), [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("::ffff:127.0.0.1", True),
    ("fe80::1%eth0", False), ("10.0.0.1", False), ("203.0.113.5", False), ("::", False),
    (None, False), ("", False), ("not-an-ip", False)])
def test_is_loopback(remote: str | None, loopback: bool) -> None:
    assert is_loopback(remote) is loopback


def test_access_rules() -> None:
    check_admin_access("127.0.0.1", None, None)
    check_admin_access("203.0.113.5", f"Bearer {KEY}", KEY)
    check_admin_access("127.0.0.1", f"bearer {KEY}", KEY)  # the scheme is case-insensitive
    for remote, header, key, status in [
            ("203.0.113.5", None, None, 403), ("203.0.113.5", f"Bearer {KEY}", None, 403),
            ("127.0.0.1", None, KEY, 401), ("127.0.0.1", f"Basic {KEY}", KEY, 401),
            ("127.0.0.1", "Bearer ", KEY, 401), ("127.0.0.1", "Bearer wrong", KEY, 403),
            ("127.0.0.1", f"Bearer {KEY}x", KEY, 403)]:
        with pytest.raises(AdminDenied) as err:
            check_admin_access(remote, header, key)
        assert err.value.status == status


async def test_without_key_only_loopback_gets_in(engine: Engine) -> None:
    async with app_client(engine, admin=True, remote="203.0.113.5", wait_idle=False) as client:
        message = await error_of(await client.get("/admin/tiers"), 403)
        assert "loopback" in message and "203.0.113.5" in message
        await error_of(await client.post("/flush_cache"), 403)
        assert (await client.get("/health")).status == 200  # only admin routes are guarded


async def test_with_key(engine: Engine) -> None:
    async with app_client(engine, admin=True, admin_key=KEY, wait_idle=False,
                          remote="203.0.113.5") as client:  # a key lets other machines in
        resp = await client.get("/admin/tiers")
        assert "Bearer" in await error_of(resp, 401)
        assert resp.headers["WWW-Authenticate"] == "Bearer"
        wrong = {"Authorization": "Bearer not-the-key"}
        assert "wrong" in await error_of(await client.get("/admin/tiers", headers=wrong), 403)
        await error_of(await client.post("/admin/flush", headers=wrong), 403)
        right = {"Authorization": f"Bearer {KEY}"}
        assert (await client.get("/admin/tiers", headers=right)).status == 200
        assert (await client.post("/hicache/storage-backend/clear", headers=right)).status == 200


def test_admin_routes_need_the_engines_app(engine: Engine) -> None:
    with pytest.raises(ValueError, match="create_app"):
        add_admin_routes(web.Application(), engine, None)
