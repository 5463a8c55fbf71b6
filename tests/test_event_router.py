"""The event router's bookkeeping (`hicache.events.page_index`) on events built here
(msgspec structs of `hicache.events.schema`, encoded and decoded as the wire carries them),
its choice of server, its subscriber against a real ZMQ PUB / ROUTER pair on loopback, and
the proxy's arguments (`hicache_server.router`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from unittest import mock

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from hicache.events.page_index import DECODER, PageIndex, Subscription, subscribe
from hicache.events.publisher import END_SEQ, SEQ_BYTES
from hicache.events.schema import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from hicache_server.loopback_guard import AdminDenied
from hicache_server.router import Proxy, check_router_admin, parse_events

PAGE = 4
A, B = "http://127.0.0.1:1111", "http://127.0.0.1:2222"
ENCODER = msgspec.msgpack.Encoder()


def h(i: int) -> bytes:
    """A stand-in 16-byte page hash."""
    return i.to_bytes(16, "big")


def stored(tokens: list[int], first: int, parent: bytes | None = None,
           medium: str = MEDIUM_GPU) -> BlockStored:
    """The pages of `tokens` (full pages only), hashed h(first), h(first + 1), ..."""
    n = len(tokens) // PAGE
    return BlockStored(block_hashes=[h(first + i) for i in range(n)],
                          parent_block_hash=parent, token_ids=tokens[:n * PAGE],
                          block_size=PAGE, lora_id=None, medium=medium, lora_name=None)


def wire(*events: object) -> KVEventBatch:
    """A batch as the subscriber sees it: encoded by the publisher's encoder, decoded."""
    return DECODER.decode(ENCODER.encode(KVEventBatch(ts=1.0, events=list(events))))


TOKENS = list(range(100, 116))  # 4 pages


def test_match_walks_the_chain_of_pages_and_stops_at_the_first_miss() -> None:
    index = PageIndex([A, B])
    index.apply(A, wire(stored(TOKENS[:8], 0), stored(TOKENS[8:12], 2, parent=h(1))))
    assert index.scores(TOKENS)[A] == (3 * 3, 3)  # three pages in L1
    assert index.scores(TOKENS)[B] == (0, 0)
    assert index.scores(TOKENS[:7])[A] == (3, 1)  # the partial second page does not count
    # the same tokens after a different first page are a different prefix
    assert index.scores([9, 9, 9, 9, *TOKENS[4:]])[A] == (0, 0)


def test_the_same_page_under_another_parent_is_not_matched() -> None:
    index = PageIndex([A])
    index.apply(A, wire(stored(TOKENS[4:8], 7, parent=h(99))))  # page 2's tokens, other parent
    index.apply(A, wire(stored(TOKENS[:4], 0)))
    assert index.scores(TOKENS)[A] == (3, 1)


def test_tiers_weigh_gpu_over_cpu_over_disk_and_a_page_counts_its_best_tier() -> None:
    index = PageIndex([A, B])
    index.apply(A, wire(stored(TOKENS, 0, medium=MEDIUM_CPU)))
    index.apply(B, wire(stored(TOKENS, 0, medium=MEDIUM_DISK)))
    assert index.scores(TOKENS) == {A: (4 * 2, 4), B: (4 * 1, 4)}
    assert index.best(TOKENS, {}) == A
    index.apply(B, wire(stored(TOKENS[:4], 0, medium=MEDIUM_GPU)))
    assert index.scores(TOKENS)[B] == (3 + 3 * 1, 4)


def test_removal_per_tier_and_a_page_no_tier_holds_leaves_the_trie() -> None:
    index = PageIndex([A])
    index.apply(A, wire(stored(TOKENS, 0), stored(TOKENS, 0, medium=MEDIUM_CPU)))
    # L1 drops pages 2 and 3 (demoted): L2 still holds them
    index.apply(A, wire(BlockRemoved(block_hashes=[h(2), h(3)], medium=MEDIUM_GPU,
                                        reason="demoted")))
    assert index.scores(TOKENS)[A] == (3 + 3 + 2 + 2, 4)
    # L2 drops page 2 too: the chain ends before it, page 3 is unreachable
    index.apply(A, wire(BlockRemoved(block_hashes=[h(2)], medium=MEDIUM_CPU)))
    assert index.scores(TOKENS)[A] == (6, 2)
    assert h(2) not in index.pages[A].tiers and h(3) in index.pages[A].tiers
    # a removal of a page never stored is ignored
    index.apply(A, wire(BlockRemoved(block_hashes=[h(42)], medium=MEDIUM_GPU)))
    assert index.scores(TOKENS)[A] == (6, 2)


def test_all_blocks_cleared_forgets_only_that_server() -> None:
    index = PageIndex([A, B])
    index.apply(A, wire(stored(TOKENS, 0)))
    index.apply(B, wire(stored(TOKENS, 0)))
    index.apply(A, wire(AllBlocksCleared()))
    assert index.scores(TOKENS) == {A: (0, 0), B: (12, 4)}
    assert index.events == {A: 2, B: 1}


def test_best_prefers_the_longest_match_then_the_least_loaded_then_the_first() -> None:
    index = PageIndex([A, B])
    assert index.best(TOKENS, {}) == A  # nothing known: the first
    assert index.best(TOKENS, {A: 2, B: 1}) == B  # nothing known: the least loaded
    assert index.best(None, {A: 0, B: 3}) == A  # no tokens (chat): load alone
    index.apply(B, wire(stored(TOKENS[:8], 0)))
    assert index.best(TOKENS, {A: 0, B: 5}) == B  # the match wins over load
    index.apply(A, wire(stored(TOKENS[:8], 0)))
    assert index.best(TOKENS, {A: 1, B: 0}) == B  # equal matches: the least loaded


def test_events_arguments_pair_each_worker_with_its_endpoints() -> None:
    subs = parse_events([A + "/", B], ["tcp://x:1,tcp://x:2", "tcp://y:1"])
    assert [(s.server, s.endpoint, s.replay_endpoint) for s in subs] == [
        (A, "tcp://x:1", "tcp://x:2"), (B, "tcp://y:1", None)]
    with pytest.raises(SystemExit, match="one endpoint per worker"):
        parse_events([A, B], ["tcp://x:1"])
    with pytest.raises(SystemExit, match="base URLs .* got '127.0.0.1:1111'"):
        parse_events(["127.0.0.1:1111"], ["tcp://x:1"])


# ------------------------------------------------------------ the subscriber over real ZMQ


def _seq(n: int) -> bytes:
    return n.to_bytes(SEQ_BYTES, "big", signed=True)


async def _serve_replay(sock: zmq.asyncio.Socket, batches: dict[int, bytes]) -> None:
    """Answer replay requests as the server's ROUTER socket does."""
    while True:
        ident, _, start = await sock.recv_multipart()
        first = int.from_bytes(start, "big", signed=True)
        for seq in sorted(s for s in batches if s >= first):
            await sock.send_multipart([ident, b"", b"", _seq(seq), batches[seq]])
        await sock.send_multipart([ident, b"", b"", END_SEQ, b""])


async def _until(cond, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _subscriber_run() -> None:
    ctx = zmq.asyncio.Context()
    pub, rep = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    rep_port = rep.bind_to_random_port("tcp://127.0.0.1")
    batches = {0: ENCODER.encode(KVEventBatch(ts=1.0, events=[stored(TOKENS[:4], 0)])),
               1: ENCODER.encode(KVEventBatch(ts=1.0, events=[
                   stored(TOKENS[4:8], 1, parent=h(0))])),
               2: ENCODER.encode(KVEventBatch(ts=1.0, events=[
                   stored(TOKENS[8:12], 2, parent=h(1))])),
               3: ENCODER.encode(KVEventBatch(ts=1.0, events=[
                   stored(TOKENS[12:], 3, parent=h(2))]))}
    replayer = asyncio.create_task(_serve_replay(rep, {0: batches[0]}))
    index = PageIndex([A])
    sub = Subscription(A, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{rep_port}")
    task = asyncio.create_task(subscribe(ctx, sub, index))
    try:
        await asyncio.wait_for(sub.ready.wait(), 5)
        assert sub.last_seq == 0 and index.scores(TOKENS)[A][1] == 1  # replayed at start
        # published live: seq 1; then 3 arrives without 2 -> a gap the replay fills
        replayer.cancel()
        replayer = asyncio.create_task(_serve_replay(rep, batches))
        deadline = asyncio.get_running_loop().time() + 5.0
        while sub.last_seq != 1:  # a SUB misses what is sent before it has joined
            assert asyncio.get_running_loop().time() < deadline, "timed out"
            await pub.send_multipart([b"", _seq(1), batches[1]])
            await asyncio.sleep(0.05)
        await pub.send_multipart([b"", _seq(3), batches[3]])
        await _until(lambda: sub.last_seq == 3)
        assert sub.gaps == 1
        assert index.scores(TOKENS)[A] == (12, 4)
    finally:
        task.cancel()
        replayer.cancel()
        await asyncio.gather(task, replayer, return_exceptions=True)
        ctx.destroy(linger=0)


def test_subscriber_replays_the_past_applies_live_batches_and_fills_gaps() -> None:
    asyncio.run(_subscriber_run())


@contextlib.asynccontextmanager
async def _router_over(worker: web.Application) -> AsyncIterator[TestClient]:
    """A client of the router's proxy in front of one worker app, both on loopback."""
    async with TestServer(worker) as upstream, aiohttp.ClientSession() as session:
        proxy = Proxy(PageIndex([str(upstream.make_url("")).rstrip("/")]), [], session)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", proxy.handle)
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            yield client


async def _admin_through_router(host: str | None, origin: str | None) -> tuple[int, int]:
    """(status, requests the worker saw) for a POST /admin/flush through the router."""
    seen: list[str] = []

    async def worker_flush(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.json_response({"ok": True})

    worker = web.Application()
    worker.router.add_post("/admin/flush", worker_flush)
    async with _router_over(worker) as client:
        headers = {"Host": host or f"127.0.0.1:{client.port}"}
        if origin is not None:
            headers["Origin"] = origin
        resp = await client.post("/admin/flush", json={"tiers": ["device"]}, headers=headers)
        return resp.status, len(seen)


@pytest.mark.parametrize(("host", "origin", "status", "forwarded"), [
    (None, None, 200, 1),  # the router's own loopback name, no browser: forwarded
    ("evil.example", None, 403, 0),  # DNS rebinding onto the router
    (None, "http://evil.example", 403, 0),  # a web page's cross-site POST
])
def test_the_router_guards_admin_routes_it_forwards(host: str | None, origin: str | None,
                                                     status: int, forwarded: int) -> None:
    assert asyncio.run(_admin_through_router(host, origin)) == (status, forwarded)


async def _tokenize_headers_through_router() -> list[str | None]:
    """The Authorization headers the worker's /tokenize saw for one text /generate."""
    seen: list[str | None] = []

    async def tokenize(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"tokens": [1, 2, 3]})

    async def generate(request: web.Request) -> web.Response:
        return web.json_response({"text": "ok"})

    worker = web.Application()
    worker.router.add_post("/tokenize", tokenize)
    worker.router.add_post("/generate", generate)
    async with _router_over(worker) as client:
        resp = await client.post("/generate", json={"text": "hello"},
                                 headers={"Authorization": "Bearer k1"})
        assert resp.status == 200
    return seen


def test_the_router_tokenizes_with_the_clients_key() -> None:
    """Workers behind `--api-key` answer the router's /tokenize only with the client's key."""
    assert asyncio.run(_tokenize_headers_through_router()) == ["Bearer k1"]


def _request(remote: str, headers: dict[str, str]) -> web.Request:
    transport = mock.Mock()
    transport.get_extra_info.side_effect = {"peername": (remote, 5555),
                                            "sockname": ("0.0.0.0", 8000)}.get
    return make_mocked_request("POST", "/admin/flush", headers=headers, transport=transport)


@pytest.mark.parametrize(("remote", "headers", "allowed"), [
    ("127.0.0.1", {"Host": "127.0.0.1:8000"}, True),
    ("127.0.0.1", {"Host": "evil.example:8000"}, False),  # rebinding
    # with a key the worker judges it (a page cannot send the header cross-origin)
    ("127.0.0.1", {"Host": "evil.example:8000", "Authorization": "Bearer k"}, True),
    ("203.0.113.9", {"Host": "127.0.0.1:8000"}, False),  # another machine, keyless
    ("203.0.113.9", {"Host": "127.0.0.1:8000", "Authorization": "Bearer k"}, False)])
def test_the_router_forwards_admin_routes_for_loopback_clients_only(
        remote: str, headers: dict[str, str], allowed: bool) -> None:
    """The router forwards from loopback under the worker's Host: a keyless worker would take
    anything, so the router judges the client it sees."""
    request = _request(remote, headers)
    if allowed:
        check_router_admin(request)
        return
    with pytest.raises(AdminDenied):
        check_router_admin(request)
