"""An event-driven router: an asyncio HTTP proxy in front of several hicache servers that
routes each request on the servers' KV events.

    python -m hicache_server.router --port 8000 \\
        --workers http://127.0.0.1:30001 http://127.0.0.1:30002 \\
        --events tcp://127.0.0.1:5557,tcp://127.0.0.1:5558 tcp://127.0.0.1:5567,tcp://127.0.0.1:5568

sglang-router's `cache_aware` guesses what each worker caches from what it sent there; it
cannot see evictions, L2, or pages another server put in a shared L3. This proxy listens
instead: each server publishes (`--kv-events-config`, vLLM's ZMQ wire format, see
`hicache.events.schema`) which pages enter and leave each of its tiers, and
`hicache.events.page_index.PageIndex` walks a request's pages down each server's trie; the
server whose match scores highest (a page in L1 counts more than one in L2, L3 least) gets
it, ties and no match going to the server with the fewest requests in flight.

    POST /generate, /v1/completions, /v1/chat/completions   routed, streamed back as is
    GET  /health        {"status", "healthy_workers"}: once every subscription is up
    GET  /stats         routing decisions, index sizes, events and sequence gaps per server
    anything else       the first worker; an admin route only for a loopback client, and
                        without a key only with no browser's foreign Origin or Host (the
                        worker sees the router's request, not the client's)

Token ids come from `/generate`'s `input_ids` (one list) or `/v1/completions`' `prompt` (a
list of ids); a text prompt is tokenized by the first worker's `/tokenize`; chat requests go
to the least loaded server.

Threading: one asyncio loop; the subscribers and the handlers share the index on it alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
import zmq.asyncio
from aiohttp import web

from hicache.events.page_index import PageIndex, Subscription, subscribe
from hicache_server.loopback_guard import (
    ADMIN_PATHS,
    AdminDenied,
    check_own_origin,
    is_loopback,
    local_port,
)

logger = logging.getLogger(__name__)

ROUTED_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive",
                         "content-encoding"})
CHUNK_BYTES = 64 * 1024  # a streamed answer is copied through in reads of at most this
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024  # a context-length prompt of ids as JSON fits
CONNECT_TIMEOUT_S = 10  # to a worker; an answer itself may take as long as it takes


def check_router_admin(request: web.Request) -> None:
    """AdminDenied unless an admin request may pass the router. It forwards from loopback
    under the worker's own Host, so a keyless worker would take anything it forwards: the
    client must be on loopback (reach a worker directly, with its key, from elsewhere),
    and without a bearer header carry no browser's foreign Origin or Host."""
    if not is_loopback(request.remote):
        raise AdminDenied(403, f"the router forwards admin routes for loopback clients only "
                          f"(this one is {request.remote}); call the worker itself, with "
                          "its --admin-api-key")
    if not request.headers.get("Authorization"):
        check_own_origin(request.headers.get("Host"), request.headers.get("Origin"),
                         local_port(request))


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

    async def prompt_ids(self, path: str, body: Any, authorization: str | None
                         ) -> list[int] | None:
        """The request's token ids when it names one prompt; None for chat and batches.
        `authorization`: the client's header, passed on to /tokenize (workers with --api-key)."""
        if not isinstance(body, dict):
            return None
        value = body.get("input_ids") if path == "/generate" else body.get("prompt")
        if path == "/generate" and value is None:
            value = body.get("text")
        if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
            return value
        if isinstance(value, str) and path != "/v1/chat/completions":
            try:
                headers = {"Authorization": authorization} if authorization else None
                async with self.session.post(self.servers[0] + "/tokenize",
                                             json={"prompt": value}, headers=headers) as resp:
                    if resp.status == 200:
                        tokens = (await resp.json()).get("tokens")
                        return tokens if isinstance(tokens, list) else None
            except aiohttp.ClientError as e:  # routed by load; forward answers the 502
                logger.warning("tokenize on %s failed: %s", self.servers[0], e)
        return None

    def choose(self, ids: list[int] | None) -> tuple[str, str]:
        scores = self.index.scores(ids) if ids else dict.fromkeys(self.index.pages, (0, 0))
        server = self.index.best(ids, self.in_flight, scores)
        return server, "match" if scores[server][0] else "load"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path in ADMIN_PATHS:  # forwarded from loopback under the worker's own
            try:                         # Host: the worker cannot tell who sent it, check here
                check_router_admin(request)
            except AdminDenied as e:
                return web.json_response({"error": {"message": e.message,
                                                    "type": "permission_error",
                                                    "code": e.status}}, status=e.status)
        raw = await request.read()
        server = self.servers[0]
        if request.method == "POST" and request.path in ROUTED_PATHS:
            try:
                body = msgspec.json.decode(raw) if raw else None
            except msgspec.DecodeError:
                body = None  # the server answers the 400
            ids = await self.prompt_ids(request.path, body, request.headers.get("Authorization"))
            server, why = self.choose(ids)
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
        if not server.startswith(("http://", "https://")):
            raise SystemExit(f"--workers takes base URLs (http://host:port), got {server!r}")
        pub, _, rep = spec.partition(",")
        subs.append(Subscription(server.rstrip("/"), pub, rep or None))
    return subs


async def serve(args: argparse.Namespace) -> None:
    subs = parse_events(args.workers, args.events)
    index = PageIndex(s.server for s in subs)
    ctx = zmq.asyncio.Context()
    tasks = [asyncio.create_task(subscribe(ctx, s, index)) for s in subs]
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
    proxy = Proxy(index, subs, aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)))
    app = web.Application(client_max_size=args.max_body_bytes)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/stats", proxy.stats)
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, args.host, args.port).start()
        except OSError as e:
            raise SystemExit(f"cannot listen on {args.host}:{args.port}: {e}") from None
        logger.info("event router on http://%s:%d over %s", args.host, args.port,
                    ", ".join(s.server for s in subs))
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
    ap.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        try:
            asyncio.run(serve(parse_args(argv)))
        except zmq.ZMQError as e:  # an --events endpoint zmq cannot connect to, e.g. no tcp://
            raise SystemExit(f"cannot subscribe to KV events: {e}; --events takes "
                             "'tcp://host:PUB[,tcp://host:REPLAY]' per worker") from None


if __name__ == "__main__":
    main()
