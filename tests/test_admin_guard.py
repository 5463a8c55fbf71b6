"""An admin API no browser can drive, through the real app on loopback: a cross-site POST
(text/plain, form) with a foreign Origin is refused and leaves L1 and L2 as they were, a
foreign Host (DNS rebinding) is refused on every method, the server's own origin with a JSON
body still works, non-JSON bodies are 415s with or without a key, and a key from
HICACHE_ADMIN_API_KEY guards the real `hicache-server` process."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestClient
from conftest import app_client, tiered_engine_in
from http_helpers import PAGE, backed_up, error_of, tiers
from test_server_process import running

from hicache.config import REDACTED
from hicache_server.engine import Engine
from hicache_server.http import AdminDenied
from hicache_server.http.admin import ADMIN_ROUTES
from hicache_server.loopback_guard import ADMIN_PATHS, check_own_origin

KEY = "guard-admin-key-7f3a"
PROMPT = [(5 * i + 1) % 250 for i in range(6 * PAGE)]  # 6 full pages
GREEDY = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
EVIL = "http://evil.example"
FLUSH_UPPER = '{"tiers": ["device", "host"]}'  # what the desk review's page sent
STORAGE_ROUTE = "/hicache/storage-backend"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    yield from tiered_engine_in(tmp_path_factory, "guard_lmdb")


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[TestClient]:
    """No admin key: loopback clients, no browser's Origin or Host."""
    async with app_client(engine, admin=True) as c:
        yield c


async def cached(client: TestClient) -> dict[str, int]:
    """L1 and L2 hold the prompt (and L3 its backup); their used tokens."""
    resp = await client.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY})
    assert resp.status == 200, await resp.text()
    await backed_up(client, len(PROMPT) - PAGE)
    shown = await tiers(client)
    used = {t: shown[t]["used"] for t in ("device", "host")}
    assert used["device"] > 0 and used["host"] > 0
    return used


async def used_now(client: TestClient) -> dict[str, int]:
    shown = await tiers(client)
    return {t: shown[t]["used"] for t in ("device", "host")}


def own(client: TestClient, name: str = "127.0.0.1") -> str:
    return f"{name}:{client.server.port}"


# ---------------------------------------------------------------------------- the rules


@pytest.mark.parametrize(("host", "origin", "allowed"), [
    (None, None, True), ("127.0.0.1:8000", None, True), ("localhost:8000", None, True),
    ("[::1]:8000", None, True), ("LocalHost:8000", "http://LOCALHOST:8000", True),
    ("127.0.0.1:8000", "http://127.0.0.1:8000", True), (None, "http://[::1]:8000", True),
    ("evil.example:8000", None, False), ("evil.example", None, False),
    ("127.0.0.1:9000", None, False), ("127.0.0.1", None, False), ("localhost.:8000", None, False),
    ("127.0.0.2:8000", None, False), (None, "http://evil.example", False),
    (None, "null", False), (None, "https://127.0.0.1:8000", False),
    (None, "http://127.0.0.1:9000", False), (None, "http://127.0.0.1", False),
    (None, "http://127.0.0.1:8000/", False), ("127.0.0.1:8000", "http://evil.example", False)])
def test_own_origin_rule(host: str | None, origin: str | None, allowed: bool) -> None:
    if allowed:
        check_own_origin(host, origin, 8000)
        return
    with pytest.raises(AdminDenied) as err:
        check_own_origin(host, origin, 8000)
    assert err.value.status == 403 and "--admin-api-key" in err.value.message


def test_port_80_may_be_left_out() -> None:
    check_own_origin("localhost", "http://localhost", 80)
    with pytest.raises(AdminDenied):
        check_own_origin("localhost", None, None)  # a Unix socket: no name is the server's


# ----------------------------------------------------------------------------- CSRF


@pytest.mark.parametrize(("route", "data", "content_type"), [
    ("/admin/flush", FLUSH_UPPER, "text/plain"),  # fetch(..., {mode: "no-cors"})
    ("/admin/flush", "tiers=device&tiers=host", "application/x-www-form-urlencoded"),
    ("/admin/flush", FLUSH_UPPER, "application/json"),  # a page cannot, but if it did
    ("/flush_cache", None, None)])  # SGLang's body-less flush, from a form with no fields
async def test_a_cross_site_post_is_refused_and_changes_nothing(
        client: TestClient, route: str, data: str | None, content_type: str | None) -> None:
    before = await cached(client)
    headers = {"Origin": EVIL, **({"Content-Type": content_type} if content_type else {})}
    message = await error_of(await client.post(route, data=data, headers=headers), 403)
    assert "Origin 'http://evil.example'" in message and own(client) in message
    assert await used_now(client) == before


async def test_a_foreign_host_is_refused_on_every_method(client: TestClient,
                                                         tmp_path: Path) -> None:
    before = await cached(client)
    put = {"hicache_storage_backend": "lmdb",
           "hicache_storage_backend_extra_config_json": {"path": str(tmp_path / "l3")}}
    for name in ("evil.example", "127.0.0.1.nip.io", "127.0.0.1:1"):
        headers = {"Host": f"{name}:{client.server.port}" if ":" not in name else name}
        for method, route, body in [("GET", "/admin/tiers", None),
                                    ("POST", "/admin/flush", {"tiers": ["device"]}),
                                    ("PUT", STORAGE_ROUTE, put), ("DELETE", STORAGE_ROUTE, None)]:
            resp = await client.request(method, route, json=body, headers=headers)
            message = await error_of(resp, 403)
            assert "DNS rebinding" in message and headers["Host"] in message
    assert await used_now(client) == before
    assert (await tiers(client))["storage"]["used"] > 0  # L3 still attached, not detached
    assert not (tmp_path / "l3").exists()


async def test_the_servers_own_origin_with_json_still_works(client: TestClient) -> None:
    await cached(client)
    for name in ("127.0.0.1", "localhost", "[::1]"):
        headers = {"Host": own(client, name), "Origin": f"http://{own(client, name)}"}
        resp = await client.get("/admin/tiers", headers=headers)
        assert resp.status == 200, await resp.text()
    resp = await client.post("/admin/flush", json={"tiers": ["device", "host"]},
                             headers={"Origin": f"http://{own(client)}"})
    assert resp.status == 200, await resp.text()
    assert set((await resp.json())["freed"]) == {"device", "host"}
    assert await used_now(client) == {"device": 0, "host": 0}
    assert (await client.post("/flush_cache")).status == 200  # body-less, no Origin: curl


# ----------------------------------------------------------------------- JSON bodies only


@pytest.mark.parametrize("admin_key", [None, KEY])
async def test_a_body_that_is_not_json_is_415(client: TestClient, engine: Engine,
                                              admin_key: str | None) -> None:
    """`client` (keyless) looks at the tiers; `keyed` is the app under test."""
    auth = {"Authorization": f"Bearer {KEY}"} if admin_key else {}
    before = await cached(client)
    async with app_client(engine, admin=True, admin_key=admin_key) as keyed:
        for content_type in ("text/plain", "application/x-www-form-urlencoded",
                             "multipart/form-data; boundary=x", "application/octet-stream"):
            resp = await keyed.post("/admin/flush", data=FLUSH_UPPER,
                                    headers={"Content-Type": content_type, **auth})
            message = await error_of(resp, 415)
            assert "application/json" in message and content_type.split(";")[0] in message
        assert await used_now(client) == before
        resp = await keyed.post("/admin/flush", data=FLUSH_UPPER, headers={
            "Content-Type": "application/json; charset=utf-8", **auth})
        assert resp.status == 200, await resp.text()
    assert await used_now(client) == {"device": 0, "host": 0}


async def test_a_key_still_comes_first(engine: Engine) -> None:
    """With a key, a browser's request fails the bearer check (it cannot send the header
    cross-site without a preflight); the Origin rules are the keyless fallback."""
    async with app_client(engine, admin=True, admin_key=KEY) as client:
        resp = await client.post("/admin/flush", data=FLUSH_UPPER,
                                 headers={"Origin": EVIL, "Content-Type": "text/plain"})
        assert "Bearer" in await error_of(resp, 401)
        right = {"Authorization": f"Bearer {KEY}", "Host": "hicache.internal:30000"}
        assert (await client.get("/admin/tiers", headers=right)).status == 200


# -------------------------------------------------------- the key from the environment


async def test_the_server_honours_hicache_admin_api_key(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The real `hicache-server` process, its admin key only in the environment (out of
    `ps`): admin routes need it, nothing shows it."""
    monkeypatch.setenv("HICACHE_ADMIN_API_KEY", KEY)
    args = ["--port", "0", "--device", "cpu", "--max-total-tokens", "2048"]
    with running(args) as (server, base):
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base}/admin/tiers") as resp:
                assert resp.status == 401
            async with session.get(f"{base}/admin/tiers",
                                   headers={"Authorization": "Bearer wrong"}) as resp:
                assert resp.status == 403
            async with session.get(f"{base}/admin/tiers",
                                   headers={"Authorization": f"Bearer {KEY}"}) as resp:
                assert resp.status == 200 and "device" in (await resp.json())["tiers"]
            async with session.get(f"{base}/get_server_info") as resp:
                info = await resp.text()
        server.proc.terminate()
        log = server.rest_of_log()
    assert KEY not in info and f'"admin_api_key": "{REDACTED}"' in info
    assert KEY not in log


def test_admin_paths_name_every_admin_route() -> None:
    """The router guards ADMIN_PATHS; every route the admin module adds must be in it."""
    assert {path for path, _, _ in ADMIN_ROUTES} == ADMIN_PATHS
