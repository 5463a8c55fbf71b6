"""The HTTP API (aiohttp): SGLang's /generate, OpenAI's /v1/completions, admin, health, metrics.

    app.py        create_app, the error middleware, /health, /metrics, attach_metrics,
                  begin_shutdown
    native.py     POST /generate (SGLang's shape)
    openai.py     POST /v1/completions, GET /v1/models
    admin.py      /admin/flush, /admin/tiers, SGLang's aliases; bearer-key or loopback access
    streaming.py  a request's results as routes read them; server-sent events
    body.py       the request body as JSON, its fields' shapes checked
    errors.py     the JSON error shape, HttpError, RequestFailed
    state.py      ServerState (STATE): what every handler shares; the body limits

Imports run one way: app -> routes (native, openai; admin is added by the caller) ->
streaming, body -> errors, state. No route module imports app.

Threading: handlers run on the event loop; the engine's blocking calls go to the default
executor, never onto the loop.
"""

from __future__ import annotations

from server.http.admin import AdminDenied, add_admin_routes, check_admin_access, is_loopback
from server.http.app import attach_metrics, begin_shutdown, create_app
from server.http.errors import HttpError, RequestFailed
from server.http.state import STATE, Handler, ServerState

__all__ = ["STATE", "AdminDenied", "Handler", "HttpError", "RequestFailed", "ServerState",
           "add_admin_routes", "attach_metrics", "begin_shutdown", "check_admin_access",
           "create_app", "is_loopback"]
