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
import ipaddress

from aiohttp import web

from hicache_server.http.errors import error_response
from hicache_server.http.state import STATE, Handler

BEARER = "bearer"  # auth scheme, compared case-insensitively (RFC 7235)
# The names a loopback client reaches this server under, as they appear in a Host or Origin
# header (RFC 3986: an IPv6 literal in brackets); what no DNS answer can stand for.
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
HTTP_DEFAULT_PORT = 80  # a Host or Origin without a port means 80 (RFC 9110, http scheme)
JSON_TYPE = "application/json"  # the one body type the admin routes take
# A header value quoted in an error, cut to this many characters: a real Origin, Host or
# Content-Type is well under it; a hostile one must not fill the answer.
SHOWN_CHARS = 100
NO_KEY_HINT = "start the server with --admin-api-key (or HICACHE_ADMIN_API_KEY) to use " \
              "a bearer key instead"


class AdminDenied(Exception):
    """An admin request refused before its handler runs; `status` is 401, 403 or 415."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def is_loopback(remote: str | None) -> bool:
    """Whether `remote` (aiohttp's `request.remote`) is a loopback address. A Unix socket
    peer or anything unparsable is not."""
    if not remote:
        return False
    try:
        ip = ipaddress.ip_address(remote.split("%", 1)[0])  # drop an IPv6 zone id
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def check_admin_access(remote: str | None, authorization: str | None,
                       api_key: str | None) -> None:
    """Raise AdminDenied unless the caller may use the admin routes: the bearer key when
    one is configured, else a loopback `remote` (the browser checks are `check_own_origin`)."""
    if api_key is None:
        if not is_loopback(remote):
            raise AdminDenied(403, f"admin routes answer loopback clients only (this one is "
                              f"{remote}); {NO_KEY_HINT}")
        return
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != BEARER or not token.strip():
        raise AdminDenied(401, "admin routes need the header `Authorization: Bearer <admin "
                          "key>`")
    # aiohttp hands header bytes that are not UTF-8 over as lone surrogates (surrogateescape):
    # encoding them back the same way compares the bytes the client sent.
    sent = token.strip().encode("utf-8", "surrogateescape")
    if not hmac.compare_digest(sent, api_key.encode("utf-8")):
        raise AdminDenied(403, "the admin key in the Authorization header is wrong")


def _shown(value: str) -> str:
    return repr(value[:SHOWN_CHARS])


def own_hosts(port: int | None) -> tuple[str, ...]:
    """The Host values that name this server on loopback at `port` (lower case)."""
    if port is None:  # not a TCP listener (a Unix socket): no name is this server's
        return ()
    bare = LOOPBACK_NAMES if port == HTTP_DEFAULT_PORT else ()
    return tuple(f"{name}:{port}" for name in LOOPBACK_NAMES) + bare


def check_own_origin(host: str | None, origin: str | None, port: int | None) -> None:
    """Raise AdminDenied (403) when a keyless admin request carries an `Origin` or a `Host`
    that is not this server's own loopback name at `port`, the port it came in on."""
    hosts = own_hosts(port)
    if origin is not None and origin.lower() not in {f"http://{h}" for h in hosts}:
        allowed = ", ".join(f"http://{h}" for h in hosts[:len(LOOPBACK_NAMES)]) or "none"
        raise AdminDenied(403, f"admin routes refuse requests sent by a web page: Origin "
                          f"{_shown(origin)} is not this server's own ({allowed}); send no "
                          f"Origin header (curl, scripts), or {NO_KEY_HINT}")
    if host is not None and host.lower() not in hosts:
        allowed = ", ".join(hosts[:len(LOOPBACK_NAMES)]) or "none"
        raise AdminDenied(403, f"admin routes answer only this server's loopback names "
                          f"(Host one of {allowed}), against DNS rebinding: Host "
                          f"{_shown(host)} is refused; address the server by one of those, "
                          f"or {NO_KEY_HINT}")


def check_json_body(request: web.BaseRequest) -> None:
    """Raise AdminDenied (415) when the request has a body that is not declared JSON."""
    if request.body_exists and request.content_type != JSON_TYPE:
        raise AdminDenied(415, f"admin routes take a JSON body only (Content-Type: "
                          f"{JSON_TYPE}), got {_shown(request.content_type)}; send the body "
                          "with that header, or no body at all")


def local_port(request: web.BaseRequest) -> int | None:
    """The port the request came in on (None on a Unix socket): the listener's, never the
    client's claim in `Host`."""
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    if isinstance(sockname, (tuple, list)) and len(sockname) >= 2:
        return int(sockname[1])
    return None


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
