"""Who may call the admin routes, and what no browser page can make them do.

With `server.admin_api_key` (or `HICACHE_ADMIN_API_KEY`) set: `Authorization: Bearer <key>`,
compared in constant time (401 without a bearer header, 403 with a wrong key). A browser
cannot send that header to another origin without a CORS preflight, which this server never
answers, so a key alone keeps web pages out.

Without a key, loopback clients only (403 otherwise) *and* nothing a browser adds:
- an `Origin` header other than this server's own loopback origin (`http://127.0.0.1:PORT`,
  `http://localhost:PORT`, `http://[::1]:PORT`, PORT being the one the request came in on) is
  refused: any page the operator opens can POST to loopback without a preflight (CSRF);
- a `Host` header other than one of those names with that port is refused: a DNS name that
  an attacker points at 127.0.0.1 (DNS rebinding) reaches loopback under its own name.
Requests without these headers (curl, scripts) pass, as they carry no browser's intent.

Either way, a request with a body must say `Content-Type: application/json` (415 otherwise):
HTML forms and `fetch` without a preflight can only send text/plain, form and multipart
bodies. Body-less requests (SGLang's `POST /flush_cache`) pass.

Threading: the event loop.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from hicache_server.api_keys import bearer_token
from hicache_server.http.errors import error_response
from hicache_server.http.state import STATE, Handler
from hicache_server.loopback_guard import (
    NO_KEY_HINT,
    AdminDenied,
    check_own_origin,
    is_loopback,
    local_port,
    quoted,
)

JSON_TYPE = "application/json"  # the one body type the admin routes take



def check_admin_access(remote: str | None, authorization: str | None,
                       api_key: str | None) -> None:
    """Raise AdminDenied unless the caller may use the admin routes: the bearer key when
    one is configured, else a loopback `remote` (the browser checks are `check_own_origin`)."""
    if api_key is None:
        if not is_loopback(remote):
            raise AdminDenied(403, f"admin routes answer loopback clients only (this one is "
                              f"{remote}); {NO_KEY_HINT}")
        return
    sent = bearer_token(authorization)
    if sent is None:
        raise AdminDenied(401, "admin routes need the header `Authorization: Bearer <admin "
                          "key>`")
    if not hmac.compare_digest(sent, api_key.encode("utf-8")):
        raise AdminDenied(403, "the admin key in the Authorization header is wrong")


def check_json_body(request: web.BaseRequest) -> None:
    """Raise AdminDenied (415) when the request has a body that is not declared JSON."""
    if request.body_exists and request.content_type != JSON_TYPE:
        raise AdminDenied(415, f"admin routes take a JSON body only (Content-Type: "
                          f"{JSON_TYPE}), got {quoted(request.content_type)}; send the body "
                          "with that header, or no body at all")


def check_admin_request(request: web.BaseRequest, api_key: str | None) -> None:
    """Every rule of the module doc, credentials first; AdminDenied on the first broken."""
    headers = request.headers
    check_admin_access(request.remote, headers.get("Authorization"), api_key)
    if api_key is None:
        check_own_origin(headers.get("Host"), headers.get("Origin"), local_port(request))
    check_json_body(request)


def guarded(handler: Handler, api_key: str | None) -> Handler:
    """`handler` behind `check_admin_request`; 503 once shutdown has begun."""
    async def guard(request: web.Request) -> web.StreamResponse:
        try:
            check_admin_request(request, api_key)
        except AdminDenied as e:
            headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
            return error_response(e.status, e.message, headers=headers)
        if request.app[STATE].closing:
            return error_response(503, "the server is shutting down")
        return await handler(request)

    return guard
