"""L3 shared by several servers: Redis (one server or a Redis Cluster), one key per KV page.

    key    key_prefix + page_hash.hex()       e.g. "hicache:" + 32 hex digits
    value  stored page (`page_format`: header, payload, tag), as LMDB stores it; its tag
           binds the page hash, so a value renamed or copied to another key is a miss

Every batch is one round trip per server (a Cluster pipeline groups commands by node):

    batch_exists  pipeline of EXISTS          consecutive hits from keys[0]
    get_values    pipeline of GET             checked, copied into the host pages (batch_get)
    put_values    pipeline of SET NX [EX ttl] first writer wins; present counts as stored

A batch whose values exceed `PIPELINE_MAX_BYTES` is split into rounds of that size, so
neither this process nor the server buffers gigabytes for one call.

Capacity is Redis' own: run it with `maxmemory` and `maxmemory-policy allkeys-lru` (or
`ttl_seconds`, measured from the first write); with `noeviction`, a full Redis refuses SETs
(OOM), and those backups are skipped and counted.

Faults and junk are the client's (`redis_client`, `RedisClient`: a part `RedisStore` holds): a
Redis that is down, slow or full, or a peer that is not Redis, is a miss or a skipped write,
counted in `errors`, logged at most once a minute per operation, and backed off. This
module's part: every reply is checked where it is consumed (`redis_replies`), and what
redis-py raises while parsing junk inside its calls counts the same (`asking`; this module's
own code is never wrapped, so its bugs still raise).

Threads: any mix of the `StorageBackend` callers. Each operation is a body that
`RedisClient.call` runs with the one client; the store's own state is its counters (one
lock) and settings fixed at construction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import redis
from redis.cluster import RedisCluster

from hicache.config_storage import RedisConfig
from hicache.storage.backends.base import (
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
    PayloadSource,
    ValueStore,
    ValueTaker,
    check_section_keys,
)
from hicache.storage.backends.redis_client import (
    BACKOFF_INITIAL_S,
    BACKOFF_MAX_S,
    CONNECT_TIMEOUT_S,
    PASSWORD_ENV,
    READ,
    SOCKET_TIMEOUT_S,
    STAT_BACKOFF,
    WRITE,
    Backoff,
    Client,
    RedisClient,
)
from hicache.storage.backends.redis_replies import asking, checked, checked_one
from hicache.storage.hashing import DIGEST_BYTES
from hicache.storage.page_format import PageCodec

__all__ = ["PASSWORD_ENV", "REDIS_KEYS", "Backoff", "RedisStore", "redis_factory"]

logger = logging.getLogger(__name__)

PIPELINE_MAX_BYTES = 64 * 2**20  # values per pipeline round (memory held on both sides)
SCAN_COUNT = 1000  # keys asked per SCAN step and deleted per pipeline in clear()
HASH_HEX_DIGITS = 2 * DIGEST_BYTES  # a page hash in hex
# The figures stats() takes from the server, summed over the primaries (0 while unknown).
_SERVER_STATS = (STAT_PAGES, STAT_BYTES, STAT_CAPACITY, STAT_EVICTED)


class RedisStore(ValueStore):
    """`ValueStore` over Redis or a Redis Cluster (see the module docstring).

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
        counts = Counters((STAT_HITS, STAT_MISSES, STAT_CORRUPT, STAT_ERRORS, STAT_WRITTEN,
                           STAT_SKIPPED, STAT_BACKOFF))
        self._counts, self._faults = counts, FaultLog(logger, counts)
        # The connection, its back-off and its fault accounting: a part of its own, which
        # adds its faults to this store's counters.
        self._redis = RedisClient(section.url, cluster=cluster,
                                  socket_timeout_s=socket_timeout_s,
                                  connect_timeout_s=connect_timeout_s,
                                  backoff_initial_s=backoff_initial_s,
                                  backoff_max_s=backoff_max_s, counts=counts,
                                  faults=self._faults)
        self.url, self.cluster = self._redis.url, cluster  # the url redacted
        self.codec = codec
        self.key_prefix, self.ttl_seconds = key_prefix, ttl_seconds
        self._round_pages = max(1, PIPELINE_MAX_BYTES // codec.value_bytes)
        logger.info("Redis L3 at %s (cluster=%s, key_prefix=%r, ttl_seconds=%s)", self.url,
                    cluster, key_prefix, ttl_seconds)

    # ------------------------------------------------------------------ ValueStore

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        def body(client: Client) -> int:
            found = self._pipeline(client, "EXISTS", lambda pipe: [pipe.exists(n) for n in
                                                                   self._names(keys)])
            return next((i for i, hit in enumerate(found) if not hit), len(keys))

        return self._redis.call("batch_exists", READ, 0, body) if keys else 0

    def batch_present(self, keys: Sequence[bytes]) -> list[bool]:
        def body(client: Client) -> list[bool]:
            return [bool(hit) for hit in self._pipeline(
                client, "EXISTS", lambda pipe: [pipe.exists(n) for n in self._names(keys)])]

        missing = [False] * len(keys)
        return self._redis.call("batch_exists", READ, missing, body) if keys else []

    def get_values(self, keys: Sequence[bytes], take: ValueTaker,
                   codec: PageCodec | None = None) -> list[bool]:
        served = [False] * len(keys)
        corrupt: list[str] = []

        def body(client: Client) -> None:
            for start, names in self._rounds(keys, codec):
                values = self._pipeline(client, "GET",
                                        lambda pipe, n=names: [pipe.get(k) for k in n])
                for i, (name, value) in enumerate(zip(names, values), start):
                    if value is None:
                        continue
                    if take(i, value):
                        served[i] = True
                    else:
                        corrupt.append(name)

        if keys:
            self._redis.call("batch_get", READ, None, body)
        hits = sum(served)
        self._counts.add(STAT_HITS, hits)
        self._counts.add(STAT_MISSES, len(keys) - hits)
        if corrupt:
            self._counts.add(STAT_CORRUPT, len(corrupt))
            self._redis.call("delete_corrupt", READ, 0,
                             lambda client: self._unlink(client, corrupt))
        return served

    def put_values(self, keys: Sequence[bytes], payload_of: PayloadSource,
                   codec: PageCodec | None = None) -> list[bool]:
        stored = [False] * len(keys)
        encoder = codec or self.codec

        def queue_sets(pipe: Any, start: int, names: list[str]) -> None:
            for i, name in enumerate(names, start):
                pipe.set(name, encoder.encode_into(keys[i], payload_of(i)), nx=True,
                         ex=self.ttl_seconds)

        def body(client: Client) -> None:
            for start, names in self._rounds(keys, encoder):
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
            self._redis.call("batch_set", WRITE, None, body)
        return stored

    def delete(self, keys: Sequence[bytes]) -> int:
        names = self._names(keys)
        return self._redis.call("delete", READ, 0, lambda client: self._unlink(client, names))

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

        return self._redis.call("clear", READ, 0, body)

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

        server = self._redis.call("stats", READ, dict.fromkeys(_SERVER_STATS, 0), body)
        out = self._counts.snapshot()
        out[STAT_ERRORS_BY_OP] = self._faults.by_op()
        out.update(server)
        out.update({"url": self.url, "cluster": self.cluster, "key_prefix": self.key_prefix,
                    "ttl_seconds": self.ttl_seconds})
        return out

    def sample_keys(self, count: int) -> list[bytes]:
        """The first keys of this store's form one SCAN step finds (on the first primary)."""
        pattern = _glob_escape(self.key_prefix) + "[0-9a-f]" * HASH_HEX_DIGITS

        def body(client: Client) -> list[bytes]:
            node = _primaries(client)[0]
            _, names = checked_one("SCAN", asking(partial(
                node.scan, 0, match=pattern, count=max(count, SCAN_COUNT))))
            prefix = len(self.key_prefix.encode())
            return [bytes.fromhex(bytes(n)[prefix:].decode()) for n in names[:count]]

        return self._redis.call("sample", READ, [], body)

    def sample_read(self, keys: Sequence[bytes]) -> int:
        names = self._names(keys)

        def body(client: Client) -> int:
            values = self._pipeline(client, "GET", lambda pipe: [pipe.get(n) for n in names])
            return sum(len(v) for v in values if v is not None)

        return self._redis.call("sample", READ, 0, body)

    def close(self) -> None:
        """`StorageBackend.close`: idempotent; later calls are quiet fallbacks."""
        self._redis.close()

    # ------------------------------------------------------------------ pipelines

    def _names(self, keys: Sequence[bytes]) -> list[str]:
        return [self.key_prefix + bytes(key).hex() for key in keys]

    def _rounds(self, keys: Sequence[bytes], codec: PageCodec | None = None
                ) -> Iterator[tuple[int, list[str]]]:
        """(index of the first key, names) per pipeline round of <= PIPELINE_MAX_BYTES of
        `codec`'s values (None: this store's)."""
        step = max(1, PIPELINE_MAX_BYTES // codec.value_bytes) if codec else self._round_pages
        for start in range(0, len(keys), step):
            yield start, self._names(keys[start:start + step])

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
    check_section_keys(RedisConfig.SECTION, config, REDIS_KEYS)
    defaults = RedisConfig()
    return RedisStore(
        config.get("url", defaults.url), codec,
        cluster=config.get("cluster", defaults.cluster),
        key_prefix=config.get("key_prefix", defaults.key_prefix),
        ttl_seconds=config.get("ttl_seconds", defaults.ttl_seconds),
        socket_timeout_s=config.get("socket_timeout_s", SOCKET_TIMEOUT_S),
        connect_timeout_s=config.get("connect_timeout_s", CONNECT_TIMEOUT_S))
