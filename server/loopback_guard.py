"""What the admin routes' browser checks need that the router needs too, apart from the
HTTP app (which imports the engine): the server's own loopback names, the Origin and Host
rule against CSRF and DNS rebinding (hicache_server.http.admin_guard's module doc), and the
admin routes' paths. Light on purpose: the router process imports it.
"""

from __future__ import annotations

import ipaddress

from aiohttp import web

# The names a loopback client reaches this server under, as they appear in a Host or Origin
# header (RFC 3986: an IPv6 literal in brackets); what no DNS answer can stand for.
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
HTTP_DEFAULT_PORT = 80  # a Host or Origin without a port means 80 (RFC 9110, http scheme)
# Every admin route's path (hicache_server.http.admin adds them; the router guards them too)
ADMIN_PATHS = frozenset({"/admin/flush", "/admin/tiers", "/admin/pin", "/admin/unpin",
                         "/flush_cache", "/hicache/storage-backend/clear",
                         "/hicache/storage-backend"})
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


def quoted(value: str) -> str:
    return repr(value[:SHOWN_CHARS])


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
                          f"{quoted(origin)} is not this server's own ({allowed}); send no "
                          f"Origin header (curl, scripts), or {NO_KEY_HINT}")
    if host is not None and host.lower() not in hosts:
        allowed = ", ".join(hosts[:len(LOOPBACK_NAMES)]) or "none"
        raise AdminDenied(403, f"admin routes answer only this server's loopback names "
                          f"(Host one of {allowed}), against DNS rebinding: Host "
                          f"{quoted(host)} is refused; address the server by one of those, "
                          f"or {NO_KEY_HINT}")


def local_port(request: web.BaseRequest) -> int | None:
    """The port the request came in on (None on a Unix socket): the listener's, never the
    client's claim in `Host`."""
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    if isinstance(sockname, (tuple, list)) and len(sockname) >= 2:
        return int(sockname[1])
    return None
