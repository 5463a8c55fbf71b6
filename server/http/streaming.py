"""A request's results as the routes read them, and server-sent events.

A stream is `data: {json}\\n\\n` per event, then `data: [DONE]\\n\\n`. A request the engine
fails before its first result is a plain 500 (`start_stream` raises RequestFailed before any
header is sent); one failing mid-stream ends with an error event in the JSON error shape.
Closing a results iterator aborts its request: every iterator here closes the one it wraps.

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
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

from aiohttp import web

from hicache_server.engine import Engine
from hicache_server.http.errors import RequestFailed, error_body, request_failure
from hicache_server.request import Request
from hicache_server.updates import Update

logger = logging.getLogger(__name__)

T = TypeVar("T")

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
    start, the others are closed (so aborted) before the error goes on."""
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


async def send_sse(request: web.Request, events: AsyncIterator[bytes]) -> web.StreamResponse:
    """Write each event as `data: ...`, then `[DONE]`. A client that goes away, before the
    headers or mid-stream, ends the stream quietly (closing `events` aborts its request)."""
    resp = web.StreamResponse(headers=SSE_HEADERS)
    try:
        await resp.prepare(request)
        try:
            async for payload in events:
                await resp.write(b"data: " + payload + b"\n\n")
        except RequestFailed as e:  # the request failed mid-stream: its last event says so
            await resp.write(b"data: " + dumps(error_body(500, str(e))) + b"\n\n")
        await resp.write(SSE_DONE)
    except ConnectionError:
        logger.info("client of %s went away mid-stream", request.path)
    finally:
        await events.aclose()
    return resp


async def json_events(items: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    """Each item as JSON; closing this closes `items` (and so aborts their request)."""
    try:
        async for item in items:
            yield dumps(item)
    finally:
        await items.aclose()


def dumps(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()
