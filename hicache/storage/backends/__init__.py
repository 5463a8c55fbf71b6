"""L3 storage: the backend registry that turns `storage.backend` into a `StorageBackend`.

    create_backend("none", ...)                    -> None (storage disabled)
    create_backend("lmdb", cfg.storage.lmdb, codec) -> LmdbStore
    create_backend("redis", cfg.storage.redis, codec) -> RedisStore
    create_backend("lmdb+redis", {"lmdb": ..., "redis": ...}, codec) -> TieredStore
    register_backend(name, factory)                -> later backends plug in here

A factory takes the backend's own config section (a Mapping, or its dataclass) and the page
codec of this server's geometry, and returns a ready backend. The tiered backend reads two
sections, so its "section" is a mapping of them (`StorageConfig.backend_config`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from hicache.config_storage import TIERED_BACKEND, LmdbConfig
from hicache.storage.backends.base import StorageBackend, check_section_keys
from hicache.storage.backends.lmdb_store import LmdbStore
from hicache.storage.backends.redis_store import redis_factory
from hicache.storage.backends.tiered_store import LOCAL, SHARED, TieredStore
from hicache.storage.page_format import PageCodec, PageGeometry

__all__ = [
    "BackendFactory", "PageCodec", "PageGeometry", "StorageBackend", "create_backend",
    "register_backend", "registered_backends",
]

DISABLED = "none"
BackendFactory = Callable[[Mapping[str, Any], PageCodec], StorageBackend]
_FACTORIES: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make `create_backend(name, ...)` call `factory`; a name is registered once."""
    if name == DISABLED or name in _FACTORIES:
        raise ValueError(f"storage backend {name!r} is already registered")
    _FACTORIES[name] = factory


def registered_backends() -> tuple[str, ...]:
    """Every name `create_backend` accepts, `"none"` first."""
    return (DISABLED, *sorted(_FACTORIES))


def create_backend(name: str, config: Mapping[str, Any] | Any,
                   codec: PageCodec) -> StorageBackend | None:
    """The backend `name` built from its config section; None for `"none"`.

    Raises ValueError for an unregistered name (listing the registered ones) or a config
    key the backend does not take.
    """
    if name == DISABLED:
        return None
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown storage backend {name!r}; registered: "
                         f"{', '.join(registered_backends())}")
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    return factory(dict(config or {}), codec)


# Keys of an `lmdb` section: `LmdbConfig`'s, plus `sync` for callers that want no
# fdatasync per commit (benchmarks, throwaway caches).
LMDB_KEYS = ("path", "max_size_gb", "prefault_gb", "sync")


def _lmdb_factory(config: Mapping[str, Any], codec: PageCodec) -> StorageBackend:
    check_section_keys(LmdbConfig.SECTION, config, LMDB_KEYS)
    defaults = LmdbConfig()
    section = LmdbConfig(path=config.get("path", defaults.path),
                         max_size_gb=config.get("max_size_gb", defaults.max_size_gb),
                         prefault_gb=config.get("prefault_gb", defaults.prefault_gb))
    return LmdbStore(section.resolved_path, section.max_size_bytes, codec,
                     sync=bool(config.get("sync", True)), prefault_bytes=section.prefault_bytes)


def _tiered_factory(config: Mapping[str, Any], codec: PageCodec) -> StorageBackend:
    """`{"lmdb": section, "redis": section}` (each a Mapping or its dataclass; a missing one
    takes its defaults) -> TieredStore."""
    unknown = sorted(set(config) - {LOCAL, SHARED})
    if unknown:
        raise ValueError(f"storage.{TIERED_BACKEND}: unknown part(s) {', '.join(unknown)}; "
                         f"allowed: {LOCAL}, {SHARED}")
    local = create_backend(LOCAL, config.get(LOCAL) or {}, codec)
    try:
        shared = create_backend(SHARED, config.get(SHARED) or {}, codec)
    except ValueError:
        local.close()
        raise
    return TieredStore(local, shared)


register_backend("lmdb", _lmdb_factory)
register_backend("redis", redis_factory)
register_backend(TIERED_BACKEND, _tiered_factory)
