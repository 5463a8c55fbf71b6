"""What `HiCacheConnector` reads from vLLM (its `kv_connector_extra_config`, validated), the
namespace its page keys live in, and its scheduler's index of L2. Imports no vLLM: plain
values in, plain values out.

The extra config holds hicache's tier keys::

    host_size_gb      L2, host memory for vLLM's blocks (GB, 10^9 bytes; 0: no L2)
    storage_backend   "lmdb" (default) | "redis" | "lmdb+redis" | "none" (L2 only)
    lmdb              {"path", "max_size_gb", "prefault_gb", "sync"}  storage.lmdb
    redis             {"url", "cluster", "key_prefix", "ttl_seconds", ...}  storage.redis
    write_buffer_gb   host memory for pages waiting for the L3 writer (GB, made at start);
                      a block it has no room for waits in L2 and goes to it from there
    l3_step_load_mb   an L3 hit of up to this many MB loads within its step (that step's
                      forward waits for it); a larger one asynchronously, beside other
                      requests' steps; 0: every L3 hit asynchronously
    namespace         a salt: servers with different salts never share pages
    secret_file       the fleet secret's file (else HICACHE_STORAGE_SECRET): keyed page
                      keys and a MAC on every page (docs/architecture.md, "Stored page format")
    encrypt           true: pages AES-GCM encrypted (needs the fleet secret)

A page is one vLLM block of every layer, keyed by hicache's page hash (`PageHasher`: xxh3 over
the block's token ids, chained from the first block) from a root that names everything that
makes two servers' bytes for one prefix differ: the model, dtype, block size, the KV layout
(the per-layer block's shape, the attention backend), the platform (cpu / cuda), the tp rank
and size, and the salt, and with several KV cache groups the groups (`vllm_groups`: each
group's block is stored as a unit of its own). A CPU layout is never served to a GPU one.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
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
from hicache.integrations.vllm_groups import KVGroups
from hicache.storage.backends import create_backend
from hicache.storage.backends.base import ValueStore, check_section_keys
from hicache.storage.hashing import PageHasher
from hicache.storage.kinds import window_key
from hicache.storage.page_format import PageCodec, PageGeometry
from hicache.storage.page_seal import FleetKeys

CONFIG_KEY = "kv_connector_extra_config"
KEYS = ("host_size_gb", "storage_backend", "write_buffer_gb", "l3_step_load_mb", "namespace",
        *TIERED_PARTS, *SECRET_KEYS)
NO_STORAGE = "none"
BACKENDS = (*STORES, NO_STORAGE)
# Apart from a hicache server's own L3 (and SGLang's), so the two never share a clear. The
# worker prefaults 2 GB of the LMDB file's page cache as it registers vLLM's caches (a hicache
# server does not by default): on a VM that backs memory when first touched, the L3 writer's
# first 2 GB cost serving ~3 ms a page less (docs/integrations.md), for ~4 s more of vLLM's
# start-up there (~0.3 s where the tail is cached already or memory comes cheap).
DEFAULT_SECTIONS = {"lmdb": {"path": "~/.cache/hicache/vllm", "prefault_gb": 2.0},
                    "redis": {"key_prefix": "hicache-vllm:"}}
DEFAULT_HOST_GB = 1.0
# ~340 pages of SmolLM2-135M in float32 (1.47 MB each), ~240 of an 8B model's 16-token blocks
DEFAULT_WRITE_BUFFER_GB = 0.5
# the other requests' steps wait while a hit loads within its step: on 2 cores a 68 MB hit
# (SmolLM2-135M float32, 1,472 tokens) reads, checks and lands in ~25 ms, so 256 MB holds
# them ~0.1 s at most; a lone request waits a step less (docs/integrations.md)
DEFAULT_STEP_LOAD_MB = 256.0


@dataclass(frozen=True)
class ConnectorSettings:
    """hicache's part of vLLM's extra config, validated."""

    host_size_gb: float = DEFAULT_HOST_GB
    backend: str = "lmdb"
    sections: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    write_buffer_gb: float = DEFAULT_WRITE_BUFFER_GB
    namespace: str = ""
    fleet: FleetKeys | None = None  # the fleet secret's keys (secret_file, encrypt)
    l3_step_load_mb: float = DEFAULT_STEP_LOAD_MB

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """ValueError naming the key and what is allowed, for anything hicache cannot use."""
        extra = dict(extra or {})
        check_section_keys(CONFIG_KEY, extra, KEYS)
        host = extra.get("host_size_gb", DEFAULT_HOST_GB)
        if not _finite(host) or host < 0:
            raise ConfigError(f"{CONFIG_KEY} host_size_gb", f"must be a number >= 0, got {host!r}")
        backend = extra.get("storage_backend", cls.backend)
        if backend not in BACKENDS:
            raise ConfigError(f"{CONFIG_KEY} storage_backend",
                              f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
        ring = extra.get("write_buffer_gb", DEFAULT_WRITE_BUFFER_GB)
        if not _finite(ring) or ring <= 0:
            raise ConfigError(f"{CONFIG_KEY} write_buffer_gb",
                              f"must be a number > 0, got {ring!r}")
        step_mb = extra.get("l3_step_load_mb", DEFAULT_STEP_LOAD_MB)
        if not _finite(step_mb) or step_mb < 0:
            raise ConfigError(f"{CONFIG_KEY} l3_step_load_mb",
                              f"must be a number >= 0, got {step_mb!r}")
        namespace = extra.get("namespace", "")
        if not isinstance(namespace, str):
            raise ConfigError(f"{CONFIG_KEY} namespace", f"must be a string, got {namespace!r}")
        sections = store_sections(CONFIG_KEY, extra, backend, DEFAULT_SECTIONS)
        if host == 0 and backend == NO_STORAGE:
            raise ConfigError(f"{CONFIG_KEY}", "host_size_gb 0 and storage_backend none "
                              "leave hicache nothing to keep")
        return cls(float(host), backend, sections, float(ring), namespace,
                   fleet_keys(CONFIG_KEY, extra), float(step_mb))

    @property
    def has_storage(self) -> bool:
        return self.backend != NO_STORAGE

    def backend_config(self, prefault: bool = True) -> Mapping[str, Any]:
        """What `create_backend(self.backend, ...)` takes: the section, or both parts'.
        `prefault` False: without the LMDB section's `prefault_gb` (a side that only looks
        pages up, and the key of the one store a process opens)."""
        sections = self.sections
        if not prefault and "lmdb" in sections:
            sections = {**sections, "lmdb": {**sections["lmdb"], "prefault_gb": 0}}
        return backend_config(self.backend, sections)

    def host_slots(self, page_bytes: int) -> int:
        """How many pages of `page_bytes` L2 holds (the scheduler and the worker agree)."""
        return int(self.host_size_gb * 1e9) // page_bytes

    def step_load_pages(self, page_bytes: int) -> int:
        """The most L3 pages of `page_bytes` a hit may have and still load within its step."""
        return int(self.l3_step_load_mb * 1e6) // page_bytes

    def write_ring_pages(self, page_bytes: int) -> int:
        """How many pages of `page_bytes` the L3 writer's ring holds (one at least)."""
        return max(1, int(self.write_buffer_gb * 1e9) // page_bytes)


def _finite(value: Any) -> bool:
    """A finite int or float (not a bool, NaN or an infinity)."""
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value))


class BlockGeometry(NamedTuple):
    """One vLLM block of every layer: what a stored page holds."""

    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: str              # torch's name without "torch.", e.g. "float32"
    layer_block_bytes: int  # one layer's block (K and V), as vLLM lays it out

    @property
    def page_bytes(self) -> int:
        return self.num_layers * self.layer_block_bytes


def namespace_fingerprint(model: str, geometry: BlockGeometry, layout: Mapping[str, Any],
                          platform: str, tp: tuple[int, int], salt: str) -> str:
    """The canonical JSON that roots a server's page hashes (`PageHasher`'s fingerprint)."""
    return json.dumps({"engine": "vllm", "model": model, "geometry": geometry._asdict(),
                       "layout": dict(layout), "platform": platform, "tp": list(tp),
                       "salt": salt}, sort_keys=True, separators=(",", ":"))


def store_key(page_hash: bytes, tp_rank: int, group: int = 0) -> bytes:
    """The stored key of a page hash on tp rank `tp_rank` (each rank stores its shard), of
    KV cache group `group`'s unit (`vllm_groups`; group 0: the page's key, as without)."""
    key = xxhash.xxh3_128_digest(page_hash + tp_rank.to_bytes(4, "little"))
    return key if not group else window_key(key + group.to_bytes(4, "little"))


def unit_id(page_hash: bytes, group: int) -> bytes:
    """What L2's index knows group `group`'s unit of a page by."""
    return page_hash if not group else page_hash + group.to_bytes(4, "little")


class HostIndex:
    """The scheduler's map of L2: page hash -> slot, least recently used first. The worker's
    host pool holds what this says, because only this assigns slots."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._where: OrderedDict[bytes, int] = OrderedDict()
        self._free = list(range(slots - 1, -1, -1))

    def find(self, page_hash: bytes) -> int | None:
        slot = self._where.get(page_hash)
        if slot is not None:
            self._where.move_to_end(page_hash)
        return slot

    def assign(self, page_hash: bytes, keep: set[int]) -> int | None:
        """A slot for `page_hash` (evicting the least recently used page not in `keep`, the
        slots this step reads); None when every slot is kept."""
        if not self.slots:
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._where.items() if s not in keep), None)
            if victim is None:
                return None
            slot = self._where.pop(victim)
        self._where[page_hash] = slot
        return slot

    def __len__(self) -> int:
        return len(self._where)


class ConnectorSpace:
    """What the scheduler and worker sides share: the settings, one block's geometry, the
    page hasher (rooted at `fingerprint`), the page codec, L2's size, and the L3 store
    (opened on first use: the scheduler side's `batch_exists`, the worker side's reads and
    writes; each process opens its own)."""

    def __init__(self, settings: ConnectorSettings, geometry: BlockGeometry,
                 fingerprint: str, groups: KVGroups | None = None) -> None:
        self.settings = settings
        self.geometry = geometry  # hybrid: of one unit (a group's block)
        self.groups = groups if groups is not None and groups.hybrid else None
        self.block_size = geometry.block_size
        fleet = settings.fleet
        self.hasher = PageHasher(geometry.block_size, fingerprint, geometry.dtype,
                                 geometry.num_layers, geometry.kv_heads, geometry.head_dim,
                                 root_key=None if fleet is None else fleet.root_key)
        dtype = getattr(torch, geometry.dtype)
        self.codec = PageCodec(PageGeometry(geometry.num_layers, geometry.kv_heads,
                                            geometry.head_dim, geometry.block_size, dtype),
                               payload_bytes=geometry.page_bytes,
                               namespace=self.hasher.namespace, keys=fleet)
        self.codecs = [self.codec] if self.groups is None else self._group_codecs(fleet)
        self.codec = self.codecs[0]  # the store's own (each unit's is passed with it)
        self.slots = settings.host_slots(geometry.page_bytes)
        self.store: ValueStore | None = None

    def _group_codecs(self, fleet: FleetKeys | None) -> list[PageCodec]:
        """Per group, a codec of its layers alone (`PageCodec(layers=...)`)."""
        assert self.groups is not None
        g = self.geometry
        layers = 1 + max(max(x.layers) for x in self.groups.groups)
        whole = PageGeometry(layers, g.kv_heads, g.head_dim, g.block_size, getattr(torch, g.dtype))
        return [PageCodec(whole, len(x.layers) * g.layer_block_bytes, layers=x.layers,
                          namespace=self.hasher.namespace, keys=fleet)
                for x in self.groups.groups]

    def unit_layers(self, group: int) -> int:
        """Layers of group `group`'s unit (those of every layer without groups)."""
        return self.geometry.num_layers if self.groups is None else len(
            self.groups.groups[group].layers)

    def open_store(self, prefault: bool = True) -> ValueStore | None:
        """The L3 store; None without one. One per process for one store and geometry (an
        LMDB environment opens once per process; the scheduler and a worker may share one).
        `prefault` False (the scheduler side, which only looks pages up, and opens the store
        at its first request): the LMDB section's `prefault_gb` is not applied, so no start-up
        work lands on a request; where both sides share a process, the first to open wins
        (the worker, which registers vLLM's caches before the scheduler exists)."""
        if self.store is None and self.settings.has_storage:
            # and the root (of the namespace, the secret and the protection): a store seals
            # pages as its codec does
            self._store_key = json.dumps([self.settings.backend,
                                          self.settings.backend_config(prefault=False),
                                          self.geometry._asdict(), self.hasher.root().hex()],
                                         sort_keys=True, default=str)
            with _OPEN_LOCK:
                entry = _OPEN_STORES.get(self._store_key)
                if entry is None:
                    entry = _OPEN_STORES[self._store_key] = [create_backend(
                        self.settings.backend, self.settings.backend_config(prefault),
                        self.codec), 0]
                entry[1] += 1
            self.store = entry[0]
        return self.store

    def close_store(self) -> None:
        if self.store is None:
            return
        self.store = None
        with _OPEN_LOCK:
            entry = _OPEN_STORES[self._store_key]
            entry[1] -= 1
            if entry[1] == 0:
                del _OPEN_STORES[self._store_key]
                entry[0].close()


# The stores this process has open: canonical (backend, config, geometry) -> [store, users].
_OPEN_STORES: dict[str, list[Any]] = {}
_OPEN_LOCK = threading.Lock()
