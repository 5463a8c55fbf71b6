"""The cache's configuration: one frozen dataclass per cache-side YAML section (cache, host,
storage (in `hicache.config_storage`), events), the validation every section shares, and the YAML reading and merging
the server's whole-file config (`hicache_server.config`, which adds model and server) builds on.

Precedence: built-in defaults (the dataclass defaults below, which docs/configuration.md lists)
< the YAML file < overrides (the CLI flags). Every section checks itself in `__post_init__`,
so building one by hand, loading YAML and `dataclasses.replace` all validate the same way.
Every error is a `ConfigError` whose message starts with the dotted key path, then says
what was wrong with the offending value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NoReturn, TypeVar

import yaml

from hicache.kernels.layouts import HOST_LAYOUTS as MEM_LAYOUTS
from hicache.policies import EVICTION_POLICIES, IO_BACKENDS, WRITE_POLICIES

# KV events (`hicache.events`): publishers by name (vLLM's --kv-events-config values), and
# the ZMQ transports an endpoint may use.
EVENT_PUBLISHERS = ("null", "zmq")
ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")

BYTES_PER_GB = 10**9  # decimal GB, as SGLang's --hicache-size
REDACTED = "***"
_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
               tuple: "a list of strings"}


class ConfigError(ValueError):
    """A configuration value that cannot be used; `key` is its dotted path (`cache.page_size`)."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        self.problem = problem
        self.message = f"{key}: {problem}"
        super().__init__(self.message)


def type_label(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _check_type(key: str, value: object, base: type, nullable: bool) -> None:
    """Strict: a bool is not an int, a str is not a number; an int is a float (PEP 484)."""
    if value is None:
        ok = nullable
    elif base is tuple:  # the only tuples in a config are of strings (lists in YAML)
        ok = isinstance(value, tuple) and all(isinstance(v, str) for v in value)
    elif base is float or base is int:
        ok = isinstance(value, (int, float) if base is float else int)
        ok = ok and not isinstance(value, bool)
    else:
        ok = isinstance(value, base)
    if not ok:
        expected = _TYPE_NAMES.get(base, f"a {base.__name__}") + (" or null" if nullable else "")
        got = "null" if value is None else f"{value!r} ({type_label(value)})"
        raise ConfigError(key, f"expected {expected}, got {got}")
    if base is float and value is not None and not math.isfinite(value):  # type: ignore[arg-type]
        raise ConfigError(key, f"must be a finite number, got {value!r}")


@functools.cache
def _field_types(cls: type) -> dict[str, tuple[type, bool]]:
    """Each field's base type and whether it may be None, read from its annotation."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        base = next(a for a in args if a is not type(None))
        out[f.name] = (typing.get_origin(base) or base, type(None) in args)
    return out


class Section:
    """Shared validation of every section: types from the annotations, then `_validate`."""

    SECTION: ClassVar[str] = ""  # dotted path of this section in the YAML

    def __post_init__(self) -> None:
        for name, (base, nullable) in _field_types(type(self)).items():
            _check_type(self._key(name), getattr(self, name), base, nullable)
        self._validate()

    def _validate(self) -> None:
        """Choice and range checks; types are already right when this runs."""

    def _key(self, name: str) -> str:
        return f"{self.SECTION}.{name}" if self.SECTION else name

    def _fail(self, name: str, problem: str) -> NoReturn:
        raise ConfigError(self._key(name), problem)

    def _choice(self, name: str, allowed: tuple[str, ...]) -> None:
        value = getattr(self, name)
        if value not in allowed:
            self._fail(name, f"{value!r} is not one of {', '.join(allowed)}")

    def _at_least(self, name: str, low: float, strict: bool = False, what: str = "") -> None:
        value = getattr(self, name)
        if value is not None and (value < low or (strict and value == low)):
            self._fail(name, f"must be {'>' if strict else '>='} {what or low}, got {value!r}")

    def _non_empty(self, name: str) -> None:
        value = getattr(self, name)
        if value is not None and not value.strip():
            self._fail(name, f"must be a non-empty string, got {value!r}")


@dataclass(frozen=True)
class CacheConfig(Section):
    SECTION: ClassVar[str] = "cache"
    enable_radix_cache: bool = True
    hierarchical: bool = False
    page_size: int = 16  # tokens per KV page
    max_total_tokens: int | None = None  # L1 capacity in tokens; None = sized from free memory
    # L1 capacity in bytes of KV (vLLM's --kv-cache-memory-bytes): as many pages as fit
    kv_cache_memory_bytes: int | None = None
    eviction_policy: str = "lru"
    # Nodes a live session's requests used are evicted after unowned ones (SGLang's
    # --enable-session-radix-cache); a session closes after this long without a request.
    session_retention: bool = False
    session_timeout_s: float = 600.0
    # Tokens POST /admin/pin may pin in all; None = a quarter of L2 (of L1 without L2)
    max_pinned_tokens: int | None = None

    def _validate(self) -> None:
        self._at_least("page_size", 1)
        self._at_least("max_total_tokens", self.page_size, what=f"page_size ({self.page_size})")
        self._at_least("kv_cache_memory_bytes", 1)
        if self.max_total_tokens is not None and self.kv_cache_memory_bytes is not None:
            self._fail("kv_cache_memory_bytes", "set either it or cache.max_total_tokens "
                       "(L1 in bytes or in tokens), not both")
        self._choice("eviction_policy", EVICTION_POLICIES)
        self._at_least("session_timeout_s", 0, strict=True)
        self._at_least("max_pinned_tokens", 0)


@dataclass(frozen=True)
class HostConfig(Section):
    SECTION: ClassVar[str] = "host"
    ratio: float = 2.0  # L2 tokens / L1 tokens; below 1, L2 reclaims copies of L1's nodes
    size_gb: float | None = None  # when set, overrides ratio
    write_policy: str = "write_through"
    io_backend: str = "kernel"
    mem_layout: str = "page_first"
    write_through_threshold: int = 2  # hits before write_through_selective copies a node

    def _validate(self) -> None:
        self._at_least("ratio", 0, strict=True)
        self._at_least("size_gb", 0, strict=True)
        self._choice("write_policy", WRITE_POLICIES)
        self._choice("io_backend", IO_BACKENDS)
        self._choice("mem_layout", MEM_LAYOUTS)
        self._at_least("write_through_threshold", 1)

    @property
    def size_bytes(self) -> int | None:
        return None if self.size_gb is None else int(self.size_gb * BYTES_PER_GB)


@dataclass(frozen=True)
class EventsConfig(Section):
    """KV cache events for cache-aware routers, vLLM's `--kv-events-config` keys. Off unless
    `publisher` is "zmq" (or `enable_kv_cache_events` is true with no publisher named)."""

    SECTION: ClassVar[str] = "events"
    publisher: str | None = None  # null | "null": off; "zmq": a ZMQ PUB socket
    enable_kv_cache_events: bool | None = None  # vLLM's switch; false turns a publisher off
    endpoint: str = "tcp://*:5557"  # PUB socket: a `*` host binds, another host connects
    replay_endpoint: str | None = None  # ROUTER socket answering replays (binds); None: none
    topic: str = ""  # first frame of every message (subscribers filter on it)
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark, in messages
    max_queue_size: int = 100_000  # batches waiting for the publisher thread

    def _validate(self) -> None:
        if self.publisher is not None:
            self._choice("publisher", EVENT_PUBLISHERS)
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(ZMQ_SCHEMES):
                self._fail(name, f"{value!r} must start with one of {', '.join(ZMQ_SCHEMES)}")
        self._at_least("buffer_steps", 0)
        self._at_least("hwm", 0)
        self._at_least("max_queue_size", 1)

    @property
    def enabled(self) -> bool:
        if self.enable_kv_cache_events is False or self.publisher == "null":
            return False
        return self.publisher == "zmq" or self.enable_kv_cache_events is True


_S = TypeVar("_S", bound=Section)


def build_section(cls: type[_S], data: object) -> _S:
    """Build one section from a mapping, rejecting unknown keys; ints become floats."""
    if not isinstance(data, Mapping):
        raise ConfigError(cls.SECTION or "config", f"expected a mapping, got {type_label(data)}")
    known = _field_types(cls)
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{cls.SECTION}.{name}" if cls.SECTION else str(name)
        if name not in known:
            close = difflib.get_close_matches(str(name), list(known), n=1)
            raise ConfigError(key, "unknown key" + (f"; did you mean {close[0]!r}?" if close else ""))
        base, _ = known[name]
        if issubclass(base, Section):
            value = build_section(base, value)
        elif base is float and type(value) is int:
            value = float(value)
        elif base is tuple and isinstance(value, list):
            value = tuple(value)
        kwargs[name] = value
    return cls(**kwargs)


def merge(low: Mapping[str, Any], high: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge: a mapping in `high` updates the one in `low` key by key."""
    out = dict(low)
    for key, value in high.items():
        below = out.get(key)
        both = isinstance(below, Mapping) and isinstance(value, Mapping)
        out[key] = merge(below, value) if both else value
    return out


def nest(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`{"cache.page_size": 32}` -> `{"cache": {"page_size": 32}}`, at every level."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        head, *rest = str(key).split(".")
        value = nest(value) if isinstance(value, Mapping) else value
        for part in reversed(rest):
            value = {part: value}
        out = merge(out, {head: value})
    return out


def read_yaml(path: Path) -> Mapping[str, Any]:
    """The file's top-level mapping; an empty file is an empty mapping."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or e
        raise ConfigError("config", f"cannot read {path}: {reason}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError("config", f"invalid YAML in {path}: "
                          f"{getattr(e, 'problem', None) or e}{where}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError("config", f"{path}: expected a mapping at the top level, "
                          f"got {type_label(data)}")
    return data
