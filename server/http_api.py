"""The HTTP API (aiohttp): SGLang's /generate, OpenAI's /v1/completions, health and metrics.

    POST /generate          {"text" | "input_ids", "sampling_params", "stream", "extra_key"}
    POST /v1/completions    {"prompt", "max_tokens", "temperature", "top_p", "stop", ...}
    GET  /v1/models         the one model served
    GET  /health            200 {"status": "ok"}; 503 once shutdown has begun
    GET  /metrics           Prometheus text (`hicache.metrics.CacheMetrics`)

Every error is a JSON body `{"error": {"message", "type", "code"}}` with a 4xx status
(`error_middleware`); a 500 is a bug and is logged with its traceback. Streams are
server-sent events, `data: {json}\\n\\n` per token, then `data: [DONE]\\n\\n`.

Threading: handlers run on the event loop; the engine's blocking calls (`stats`,
`flush_cache`) go to the default executor, never onto the loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import reprlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from aiohttp import web

from hicache.hiradix_cache import HiRadixCache
from hicache.metrics import CacheMetrics
from hicache.storage.page_format import HEADER_BYTES
from server.engine import Engine, EngineClosed
from server.request import InvalidRequest, Request

logger = logging.getLogger(__name__)

# Largest request body read (bytes). A context-length prompt of token ids as JSON is well
# under 1 MB for today's models (128k ids x ~7 bytes); 8 MiB leaves room and stops a client
# from making the server buffer arbitrary amounts.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# Longest wait for a request body once its headers are in (seconds): a body of the largest
# size above arrives in well under a second on any link a server is reached over, so only a
# stalled or hostile client waits this long (uvicorn and nginx use 60 s for their timeouts).
DEFAULT_BODY_TIMEOUT_S = 30.0
SSE_DONE = b"data: [DONE]\n\n"
CLIENT_CLOSED = 499  # nginx's status for a request whose client closed the connection
REPLACEMENT_CHAR = "\ufffd"  # what decoding an unfinished UTF-8 sequence ends with
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}  # nginx must not buffer a stream
GENERATE_FIELDS = ("text", "input_ids", "sampling_params", "stream", "extra_key", "cache_salt")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               408: "timeout_error", 413: "invalid_request_error", 500: "internal_error",
               503: "unavailable_error"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class ServerState:
    """What the handlers share besides the engine. `closing`: shutdown has begun."""

    engine: Engine
    metrics: CacheMetrics
    max_body_bytes: int
    started: int  # Unix time the app was built (OpenAI's `created` of the model)
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    closing: bool = False


STATE = web.AppKey("hicache_state", ServerState)


class RequestFailed(Exception):
    """The engine failed this request (logged there with its traceback): an HTTP 500."""


class HttpError(Exception):
    """A client error with its status, turned into the JSON error shape by the middleware."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# ------------------------------------------------------------------------------- errors


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"),
                      "code": status}}


def error_response(status: int, message: str,
                   headers: dict[str, str] | None = None) -> web.Response:
    """The one error shape every route answers with."""
    return web.json_response(error_body(status, message), status=status, headers=headers)


def request_failure(result: dict[str, Any]) -> str | None:
    """Why the engine failed this request (finish_reason "error"), None when it did not."""
    meta = result.get("meta_info", {})
    if meta.get("finish_reason") != "error":
        return None
    return meta.get("error") or "the server failed while serving this request"


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except HttpError as e:
        return error_response(e.status, e.message)
    except InvalidRequest as e:
        return error_response(400, str(e))
    except EngineClosed as e:
        return error_response(503, str(e))
    except RequestFailed as e:  # logged with its traceback where it failed
        return error_response(500, str(e))
    except ConnectionError:  # the client left (mid-body, say): nobody reads an answer
        logger.info("client of %s %s went away before its response", request.method,
                    request.path)
        return web.Response(status=CLIENT_CLOSED)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _http_exception_response(request, e)
    except Exception as e:  # a bug: log it whole, answer the JSON shape, keep serving
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, f"internal server error ({type(e).__name__}); "
                              "this is a bug, the server log has the traceback")


def _http_exception_response(request: web.Request, e: web.HTTPException) -> web.Response:
    route = f"{request.method} {request.path}"
    if e.status == 404:
        return error_response(404, f"no route {route}")
    if e.status == 405:
        allow = e.headers.get("Allow", "")
        return error_response(405, f"{request.path} does not take {request.method}; "
                              f"allowed: {allow}", headers={"Allow": allow})
    if e.status == 413:
        limit = request.app[STATE].max_body_bytes
        return error_response(413, f"the request body is larger than the limit of {limit} "
                              "bytes")
    return error_response(e.status, e.text or e.reason)


# -------------------------------------------------------------------------- app helpers


def attach_metrics(engine: Engine) -> CacheMetrics:
    """A `CacheMetrics` over `engine.stats`, fed by the scheduler's and the tree's hooks."""
    metrics = CacheMetrics(engine.stats, page_size=engine.config.cache.page_size,
                           storage_page_bytes=storage_page_bytes(engine))
    engine.scheduler.observer = metrics.observe
    if isinstance(engine.cache.tree, HiRadixCache):
        engine.cache.tree.observer = metrics.observe
    return metrics


def storage_page_bytes(engine: Engine) -> int | None:
    """Bytes of one stored L3 page (header + payload), None without a storage tier."""
    if engine.cache.host_pool is None or not engine.config.storage.enabled:
        return None
    return HEADER_BYTES + engine.cache.host_pool.page_bytes


def begin_shutdown(app: web.Application) -> None:
    """From now on /health answers 503 and new generation requests are refused."""
    app[STATE].closing = True


async def read_json(request: web.Request, *, empty: Any = None) -> Any:
    """The body as JSON (`empty` when there is none); 400 when it is not valid JSON, 408 when
    it does not arrive within the body timeout (a client sending a byte a minute must not
    hold a handler forever)."""
    timeout = request.app[STATE].body_timeout_s
    try:
        raw = await asyncio.wait_for(request.read(), timeout)  # 413 past client_max_size
    except asyncio.TimeoutError:  # not yet the builtin TimeoutError on Python 3.10
        raise HttpError(408, f"the request body did not arrive within {timeout:g} s") from None
    if not raw.strip():
        if empty is None:
            raise HttpError(400, "the request body is empty; expected a JSON object")
        return empty
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise HttpError(400, f"the request body is not valid JSON: {e}") from None


async def read_object(request: web.Request, *, empty: Any = None) -> dict[str, Any]:
    body = await read_json(request, empty=empty)
    if not isinstance(body, dict):
        raise HttpError(400, f"the request body must be a JSON object, got "
                        f"{json_type(body)}")
    return body


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string",
             list: "an array", dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def brief(value: Any) -> str:
    """`repr(value)` cut short: error messages echo what was sent, never megabytes of it."""
    return reprlib.repr(value)


def check_fields(body: dict[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise HttpError(400, f"unknown field(s) {brief(unknown)[1:-1]}; allowed: "
                        f"{', '.join(allowed)}")


def check_type(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    """`body[name]`, None when absent or null; 400 unless it is one of `kinds` (no bools
    passing for numbers)."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise HttpError(400, f"`{name}` must be {what}, got {json_type(value)}")
    return value


def _engine(request: web.Request) -> Engine:
    state = request.app[STATE]
    if state.closing:
        raise EngineClosed("the server is shutting down")
    return state.engine


# ---------------------------------------------------------------------------- streaming


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


def dumps(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


# ------------------------------------------------------------------------------ OpenAI

OPENAI_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
COMPLETION_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stop",
                     "seed", "ignore_eos", "stream", "stream_options", "n", "user")
# OpenAI field -> sampling_params field (top_k and ignore_eos: the vLLM/SGLang extensions)
OPENAI_PARAMS = {"max_tokens": "max_new_tokens", "temperature": "temperature",
                 "top_p": "top_p", "top_k": "top_k", "stop": "stop", "seed": "seed",
                 "ignore_eos": "ignore_eos"}


class Completion(NamedTuple):
    text: str | None
    input_ids: list[int] | None
    sampling_params: dict[str, Any]
    stream: bool
    include_usage: bool


def parse_completion(body: dict[str, Any]) -> Completion:
    """Check the OpenAI fields' shapes; the engine checks the values' ranges."""
    check_fields(body, COMPLETION_FIELDS)
    check_type(body, "model", (str,), "a string")  # any name: one model is served (SGLang)
    check_type(body, "user", (str,), "a string")
    if check_type(body, "n", (int,), "an integer") not in (None, 1):
        raise HttpError(400, f"`n` must be 1 (one choice per request), got {body['n']}")
    stream = bool(check_type(body, "stream", (bool,), "a boolean"))
    options = check_type(body, "stream_options", (dict,), "an object") or {}
    check_fields(options, ("include_usage",))
    usage = check_type(options, "include_usage", (bool,), "a boolean")
    text, ids = _prompt(body.get("prompt"))
    params = {OPENAI_PARAMS[k]: v for k, v in body.items() if k in OPENAI_PARAMS and v is not None}
    params.setdefault("max_new_tokens", OPENAI_DEFAULT_MAX_TOKENS)
    return Completion(text, ids, params, stream, bool(usage))


def _prompt(prompt: Any) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise HttpError(400, "`prompt`: a batch of prompts is not supported; send one "
                        "request per prompt")
    raise HttpError(400, f"`prompt` must be a string or an array of token ids (integers), "
                    f"got {json_type(prompt)}")


def openai_message(message: str) -> str:
    """An engine message about `sampling_params.X`, in the OpenAI field's name."""
    for openai, ours in OPENAI_PARAMS.items():
        message = message.replace(f"sampling_params.{ours}", openai)
    return message.replace("`input_ids`", "`prompt`")


def _usage(meta: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": meta["cached_tokens"]}}


def _completion(model: str, choices: list[dict[str, Any]], cid: str | None = None
                ) -> dict[str, Any]:
    return {"id": cid or f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": model, "choices": choices}


def _choice(text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}


def completion_response(result: dict[str, Any], model: str) -> dict[str, Any]:
    meta = result["meta_info"]
    out = _completion(model, [_choice(result["text"], meta["finish_reason"])])
    return {**out, "usage": _usage(meta)}


async def completion_chunks(results: AsyncIterator[dict], model: str, stop: tuple[str, ...],
                            include_usage: bool) -> AsyncIterator[dict[str, Any]]:
    """OpenAI chunks carrying text deltas. Until the end, the tail that could still become a
    stop string (cut from the final text) or an unfinished UTF-8 character is held back, so a
    delta is never taken back."""
    cid, hold, sent = f"cmpl-{uuid.uuid4().hex}", max(map(len, stop), default=1) - 1, ""
    meta: dict[str, Any] = {}
    try:
        async for result in results:
            meta = result["meta_info"]
            final = meta["finish_reason"] is not None
            text = result["text"]
            visible = text if final else text[:len(text) - hold].rstrip(REPLACEMENT_CHAR)
            delta = visible[len(sent):] if visible.startswith(sent) else ""
            sent = visible if visible.startswith(sent) else sent
            if delta or final:
                yield _completion(model, [_choice(delta, meta["finish_reason"])], cid)
    finally:
        await results.aclose()  # a client gone: its request is aborted now
    if include_usage and meta:
        yield {**_completion(model, [], cid), "usage": _usage(meta)}


async def json_events(items: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    """Each item as JSON; closing this closes `items` (and so aborts their request)."""
    try:
        async for item in items:
            yield dumps(item)
    finally:
        await items.aclose()


# ----------------------------------------------------------------------------- handlers


async def handle_generate(request: web.Request) -> web.StreamResponse:
    body = await read_object(request)
    check_fields(body, GENERATE_FIELDS)
    stream = check_type(body, "stream", (bool,), "a boolean")
    params = check_type(body, "sampling_params", (dict,), "an object")
    if body.get("extra_key") is not None and body.get("cache_salt") is not None:
        raise HttpError(400, "give at most one of `extra_key` or `cache_salt` (both name "
                        "the cache namespace)")
    extra_key = body.get("extra_key", body.get("cache_salt"))
    engine = _engine(request)
    req = engine.make_request(body.get("text"), body.get("input_ids"), params, extra_key)
    results = await start_stream(engine, req)
    if not stream:
        return web.json_response(await _last(results))  # RequestFailed: a 500
    return await send_sse(request, json_events(results))


async def _last(results: AsyncIterator[dict]) -> dict:
    last: dict = {}
    async for result in results:
        last = result
    return last


async def handle_completions(request: web.Request) -> web.StreamResponse:
    parsed = parse_completion(await read_object(request))
    engine = _engine(request)
    model = engine.config.model.path
    try:
        req = engine.make_request(parsed.text, parsed.input_ids, parsed.sampling_params)
    except InvalidRequest as e:
        raise HttpError(400, openai_message(str(e))) from None
    results = await start_stream(engine, req)
    if not parsed.stream:
        return web.json_response(completion_response(await _last(results), model))
    chunks = completion_chunks(results, model, req.params.stop, parsed.include_usage)
    return await send_sse(request, json_events(chunks))


async def handle_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    card = {"id": state.engine.config.model.path, "object": "model", "created": state.started,
            "owned_by": "hicache", "max_model_len": state.engine.context_len}
    return web.json_response({"object": "list", "data": [card]})


async def handle_health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.closing:
        return error_response(503, "the server is shutting down")
    if not state.engine.alive():
        return error_response(503, "the scheduler thread has stopped; restart the server")
    return web.json_response({"status": "ok"})


async def handle_metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _engine(request)  # a closed engine's stats would never answer
    body = await asyncio.get_running_loop().run_in_executor(None, state.metrics.render)
    return web.Response(body=body, headers={"Content-Type": state.metrics.content_type})


def create_app(engine: Engine, *, metrics: CacheMetrics | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> web.Application:
    """The API over `engine`; without `metrics`, one is made and wired to the engine's hooks.
    Admin routes are added separately (`server.admin_api.add_admin_routes`)."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    app = web.Application(middlewares=[error_middleware], client_max_size=max_body_bytes)
    if not body_timeout_s > 0:
        raise ValueError(f"body_timeout_s must be > 0, got {body_timeout_s}")
    app[STATE] = ServerState(engine, metrics or attach_metrics(engine), max_body_bytes,
                             int(time.time()), body_timeout_s)
    app.router.add_post("/generate", handle_generate)
    app.router.add_post("/v1/completions", handle_completions)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/metrics", handle_metrics)
    return app
