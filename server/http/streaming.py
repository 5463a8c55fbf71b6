"""A request's results as the routes read them, and server-sent events.

A stream is `data: {json}\\n\\n` per event, then `data: [DONE]\\n\\n`. A request the engine
fails before its first result is a plain 500 (`start_stream` raises RequestFailed before any
header is sent); one failing mid-stream ends with an error event in the JSON error shape.
Closing a results iterator aborts its request: every iterator here closes the one it wraps.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from server.engine import Engine
from server.http.errors import RequestFailed, error_body, request_failure
from server.request import Request

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}  # nginx must not buffer a stream


async def start_stream(engine: Engine, req: Request) -> AsyncIterator[dict]:
    """The request's results, its first one already awaited: a refusal (503) or any error
    comes out here, before a stream's headers are sent. A result saying the engine failed
    the request raises RequestFailed instead of being yielded: the middleware answers a 500,
    and a stream already under way ends with an error event (`send_sse`)."""
    results = engine.stream(req)
    first = await anext(results)
    failure = request_failure(first)
    if failure is not None:  # failed before its first token: a plain error response
        await results.aclose()
        raise RequestFailed(failure)

    async def chained() -> AsyncIterator[dict]:
        try:
            yield first
            async for result in results:
                failure = request_failure(result)
                if failure is not None:
                    raise RequestFailed(failure)
                yield result
        finally:
            await results.aclose()

    return chained()


async def last_result(results: AsyncIterator[dict]) -> dict:
    """The final result of a request that is not streamed."""
    last: dict = {}
    async for result in results:
        last = result
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
