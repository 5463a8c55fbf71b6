"""L3: the tree's side of it (`StorageTier`: page hashes on nodes, backups, prefetches), the
I/O threads (`StorageController`), page hashing and the stored page format; the backends
themselves (LMDB, Redis, LMDB in front of Redis) and their registry are in `backends/`."""

from hicache.storage.page_format import PageCodec, PageGeometry  # noqa: I001 - before backends
from hicache.storage.hashing import PageHasher
from hicache.storage.io import StorageController
from hicache.storage.tier import StorageTier

__all__ = ["PageCodec", "PageGeometry", "PageHasher", "StorageController", "StorageTier"]
