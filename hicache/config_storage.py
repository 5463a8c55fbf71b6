"""The storage (L3) sections of the configuration: `storage` and its backends' own
sections (`storage.lmdb`, `storage.redis`, `storage.throttle`), on `hicache.config`'s
shared validation; the redaction of passwords in a URL shown anywhere; and `TierSections`,
what the cache reads of a whole configuration."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol
from urllib.parse import parse_qsl, urlencode, urlsplit

from hicache.config import (
    BYTES_PER_GB,
    REDACTED,
    CacheConfig,
    ConfigError,
    EventsConfig,
    HostConfig,
    Section,
)
from hicache.policies import PREFETCH_POLICIES

logger = logging.getLogger(__name__)

TIERED_BACKEND = "lmdb+redis"  # a local LMDB in front of a shared Redis
TIERED_PARTS = ("lmdb", "redis")  # the sections it reads: the local part, the shared part
# L3 fetch workers by default: reads of a local store are bounded by the copy and the
# checksum (both release the GIL), reads of a remote one by round trips, which overlap.
DEFAULT_FETCH_WORKERS = 4
STORAGE_BACKENDS = ("none", "lmdb", "redis", TIERED_BACKEND)
REDIS_SCHEMES = ("redis", "rediss", "unix")  # what redis-py's from_url accepts

# A URL query parameter whose name holds one of these carries a secret (redact_url)
SECRET_PARAMETER_WORDS = ("password", "passwd", "secret", "token", "key")
TOKENS_PER_KI = 1024  # prefetch_timeout_per_ki_token is seconds per 1024 tokens
SECRET_ENV = "HICACHE_STORAGE_SECRET"  # the fleet secret, where storage.secret_file is unset
# The fleet secret's least length: 256 bits, the keys derived from it (AES-256); what
# `openssl rand -hex 32` prints is 64 bytes.
MIN_SECRET_BYTES = 32
# Permission bits that let others than the owner read a secret file (warned about, as ssh does)
OTHERS_CAN_READ = 0o077


@dataclass(frozen=True)
class LmdbConfig(Section):
    SECTION: ClassVar[str] = "storage.lmdb"
    path: str = "~/.cache/hicache/lmdb"
    max_size_gb: float = 32.0  # capacity bound; least recently used pages go first
    prefault_gb: float = 0.0  # page cache faulted in at open for the writes that grow it

    def _validate(self) -> None:
        self._non_empty("path")
        self._at_least("max_size_gb", 0, strict=True)
        self._at_least("prefault_gb", 0)

    @property
    def resolved_path(self) -> Path:
        """`~` and `$VARS` expanded; a relative path stays relative to the working directory."""
        return Path(os.path.expandvars(self.path)).expanduser()

    @property
    def max_size_bytes(self) -> int:
        return int(self.max_size_gb * BYTES_PER_GB)

    @property
    def prefault_bytes(self) -> int:
        return int(self.prefault_gb * BYTES_PER_GB)


@dataclass(frozen=True)
class RedisConfig(Section):
    SECTION: ClassVar[str] = "storage.redis"
    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False
    key_prefix: str = "hicache:"  # may be empty
    ttl_seconds: int | None = None  # None: pages never expire

    def _validate(self) -> None:
        self._non_empty("url")
        scheme = urlsplit(self.url).scheme
        if scheme not in REDIS_SCHEMES:
            allowed = ", ".join(f"{s}://" for s in REDIS_SCHEMES)
            self._fail("url", f"{redact_url(self.url)!r} must start with one of {allowed}")
        self._at_least("ttl_seconds", 1)


@dataclass(frozen=True)
class ThrottleConfig(Section):
    """A slower medium in front of the chosen backend (`ThrottledBackend`): for trying what
    L3 on a slow disk or network does, and for the benchmarks. Off by default."""

    SECTION: ClassVar[str] = "storage.throttle"
    bandwidth_mb_s: float | None = None  # MB/s (10^6 bytes) shared by reads and writes
    latency_ms: float = 0.0  # added to every backend call

    def _validate(self) -> None:
        self._at_least("bandwidth_mb_s", 0, strict=True)
        self._at_least("latency_ms", 0)

    @property
    def enabled(self) -> bool:
        return self.bandwidth_mb_s is not None or self.latency_ms > 0


@dataclass(frozen=True)
class StorageConfig(Section):
    SECTION: ClassVar[str] = "storage"
    backend: str = "none"
    prefetch_policy: str = "timeout"
    prefetch_threshold: int = 256  # tokens; shorter L3 hits are not worth a prefetch
    prefetch_timeout_base: float = 2.0  # seconds
    prefetch_timeout_per_ki_token: float = 0.1  # seconds per 1024 tokens
    prefetch_timeout_max: float = 30.0  # seconds
    fetch_workers: int = DEFAULT_FETCH_WORKERS  # threads reading L3 pages into L2
    cost_model: bool = True  # fetch, recompute or split a hit by measured costs
    overlap: bool = True  # compute a hit's head while its tail loads (needs cost_model)
    prefill_warmup_s: float = 1.0  # seconds of timed forwards at start (0: none)
    lmdb: LmdbConfig = field(default_factory=LmdbConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    throttle: ThrottleConfig = field(default_factory=ThrottleConfig)
    # The fleet secret's file (docs/security.md); the secret itself never sits in YAML, a
    # flag or a log. None: HICACHE_STORAGE_SECRET from the environment, if set.
    secret_file: str | None = None
    encrypt: bool = False  # AES-GCM on every stored payload (needs the fleet secret)
    # Folders under which PUT /hicache/storage-backend may open an LMDB; empty: attach refused
    # for LMDB paths (the start-up configuration is not limited by them).
    attach_roots: tuple[str, ...] = ()

    def _validate(self) -> None:
        self._choice("backend", STORAGE_BACKENDS)
        self._choice("prefetch_policy", PREFETCH_POLICIES)
        self._at_least("prefetch_threshold", 0)
        self._at_least("fetch_workers", 1)
        self._non_empty("secret_file")
        if self.encrypt and self.secret_file is None and not os.environ.get(SECRET_ENV):
            self._fail("encrypt", f"true needs the fleet secret: set storage.secret_file or "
                       f"{SECRET_ENV}")
        for root in self.attach_roots:
            if not os.path.isabs(os.path.expanduser(root)):
                self._fail("attach_roots", f"each root must be an absolute path, got {root!r}")
        self._at_least("prefill_warmup_s", 0)
        for name in ("prefetch_timeout_base", "prefetch_timeout_per_ki_token",
                     "prefetch_timeout_max"):
            self._at_least(name, 0)
        if self.prefetch_timeout_base > self.prefetch_timeout_max:
            self._fail("prefetch_timeout_base", f"must be <= prefetch_timeout_max "
                       f"({self.prefetch_timeout_max!r}), got {self.prefetch_timeout_base!r}")

    @property
    def enabled(self) -> bool:
        return self.backend != "none"

    @property
    def backend_config(self) -> LmdbConfig | RedisConfig | dict[str, Any] | None:
        """The chosen backend's own section, `{"lmdb": ..., "redis": ...}` for the tiered
        backend (it reads both); None when storage is disabled."""
        if self.backend == TIERED_BACKEND:
            return {part: getattr(self, part) for part in TIERED_PARTS}
        return {"lmdb": self.lmdb, "redis": self.redis}.get(self.backend)

    def prefetch_timeout(self, num_tokens: int) -> float:
        """Seconds the `timeout` policy waits for an L3 prefetch of `num_tokens` tokens."""
        per_token = self.prefetch_timeout_per_ki_token / TOKENS_PER_KI
        return min(self.prefetch_timeout_max, self.prefetch_timeout_base + per_token * num_tokens)


def storage_secret(storage: StorageConfig) -> bytes | None:
    """The fleet secret's bytes: `storage.secret_file`'s content (one trailing line end
    dropped, so `openssl rand -hex 32 > FILE` works, and a binary secret keeps its bytes),
    else HICACHE_STORAGE_SECRET; None when
    neither is set. ConfigError for a file that cannot be read or a secret shorter than
    MIN_SECRET_BYTES; no message, log line or repr ever holds the secret itself."""
    if storage.secret_file is None:
        value = os.environ.get(SECRET_ENV)
        if not value:
            return None
        return _long_enough(SECRET_ENV, "it", value.strip().encode())
    path = Path(storage.secret_file).expanduser()
    try:
        secret = _without_line_end(path.read_bytes())
        mode = path.stat().st_mode
    except OSError as e:
        raise ConfigError("storage.secret_file", f"cannot read {str(path)!r}: "
                          f"{e.strerror}") from None
    if mode & OTHERS_CAN_READ:
        logger.warning("storage.secret_file %s may be read by other users (mode %o); "
                       "chmod 600 it", path, mode & 0o777)
    return _long_enough("storage.secret_file", repr(str(path)), secret)


def _without_line_end(data: bytes) -> bytes:
    for end in (b"\r\n", b"\n"):
        if data.endswith(end):
            return data[:-len(end)]
    return data


def _long_enough(key: str, where: str, secret: bytes) -> bytes:
    """`secret`, or ConfigError naming `key` and `where` it came from (never the secret)."""
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(key, f"{where} holds {len(secret)} bytes; the fleet secret needs "
                          f"at least {MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)")
    return secret


class TierSections(Protocol):
    """What the cache reads of a configuration: its four cache-side sections (the server's
    whole-file `hicache_server.config.Config` is one)."""

    @property
    def cache(self) -> CacheConfig: ...

    @property
    def host(self) -> HostConfig: ...

    @property
    def storage(self) -> StorageConfig: ...

    @property
    def events(self) -> EventsConfig: ...


def redact_url(url: str) -> str:
    """`url` with every password hidden: `user:password@` and query parameters that carry one
    (redis-py's `?password=`, any `*password*`, `*secret*`, `*token*` or `*key*` parameter)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = netloc.replace(f":{parts.password}@", f":{REDACTED}@", 1)
    query = [(name, REDACTED if _secret_parameter(name) else value)
             for name, value in parse_qsl(parts.query, keep_blank_values=True)]
    if netloc == parts.netloc and query == parse_qsl(parts.query, keep_blank_values=True):
        return url
    # built by hand: urlunsplit drops the `//` of a URL with an empty host (unix:///path)
    shown = f"{parts.scheme}://{netloc}{parts.path}"
    shown += f"?{urlencode(query, safe='*/')}" if query else ""
    return shown + (f"#{parts.fragment}" if parts.fragment else "")


def _secret_parameter(name: str) -> bool:
    return any(word in name.lower() for word in SECRET_PARAMETER_WORDS)
