"""L3 attached and detached at runtime through SGLang's `PUT / DELETE / GET
/hicache/storage-backend`, on the real aiohttp app: pages reach a store attached to a server
started without one, a detached store leaves the server serving, refusals are 400s that
change nothing, the routes are admin routes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from conftest import WAIT_S, app_client, small_engine, tiered_engine_in
from http_helpers import PAGE, backed_up, error_of, tiers
from typing_extensions import Self

from hicache.config import REDACTED
from hicache.config_storage import RedisConfig, StorageConfig
from hicache_server.attach_targets import AttachTargets, redact_urls
from hicache_server.config import load_config
from hicache_server.engine import Engine
from hicache_server.storage_attach import StorageChangeRefused

ROUTE = "/hicache/storage-backend"
KEY = "attach-admin-key"
QS_PASSWORD = "qs-secret-4711"  # the start-up Redis URL's ?password=, never to be shown
ENV_PASSWORD = "env-secret-0815"  # HICACHE_REDIS_PASSWORD, sent to the start-up Redis only
CANARY = "canary-value-9d2c"  # an environment variable's value no answer may hold
RECV_BYTES = 1 << 16  # what a `Recorder` reads per packet; a handshake is far smaller
ACCEPT_POLL_S = 0.05  # how soon a `Recorder` notices stop()
PROMPT = [(7 * i) % 250 for i in range(8 * PAGE)]  # 8 full pages
OTHER = [(11 * i + 3) % 250 for i in range(8 * PAGE)]
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
# A stream long enough to be running whenever the test asks: the tiny model on the CPU
# takes seconds for it; the test reads one event, asks, then closes the stream (an abort).
LONG = {"max_new_tokens": 1500, "ignore_eos": True}
NONE_ATTACHED = {"hicache_storage_backend": None, "hicache_storage_backend_extra_config": None,
                 "hicache_storage_prefetch_policy": None,
                 "hicache_write_policy": "write_through", "backend_config": None}


@pytest.fixture(scope="module")
def redis_port() -> int:
    """The port of the module engine's start-up `storage.redis.url`: the one Redis endpoint
    an attach may reach. Nobody listens there unless a test starts a server on it."""
    from redis_fixtures import free_port

    return free_port()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, redis_port: int) -> Iterator[Engine]:
    """L1 + L2 on the CPU, no L3 at start; prefetches waited for (as `tiered_engine`) and
    hits fetched whole (overlap off: the tests count the tokens L3 serves). LMDB attaches
    may open stores under the session's temporary folder (every `tmp_path`); the start-up
    Redis URL carries a password in its query string, as redis-py reads it."""
    with Engine(load_config(None, {
            "cache.max_total_tokens": 2048, "cache.hierarchical": True,
            "storage.prefetch_policy": "wait_complete", "storage.prefetch_threshold": 32,
            "storage.overlap": False, "model.device": "cpu",
            "storage.attach_roots": [str(tmp_path_factory.getbasetemp())],
            "storage.redis.url": f"redis://127.0.0.1:{redis_port}/0?password={QS_PASSWORD}"})
            ) as e:
        yield e


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[TestClient]:
    """The app with admin routes (loopback, no key); each test ends with no request running
    and L3 detached."""
    async with app_client(engine, admin=True) as c:
        yield c
    engine.detach_storage()
    engine.flush_cache()


def lmdb_body(path: Path, **extra: Any) -> dict[str, Any]:
    """SGLang's body: the extra config as JSON text."""
    return {"hicache_storage_backend": "lmdb",
            "hicache_storage_backend_extra_config_json": json.dumps({"path": str(path),
                                                                     **extra})}


async def ok(resp: Any) -> dict[str, Any]:
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def attach(client: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    return await ok(await client.put(ROUTE, json=body))


async def backend(client: TestClient) -> dict[str, Any]:
    return await ok(await client.get(ROUTE))


async def generate(client: TestClient, ids: list[int] = PROMPT) -> dict[str, int]:
    body = await ok(await client.post("/generate", json={"input_ids": ids,
                                                         "sampling_params": GREEDY}))
    return body["meta_info"]["cached_tokens_details"]


async def flush_upper(client: TestClient) -> None:
    await ok(await client.post("/admin/flush", json={"tiers": ["device", "host"]}))


async def storage_hit_after_flush(client: TestClient, ids: list[int]) -> int:
    """The storage tokens a request for `ids` is served after L1 and L2 are emptied."""
    await flush_upper(client)
    return (await generate(client, ids))["storage"]


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


# ------------------------------------------------------------------------ attach, detach


async def test_attach_lmdb_serves_pages_then_detach(client: TestClient, tmp_path: Path
                                                    ) -> None:
    assert await backend(client) == NONE_ATTACHED
    assert "storage" not in await tiers(client)
    await generate(client)  # in L1 and L2 before the attach

    body = await attach(client, lmdb_body(tmp_path / "l3"))
    assert body["success"] is True and "attached" in body["message"]
    assert body["hicache_storage_backend"] == "lmdb"
    assert body["backend_config"]["path"] == str(tmp_path / "l3")
    assert json.loads(body["hicache_storage_backend_extra_config"]) == body["backend_config"]
    assert body["hicache_storage_prefetch_policy"] == "wait_complete"
    assert await backend(client) == {k: v for k, v in body.items()
                                     if k not in ("success", "message")}
    assert (await tiers(client))["storage"]["capacity"] > 0
    await backed_up(client, len(PROMPT))  # what L2 held is written to L3

    await generate(client, OTHER)  # reaches L2, then L3
    await backed_up(client, len(PROMPT) + len(OTHER))
    assert await storage_hit_after_flush(client, PROMPT) >= len(PROMPT) - PAGE
    assert await storage_hit_after_flush(client, OTHER) >= len(OTHER) - PAGE
    metrics = await (await client.get("/metrics")).text()
    assert metric(metrics, 'hicache:tier_capacity_tokens{tier="storage"}') > 0
    assert metric(metrics, "hicache:prefetch_seconds_count") >= 1  # the new tier's hook

    body = await ok(await client.delete(ROUTE))
    assert body["success"] is True and "detached" in body["message"]
    assert {k: body[k] for k in NONE_ATTACHED} == NONE_ATTACHED
    assert await backend(client) == NONE_ATTACHED
    assert set(await tiers(client)) == {"device", "host"}
    await flush_upper(client)
    assert (await generate(client, OTHER))["storage"] == 0  # computed: no L3 to read
    metrics = await (await client.get("/metrics")).text()
    assert metric(metrics, 'hicache:tier_capacity_tokens{tier="storage"}') is None
    assert metric(metrics, 'hicache:tier_capacity_tokens{tier="host"}') > 0

    again = await ok(await client.delete(ROUTE))  # idempotent, as SGLang's
    assert again["success"] is True and "nothing changed" in again["message"]


async def test_a_detached_store_keeps_its_pages(client: TestClient, tmp_path: Path) -> None:
    await attach(client, lmdb_body(tmp_path / "l3"))
    await generate(client, OTHER)
    await backed_up(client, len(OTHER))
    await ok(await client.delete(ROUTE))
    await attach(client, lmdb_body(tmp_path / "l3"))  # the same store, opened again
    assert (await tiers(client))["storage"]["used"] >= len(OTHER)
    assert await storage_hit_after_flush(client, OTHER) >= len(OTHER) - PAGE


async def test_attach_twice(client: TestClient, tmp_path: Path) -> None:
    body = lmdb_body(tmp_path / "a")
    await attach(client, body)
    same = await attach(client, body)  # SGLang: success, the policies updated
    assert "attached already" in same["message"]
    policy = await attach(client, {**body, "hicache_storage_prefetch_policy": "best_effort"})
    assert policy["hicache_storage_prefetch_policy"] == "best_effort"
    assert (await backend(client))["hicache_storage_prefetch_policy"] == "best_effort"
    for other in (lmdb_body(tmp_path / "b"), {"hicache_storage_backend": "redis"}):
        message = await error_of(await client.put(ROUTE, json=other))
        assert "attached already" in message and "detach it first" in message
    assert (await backend(client))["backend_config"]["path"] == str(tmp_path / "a")


async def test_not_idle_is_400_and_changes_nothing(engine: Engine, client: TestClient,
                                                   tmp_path: Path) -> None:
    resp = await client.post("/generate", json={"input_ids": PROMPT, "stream": True,
                                                "sampling_params": LONG})
    assert (await resp.content.readuntil(b"\n\n")).startswith(b"data: ")  # running now
    message = await error_of(await client.put(ROUTE, json=lmdb_body(tmp_path / "l3")))
    assert "not idle: 1 request running, 0 waiting" in message
    assert "not idle" in await error_of(await client.delete(ROUTE))
    assert await backend(client) == NONE_ATTACHED  # GET answers while busy
    resp.close()  # the request is aborted
    await asyncio.get_running_loop().run_in_executor(None, engine.flush_cache, ())  # idle
    assert (await attach(client, lmdb_body(tmp_path / "l3")))["success"] is True


# ------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(("body", "words"), [
    ({}, "`hicache_storage_backend` is required"),
    ({"hicache_storage_backend": "s3"}, "storage.backend: 's3' is not one of lmdb, redis"),
    ({"hicache_storage_backend": "none"}, "detach"),
    ({"hicache_storage_backend": 3}, "must be a backend name"),
    ({"hicache_storage_backend": "lmdb", "hicache_storage_backend_extra_config_json": "{"},
     "storage.extra_config: not valid JSON"),
    ({"hicache_storage_backend": "lmdb", "hicache_storage_backend_extra_config_json": "[1]"},
     "storage.extra_config: expected a JSON object"),
    ({"hicache_storage_backend": "lmdb", "hicache_storage_backend_extra_config_json": [1]},
     "must be a JSON object"),
    ({"hicache_storage_backend": "lmdb",
      "hicache_storage_backend_extra_config_json": {"bogus": 1}},
     "storage.lmdb.bogus: unknown key"),
    ({"hicache_storage_backend": "lmdb",
      "hicache_storage_backend_extra_config_json": '{"max_size_gb": -1}'},
     "storage.lmdb.max_size_gb: must be > 0"),
    ({"hicache_storage_backend": "lmdb+redis",
      "hicache_storage_backend_extra_config_json": {"path": "/x"}},
     'lmdb+redis takes {"lmdb": {...}, "redis": {...}}'),
    ({"hicache_storage_backend": "redis",
      "hicache_storage_backend_extra_config_json": {"url": "http://x"}},
     "storage.redis.url: 'http://x' must start with one of"),
    ({"hicache_storage_backend": "lmdb", "hicache_storage_prefetch_policy": "sometimes"},
     "storage.prefetch_policy: 'sometimes' is not one of"),
    ({"hicache_storage_backend": "lmdb", "hicache_write_policy": "write_back"},
     "host.write_policy: 'write_back'"),
    ({"hicache_storage_backend": "lmdb", "backend": "lmdb"}, "unknown field(s) 'backend'"),
    ({"hicache_storage_backend": "lmdb"}, "storage.lmdb.path is required"),
    ({"hicache_storage_backend": "lmdb",
      "hicache_storage_backend_extra_config_json": {"path": "relative/l3"}},
     "must be an absolute folder"),
])
async def test_bad_attach_is_400_naming_the_key(client: TestClient, body: dict[str, Any],
                                                words: str) -> None:
    assert words in await error_of(await client.put(ROUTE, json=body))
    assert await backend(client) == NONE_ATTACHED


async def test_a_store_that_cannot_open_leaves_the_server_without_l3(
        client: TestClient, tmp_path: Path, redis_port: int) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    message = await error_of(await client.put(ROUTE, json=lmdb_body(blocker / "l3")))
    assert "could not open L3 (lmdb" in message and "without L3" in message
    down = {"hicache_storage_backend": "redis",  # nobody listens there: Redis is down
            "hicache_storage_backend_extra_config_json":
            {"url": f"redis://:hunter2@127.0.0.1:{redis_port}/0"}}
    message = await error_of(await client.put(ROUTE, json=down))
    assert "did not answer" in message and "hunter2" not in message
    assert await backend(client) == NONE_ATTACHED
    assert "storage" not in await tiers(client)
    assert (await generate(client))["storage"] == 0  # still serving


def test_engine_api(engine: Engine, tmp_path: Path) -> None:
    with pytest.raises(StorageChangeRefused, match="storage.backend"):
        engine.attach_storage("tape")
    launch = engine.config.storage
    out = engine.attach_storage("lmdb", '{"path": "%s"}' % (tmp_path / "l3"),
                                prefetch_policy="best_effort")
    try:
        assert out["hicache_storage_backend"] == "lmdb"
        assert engine.config.storage.backend == "lmdb"
        assert engine.config.storage.lmdb.path == str(tmp_path / "l3")
        assert engine.config.storage.prefetch_policy == "best_effort"
        assert engine.cache.storage.policy == "best_effort"
        assert engine.storage_backend()["backend_config"]["path"] == str(tmp_path / "l3")
        engine.generate(input_ids=OTHER, sampling_params=GREEDY)
        engine.flush_cache(["device"])  # L2 holds it, L3 too once its backup lands
    finally:
        engine.detach_storage()
    # The launch section again: the next attach merges over it, not over this one's.
    assert engine.config.storage == dataclasses.replace(launch, backend="none")
    assert not any(n.storage_backed for n in engine.cache.tree.iter_nodes())
    engine.cache.check_integrity()


@pytest.fixture(scope="module")
def l1_only() -> Iterator[Engine]:
    yield from small_engine()


async def test_without_hierarchical_cache(l1_only: Engine, tmp_path: Path) -> None:
    async with app_client(l1_only, admin=True, wait_idle=False) as client:
        message = await error_of(await client.put(ROUTE, json=lmdb_body(tmp_path)))
        assert "host tier (L2)" in message and "--enable-hierarchical-cache" in message
        assert (await ok(await client.delete(ROUTE)))["success"] is True
        assert await backend(client) == {**NONE_ATTACHED, "hicache_write_policy": None}


# --------------------------------------------------------------------------------- access


@pytest.mark.parametrize("method", ["PUT", "DELETE", "GET"])
async def test_admin_access(engine: Engine, tmp_path: Path, method: str) -> None:
    body = lmdb_body(tmp_path / "l3") if method == "PUT" else None
    for key, headers, status in [(None, {}, 403), (KEY, {}, 401),
                                 (KEY, {"Authorization": "Bearer wrong"}, 403)]:
        try:
            async with app_client(engine, admin=True, admin_key=key, wait_idle=False,
                                  remote="203.0.113.5") as client:
                await error_of(await client.request(method, ROUTE, json=body,
                                                    headers=headers), status)
                assert engine.storage_backend()["hicache_storage_backend"] is None
                if key is not None:
                    right = {"Authorization": f"Bearer {KEY}"}
                    await ok(await client.request(method, ROUTE, json=body, headers=right))
        finally:
            engine.detach_storage()


# ---------------------------------------------------------------------------------- Redis


async def test_attach_redis(client: TestClient, tmp_path: Path, redis_port: int) -> None:
    from redis_fixtures import RedisServer

    with RedisServer.start(tmp_path / "redis", redis_port, password="hunter2") as server:
        url = f"redis://:hunter2@127.0.0.1:{server.port}/0"
        body = await attach(client, {
            "hicache_storage_backend": "redis",
            "hicache_storage_backend_extra_config_json": {"url": url,
                                                          "key_prefix": "attach:"}})
        assert body["backend_config"]["url"] == f"redis://:{REDACTED}@127.0.0.1:" \
                                                f"{server.port}/0"
        assert "hunter2" not in json.dumps(await backend(client))
        await generate(client, OTHER)
        await backed_up(client, len(OTHER))
        assert await storage_hit_after_flush(client, OTHER) >= len(OTHER) - PAGE
        await ok(await client.delete(ROUTE))


def test_a_store_that_fails_to_close_is_detached_all_the_same(tmp_path: Path,
                                                              monkeypatch) -> None:
    """Closing L3 at its detach raises: the detach still succeeds (logged), the server goes
    on without L3 and can attach one again."""
    with Engine(load_config(None, {"cache.max_total_tokens": 2048, "cache.hierarchical": True,
                                   "model.device": "cpu",
                                   "storage.attach_roots": [str(tmp_path)]})) as e:
        e.attach_storage("lmdb", {"path": str(tmp_path / "a")})

        def broken_close() -> None:
            raise OSError("disk gone")
        monkeypatch.setattr(e.cache.storage, "close", broken_close)
        assert e.detach_storage()["success"] is True
        assert e.storage_backend()["hicache_storage_backend"] is None
        assert e.attach_storage("lmdb", {"path": str(tmp_path / "b")})["success"] is True


# ------------------------------------------------------------------------ attach targets


def lmdb_at(path: str) -> dict[str, Any]:
    """An LMDB attach naming `path` exactly as given (no Path normalisation)."""
    return {"hicache_storage_backend": "lmdb",
            "hicache_storage_backend_extra_config_json": json.dumps({"path": path})}


async def test_lmdb_outside_the_roots_is_refused(client: TestClient, tmp_path: Path,
                                                 tmp_path_factory: pytest.TempPathFactory
                                                 ) -> None:
    """Outside the root, through a symlink out of it, or climbing with `..`: refused before
    any folder is made, and the symlink's target never shown."""
    outside = tmp_path_factory.getbasetemp().parent / f"hicache-outside-{tmp_path.name}"
    escape = tmp_path / "escape"
    escape.symlink_to(outside, target_is_directory=True)
    tiered = {"hicache_storage_backend": "lmdb+redis",
              "hicache_storage_backend_extra_config_json": {"lmdb": {"path": str(escape)}}}
    for body in (lmdb_at(str(outside / "l3")), lmdb_at(str(escape / "l3")), lmdb_at(str(escape)),
                 tiered):
        message = await error_of(await client.put(ROUTE, json=body))
        assert "does not lie under any of storage.attach_roots" in message
        if "escape" in json.dumps(body):
            assert str(outside) not in message  # where the link leads is not told
    message = await error_of(await client.put(ROUTE, json=lmdb_at(f"{tmp_path}/../../x")))
    assert "must not hold `..`" in message
    assert not outside.exists() and not (tmp_path.parent.parent / "x").exists()
    assert await backend(client) == NONE_ATTACHED
    inside = tmp_path / "inside"  # a symlink that stays inside a root is followed
    inside.mkdir()
    (tmp_path / "link").symlink_to(inside, target_is_directory=True)
    assert (await attach(client, lmdb_at(str(tmp_path / "link" / "l3"))))["success"] is True
    assert (inside / "l3" / "data.mdb").exists()


async def test_no_variable_is_expanded_nor_echoed(client: TestClient, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The desk review's leak: a `$VAR` in the path came back expanded in the 400."""
    monkeypatch.setenv("HICACHE_TEST_CANARY", CANARY)
    paths = ("/proc/$HICACHE_TEST_CANARY/x", f"{tmp_path}/${{HICACHE_TEST_CANARY}}/x",
             f"{tmp_path}/$HICACHE_TEST_CANARY", "~/hicache-l3", "~root/x")
    for path in paths:
        resp = await client.put(ROUTE, json=lmdb_at(path))
        text = await resp.text()
        assert resp.status == 400 and "never expanded" in text, text
        assert CANARY not in text and os.path.expanduser("~/hicache-l3") not in text
    assert CANARY not in caplog.text
    assert list(tmp_path.iterdir()) == []  # nothing created, under any name
    assert await backend(client) == NONE_ATTACHED


@pytest.fixture(scope="module")
def no_roots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """Started with LMDB (all three tiers) and no `storage.attach_roots`."""
    yield from tiered_engine_in(tmp_path_factory, "no_roots_lmdb")


async def test_without_roots_only_the_start_up_store(no_roots: Engine, tmp_path: Path) -> None:
    start_up = no_roots.config.storage.lmdb.path
    async with app_client(no_roots, admin=True) as client:
        message = await error_of(await client.put(ROUTE, json=lmdb_body(tmp_path / "l3")))
        assert "started without storage.attach_roots" in message
        assert "leave `path` out to reopen the start-up store" in message
        assert not (tmp_path / "l3").exists()
        await ok(await client.delete(ROUTE))
        again = await attach(client, {"hicache_storage_backend": "lmdb"})  # no path
        assert again["backend_config"]["path"] == start_up
        await ok(await client.delete(ROUTE))
        named = await attach(client, lmdb_at(start_up))  # named as configured: the same
        assert named["backend_config"]["path"] == start_up


class Recorder:
    """A TCP listener on 127.0.0.1 that keeps every byte sent to it and answers nothing:
    each connection is closed after its first packet (a client sees a dead Redis at once).
    `connections` counts those accepted; `stop` (the end of the block) joins its thread."""

    def __init__(self, port: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", port))
        self.listener.settimeout(ACCEPT_POLL_S)
        self.port = self.listener.getsockname()[1]
        self.received = bytearray()
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="recorder", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            with conn:
                self.connections += 1
                conn.settimeout(WAIT_S)
                self.received += conn.recv(RECV_BYTES)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.listener.close()


async def test_redis_elsewhere_is_refused_and_no_password_leaves(
        client: TestClient, tmp_path: Path, redis_port: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHE_REDIS_PASSWORD", ENV_PASSWORD)
    with Recorder(0) as elsewhere:
        urls = (f"redis://127.0.0.1:{elsewhere.port}/0", f"redis://localhost:{redis_port}/0",
                f"redis://:{ENV_PASSWORD}x@127.0.0.1:{elsewhere.port}/0",
                f"unix://{tmp_path}/redis.sock")
        for url in urls:
            for body in ({"hicache_storage_backend": "redis",
                          "hicache_storage_backend_extra_config_json": {"url": url}},
                         {"hicache_storage_backend": "lmdb+redis",
                          "hicache_storage_backend_extra_config_json": {
                              "lmdb": {"path": str(tmp_path / "l3")}, "redis": {"url": url}}}):
                message = await error_of(await client.put(ROUTE, json=body))
                assert f"only the Redis this server was configured with at start " \
                       f"(127.0.0.1:{redis_port})" in message
                assert ENV_PASSWORD not in message and QS_PASSWORD not in message
        assert elsewhere.connections == 0 and elsewhere.received == b""
    assert not (tmp_path / "l3").exists()
    assert await backend(client) == NONE_ATTACHED
    # The control: the start-up endpoint is sent the password (the recorder does hear it).
    with Recorder(redis_port) as configured:
        bare = {"hicache_storage_backend": "redis", "hicache_storage_backend_extra_config_json":
                {"url": f"redis://127.0.0.1:{redis_port}/0"}}
        assert "did not answer" in await error_of(await client.put(ROUTE, json=bare))
    assert configured.connections >= 1 and ENV_PASSWORD.encode() in configured.received


async def test_a_query_string_password_is_never_shown(client: TestClient, tmp_path: Path,
                                                      redis_port: int,
                                                      caplog: pytest.LogCaptureFixture
                                                      ) -> None:
    """The start-up URL's `?password=` opens the store and shows nowhere: not in the attach
    answer, GET /hicache/storage-backend, /get_server_info, /admin/tiers, /metrics, a
    refusal quoting the attached section, or the log."""
    from redis_fixtures import RedisServer

    with RedisServer.start(tmp_path / "redis", redis_port, password=QS_PASSWORD):
        body = await attach(client, {"hicache_storage_backend": "redis"})  # start-up URL
        url = f"redis://127.0.0.1:{redis_port}/0?password={REDACTED}"
        assert body["backend_config"]["url"] == url
        await generate(client, OTHER)
        await backed_up(client, len(OTHER))  # the password did open the store
        shown = [json.dumps(body)]
        for route in (ROUTE, "/get_server_info", "/server_info", "/admin/tiers", "/metrics"):
            resp = await client.get(route)
            assert resp.status == 200
            shown.append(await resp.text())
        other = {"hicache_storage_backend": "redis",
                 "hicache_storage_backend_extra_config_json": {"key_prefix": "other:"}}
        shown.append(await error_of(await client.put(ROUTE, json=other)))
        assert "attached already" in shown[-1] and url in shown[-1]
        await ok(await client.delete(ROUTE))
    assert json.loads(shown[2])["config"]["storage"]["redis"]["url"] == url
    assert all(QS_PASSWORD not in text for text in shown)
    assert QS_PASSWORD not in caplog.text


async def test_an_error_quoting_a_sent_url_hides_its_password(client: TestClient) -> None:
    body = {"hicache_storage_backend": "redis",
            "hicache_storage_backend_extra_config_json": {"url": "http://:pw-9a7e@x:1/0"}}
    message = await error_of(await client.put(ROUTE, json=body))
    assert "must start with one of" in message and "pw-9a7e" not in message


@pytest.mark.parametrize(("start", "asked", "allowed"), [
    ("redis://10.0.0.5:6379/0", "redis://10.0.0.5/3", True),  # the default port, another db
    ("redis://10.0.0.5:6379/0", "rediss://10.0.0.5:6379/0", True),  # TLS is never worse
    ("redis://10.0.0.5:6379/0", "redis://10.0.0.6:6379/0", False),
    ("redis://10.0.0.5:6379/0", "redis://10.0.0.5:6380/0", False),
    ("rediss://cache.internal:6379/0", "redis://cache.internal:6379/0", False),  # no downgrade
    ("rediss://Cache.Internal:6379/0", "rediss://cache.internal:6379/1", True),
    ("unix:///run/redis.sock", "unix:///run/redis.sock?db=2", True),
    ("unix:///run/redis.sock", "unix:///tmp/other.sock", False),
    ("redis://10.0.0.5:99999/0", "redis://10.0.0.5:99999/0", False),  # no usable endpoint
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1/0?port=7000", False),  # redis-py's ?port=
    ("rediss://h:6379/0", "rediss://h:6379/0?ssl_cert_reqs=none", False),  # checks turned off
    ("redis://h:6379/0", "redis://h:6379/0?socket_timeout=0.001", False),
    ("redis://h:6379/0?password=p", "redis://u:q@h:6379/5", True)])  # credentials, db
def test_the_redis_endpoint_rule(start: str, asked: str, allowed: bool) -> None:
    targets = AttachTargets(StorageConfig(redis=RedisConfig(url=start)))
    storage = StorageConfig(backend="redis", redis=RedisConfig(url=asked))
    if allowed:
        targets.check("redis", {}, storage)
        return
    with pytest.raises(StorageChangeRefused, match="storage.redis.url"):
        targets.check("redis", {}, storage)


@pytest.mark.parametrize("text", [
    "bad url 'redis://:pa'ss-9a7e@h:1/0' here",  # a quote inside the password
    'bad url "redis://:pa\'ss-9a7e@h" here',  # repr's double quotes around it
    "bad url 'redis://h:1/0?password=pa-9a7e' here"])
def test_redact_urls_hides_a_password_whatever_it_holds(text: str) -> None:
    assert "9a7e" not in redact_urls(text) and "bad url" in redact_urls(text)
