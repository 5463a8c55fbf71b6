"""The subscriber's side of KV events: what each server caches, for a router to route on
(hicache_server.router is one; see docs/events.md, "Several servers behind a router").

`PageIndex` keeps, per server, a trie of pages keyed by `(parent page hash, the page's token
ids)` -> page hash, and the tiers ("GPU" L1, "CPU" L2, "DISK" L3) holding each hash. A
request's token ids are cut into pages and walked down each server's trie: no hashing, the
events carry the tokens. `subscribe` feeds it from one server's PUB socket, in sequence
order; a gap (a lost batch) is asked of the server's replay socket, and when that fails the
server's pages are cleared (rebuilt by new events: routing degrades to load, never to a
wrong server).

Threading: one asyncio loop; the subscribers and the router's handlers share the index on it
alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

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

logger = logging.getLogger(__name__)

# A page in L1 is worth more than one the server must first load from L2, which is worth more
# than one it must fetch from L3; a page held in several tiers counts its best.
MEDIUM_WEIGHTS = {MEDIUM_GPU: 3, MEDIUM_CPU: 2, MEDIUM_DISK: 1}
REPLAY_TIMEOUT_S = 2.0  # a replay socket on a live server answers within milliseconds
DECODER = msgspec.msgpack.Decoder(KVEventBatch)

PageKey = tuple[bytes | int | None, tuple[int, ...]]  # (parent hash, the page's token ids)


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

    def best(self, tokens: Sequence[int] | None, in_flight: dict[str, int],
             scores: dict[str, tuple[int, int]] | None = None) -> str:
        """The server with the highest score for `tokens`; ties (and no tokens) to the one
        with the fewest requests in flight, then the first listed. `scores`, when the caller
        has them, are `self.scores(tokens)` (each server's trie is then walked once)."""
        if scores is None:
            scores = self.scores(tokens) if tokens else dict.fromkeys(self.pages, (0, 0))
        order = list(self.pages)
        return min(order, key=lambda s: (-scores[s][0], in_flight.get(s, 0), order.index(s)))


@dataclass
class Subscription:
    """One server's event sockets, and how far its batches have been applied."""

    server: str
    endpoint: str
    replay_endpoint: str | None
    last_seq: int | None = None
    gaps: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)


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
            if frames[-2] == END_SEQ:
                return True
            seq = int.from_bytes(frames[-2], "big", signed=True)
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
