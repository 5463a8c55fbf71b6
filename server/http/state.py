"""What every handler shares: the engine, the metrics, the server's limits, the API keys,
the closing flag.

Threading: a `ServerState`'s fields are read and written on the event loop only; `closing`
flips once (`hicache_server.http.app.begin_shutdown`) and never back.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from hicache_server.api_keys import OPEN, ApiKeys
from hicache_server.engine import Engine, EngineClosed
from hicache_server.http.metrics import CacheMetrics

# Largest request body read (bytes). A context-length prompt of token ids as JSON is well
# under 1 MB for today's models (128k ids x ~7 bytes); 8 MiB leaves room and stops a client
# from making the server buffer arbitrary amounts.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# Longest wait for a request body once its headers are in (seconds): a body of the largest
# size above arrives in well under a second on any link a server is reached over, so only a
# stalled or hostile client waits this long (uvicorn and nginx use 60 s for their timeouts).
DEFAULT_BODY_TIMEOUT_S = 30.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class ServerState:
    """What the handlers share besides the engine. `closing`: shutdown has begun."""

    engine: Engine
    metrics: CacheMetrics
    max_body_bytes: int
    started: int  # Unix time the app was built (OpenAI's `created` of the model)
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    api_keys: ApiKeys = OPEN  # the inference routes' keys (`hicache_server.http.auth`)
    closing: bool = False


STATE = web.AppKey("hicache_state", ServerState)


def live_engine(request: web.Request) -> Engine:
    """The engine, for a route that starts work; EngineClosed (a 503) once shutdown has
    begun."""
    state = request.app[STATE]
    if state.closing:
        raise EngineClosed("the server is shutting down")
    return state.engine
