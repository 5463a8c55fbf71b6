"""L3 shared by several servers: Redis (one server or a Redis Cluster), one key per KV page.

    key    key_prefix + page_hash.hex()       e.g. "hicache:" + 32 hex digits
    value  stored page (`page_format`: 48-byte header + payload), as LMDB stores it

Every batch is one round trip per server (a Cluster pipeline groups commands by node):

    batch_exists  pipeline of EXISTS          consecutive hits from keys[0]
    batch_get     pipeline of GET             checked, copied into the host pages
    batch_set     pipeline of SET NX [EX ttl] first writer wins; present counts as stored

A batch whose values exceed `PIPELINE_MAX_BYTES` is split into rounds of that size, so
neither this process nor the server buffers gigabytes for one call.

Capacity is Redis' own: run it with `maxmemory` and `maxmemory-policy allkeys-lru` (or
`ttl_seconds`, measured from the first write); with `noeviction`, a full Redis refuses SETs
(OOM), and those backups are skipped and counted.

Faults: a Redis that is down, slow (socket timeouts) or full is a miss or a skipped write,
counted in `errors` and logged at most once a minute per operation. After a fault the
operations it concerns are not sent at all for a back-off interval (0.5 s doubling to
30 s; `backoff_calls` counts the calls answered that way), so a dead server costs no
timeouts per request; the first call after the interval probes it, and a success resets
the interval: the store recovers by itself when Redis returns. A connection fault blocks
reads and writes; a refused write (OOM, READONLY) blocks only writes.

Junk: a reply of the wrong type (a misconfigured proxy or another service on the port,
answering `+OK` or `:1` to every command) is such a fault too, a `BadReply`, at start-up
and mid-run: every reply is checked where it is consumed (`redis_replies`), and what redis-py
raises while parsing junk inside its calls counts the same (`asking`; this module's own
code is never wrapped, so its bugs still raise). The client's connections are then closed
(one whose replies may be out of step with its commands must not be reused), so the first
call after the back-off connects afresh and finds a peer that behaves again. Junk that
reads as an answer cannot be told apart (EXISTS answered `:1`, SET NX answered `+OK`); the
RESP3 handshake (`RESP_PROTOCOL`: HELLO's reply must be a map) refuses most such peers at
connect, before any command is sent.

Threads: any mix of the `StorageBackend` callers. The connection pool holds
`POOL_CONNECTIONS` per server: the query, fetch and backup threads plus the scheduler's admin
calls each hold at most one connection per server at a time.

Secrets: the password comes from the URL or, when the URL has none, from the environment
variable `HICACHE_REDIS_PASSWORD`; only the redacted URL is ever logged or reported.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

import redis
import torch
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

from hicache.config import RedisConfig, _redact_url
from hicache.memory_pool_host import HostKVPool
from hicache.storage.base import (
    STAT_BYTES,
    STAT_CAPACITY,
    STAT_CORRUPT,
    STAT_ERRORS,
    STAT_ERRORS_BY_OP,
    STAT_EVICTED,
    STAT_HITS,
    STAT_MISSES,
    STAT_PAGES,
    STAT_SKIPPED,
    STAT_WRITTEN,
    Counters,
    FaultLog,
    StorageBackend,
    check_batch,
    check_section_keys,
)
from hicache.storage.page_format import PageCodec
from hicache.storage.redis_replies import BadReply, asking, checked, checked_one

logger = logging.getLogger(__name__)
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
PIPELINE_MAX_BYTES = 64 * 2**20  # values per pipeline round (memory held on both sides)
SCAN_COUNT = 1000  # keys asked per SCAN step and deleted per pipeline in clear()
HASH_HEX_DIGITS = 32  # a 16-byte page hash in hex
STAT_BACKOFF = "backoff_calls"  # calls answered (miss / skipped) without asking Redis
# RESP3, redis-py 8's default, pinned: a new connection's HELLO must be answered with a map
# holding the protocol, which a peer that is not Redis does not send (Redis >= 6 does).
RESP_PROTOCOL = 3
# The figures stats() takes from the server, summed over the primaries (0 while unknown).
_SERVER_STATS = (STAT_PAGES, STAT_BYTES, STAT_CAPACITY, STAT_EVICTED)


class _Closed(Exception):
    """The store was closed: calls are quiet misses, not errors."""


# Faults that say the server is unreachable or broken (block reads and writes), as opposed
# to a server that answered and refused one command (a `ResponseError`: blocks that side).
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, ClusterError, RedisClusterException,
                OSError)
_FAULTS = (RedisError, RedisClusterException, OSError)
# Faults after which a connection's replies may be out of step with its commands.
_OUT_OF_STEP = (BadReply, InvalidResponse)
_READ, _WRITE = "read", "write"


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


class RedisStore(StorageBackend):
    """`StorageBackend` over Redis or a Redis Cluster (see the module docstring).

    `url`: redis://[user:password@]host:port/db, rediss:// (TLS) or unix:///path (not for a
    cluster, whose db is always 0). The client connects lazily: a Redis that is down when
    the store is built is a miss until it comes up, not a start-up failure.
    """

    def __init__(self, url: str, codec: PageCodec, *, cluster: bool = False,
                 key_prefix: str = "hicache:", ttl_seconds: int | None = None,
                 socket_timeout_s: float = SOCKET_TIMEOUT_S,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 backoff_initial_s: float = BACKOFF_INITIAL_S,
                 backoff_max_s: float = BACKOFF_MAX_S) -> None:
        section = RedisConfig(url=url, cluster=cluster, key_prefix=key_prefix,
                              ttl_seconds=ttl_seconds)  # validates; ConfigError is a ValueError
        for name, value in (("socket_timeout_s", socket_timeout_s),
                            ("connect_timeout_s", connect_timeout_s)):
            if not value > 0:
                raise ValueError(f"storage.redis.{name} must be > 0 seconds, got {value!r}")
        self.url = _redact_url(section.url)  # shown in logs and stats: never the password
        try:
            options = parse_url(section.url)
        except ValueError as err:  # a bad port or db: refused now, not at the first call
            raise ValueError(f"storage.redis.url: {self.url!r} is not a Redis URL: {err}") \
                from None
        if cluster and ("path" in options or options.get("db", 0) != 0):
            raise ValueError(f"storage.redis.url: a cluster needs redis:// or rediss:// and "
                             f"db 0, got {self.url!r}")
        self.codec = codec
        self.cluster, self.key_prefix, self.ttl_seconds = cluster, key_prefix, ttl_seconds
        self._url = section.url
        self._timeouts = (socket_timeout_s, connect_timeout_s)
        self._round_pages = max(1, PIPELINE_MAX_BYTES // codec.value_bytes)
        self._gates = {_READ: Backoff(backoff_initial_s, backoff_max_s),
                       _WRITE: Backoff(backoff_initial_s, backoff_max_s)}
        self._counts = Counters((STAT_HITS, STAT_MISSES, STAT_CORRUPT, STAT_ERRORS,
                                 STAT_WRITTEN, STAT_SKIPPED, STAT_BACKOFF))
        self._faults = FaultLog(logger, self._counts)
        self._client_lock = threading.Lock()
        self._client: Client | None = None
        self._closed = False
        logger.info("Redis L3 at %s (cluster=%s, key_prefix=%r, ttl_seconds=%s)", self.url,
                    cluster, key_prefix, ttl_seconds)

    # ------------------------------------------------------------------ StorageBackend

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        def body(client: Client) -> int:
            found = self._pipeline(client, "EXISTS", lambda pipe: [pipe.exists(n) for n in
                                                                   self._names(keys)])
            return next((i for i, hit in enumerate(found) if not hit), len(keys))

        return self._call("batch_exists", _READ, 0, body) if keys else 0

    def batch_get(self, keys: Sequence[bytes], host_pool: HostKVPool,
                  host_indices: torch.Tensor) -> list[bool]:
        pages = check_batch(self.codec, keys, host_pool, host_indices)
        served = [False] * len(keys)
        corrupt: list[str] = []
        copy_in = self.codec.value_writer(host_pool)

        def body(client: Client) -> None:
            for start, names in self._rounds(keys):
                values = self._pipeline(client, "GET",
                                        lambda pipe, n=names: [pipe.get(k) for k in n])
                for i, (name, value) in enumerate(zip(names, values), start):
                    if value is None:
                        continue
                    if copy_in(value, pages[i]):
                        served[i] = True
                    else:
                        corrupt.append(name)

        if keys:
            self._call("batch_get", _READ, None, body)
        hits = sum(served)
        self._counts.add(STAT_HITS, hits)
        self._counts.add(STAT_MISSES, len(keys) - hits)
        if corrupt:
            self._counts.add(STAT_CORRUPT, len(corrupt))
            self._call("delete_corrupt", _READ, 0, lambda client: self._unlink(client, corrupt))
        return served

    def batch_set(self, keys: Sequence[bytes], host_pool: HostKVPool,
                  host_indices: torch.Tensor) -> list[bool]:
        pages = check_batch(self.codec, keys, host_pool, host_indices)
        read_page = self.codec.payload_reader(host_pool)
        stored = [False] * len(keys)

        def queue_sets(pipe: Any, start: int, names: list[str]) -> None:
            for i, name in enumerate(names, start):
                pipe.set(name, self.codec.encode_into(read_page(pages[i])), nx=True,
                         ex=self.ttl_seconds)

        def body(client: Client) -> None:
            for start, names in self._rounds(keys):
                # raise_on_error=False: a refused SET (OOM) comes back as its exception, so
                # the pages before it still count as stored.
                results = self._pipeline(client, "SET", lambda pipe, s=start, n=names:
                                         queue_sets(pipe, s, n), raise_on_error=False)
                refused = next((r for r in results if isinstance(r, Exception)), None)
                for i, result in enumerate(results, start):
                    stored[i] = not isinstance(result, Exception)
                self._counts.add(STAT_WRITTEN, sum(r is True for r in results))
                self._counts.add(STAT_SKIPPED, sum(r is None for r in results))
                if refused is not None:
                    raise refused

        if keys:
            self._call("batch_set", _WRITE, None, body)
        return stored

    def delete(self, keys: Sequence[bytes]) -> int:
        names = self._names(keys)
        return self._call("delete", _READ, 0, lambda client: self._unlink(client, names))

    def clear(self) -> int:
        """Remove every key of this store's form (`key_prefix` + 32 hex digits) on every
        primary, by SCAN (never KEYS, which blocks the server) + UNLINK in batches; keys of
        any other form survive, even with an empty prefix."""
        pattern = _glob_escape(self.key_prefix) + "[0-9a-f]" * HASH_HEX_DIGITS

        def body(client: Client) -> int:
            removed = 0
            for node in _primaries(client):
                batch: list[bytes] = []
                for name in _scan(node, pattern):
                    batch.append(name)
                    if len(batch) == SCAN_COUNT:
                        removed += self._unlink(node, batch)
                        batch = []
                removed += self._unlink(node, batch)
            return removed

        return self._call("clear", _READ, 0, body)

    def stats(self) -> dict[str, Any]:
        """Server figures, summed over the primaries: `pages` is DBSIZE, every key of the
        database, an upper bound that is exact when the database holds only this store's
        pages (counting the prefix's keys would need a SCAN of the whole keyspace); `bytes`
        is `used_memory`, `capacity_bytes` `maxmemory` (0: unbounded), `evicted_pages`
        `evicted_keys` (every key Redis evicted since it started). All are 0 while Redis is
        unreachable or answers junk; the counters are read after asking, so they include
        this call's own fault."""

        def body(client: Client) -> dict[str, int]:
            summed = dict.fromkeys(_SERVER_STATS, 0)
            for node in _primaries(client):
                # The default sections: memory and stats among them.
                info = checked_one("INFO", asking(node.info))
                summed[STAT_PAGES] += checked_one("DBSIZE", asking(node.dbsize))
                summed[STAT_BYTES] += info["used_memory"]
                summed[STAT_CAPACITY] += info.get("maxmemory", 0)
                summed[STAT_EVICTED] += info.get("evicted_keys", 0)
            return summed

        server = self._call("stats", _READ, dict.fromkeys(_SERVER_STATS, 0), body)
        out = self._counts.snapshot()
        out[STAT_ERRORS_BY_OP] = self._faults.by_op()
        out.update(server)
        out.update({"url": self.url, "cluster": self.cluster, "key_prefix": self.key_prefix,
                    "ttl_seconds": self.ttl_seconds})
        return out

    def close(self) -> None:
        with self._client_lock:
            client, self._client, self._closed = self._client, None, True
        if client is not None:
            _disconnect(client)

    # ------------------------------------------------------------------ calls

    def _names(self, keys: Sequence[bytes]) -> list[str]:
        return [self.key_prefix + bytes(key).hex() for key in keys]

    def _rounds(self, keys: Sequence[bytes]) -> Iterator[tuple[int, list[str]]]:
        """(index of the first key, names) per pipeline round of <= PIPELINE_MAX_BYTES."""
        for start in range(0, len(keys), self._round_pages):
            yield start, self._names(keys[start:start + self._round_pages])

    @staticmethod
    def _pipeline(client: Client, command: str, queue: Callable[[Any], object],
                  raise_on_error: bool = True) -> list[Any]:
        """Queue `command`s with `queue(pipe)`, send them in one round trip per server;
        their replies, one per command, each checked (`redis_replies.checked`)."""
        with client.pipeline(transaction=False) as pipe:
            queue(pipe)
            sent = len(pipe)
            replies = asking(partial(pipe.execute, raise_on_error=raise_on_error))
        return checked(command, replies, sent)

    def _unlink(self, client: Client, names: Sequence[str | bytes]) -> int:
        """UNLINK (a DEL that frees the value off the server's main thread) one key per
        command: a Cluster refuses multi-key commands across slots."""
        if not names:
            return 0
        return sum(self._pipeline(client, "UNLINK",
                                  lambda pipe: [pipe.unlink(n) for n in names]))

    def _call(self, op: str, side: str, fallback: T, body: Callable[[Client], T]) -> T:
        """`body(client)`, or `fallback` when closed, backing off, or Redis fails."""
        if not self._gates[side].ready():
            self._counts.add(STAT_BACKOFF, 1)
            return fallback
        client: Client | None = None
        try:
            client = self._connected()
            result = body(client)
        except _Closed:
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
        sides = (side,) if refused else (_READ, _WRITE)
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
                raise _Closed
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


def _scan(node: redis.Redis, pattern: str) -> Iterator[bytes]:
    """The names matching `pattern` on `node`, SCAN step by step, each step checked."""
    cursor = 0
    while True:
        cursor, names = checked_one("SCAN", asking(partial(
            node.scan, cursor, match=pattern, count=SCAN_COUNT)))
        yield from names
        if cursor == 0:
            return


def _primaries(client: Client) -> list[redis.Redis]:
    """A client per primary: the cluster's, or the one server's."""
    if isinstance(client, RedisCluster):
        return [client.get_redis_connection(node) for node in client.get_primaries()]
    return [client]


def _glob_escape(text: str) -> str:
    """`text` matched literally in a SCAN MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


# Keys of a `redis` section: `RedisConfig`'s, plus the socket timeouts for callers that
# build the section themselves (benchmarks, tests); the YAML schema has no timeout keys.
REDIS_KEYS = ("url", "cluster", "key_prefix", "ttl_seconds", "socket_timeout_s",
              "connect_timeout_s")


def redis_factory(config: Mapping[str, Any], codec: PageCodec) -> RedisStore:
    """`create_backend("redis", section, codec)`: the section's keys are `REDIS_KEYS`."""
    check_section_keys("storage.redis", config, REDIS_KEYS)
    defaults = RedisConfig()
    return RedisStore(
        config.get("url", defaults.url), codec,
        cluster=config.get("cluster", defaults.cluster),
        key_prefix=config.get("key_prefix", defaults.key_prefix),
        ttl_seconds=config.get("ttl_seconds", defaults.ttl_seconds),
        socket_timeout_s=config.get("socket_timeout_s", SOCKET_TIMEOUT_S),
        connect_timeout_s=config.get("connect_timeout_s", CONNECT_TIMEOUT_S))
