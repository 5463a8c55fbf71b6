"""SGLang's native route.

    POST /generate    {"text" | "input_ids", "sampling_params", "stream", "extra_key"}

The answer is the engine's result as is (`text`, `output_ids`, `meta_info`); with
`"stream": true`, one such result per event, each carrying the text so far.
"""

from __future__ import annotations

from aiohttp import web

from server.http.body import check_fields, check_type, read_object
from server.http.errors import HttpError
from server.http.state import live_engine
from server.http.streaming import json_events, last_result, send_sse, start_stream

GENERATE_FIELDS = ("text", "input_ids", "sampling_params", "stream", "extra_key", "cache_salt")


async def handle_generate(request: web.Request) -> web.StreamResponse:
    body = await read_object(request)
    check_fields(body, GENERATE_FIELDS)
    stream = check_type(body, "stream", (bool,), "a boolean")
    params = check_type(body, "sampling_params", (dict,), "an object")
    if body.get("extra_key") is not None and body.get("cache_salt") is not None:
        raise HttpError(400, "give at most one of `extra_key` or `cache_salt` (both name "
                        "the cache namespace)")
    extra_key = body.get("extra_key", body.get("cache_salt"))
    engine = live_engine(request)
    req = engine.make_request(body.get("text"), body.get("input_ids"), params, extra_key)
    results = await start_stream(engine, req)
    if not stream:
        return web.json_response(await last_result(results))  # RequestFailed: a 500
    return await send_sse(request, json_events(results))
