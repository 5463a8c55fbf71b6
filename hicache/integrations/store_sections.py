"""The store part of an engine's extra config, for every integration: which of hicache's L3
stores (`lmdb`, `redis`, `lmdb+redis`) and its sections, validated, with the integration's
own defaults (its own LMDB path and Redis key prefix, apart from a hicache server's L3).
Imports no engine."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hicache.config import ConfigError
from hicache.config_storage import TIERED_BACKEND, TIERED_PARTS, StorageConfig, storage_secret
from hicache.storage.backends import LMDB_KEYS
from hicache.storage.backends.base import check_section_keys
from hicache.storage.backends.redis_store import REDIS_KEYS
from hicache.storage.page_seal import FleetKeys

STORES = ("lmdb", "redis", TIERED_BACKEND)
# The fleet secret's keys in an engine's extra config (`storage.secret_file`, `storage.encrypt`
# of a hicache server): without `secret_file`, HICACHE_STORAGE_SECRET from the environment.
SECRET_KEYS = ("secret_file", "encrypt")
# What each store reads: its parts' sections (the tiered one reads both).
PARTS = {"lmdb": ("lmdb",), "redis": ("redis",), TIERED_BACKEND: TIERED_PARTS}
SECTION_KEYS = {"lmdb": LMDB_KEYS, "redis": REDIS_KEYS}

Sections = Mapping[str, Mapping[str, Any]]


def store_sections(where: str, extra: Mapping[str, Any], store: str,
                   defaults: Sections) -> dict[str, dict[str, Any]]:
    """The sections `store` reads from `extra` over `defaults`; ConfigError naming `where`
    and the key for a section that is not an object, an unknown key, or a section given
    that `store` does not read."""
    sections = {part: _section(where, extra, part, defaults) for part in PARTS.get(store, ())}
    unused = sorted(set(TIERED_PARTS) - set(sections) & set(extra))
    if unused:
        raise ConfigError(f"{where} {', '.join(unused)}",
                          f"given, but the store {store!r} reads only "
                          f"{', '.join(sections) or 'none'}")
    return sections


def fleet_keys(where: str, extra: Mapping[str, Any]) -> FleetKeys | None:
    """The fleet secret's keys from `extra`'s `secret_file` (else the environment), with its
    `encrypt`; None without a secret. ConfigError naming `where` and the key for a value of
    the wrong type, `encrypt` without a secret, or a secret that cannot be used."""
    try:
        storage = StorageConfig(secret_file=extra.get("secret_file"),
                                encrypt=extra.get("encrypt", False))
        secret = storage_secret(storage)
    except ConfigError as e:
        raise ConfigError(f"{where} {e.key.removeprefix('storage.')}", e.problem) from None
    return None if secret is None else FleetKeys(secret, storage.encrypt)


def backend_config(store: str, sections: Sections) -> Mapping[str, Any]:
    """What `create_backend(store, ...)` takes: its section, or both parts' (tiered)."""
    return dict(sections) if store == TIERED_BACKEND else sections[store]


def _section(where: str, extra: Mapping[str, Any], part: str,
             defaults: Sections) -> dict[str, Any]:
    given = extra.get(part, {})
    if not isinstance(given, Mapping):
        raise ConfigError(f"{where} {part}", f"must be an object of "
                          f"{', '.join(SECTION_KEYS[part])}, got {given!r}")
    check_section_keys(f"{where} {part}", given, SECTION_KEYS[part])
    return {**defaults.get(part, {}), **given}
