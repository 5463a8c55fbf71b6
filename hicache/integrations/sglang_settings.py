"""What `HiCacheStore` reads from SGLang: its extra config (validated) and the namespace its
keys live in. Imports no SGLang: plain values in, plain values out.

SGLang's `--hicache-storage-backend-extra-config` JSON reaches the backend whole: SGLang's own
keys (`SGLANG_KEYS`: which class to load, `interface_v1`, ...) beside hicache's::

    backend     "lmdb" (default) | "redis" | "lmdb+redis"
    lmdb        {"path", "max_size_gb", "prefault_gb", "sync"}  storage.lmdb
    redis       {"url", "cluster", "key_prefix", "ttl_seconds", ...}  storage.redis
    namespace   a salt: servers with different salts never share pages
    secret_file the fleet secret's file (else HICACHE_STORAGE_SECRET): keyed roots, a MAC
    encrypt     true: pages AES-GCM encrypted (needs the fleet secret)

Keys: SGLang's page hash (a string that already chains the whole prefix) under a namespace
digest, `xxh3_128(root + hash)`, 16 bytes like hicache's own page keys, so every store works
unchanged; with the fleet secret the root is a keyed BLAKE2b, so no key can be computed
without it. The root covers all that makes two servers' bytes for one hash differ: the model
(SGLang's name, tagged with its pool's page format), the shard (tp rank and size, except for
MLA, whose KV every rank holds whole; pp, attention cp and dcp ranks), the host pool's class,
layout, dtype, page size and page bytes, and the salt. A page of another geometry is never
asked for, and if a colliding value were, its header would refuse it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from hicache.config import ConfigError
from hicache.config_storage import TIERED_PARTS
from hicache.integrations.store_sections import (
    SECRET_KEYS,
    STORES,
    backend_config,
    fleet_keys,
    store_sections,
)
from hicache.storage.backends.base import check_section_keys
from hicache.storage.hashing import DIGEST_BYTES
from hicache.storage.page_seal import FleetKeys

CONFIG_FLAG = "--hicache-storage-backend-extra-config"
# Keys SGLang itself reads from the extra config (its factory, its controller); they pass.
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size",
               "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
               "hicache_storage_pass_prefix_keys")
HICACHE_KEYS = ("backend", "namespace", *TIERED_PARTS, *SECRET_KEYS)
BACKENDS = STORES
# Defaults apart from a hicache server's own L3, so the two never share a capacity or a clear.
DEFAULT_SECTIONS = {"lmdb": {"path": "~/.cache/hicache/sglang"},
                    "redis": {"key_prefix": "hicache-sglang:"}}
NAMESPACE_SEED = b"hicache/sglang/v1"


@dataclass(frozen=True)
class StoreSettings:
    """hicache's part of the extra config, validated: which store, its sections, the salt."""

    backend: str = "lmdb"
    sections: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    namespace: str = ""
    interface_v1: bool = False
    fleet: FleetKeys | None = None  # the fleet secret's keys (secret_file, encrypt)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> StoreSettings:
        """ValueError naming the key and what is allowed, for anything hicache cannot use."""
        extra = dict(extra or {})
        check_section_keys(CONFIG_FLAG, extra, (*SGLANG_KEYS, *HICACHE_KEYS))
        backend = extra.get("backend", cls.backend)
        if backend not in BACKENDS:
            raise ValueError(f"{CONFIG_FLAG}: backend {backend!r} is not one of "
                             f"{', '.join(BACKENDS)}")
        namespace = extra.get("namespace", "")
        if not isinstance(namespace, str):
            raise ConfigError(f"{CONFIG_FLAG} namespace", f"must be a string, got {namespace!r}")
        sections = store_sections(CONFIG_FLAG, extra, backend, DEFAULT_SECTIONS)
        return cls(backend, sections, namespace, bool(extra.get("interface_v1", 0)),
                   fleet_keys(CONFIG_FLAG, extra))

    def backend_config(self) -> Mapping[str, Any]:
        """What `create_backend(self.backend, ...)` takes: the section, or both parts'."""
        return backend_config(self.backend, self.sections)


def page_namespace(storage_config: Any, pool_format: Mapping[str, Any],
                   salt: str) -> dict[str, Any]:
    """The namespace of one server's pages: its shard (from SGLang's HiCacheStorageConfig),
    its host pool's page format (`sglang_pages.pool_format`) and the salt."""
    c = storage_config
    return {
        "model": c.model_name or "",
        "mla": bool(c.is_mla_model),
        # MLA's KV is whole on every tp rank: one copy serves them all (and any tp size).
        "tp": None if c.is_mla_model else [c.tp_rank, c.tp_size],
        "pp": [c.pp_rank, c.pp_size],
        "attn_cp": [c.attn_cp_rank, c.attn_cp_size],
        "dcp": [getattr(c, "dcp_rank", 0), getattr(c, "dcp_size", 1)],
        "pool": dict(pool_format),
        "salt": salt,
    }


def namespace_bytes(namespace: Mapping[str, Any]) -> bytes:
    """The canonical JSON of a namespace (as hicache's page hash): what a page's seal binds."""
    return json.dumps(namespace, sort_keys=True, separators=(",", ":")).encode()


def namespace_root(namespace: Mapping[str, Any], fleet: FleetKeys | None = None) -> bytes:
    """The 16-byte root of a namespace's keys: keyed by the fleet secret where there is one."""
    data = NAMESPACE_SEED + namespace_bytes(namespace)
    if fleet is None:
        return xxhash.xxh3_128_digest(data)
    return hashlib.blake2b(data, key=fleet.root_key, digest_size=DIGEST_BYTES).digest()


def store_key(root: bytes, page_hash: str) -> bytes:
    """The stored key of SGLang's page hash `page_hash` under `root`."""
    return xxhash.xxh3_128_digest(root + page_hash.encode())
