"""Tenants (--api-keys-file) through the real server on loopback, all three tiers on (L3 in
LMDB): a prefix one tenant cached is a miss for every other (0 cached tokens in `usage` and
in `cached_tokens_details`) and a hit for its own, also once L1 and L2 are flushed; a
tenant's `cache_salt` splits further within it; sessions are per tenant; the composition of
tenant and salt is one to one."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from api_key_helpers import bearer, keyed_client
from conftest import tiered_engine
from http_helpers import PAGE, backed_up, error_of, tiers
from hypothesis import given
from hypothesis import strategies as st

from hicache_server.engine import Engine
from hicache_server.tenancy import TENANT_PREFIX, UNSCOPED, Scope

OPERATOR, ALICE, BOB = "sk-operator-key", "sk-alice-key", "sk-bob-key"
KEYS = {"alice": ALICE, "bob": BOB}
GREEDY = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
NO_HITS = {"device": 0, "host": 0, "storage": 0}


def prompt(seed: int) -> list[int]:
    """Six full pages no other test of this module sends."""
    return [(seed * 131 + 7 * i) % 250 + 3 for i in range(6 * PAGE)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    folder = tmp_path_factory.mktemp("tenants")
    keys_file = folder / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    keys_file.chmod(0o600)
    with tiered_engine(folder / "lmdb", **{
            "server.api_key": OPERATOR, "server.api_keys_file": str(keys_file),
            "cache.session_retention": True}) as e:
        yield e


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[TestClient]:
    async with keyed_client(engine, admin=True) as c:
        yield c


async def generate(client: TestClient, key: str, ids: list[int], **extra: Any
                   ) -> dict[str, int]:
    """POST /generate as `key`'s owner: its `cached_tokens_details`, checked against
    `cached_tokens`."""
    resp = await client.post("/generate", headers=bearer(key), json={
        "input_ids": ids, "sampling_params": GREEDY, **extra})
    assert resp.status == 200, await resp.text()
    meta = (await resp.json())["meta_info"]
    assert meta["cached_tokens"] == sum(meta["cached_tokens_details"].values())
    return meta["cached_tokens_details"]


async def complete(client: TestClient, key: str, ids: list[int], **extra: Any) -> int:
    """POST /v1/completions as `key`'s owner: `usage.prompt_tokens_details.cached_tokens`,
    checked against `sglext.cached_tokens_details`."""
    resp = await client.post("/v1/completions", headers=bearer(key), json={
        "prompt": ids, "max_tokens": 2, "temperature": 0, **extra})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == sum(body["sglext"]["cached_tokens_details"].values())
    return cached


async def test_a_prefix_is_its_tenants_own(client: TestClient) -> None:
    ids = prompt(1)
    assert await complete(client, ALICE, ids) == 0
    assert await complete(client, ALICE, ids) >= len(ids) - PAGE
    assert await complete(client, BOB, ids) == 0
    assert await generate(client, BOB, ids) != NO_HITS  # now bob's own, cached for him
    assert await generate(client, OPERATOR, ids) == NO_HITS  # unsalted: no tenant's either
    assert sum((await generate(client, ALICE, ids)).values()) >= len(ids) - PAGE


async def test_after_l1_and_l2_are_flushed_l3_keeps_tenants_apart(client: TestClient) -> None:
    ids = prompt(2)
    before = (await tiers(client))["storage"]["used"]
    assert await generate(client, ALICE, ids) == NO_HITS
    await backed_up(client, before + len(ids))
    resp = await client.post("/admin/flush", json={"tiers": ["device", "host"]})
    assert resp.status == 200, await resp.text()  # no inference key: admin's own rule
    assert await generate(client, BOB, ids) == NO_HITS  # alice's pages in L3: not his
    hits = await generate(client, ALICE, ids)  # the cost model may recompute a head
    assert hits["device"] == hits["host"] == 0 and hits["storage"] >= PAGE


async def test_cache_salt_splits_within_a_tenant(client: TestClient) -> None:
    ids = prompt(3)
    await complete(client, ALICE, ids)
    assert await complete(client, ALICE, ids, cache_salt="s1") == 0
    assert await complete(client, ALICE, ids, cache_salt="s1") >= len(ids) - PAGE
    assert await complete(client, ALICE, ids, cache_salt="s2") == 0
    assert await complete(client, BOB, ids, cache_salt="s1") == 0  # same salt, other tenant
    assert await complete(client, OPERATOR, ids, cache_salt="s1") == 0


async def test_chat_is_salted_too(client: TestClient) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me about tenants. " * 8}],
            "max_tokens": 2, "temperature": 0}
    cached = []
    for key in (ALICE, ALICE, BOB):
        resp = await client.post("/v1/chat/completions", headers=bearer(key), json=body)
        assert resp.status == 200, await resp.text()
        out = await resp.json()
        cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached[-1] == sum(out["sglext"]["cached_tokens_details"].values())
    assert cached[0] == 0 and cached[1] >= PAGE and cached[2] == 0


async def test_no_salt_reaches_another_tenants_namespace(client: TestClient) -> None:
    ids = prompt(4)
    await generate(client, BOB, ids)
    bobs = Scope("bob", True).extra_key(None, "cache_salt")
    resp = await client.post("/generate", headers=bearer(OPERATOR), json={
        "input_ids": ids, "sampling_params": GREEDY, "cache_salt": bobs})
    message = await error_of(resp, 400)
    assert "`cache_salt` may not start with 'hicache-tenant:'" in message
    assert await generate(client, ALICE, ids, extra_key=bobs) == NO_HITS  # alice's own
    assert await generate(client, ALICE, ids, extra_key="") == NO_HITS  # not the unsalted


async def test_page_hashes_differ_per_tenant(client: TestClient, engine: Engine) -> None:
    """The hashes L3 keys its pages by and KV events publish: a tenant's chain starts at a
    root of its own."""
    ids = prompt(5)
    keys = {"alice": ALICE, "bob": BOB, None: OPERATOR}
    for key in keys.values():
        await generate(client, key, ids)
    chains = {}
    for tenant in keys:
        extra = Scope(tenant, True).extra_key(None, "extra_key")
        chains[tenant] = engine.scheduler.call(lambda extra=extra: [
            h for n in engine.cache.tree.peek_path(ids, extra) for h in n.hash_value]).result()
        assert chains[tenant] == engine.cache.storage.hasher.hash_pages(ids, extra_key=extra)
        assert len(chains[tenant]) == len(ids) // PAGE
    assert len({h for chain in chains.values() for h in chain}) == 3 * len(ids) // PAGE


async def test_an_admin_pin_names_a_tenants_prefix_by_its_key(client: TestClient) -> None:
    """Pins stay as they are: the admin API takes the engine's `extra_key`, so the operator
    pins a tenant's prefix under the key the tenant's requests get."""
    ids = prompt(7)
    alices = TENANT_PREFIX + '["alice",null]'
    resp = await client.post("/admin/pin", json={"input_ids": ids, "extra_key": alices,
                                                 "ttl_seconds": 600})
    assert resp.status == 200, await resp.text()
    resp = await client.post("/admin/flush", json={"tiers": ["device", "host"]})
    assert resp.status == 200
    pinned = await generate(client, ALICE, ids)  # a pin keeps its pages in L2 at least
    assert pinned["device"] + pinned["host"] >= len(ids) - PAGE
    assert await generate(client, BOB, ids) == NO_HITS
    resp = await client.post("/admin/unpin", json={"input_ids": ids, "extra_key": alices})
    assert resp.status == 200, await resp.text()


async def test_sessions_are_per_tenant(client: TestClient) -> None:
    await generate(client, BOB, prompt(6), session_id="shared-name")
    closed = []
    for key in (ALICE, OPERATOR, BOB, BOB):
        resp = await client.post("/close_session", headers=bearer(key),
                                 json={"session_id": "shared-name"})
        assert resp.status == 200
        closed.append((await resp.json())["success"])
    assert closed == [False, False, True, False]


SALTS = st.none() | st.text(max_size=12)
TENANTS = st.text(min_size=1, max_size=8)


@given(st.tuples(TENANTS, SALTS), st.tuples(TENANTS, SALTS))
def test_tenant_and_salt_compose_one_to_one(a: tuple[str, str | None],
                                            b: tuple[str, str | None]) -> None:
    key_a, key_b = (Scope(t, True).extra_key(s, "cache_salt") for t, s in (a, b))
    assert (key_a == key_b) == (a == b)
    assert key_a is not None and key_a.startswith(TENANT_PREFIX)
    assert tuple(json.loads(key_a[len(TENANT_PREFIX):])) == a
    sid_a, sid_b = (Scope(t, True).session_id(s or "x") for t, s in (a, b))
    assert (sid_a == sid_b) == ((a[0], a[1] or "x") == (b[0], b[1] or "x"))


@given(SALTS)
def test_without_a_tenant_a_salt_is_as_sent(salt: str | None) -> None:
    assert UNSCOPED.extra_key(salt, "cache_salt") == salt
    if salt is None or not salt.startswith(TENANT_PREFIX):
        assert Scope(None, True).extra_key(salt, "cache_salt") == salt
