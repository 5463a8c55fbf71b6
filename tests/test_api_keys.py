"""The inference routes' API key (--api-key): through the real server on loopback, every
protected route without a key, with a wrong one and with the right one; /health, /metrics
and the admin routes without it; the official `openai` client; keys never echoed; the keys
file refused at start with a clear message."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient
from api_key_helpers import bearer, denied, keyed_client
from conftest import small_engine
from test_server_process import EXIT_TIMEOUT_S, REPO, START_TIMEOUT_S, running

from hicache.config import REDACTED
from hicache_server.api_keys import OPEN, ApiKeys, ApiKeysError, load_api_keys, read_tenants
from hicache_server.engine import Engine
from hicache_server.tenancy import UNSCOPED

KEY = "sk-operator-0123456789"
WRONG = "sk-wrong-9876543210"
PROMPT = [(11 * i) % 250 + 3 for i in range(48)]  # three full pages
GREEDY = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
OPEN_PATHS = {"/health", "/metrics"}


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield from small_engine(**{"server.api_key": KEY})


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[TestClient]:
    async with keyed_client(engine, admin=True) as c:
        yield c


def requests_of(model_id: str) -> list[tuple[str, str, Any]]:
    """(method, path, body) of a request each protected route answers 200."""
    return [
        ("POST", "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}),
        ("POST", "/close_session", {"session_id": "s1"}),
        ("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0}),
        ("POST", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
        ("GET", "/v1/models", None), ("GET", f"/v1/models/{model_id}", None),
        ("GET", "/get_model_info", None), ("GET", "/model_info", None),
        ("GET", "/get_server_info", None), ("GET", "/server_info", None),
        ("GET", "/get_load", None),
        ("POST", "/tokenize", {"text": "Hello"}), ("POST", "/detokenize", {"tokens": [72, 105]}),
    ]


async def send(client: TestClient, method: str, path: str, body: Any,
               headers: dict[str, str] | None = None) -> ClientResponse:
    return await client.request(method, path, json=body, headers=headers)


async def model_id(client: TestClient) -> str:
    resp = await client.get("/v1/models", headers=bearer(KEY))
    assert resp.status == 200
    return (await resp.json())["data"][0]["id"]


async def test_every_route_but_health_and_metrics_is_protected(engine: Engine) -> None:
    """Read from the router itself: a route added later without the key fails here."""
    async with keyed_client(engine, ApiKeys.of(KEY, {})) as c:
        routes = [(r.method, r.resource.canonical) for r in c.server.app.router.routes()]
        for method, path in routes:
            resp = await c.request(method, path.replace("{id}", "x"))
            assert resp.status == (200 if path in OPEN_PATHS else 401), (method, path)
    assert {path for _, path in routes} == \
        {path for _, path, _ in requests_of("{id}")} | OPEN_PATHS


async def test_no_key_wrong_key_right_key_on_each_route(client: TestClient) -> None:
    name = await model_id(client)
    for method, path, body in requests_of(name):
        await denied(await send(client, method, path, body), wrong=False)
        await denied(await send(client, method, path, body, bearer(WRONG)), wrong=True)
        resp = await send(client, method, path, body, bearer(KEY))
        assert resp.status == 200, (path, await resp.text())


@pytest.mark.parametrize("header", [KEY, f"Basic {KEY}", "Bearer", "Bearer ", f"bearer{KEY}"])
async def test_malformed_headers_are_missing_keys(client: TestClient, header: str) -> None:
    resp = await client.post("/generate", json={"input_ids": PROMPT},
                             headers={"Authorization": header})
    await denied(resp, wrong=False)


async def test_scheme_is_case_insensitive_and_the_token_exact(client: TestClient) -> None:
    resp = await client.post("/tokenize", json={"text": "a"},
                             headers={"Authorization": f"BEARER   {KEY}  "})
    assert resp.status == 200
    for near in (KEY[:-1], KEY + "x", KEY.upper()):
        resp = await client.post("/tokenize", json={"text": "a"}, headers=bearer(near))
        await denied(resp, wrong=True)


async def test_health_metrics_and_admin_need_no_inference_key(client: TestClient) -> None:
    assert (await client.get("/health")).status == 200
    metrics = await client.get("/metrics")
    assert metrics.status == 200 and "hicache" in await metrics.text()
    tiers = await client.get("/admin/tiers")  # loopback, no admin key: its own rule
    assert tiers.status == 200 and "device" in (await tiers.json())["tiers"]


async def test_the_key_is_never_echoed(client: TestClient, caplog: pytest.LogCaptureFixture
                                       ) -> None:
    caplog.set_level(logging.DEBUG)
    name = await model_id(client)
    seen = []
    for method, path, body in requests_of(name):
        for key in (WRONG, KEY):
            resp = await send(client, method, path, body, bearer(key))
            seen.append(await resp.text() + json.dumps(dict(resp.headers)))
    info = await client.get("/get_server_info", headers=bearer(KEY))
    assert (await info.json())["config"]["server"]["api_key"] == REDACTED
    for secret in (KEY, WRONG):
        assert not any(secret in text for text in seen)
        assert secret not in caplog.text


async def test_the_official_openai_client(client: TestClient) -> None:
    base_url = str(client.make_url("/v1"))
    name = await model_id(client)
    async with openai.AsyncOpenAI(api_key=KEY, base_url=base_url, max_retries=0) as good:
        done = await good.completions.create(model=name, prompt="Hello", max_tokens=2)
        assert done.usage is not None and done.usage.completion_tokens == 2
        chat = await good.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert chat.choices[0].message.role == "assistant"
        assert [m.id async for m in good.models.list()] == [name]
    async with openai.AsyncOpenAI(api_key=WRONG, base_url=base_url, max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as refused:
            await bad.completions.create(model=name, prompt="Hello", max_tokens=2)
        assert refused.value.status_code == 401 and WRONG not in str(refused.value)
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)


async def test_an_open_server_needs_no_key(engine: Engine) -> None:
    async with keyed_client(engine, OPEN) as c:
        resp = await c.post("/tokenize", json={"text": "a"})
        assert resp.status == 200
        resp = await c.post("/tokenize", json={"text": "a"}, headers=bearer(WRONG))
        assert resp.status == 200  # no keys configured: the header means nothing


async def test_operator_requests_keep_todays_keys(engine: Engine) -> None:
    """The operator's key (no tenants) salts nothing: a prefix the engine cached under a
    salt directly is a hit over HTTP under the same salt, as before keys existed."""
    await web_run(engine.generate, input_ids=PROMPT, extra_key="salt-1",
                  sampling_params=GREEDY)
    async with keyed_client(engine, ApiKeys.of(KEY, {})) as c:
        resp = await c.post("/generate", headers=bearer(KEY), json={
            "input_ids": PROMPT, "sampling_params": GREEDY, "extra_key": "salt-1"})
        assert resp.status == 200
        assert (await resp.json())["meta_info"]["cached_tokens"] >= len(PROMPT) - 16
    assert UNSCOPED.extra_key("salt-1", "extra_key") == "salt-1"
    assert UNSCOPED.extra_key(None, "extra_key") is None


async def web_run(fn: Any, **kwargs: Any) -> Any:
    """A blocking engine call off the event loop."""
    import asyncio

    return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(**kwargs))


# ------------------------------------------------------------------ the keys at start-up

BAD_FILES = [
    ('["alice", "k"]', "must be a JSON object of tenant name to key"),
    ("{}", "names no tenant"),
    ('{"": "sk-a"}', "a tenant name is empty"),
    ('{"alice": ""}', "tenant 'alice': the key is empty"),
    ('{"alice": 7}', "tenant 'alice': the key must be a string"),
    ('{"alice": "sk-same", "bob": "sk-same"}', "tenant 'bob' has the same key as tenant 'alice'"),
    ('{"alice": "sk-a", "alice": "sk-b"}', "tenant 'alice' is named twice"),
    ('{"alice": "sk a"}', "only visible ASCII"),
    ('{"alice": "sk-a",}', "not valid JSON"),
    ('{"\\ud800": "sk-a"}', "is not valid Unicode"),
]


@pytest.mark.parametrize(("text", "wanted"), BAD_FILES)
def test_bad_keys_files_are_refused(tmp_path: Path, text: str, wanted: str) -> None:
    path = tmp_path / "keys.json"
    path.write_text(text)
    with pytest.raises(ApiKeysError) as refused:
        load_api_keys(None, str(path))
    message = str(refused.value)
    assert message.startswith(f"--api-keys-file {path}: ") and wanted in message, message
    assert "sk-same" not in message and "sk-a" not in message and "sk-b" not in message


def test_unreadable_and_colliding_with_the_operator_key(tmp_path: Path) -> None:
    with pytest.raises(ApiKeysError, match="cannot read it: No such file"):
        read_tenants(str(tmp_path / "missing.json"))
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"alice": KEY}))
    with pytest.raises(ApiKeysError) as refused:
        load_api_keys(KEY, str(path))
    assert "tenant 'alice' has the same key as --api-key" in str(refused.value)
    assert KEY not in str(refused.value)


def test_a_readable_file_loads_and_identifies(tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"bob": "sk-bob", "alice": "sk-alice"}))
    os.chmod(path, 0o644)
    keys = load_api_keys(KEY, str(path))
    assert keys.tenant_names == ("alice", "bob") and keys.required and keys.has_tenants
    assert [keys.identify(k.encode()) for k in ("sk-alice", "sk-bob", KEY, "sk-x")] == [
        ("alice",), ("bob",), (None,), None]
    assert "readable by other users" in caplog.text and "sk-alice" not in caplog.text
    assert load_api_keys(None, None) is OPEN and not OPEN.required


async def test_the_real_process_takes_its_key_from_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`hicache-server` with HICACHE_API_KEY (out of `ps`) and a tenant: each key works,
    none is ever written to the log."""
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"alice": "sk-alice-process"}))
    path.chmod(0o600)
    monkeypatch.setenv("HICACHE_API_KEY", KEY)
    args = ["--port", "0", "--device", "cpu", "--max-total-tokens", "2048",
            "--api-keys-file", str(path)]
    with running(args) as (server, base):
        async with aiohttp.ClientSession() as session:
            url, body = f"{base}/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}
            async with session.post(url, json=body) as resp:
                await denied(resp, wrong=False)
            for key in (KEY, "sk-alice-process"):
                async with session.post(url, json=body, headers=bearer(key)) as resp:
                    assert resp.status == 200, await resp.text()
            async with session.get(f"{base}/health") as resp:
                assert resp.status == 200
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=EXIT_TIMEOUT_S) == 0
        log = server.rest_of_log()
    assert "inference routes: bearer key required; 1 tenant(s)" in log
    assert KEY not in log and "sk-alice-process" not in log


def test_launch_refuses_a_bad_keys_file_before_loading_the_model(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text('{"alice": "sk-same", "bob": "sk-same"}')
    done = subprocess.run(
        [sys.executable, "-m", "hicache_server.launch", "--api-keys-file", str(path),
         "--port", "0", "--device", "cpu"], cwd=REPO, env=dict(os.environ),
        capture_output=True, text=True, check=False, timeout=START_TIMEOUT_S)
    assert done.returncode == 1, done.stderr
    assert f"cannot start: --api-keys-file {path}: tenant 'bob' has the same key" in done.stderr
    assert "sk-same" not in done.stderr and "listening" not in done.stderr
