"""Helpers of the API-key and tenant tests (tests/test_api_keys.py, tests/test_tenants.py):

    async with keyed_client(engine, admin=True) as c:   the app on loopback, its inference
                                                         routes behind the engine's keys
    headers = bearer(KEY)                                      {"Authorization": "Bearer KEY"}
    await denied(resp, wrong=False)                            a 401 in the JSON error shape
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer
from http_helpers import error_of

from hicache_server.api_keys import ApiKeys, load_api_keys
from hicache_server.engine import Engine
from hicache_server.http import add_admin_routes, create_app


@asynccontextmanager
async def keyed_client(engine: Engine, keys: ApiKeys | None = None, *, admin: bool = False
                       ) -> AsyncIterator[TestClient]:
    """The engine's app on loopback with `keys` on its inference routes (None: those of the
    engine's `server.api_key` and `server.api_keys_file`, read as launch reads them), with
    the admin routes (no admin key: loopback) when `admin`; afterwards waits until no
    request runs."""
    if keys is None:
        keys = load_api_keys(engine.config.server.api_key, engine.config.server.api_keys_file)
    app = create_app(engine, api_keys=keys)
    if admin:
        add_admin_routes(app, engine, None)
    async with TestClient(TestServer(app)) as c:
        yield c
    engine.flush_cache(())


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def denied(resp: ClientResponse, *, wrong: bool) -> str:
    """The message of a 401 refusal: the JSON error shape, the Bearer challenge
    (`error="invalid_token"` when a key was sent and is `wrong`)."""
    message = await error_of(resp, 401)
    assert (await resp.json())["error"]["type"] == "authentication_error"
    challenge = resp.headers.get("WWW-Authenticate")
    assert challenge == ('Bearer error="invalid_token"' if wrong else "Bearer"), challenge
    return message
