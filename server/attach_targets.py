"""Where a runtime L3 attach may open a store: what an admin request may point the server at.

- LMDB: only folders under `storage.attach_roots` (absolute folders chosen at start; none:
  every LMDB path a request names is refused). The request's `path` is taken literally
  (never `$VAR`- or `~`-expanded, no `..`), resolved with its symlinks followed, and must
  lie under a root that exists, so the store's `mkdir -p` and its moving aside of a damaged
  data file stay inside the roots. A request naming no path reopens the start-up store
  (`storage.lmdb.path` of a server started with LMDB): the start-up configuration is the
  operator's and is not limited by the roots.
- Redis: only the endpoint of the start-up `storage.redis.url` (its host and port, or its
  Unix socket; TLS when it had TLS), so the start-up password (the URL's, or
  `HICACHE_REDIS_PASSWORD`) is never sent anywhere else, nor L2 backed up there.

Errors never echo a resolved path, an expanded variable or anything else the request did
not send (`redact_urls` hides a password in any URL a message quotes).

Threading: any thread; an `AttachTargets` holds only the start-up section.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any, NamedTuple, NoReturn
from urllib.parse import urlsplit

from redis.connection import parse_url

from hicache.config_storage import TIERED_BACKEND, StorageConfig, redact_url
from hicache_server.request import InvalidRequest

LMDB_BACKENDS = ("lmdb", TIERED_BACKEND)  # the backends that open an LMDB folder
REDIS_BACKENDS = ("redis", TIERED_BACKEND)
REDIS_DEFAULT_PORT = 6379  # redis-py's port when a URL names none
TLS_SCHEME = "rediss"
UNIX_SCHEME = "unix"
# What an attach URL may change at the start-up endpoint: the database and its own
# credentials. Everything else redis-py reads from a URL (host, port and socket, query
# parameters such as `?port=` or `?ssl_cert_reqs=none`, timeouts) must be the start-up
# URL's, or the start-up password could be sent elsewhere or TLS checks turned off.
# (TLS or not, the connection class, follows the endpoint rule: never a downgrade.)
REDIS_ATTACH_MAY_CHANGE = frozenset({"db", "username", "password", "connection_class"})
# What in an error message may be a URL: a scheme, "://", then anything up to a space. A
# closing quote of repr is taken in too: it lands in the host or path, and a password that
# holds a quote is still all inside the match.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S+")


class StorageChangeRefused(InvalidRequest):
    """An L3 attach or detach that was refused (HTTP 400, as SGLang answers); the message
    says why. Nothing changed: the engine serves as before."""


class RedisEndpoint(NamedTuple):
    """Where a Redis URL connects: `host` and `port`, or `socket` (a unix:// path)."""

    tls: bool
    host: str | None
    port: int | None
    socket: str | None

    def shown(self) -> str:
        return f"unix://{self.socket}" if self.socket is not None else f"{self.host}:{self.port}"


def redact_urls(text: str) -> str:
    """`text` with every URL in it passed through `redact_url` (no password shown)."""
    return _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)


def redis_endpoint(url: str) -> RedisEndpoint:
    """The endpoint of a Redis URL (already validated as one); ValueError for a bad port."""
    parts = urlsplit(url)
    if parts.scheme == UNIX_SCHEME:
        return RedisEndpoint(False, None, None, parts.path)
    host = (parts.hostname or "").lower()
    return RedisEndpoint(parts.scheme == TLS_SCHEME, host, parts.port or REDIS_DEFAULT_PORT,
                         None)


def redis_connection(url: str) -> dict[str, Any]:
    """What redis-py connects with for `url`, less what an attach may change; ValueError
    for a value redis-py refuses."""
    kwargs = parse_url(url)
    if isinstance(kwargs.get("host"), str):  # a host name is case-insensitive
        kwargs["host"] = kwargs["host"].lower()
    if "path" not in kwargs:  # a TCP endpoint: the port as redis-py will use it
        kwargs["port"] = int(kwargs.get("port", REDIS_DEFAULT_PORT))
    return {k: v for k, v in kwargs.items() if k not in REDIS_ATTACH_MAY_CHANGE}


def _under(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


class AttachTargets:
    """The checks of the module doc, against the start-up storage section `launch`."""

    def __init__(self, launch: StorageConfig) -> None:
        self.launch = launch
        self.roots = launch.attach_roots
        try:
            self.redis: RedisEndpoint | None = redis_endpoint(launch.redis.url)
        except ValueError:  # a bad port: a server without Redis starts all the same
            self.redis = None

    def check(self, backend: str, sent: Mapping[str, Mapping[str, Any]],
              storage: StorageConfig) -> None:
        """Raise StorageChangeRefused unless `storage` (the merged, validated section about
        to be opened) opens only allowed targets; `sent`: the request's own sections by
        part ("lmdb", "redis"), to tell a path it named from the start-up one."""
        if backend in LMDB_BACKENDS:
            self._check_lmdb(sent.get("lmdb", {}).get("path"))
        if backend in REDIS_BACKENDS:
            self._check_redis(storage.redis.url)

    # ------------------------------------------------------------------------------- LMDB

    def _check_lmdb(self, path: object) -> None:
        started_with_lmdb = self.launch.backend in LMDB_BACKENDS
        if path is None or (started_with_lmdb and path == self.launch.lmdb.path):
            if not started_with_lmdb:
                raise StorageChangeRefused(
                    "storage.lmdb.path is required: this server was started without an LMDB "
                    "store, so an attach names the folder, under one of "
                    f"storage.attach_roots ({self._roots_shown()})")
            return  # the start-up store, reopened
        if not self.roots:
            raise StorageChangeRefused(
                "storage.lmdb.path: this server takes no LMDB path from a request: it was "
                "started without storage.attach_roots (the folders an attach may open "
                "stores under); restart it with them"
                + (", or leave `path` out to reopen the start-up store"
                   if started_with_lmdb else ""))
        if not isinstance(path, str):  # the config's validation refuses it first
            raise StorageChangeRefused("storage.lmdb.path must be a string")
        self._check_literal(path)
        real = os.path.realpath(path)
        if not any(_under(real, root) for root in self._real_roots()):
            raise StorageChangeRefused(
                f"storage.lmdb.path {path!r} does not lie under any of storage.attach_roots "
                f"({self._roots_shown()}) once its symlinks are followed; name a folder "
                "inside one of them")

    def _check_literal(self, path: str) -> None:
        """Refuse what the store would expand or what could climb out of a root."""
        if "$" in path or path.startswith("~"):
            raise StorageChangeRefused(
                f"storage.lmdb.path {path!r}: an attach takes the path literally, and "
                "`$VARIABLES` and `~` are never expanded; give the absolute folder")
        if not os.path.isabs(path):
            raise StorageChangeRefused(f"storage.lmdb.path {path!r} must be an absolute "
                                       "folder under one of storage.attach_roots")
        if ".." in PurePath(path).parts:
            raise StorageChangeRefused(f"storage.lmdb.path {path!r} must not hold `..`; "
                                       "name the folder under the root directly")

    def _real_roots(self) -> list[str]:
        """The roots that exist, symlinks followed (a missing root would let `mkdir -p`
        create folders above it)."""
        real = [os.path.realpath(os.path.expanduser(root)) for root in self.roots]
        return [root for root in real if os.path.isdir(root)]

    def _roots_shown(self) -> str:
        """The roots as configured (what /get_server_info shows), never as resolved."""
        return ", ".join(self.roots) if self.roots else "none configured"

    # ------------------------------------------------------------------------------ Redis

    def _check_redis(self, url: str) -> None:
        try:
            asked = redis_endpoint(url)
        except ValueError:
            raise StorageChangeRefused(f"storage.redis.url {redact_url(url)!r} is not a "
                                       "Redis URL (a bad port)") from None
        allowed = self.redis
        if allowed is None:
            raise StorageChangeRefused("storage.redis.url: the start-up URL names no usable "
                                       "endpoint (a bad port), and an attach may reach no "
                                       "other; restart the server with a valid one")
        if asked._replace(tls=False) != allowed._replace(tls=False) or \
                (allowed.tls and not asked.tls):
            self._refuse_endpoint(asked, allowed)
        try:
            differ = sorted(set(redis_connection(url).items())
                            ^ set(redis_connection(self.launch.redis.url).items()))
        except (ValueError, TypeError):
            raise StorageChangeRefused(f"storage.redis.url {redact_url(url)!r} is not a "
                                       "Redis URL redis-py accepts") from None
        if differ:
            names = ", ".join(sorted({name for name, _ in differ}))
            raise StorageChangeRefused(
                f"storage.redis.url: an attach may change only the database and credentials "
                f"of the start-up URL; it differs in {names}: restart the server with another "
                "storage.redis.url to connect otherwise")

    def _refuse_endpoint(self, asked: RedisEndpoint, allowed: RedisEndpoint) -> NoReturn:
        tls = " over TLS (rediss://)" if allowed.tls else ""
        raise StorageChangeRefused(
            f"storage.redis.url: an attach may reach only the Redis this server was "
            f"configured with at start ({allowed.shown()}{tls}), so that its password "
            f"is never sent elsewhere; {asked.shown()} is refused; restart the server "
            "with another storage.redis.url to use another")
