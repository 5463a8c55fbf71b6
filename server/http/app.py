"""The aiohttp app: `create_app` wires the routes, the error middleware, health and metrics.

    GET  /health            200 {"status": "ok"}; 503 once shutdown has begun
    GET  /metrics           Prometheus text (`metrics.CacheMetrics`)

Both stay open; every other route `create_app` adds needs the API key when the server has
one (`inference_routes`, `hicache_server.http.auth`).

Every error is a JSON body `{"error": {"message", "type", "code"}}` with a 4xx status
(`error_middleware`); a 500 is a bug and is logged with its traceback.

Threading: handlers run on the event loop; the engine's blocking calls (`stats`,
`flush_cache`) go to the default executor, never onto the loop.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web

from hicache_server.api_keys import OPEN, ApiKeys
from hicache_server.engine import Engine, EngineClosed, QueueFull
from hicache_server.http.auth import protected
from hicache_server.http.chat import chat_route
from hicache_server.http.discovery import (
    handle_detokenize,
    handle_get_load,
    handle_model,
    handle_model_info,
    handle_models,
    handle_server_info,
    handle_tokenize,
)
from hicache_server.http.errors import HttpError, RequestFailed, error_response
from hicache_server.http.metrics import CacheMetrics
from hicache_server.http.native import handle_close_session, handle_generate
from hicache_server.http.offload import off_loop
from hicache_server.http.openai import handle_completions
from hicache_server.http.state import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    STATE,
    Handler,
    ServerState,
    live_engine,
)
from hicache_server.request import InvalidRequest

logger = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's status for a request whose client closed the connection


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except HttpError as e:
        return error_response(e.status, e.message, headers=e.headers)
    except InvalidRequest as e:
        return error_response(400, str(e))
    except EngineClosed as e:
        return error_response(503, str(e))
    except QueueFull as e:  # server.max_queued_requests wait already: nothing was queued
        return error_response(429, str(e), headers={"Retry-After": str(e.retry_after_s)})
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


def attach_metrics(engine: Engine) -> CacheMetrics:
    """A `CacheMetrics` over `engine.cache_stats`, fed by the scheduler's and the tiers'
    latency hooks."""
    metrics = CacheMetrics(engine.cache_stats, page_size=engine.config.cache.page_size)
    engine.set_observer(metrics.observe)
    return metrics


def begin_shutdown(app: web.Application) -> None:
    """From now on /health answers 503 and new generation requests are refused."""
    app[STATE].closing = True


async def handle_health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.closing:
        return error_response(503, "the server is shutting down")
    if not state.engine.alive():
        return error_response(503, "the scheduler thread has stopped; restart the server")
    return web.json_response({"status": "ok"})


async def handle_metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    live_engine(request)  # a closed engine's stats would never answer
    body = await off_loop(state.metrics.render)
    return web.Response(body=body, headers={"Content-Type": state.metrics.content_type})


def create_app(engine: Engine, *, metrics: CacheMetrics | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
               api_keys: ApiKeys = OPEN) -> web.Application:
    """The API over `engine`; without `metrics`, one is made and wired to the engine's hooks.
    With `api_keys` (`hicache_server.api_keys.load_api_keys`), every route but /health and
    /metrics needs one of them (`hicache_server.http.auth`). Admin routes are added
    separately, with their own key (`hicache_server.http.admin.add_admin_routes`)."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    app = web.Application(middlewares=[error_middleware], client_max_size=max_body_bytes)
    if not body_timeout_s > 0:
        raise ValueError(f"body_timeout_s must be > 0, got {body_timeout_s}")
    app[STATE] = ServerState(engine, metrics or attach_metrics(engine), max_body_bytes,
                             int(time.time()), body_timeout_s, api_keys)
    add = {"GET": app.router.add_get, "POST": app.router.add_post}
    for method, path, handler in inference_routes(engine):
        add[method](path, protected(handler))
    app.router.add_get("/health", handle_health)  # open, as vLLM's: probes carry no key
    app.router.add_get("/metrics", handle_metrics)  # open, as vLLM's: scrapers carry no key
    return app


def inference_routes(engine: Engine) -> list[tuple[str, str, Handler]]:
    """(method, path, handler) of every route behind the API key."""
    return [
        ("POST", "/generate", handle_generate),
        ("POST", "/close_session", handle_close_session),  # SGLang's; a client route
        ("POST", "/v1/completions", handle_completions),
        ("POST", "/v1/chat/completions", chat_route(engine)),
        ("GET", "/v1/models", handle_models),
        ("GET", "/v1/models/{id:.+}", handle_model),  # an id may hold slashes
        *(("GET", path, handle_model_info)  # SGLang's old and new names
          for path in ("/get_model_info", "/model_info")),
        *(("GET", path, handle_server_info) for path in ("/get_server_info", "/server_info")),
        ("GET", "/get_load", handle_get_load),  # sglang-router's load monitor
        ("POST", "/tokenize", handle_tokenize),
        ("POST", "/detokenize", handle_detokenize),
    ]
