"""An event-driven router: an asyncio HTTP proxy that routes on the servers' KV events.

    python benchmarks/event_router.py --port 8000 \\
        --workers http://127.0.0.1:30001 http://127.0.0.1:30002 \\
        --events tcp://127.0.0.1:5557,tcp://127.0.0.1:5558 tcp://127.0.0.1:5567,tcp://127.0.0.1:5568

sglang-router's `cache_aware` guesses what each worker caches from what it sent there; it
cannot see evictions, L2, or pages another server put in a shared L3. This proxy listens
instead: each server publishes (`--kv-events-config`, vLLM's ZMQ wire format, see
`hicache.events.schema`) which pages enter and leave each of its tiers, and `PageIndex` keeps,
per server, a trie of pages keyed by `(parent page hash, the page's token ids)` -> page hash,
and the tiers ("GPU" L1, "CPU" L2, "DISK" L3) holding each hash. A request's token ids are cut
into pages and walked down each server's trie; the server whose match scores highest (a page
in L1 counts `MEDIUM_WEIGHTS["GPU"]`, in L2 less, in L3 least) gets it, ties and no match going
to the server with the fewest requests in flight. No hashing: the events carry the tokens.

    POST /generate, /v1/completions, /v1/chat/completions   routed, streamed back as is
    GET  /health        {"status", "healthy_workers"}: once every subscription is up
    GET  /stats         routing decisions, index sizes, events and sequence gaps per server
    anything else       the first worker

Token ids come from `/generate`'s `input_ids` (one list) or `/v1/completions`' `prompt` (a
list of ids); a text prompt is tokenized by the first worker's `/tokenize`; chat requests go
to the least loaded server. A gap in a server's sequence numbers (a lost batch) asks the
server's replay socket for what was missed; when that fails the server's index is cleared
(it will be rebuilt by new events: routing degrades to load, never to a wrong server).

Threading: one asyncio loop; the subscribers and the handlers share `PageIndex` on it alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import zmq
import zmq.asyncio
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hicache.events.schema import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

logger = logging.getLogger("event_router")

# A page in L1 is worth more than one the server must first load from L2, which is worth more
# than one it must fetch from L3; a page held in several tiers counts its best.
MEDIUM_WEIGHTS = {MEDIUM_GPU: 3, MEDIUM_CPU: 2, MEDIUM_DISK: 1}
SEQ_BYTES = 8  # the publisher's sequence number: 8 bytes, big-endian
END_SEQ = -1  # the replay socket's end-of-replay marker
REPLAY_TIMEOUT_S = 2.0
ROUTED_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive",
                         "content-encoding"})
CHUNK_BYTES = 64 * 1024

PageKey = tuple[bytes | int | None, tuple[int, ...]]  # (parent hash, the page's token ids)


# ------------------------------------------------------------------------------ the index


@dataclass
class ServerPages:
    """One server's pages: the trie edge of each page, and the tiers that hold it."""

    children: dict[PageKey, bytes | int] = field(default_factory=dict)
    edge: dict[bytes | int, PageKey] = field(default_factory=dict)  # hash -> its trie key
    tiers: dict[bytes | int, set[str]] = field(default_factory=dict)  # hash -> mediums

    def store(self, ev: BlockStored) -> None:
        size = ev.block_size
        parent = ev.parent_block_hash
        for i, h in enumerate(ev.block_hashes):
            key = (parent, tuple(ev.token_ids[i * size:(i + 1) * size]))
            self.children[key] = h
            self.edge[h] = key
            self.tiers.setdefault(h, set()).add(ev.medium or MEDIUM_GPU)
            parent = h

    def remove(self, ev: BlockRemoved) -> None:
        """A page no tier holds leaves the trie; its children stay (unreachable until it
        comes back, as the server's own tree works)."""
        medium = ev.medium or MEDIUM_GPU
        for h in ev.block_hashes:
            held = self.tiers.get(h)
            if held is None:
                continue
            held.discard(medium)
            if not held:
                del self.tiers[h]
                key = self.edge.pop(h, None)
                if key is not None and self.children.get(key) == h:
                    del self.children[key]

    def clear(self) -> None:
        self.children.clear()
        self.edge.clear()
        self.tiers.clear()

    def match(self, tokens: Sequence[int], page_size: int) -> tuple[int, int]:
        """(score, pages matched) of the longest chain of `tokens`' full pages held here."""
        parent: bytes | int | None = None
        score = pages = 0
        for start in range(0, len(tokens) - page_size + 1, page_size):
            h = self.children.get((parent, tuple(tokens[start:start + page_size])))
            if h is None:
                break
            score += max(MEDIUM_WEIGHTS.get(m, 0) for m in self.tiers[h])
            pages += 1
            parent = h
        return score, pages


class PageIndex:
    """Every server's pages, fed by decoded event batches; `best` picks a server."""

    def __init__(self, servers: Iterable[str]) -> None:
        self.pages = {s: ServerPages() for s in servers}
        self.page_size: int | None = None  # learnt from the first BlockStored
        self.events = dict.fromkeys(self.pages, 0)

    def apply(self, server: str, batch: KVEventBatch) -> None:
        pages = self.pages[server]
        for ev in batch.events:
            self.events[server] += 1
            if isinstance(ev, BlockStored):
                self.page_size = self.page_size or ev.block_size
                pages.store(ev)
            elif isinstance(ev, BlockRemoved):
                pages.remove(ev)
            elif isinstance(ev, AllBlocksCleared):
                pages.clear()

    def scores(self, tokens: Sequence[int]) -> dict[str, tuple[int, int]]:
        if self.page_size is None:
            return dict.fromkeys(self.pages, (0, 0))
        return {s: p.match(tokens, self.page_size) for s, p in self.pages.items()}

    def best(self, tokens: Sequence[int] | None, in_flight: dict[str, int]) -> str:
        """The server with the highest score for `tokens`; ties (and no tokens) to the one
        with the fewest requests in flight, then the first listed."""
        scores = self.scores(tokens) if tokens else dict.fromkeys(self.pages, (0, 0))
        order = list(self.pages)
        return min(order, key=lambda s: (-scores[s][0], in_flight.get(s, 0), order.index(s)))


# ---------------------------------------------------------------------------- subscribers


@dataclass
class Subscription:
    server: str
    endpoint: str
    replay_endpoint: str | None
    last_seq: int | None = None
    gaps: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


async def replay(ctx: zmq.asyncio.Context, sub: Subscription, start: int, index: PageIndex
                 ) -> bool:
    """Ask the server's replay socket for every batch from `start`; False when it does not
    answer in time."""
    if sub.replay_endpoint is None:
        return False
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sub.replay_endpoint)
    try:
        await sock.send_multipart([b"", start.to_bytes(SEQ_BYTES, "big", signed=True)])
        while True:
            if not await sock.poll(REPLAY_TIMEOUT_S * 1000):
                return False
            frames = await sock.recv_multipart()
            seq = int.from_bytes(frames[-2], "big", signed=True)
            if seq == END_SEQ:
                return True
            if sub.last_seq is None or seq > sub.last_seq:
                index.apply(sub.server, DECODER.decode(frames[-1]))
                sub.last_seq = seq
    finally:
        sock.close()


async def subscribe(ctx: zmq.asyncio.Context, sub: Subscription, index: PageIndex) -> None:
    """Apply the server's batches in order, forever; fills a gap from the replay socket."""
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(sub.endpoint)
    await replay(ctx, sub, 0, index)  # what the server published before we listened
    sub.ready.set()
    try:
        while True:
            _topic, seq_bytes, payload = await sock.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if sub.last_seq is not None and seq <= sub.last_seq:
                continue  # already applied by a replay
            if sub.last_seq is not None and seq != sub.last_seq + 1:
                sub.gaps += 1
                if not await replay(ctx, sub, sub.last_seq + 1, index):
                    logger.warning("%s: batches %d..%d lost and not replayed; its index is "
                                   "cleared", sub.server, sub.last_seq + 1, seq - 1)
                    index.pages[sub.server].clear()
            if sub.last_seq is None or seq > sub.last_seq:
                index.apply(sub.server, DECODER.decode(payload))
                sub.last_seq = seq
    finally:
        sock.close()


# ---------------------------------------------------------------------------------- proxy


@dataclass
class Proxy:
    index: PageIndex
    subs: list[Subscription]
    session: aiohttp.ClientSession | None = None
    in_flight: dict[str, int] = field(default_factory=dict)
    routed: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def servers(self) -> list[str]:
        return list(self.index.pages)

    async def prompt_ids(self, path: str, body: Any) -> list[int] | None:
        """The request's token ids when it names one prompt; None for chat and batches."""
        if not isinstance(body, dict):
            return None
        value = body.get("input_ids") if path == "/generate" else body.get("prompt")
        if path == "/generate" and value is None:
            value = body.get("text")
        if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
            return value
        if isinstance(value, str) and path != "/v1/chat/completions":
            async with self.session.post(self.servers[0] + "/tokenize",
                                         json={"prompt": value}) as resp:
                if resp.status == 200:
                    return (await resp.json())["tokens"]
        return None

    def choose(self, ids: list[int] | None) -> tuple[str, str]:
        server = self.index.best(ids, self.in_flight)
        score = self.index.scores(ids)[server][0] if ids else 0
        return server, "match" if score else "load"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        server = self.servers[0]
        if request.method == "POST" and request.path in ROUTED_PATHS:
            try:
                body = msgspec.json.decode(raw) if raw else None
            except msgspec.DecodeError:
                body = None  # the server answers the 400
            server, why = self.choose(await self.prompt_ids(request.path, body))
            counts = self.routed.setdefault(server, {"match": 0, "load": 0})
            counts[why] += 1
        return await self.forward(request, server, raw)

    async def forward(self, request: web.Request, server: str, raw: bytes
                      ) -> web.StreamResponse:
        """Stream `server`'s answer back. A worker that fails before answering is a 502; one
        that fails mid-stream ends the stream where it broke (the client sees no [DONE])."""
        self.in_flight[server] = self.in_flight.get(server, 0) + 1
        resp: web.StreamResponse | None = None
        try:
            headers = {k: v for k, v in request.headers.items()
                       if k.lower() not in HOP_HEADERS and k.lower() != "host"}
            async with self.session.request(request.method, server + request.path_qs,
                                            data=raw, headers=headers) as upstream:
                resp = web.StreamResponse(status=upstream.status, headers={
                    k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS})
                await resp.prepare(request)
                async for chunk in upstream.content.iter_chunked(CHUNK_BYTES):
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except aiohttp.ClientError as e:
            if resp is not None and resp.prepared:
                logger.warning("worker %s failed mid-answer: %s", server, e)
                return resp
            return web.json_response({"error": {"message": f"worker {server} failed: {e}",
                                                 "type": "bad_gateway", "code": 502}},
                                     status=502)
        finally:
            self.in_flight[server] -= 1

    async def health(self, request: web.Request) -> web.Response:
        ready = sum(s.ready.is_set() for s in self.subs)
        return web.json_response({"status": "ok" if ready == len(self.subs) else "starting",
                                  "healthy_workers": ready})

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"routed": self.routed, "in_flight": self.in_flight,
                                  "servers": {s.server: {
                                      "pages": len(self.index.pages[s.server].tiers),
                                      "events": self.index.events[s.server],
                                      "last_seq": s.last_seq, "gaps": s.gaps}
                                      for s in self.subs}})


def parse_events(workers: Sequence[str], events: Sequence[str]) -> list[Subscription]:
    """`events[i]` is worker i's "PUB endpoint[,replay endpoint]"."""
    if len(events) != len(workers):
        raise SystemExit(f"--events needs one endpoint per worker: {len(workers)} workers, "
                         f"{len(events)} endpoints")
    subs = []
    for server, spec in zip(workers, events):
        pub, _, rep = spec.partition(",")
        subs.append(Subscription(server.rstrip("/"), pub, rep or None))
    return subs


async def serve(args: argparse.Namespace) -> None:
    subs = parse_events(args.workers, args.events)
    index = PageIndex(s.server for s in subs)
    ctx = zmq.asyncio.Context()
    tasks = [asyncio.create_task(subscribe(ctx, s, index)) for s in subs]
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    proxy = Proxy(index, subs, aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)))
    app = web.Application(client_max_size=args.max_body_bytes)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/stats", proxy.stats)
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    logger.info("event router on http://%s:%d over %s", args.host, args.port,
                ", ".join(s.server for s in subs))
    try:
        await asyncio.gather(*tasks)
    finally:
        await proxy.session.close()
        await runner.cleanup()
        ctx.destroy(linger=0)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--workers", nargs="+", required=True, help="each server's base URL")
    ap.add_argument("--events", nargs="+", required=True,
                    help="each server's KV events 'tcp://host:PUB[,tcp://host:REPLAY]', in "
                         "the order of --workers")
    ap.add_argument("--max-body-bytes", type=int, default=64 * 1024 * 1024)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
