"""A request's results as the routes read them, and server-sent events.

A stream is `data: {json}\\n\\n` per event, then `data: [DONE]\\n\\n`. A request the engine
fails before its first result is a plain 500 (`start_stream` raises RequestFailed before any
header is sent); one failing mid-stream ends with an error event in the JSON error shape.
Closing a results iterator aborts its request: every iterator here closes the one it wraps.
A reader that stops reading is dropped after `server.stream_write_timeout_s` (`send_sse`).

A request's stream is `hicache_server.updates.Update`s: what is new since the last (the
text in it settled: never taken back), the last one with the whole result. Several requests
(a batch, `n` choices) start together (`start_streams`) and are read as one stream of
`(index, update)` as their tokens come (`merged`), or for their final results
(`last_results`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from aiohttp import web

from hicache_server.engine import Engine
from hicache_server.http.errors import HttpError, RequestFailed, error_body, request_failure
from hicache_server.http.state import STATE
from hicache_server.request import Request
from hicache_server.updates import Update

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A stream event is written in pieces of this size, each with its own write timeout: the
# size of aiohttp's write buffer (its high-water mark), past which a write waits to drain
WRITE_PIECE_BYTES = 64 * 1024
SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}  # nginx must not buffer a stream


async def start_stream(engine: Engine, req: Request) -> AsyncIterator[Update]:
    """The request's updates, its first one already awaited: a refusal (503) or any error
    comes out here, before a stream's headers are sent. An update saying the engine failed
    the request raises RequestFailed instead of being yielded: the middleware answers a 500,
    and a stream already under way ends with an error event (`send_sse`)."""
    results = engine.stream(req)
    first = await anext(results)
    failure = request_failure(first.delta.meta)
    if failure is not None:  # failed before its first token: a plain error response
        await results.aclose()
        raise RequestFailed(failure)

    async def chained() -> AsyncIterator[Update]:
        try:
            yield first
            async for update in results:
                failure = request_failure(update.delta.meta)
                if failure is not None:
                    raise RequestFailed(failure)
                yield update
        finally:
            await results.aclose()

    return chained()


async def start_streams(engine: Engine, reqs: Sequence[Request]
                        ) -> list[AsyncIterator[Update]]:
    """`start_stream` for each request, all submitted at once (a batch's prompts are
    prefilled together, not one after another's first token), in the order given: asyncio
    runs the tasks in creation order, and each submits before its first await (choice 0 of
    an `n` must be submitted before the choices that wait for its prompt). When one fails to
    start (a full queue, say), the others are closed (so aborted) before the error goes on.
    More requests than the queue ever holds are a 400: a 429 would have them retry forever."""
    limit = engine.config.server.max_queued_requests
    if len(reqs) > limit:
        raise HttpError(400, f"{len(reqs)} sequences in one request (prompts x n) are more "
                        f"than the server queues at once (server.max_queued_requests, "
                        f"--max-queued-requests: {limit}); send fewer")
    tasks = [asyncio.ensure_future(start_stream(engine, req)) for req in reqs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        for started in outcomes:
            if not isinstance(started, BaseException):
                await started.aclose()
        raise


async def merged(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """`(i, item)` for every item of every stream, as they arrive (ties in stream order).
    An error in any stream ends this one with it; closing this closes every stream (so
    aborts the requests still running)."""
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                yield i, item
                pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]


async def last_results(streams: Sequence[AsyncIterator[Update]]) -> list[dict]:
    """The whole result of each stream, in order (requests that are not streamed)."""
    last: list[dict] = [{} for _ in streams]
    async for i, update in merged(streams):
        if update.result is not None:
            last[i] = update.result
    return last


class ReaderStalled(Exception):
    """A stream's write waited `server.stream_write_timeout_s` for its reader in vain."""


async def send_sse(request: web.Request, events: AsyncIterator[bytes]) -> web.StreamResponse:
    """Write each event as `data: ...`, then `[DONE]`. A client that goes away, before the
    headers or mid-stream, ends the stream quietly (closing `events` aborts its request).

    A client that stops reading is dropped: a write waits for the socket to drain (aiohttp
    buffers 64 KiB, the kernel its socket buffers), and one that waits longer than
    `server.stream_write_timeout_s` closes the connection and aborts the request, so a
    stalled reader holds its KV for that long at most. Meanwhile the tokens it has not read
    wait merged into one update (`hicache_server.updates.Mailbox`), never one per token."""
    resp = web.StreamResponse(headers=SSE_HEADERS)
    timeout_s = request.app[STATE].engine.config.server.stream_write_timeout_s

    try:
        await _in_time(resp.prepare(request), timeout_s)
        try:
            async for payload in events:
                await _write(resp, b"data: " + payload + b"\n\n", timeout_s)
        except RequestFailed as e:  # the request failed mid-stream: its last event says so
            error = b"data: " + dumps(error_body(500, str(e))) + b"\n\n"
            await _write(resp, error, timeout_s)
        await _write(resp, SSE_DONE, timeout_s)
    except ConnectionError:
        logger.info("client of %s went away mid-stream", request.path)
    except ReaderStalled:
        _drop_stalled(request, timeout_s)
    finally:
        await events.aclose()
    return resp


async def _write(resp: web.StreamResponse, data: bytes, timeout_s: float) -> None:
    """Write `data` in pieces, each in `timeout_s`: the timeout measures a reader that takes
    nothing, not a large event (prompt logprobs can be megabytes) read by a slow link."""
    view = memoryview(data)
    for start in range(0, len(view), WRITE_PIECE_BYTES):
        await _in_time(resp.write(view[start:start + WRITE_PIECE_BYTES]), timeout_s)


async def _in_time(write: Awaitable[Any], timeout_s: float) -> None:
    """Await `write` (of a response to its client); ReaderStalled once it waited
    `timeout_s`."""
    try:
        async with asyncio.timeout(timeout_s):
            await write
    except TimeoutError:
        raise ReaderStalled(timeout_s) from None


def _drop_stalled(request: web.Request, timeout_s: float) -> None:
    """Close the connection of a reader that took nothing for `timeout_s` (what is still
    buffered for it is discarded: nobody would read it)."""
    logger.warning("dropping the client of %s: it read nothing for %g s "
                   "(server.stream_write_timeout_s); its request is aborted", request.path,
                   timeout_s)
    if request.transport is not None:
        request.transport.abort()


async def json_events(items: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    """Each item as JSON; closing this closes `items` (and so aborts their request)."""
    try:
        async for item in items:
            yield dumps(item)
    finally:
        await items.aclose()


def dumps(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()
