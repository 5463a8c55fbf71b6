"""The client side of `RedisStore`: one redis-py client, connected lazily, and the calls into
it, whose faults become fallbacks behind a back-off.

    call(op, side, fallback, body)    `body(client)`, or `fallback` when closed, backing off
                                      or when Redis fails (counted, logged, backed off)
    Backoff                           the pause after a fault, one per side (reads, writes)

`RedisClient` is a part of `RedisStore` (`redis_store`: the `StorageBackend` operations,
each a body run by `call`).

Faults: a Redis that is down, slow (socket timeouts) or full is a miss or a skipped write,
counted in `errors` and logged at most once a minute per operation. After a fault the
operations it concerns are not sent at all for a back-off interval (0.5 s doubling to
30 s; `backoff_calls` counts the calls answered that way), so a dead server costs no
timeouts per request; the first call after the interval probes it, and a success resets
the interval: the store recovers by itself when Redis returns. A connection fault blocks
reads and writes; a refused write (OOM, READONLY) blocks only writes.

Junk: a reply of the wrong type (a misconfigured proxy or another service on the port,
answering `+OK` or `:1` to every command) is such a fault too, a `BadReply`, at start-up
and mid-run (the operations check every reply where they consume it: `redis_replies`). The
client's connections are then closed (one whose replies may be out of step with its commands
must not be reused), so the first call after the back-off connects afresh and finds a peer
that behaves again. The RESP3 handshake (`RESP_PROTOCOL`: HELLO's reply must be a map)
refuses most such peers at connect, before any command is sent.

Threads: any mix of the `StorageBackend` callers. The connection pool holds
`POOL_CONNECTIONS` per server: the query, fetch and backup threads plus the scheduler's admin
calls each hold at most one connection per server at a time. The client is made, dropped and
closed under one lock; a call uses the client it found.

Secrets: the password comes from the URL or, when the URL has none, from the environment
variable `HICACHE_REDIS_PASSWORD`; only the redacted URL is ever logged or reported.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import parse_url
from redis.exceptions import (
    ClusterError,
    InvalidResponse,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from hicache.config_storage import redact_url
from hicache.storage.backends.base import Counters, FaultLog, StoreClosed
from hicache.storage.backends.redis_replies import BadReply, asking

T = TypeVar("T")
Client = redis.Redis | RedisCluster

PASSWORD_ENV = "HICACHE_REDIS_PASSWORD"
# Per server: query, fetch and backup threads + the scheduler's admin calls, + 1 spare.
POOL_CONNECTIONS = 5
POOL_WAIT_S = 5.0  # a caller waits this long for a free pooled connection
# Reads of one page batch take milliseconds; a Redis that cannot answer a socket read within
# the prefetch timeout policy's base (2 s) is worth less than recomputing.
SOCKET_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 1.0  # a live server on a LAN accepts in well under a millisecond
BACKOFF_INITIAL_S = 0.5  # first back-off interval after a fault; doubles per fault
BACKOFF_MAX_S = 30.0  # longest back-off: a returned server is found within this long
STAT_BACKOFF = "backoff_calls"  # calls answered (miss / skipped) without asking Redis
# RESP3, redis-py 8's default, pinned: a new connection's HELLO must be answered with a map
# holding the protocol, which a peer that is not Redis does not send (Redis >= 6 does).
RESP_PROTOCOL = 3

# Faults that say the server is unreachable or broken (block reads and writes), as opposed
# to a server that answered and refused one command (a `ResponseError`: blocks that side).
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, ClusterError, RedisClusterException,
                OSError)
_FAULTS = (RedisError, RedisClusterException, OSError)
# Faults after which a connection's replies may be out of step with its commands.
_OUT_OF_STEP = (BadReply, InvalidResponse)
READ, WRITE = "read", "write"  # the sides of `call`, each backed off on its own


class Backoff:
    """After a fault, `ready()` is False for an interval that doubles per fault up to a cap;
    a success resets it. Intervals are on the monotonic clock. Threading: any thread."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        if not 0 < initial_s <= max_s:
            raise ValueError(f"back-off needs 0 < initial_s <= max_s, got initial_s="
                             f"{initial_s!r}, max_s={max_s!r}")
        self._initial_s, self._max_s = initial_s, max_s
        self._interval_s = 0.0  # 0: healthy
        self._until = 0.0
        self._lock = threading.Lock()

    def ready(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._until

    def failed(self) -> float:
        """Start (or double) the interval; the new interval in seconds."""
        with self._lock:
            self._interval_s = min(self._max_s, max(self._initial_s, 2 * self._interval_s))
            self._until = time.monotonic() + self._interval_s
            return self._interval_s

    def succeeded(self) -> None:
        with self._lock:
            self._interval_s, self._until = 0.0, 0.0


class RedisClient:
    """The client of one `RedisStore` and the calls into it (see the module docstring).

    `url` unredacted (it may hold the password; `self.url` is the redacted one); `counts`
    and `faults`: the store's, which `call` adds its faults and back-off answers to.
    """

    def __init__(self, url: str, *, cluster: bool, socket_timeout_s: float,
                 connect_timeout_s: float, backoff_initial_s: float, backoff_max_s: float,
                 counts: Counters, faults: FaultLog) -> None:
        for name, value in (("socket_timeout_s", socket_timeout_s),
                            ("connect_timeout_s", connect_timeout_s)):
            if not value > 0:
                raise ValueError(f"storage.redis.{name} must be > 0 seconds, got {value!r}")
        self.url = redact_url(url)  # shown in logs and stats: never the password
        try:
            options = parse_url(url)
        except ValueError as err:  # a bad port or db: refused now, not at the first call
            raise ValueError(f"storage.redis.url: {self.url!r} is not a Redis URL: {err}") \
                from None
        if cluster and ("path" in options or options.get("db", 0) != 0):
            raise ValueError(f"storage.redis.url: a cluster needs redis:// or rediss:// and "
                             f"db 0, got {self.url!r}")
        self.cluster = cluster
        self._url = url
        self._timeouts = (socket_timeout_s, connect_timeout_s)
        self._gates = {READ: Backoff(backoff_initial_s, backoff_max_s),
                       WRITE: Backoff(backoff_initial_s, backoff_max_s)}
        self._counts, self._faults = counts, faults
        self._client_lock = threading.Lock()
        self._client: Client | None = None
        self._closed = False

    def close(self) -> None:
        """`StorageBackend.close`: idempotent; later calls are quiet fallbacks."""
        with self._client_lock:
            client, self._client, self._closed = self._client, None, True
        if client is not None:
            _disconnect(client)

    # ------------------------------------------------------------------ calls

    def call(self, op: str, side: str, fallback: T, body: Callable[[Client], T]) -> T:
        """`body(client)`, or `fallback` when closed, backing off, or Redis fails."""
        if not self._gates[side].ready():
            self._counts.add(STAT_BACKOFF, 1)
            return fallback
        client: Client | None = None
        try:
            client = self._connected()
            result = body(client)
        except StoreClosed:
            return fallback
        except _FAULTS as err:
            if self._closed:  # close() pulled the connections from under this call
                return fallback
            self._fault(op, side, err)
            if client is not None and isinstance(err, _OUT_OF_STEP):
                self._drop(client)
            return fallback
        self._gates[side].succeeded()
        return result

    def _fault(self, op: str, side: str, err: BaseException) -> None:
        refused = isinstance(err, ResponseError) and not isinstance(err, _UNREACHABLE)
        sides = (side,) if refused else (READ, WRITE)
        interval = max(self._gates[s].failed() for s in sides)
        self._faults.record(op, f"Redis {self.url}: {type(err).__name__}: {err}{_hint(err)}; "
                                f"treated as a miss / skipped write; {'/'.join(sides)} calls "
                                f"paused for {interval:.1f} s")

    def _drop(self, client: Client) -> None:
        """Close `client`'s connections after a reply that was junk or out of step: such a
        connection must never be used again (its next reply may answer an older command).
        The next call connects afresh. A call of another thread still using `client` may
        fail on its closed connection (one more counted fault)."""
        with self._client_lock:
            if self._client is not client:  # another thread dropped it already
                return
            self._client = None
        _disconnect(client)

    def _connected(self) -> Client:
        with self._client_lock:
            if self._closed:
                raise StoreClosed
            if self._client is None:
                self._client = self._connect()
            return self._client

    def _connect(self) -> Client:
        socket_timeout, connect_timeout = self._timeouts
        options: dict[str, Any] = {"socket_timeout": socket_timeout,
                                   "socket_connect_timeout": connect_timeout,
                                   "protocol": RESP_PROTOCOL}
        password = os.environ.get(PASSWORD_ENV)
        if password:
            options["password"] = password  # a password in the URL takes precedence
        # One immediate retry on a connection error: a pooled connection that died with a
        # restarted server reconnects at once; a dead server is left to the back-off.
        retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
        if self.cluster:  # connects now, to learn the slot map (a fault when it is down)
            return asking(partial(RedisCluster, url=self._url, retry=retry,
                                   max_connections=POOL_CONNECTIONS, **options))
        pool = redis.BlockingConnectionPool.from_url(
            self._url, max_connections=POOL_CONNECTIONS, timeout=POOL_WAIT_S, retry=retry,
            **options)
        return redis.Redis(connection_pool=pool)


def _disconnect(client: Client) -> None:
    """Close every connection of `client`, in use or not."""
    if isinstance(client, RedisCluster):
        client.close()
    else:
        client.connection_pool.disconnect()


def _hint(err: BaseException) -> str:
    """What a fault's log line suggests to whoever runs the server."""
    if isinstance(err, _OUT_OF_STEP):
        return (" (not a Redis reply: is another service or a misconfigured proxy on that "
                "port? its connections are closed and opened afresh)")
    if "OOM" in str(err):
        return " (Redis is full: give it maxmemory-policy allkeys-lru)"
    return ""
