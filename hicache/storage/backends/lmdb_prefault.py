"""Prefault (`storage.lmdb.prefault_gb`; why and what it costs: docs/tiers.md): at open, an
LMDB store's data.mdb is extended past its last page and that tail read into the page cache,
so the first writes beside serving do not fault pages in one at a time.

The file is extended inside a write transaction (no writer of any process grows it
meanwhile) and never shrunk; the tail is capped by the map's bound, the disk's room and
`PREFAULT_FREE_SHARE` of the memory free.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

import lmdb

from hicache.storage.backends import lmdb_file
from hicache.storage.backends.base import StoreClosed
from hicache.storage.backends.lmdb_file import Replaced

logger = logging.getLogger("hicache.storage.backends.lmdb_store")  # the store's own logger
PREFAULT_FREE_SHARE = 0.5  # of the memory free at open, the most a prefault takes
T = TypeVar("T")


class Environment(Protocol):
    """What a prefault needs of `lmdb_env.LmdbEnvironment`."""

    path: Path
    max_size_bytes: int

    def used_bytes(self) -> int: ...

    def txn(self, write: bool, body: Callable[[lmdb.Transaction], T],
            make_room: bool = True, room_pages: int = 1) -> T: ...


def prefault(env: Environment, want_bytes: int) -> int:
    """Put the `want_bytes` of `env`'s data.mdb past its last page in the page cache; the
    bytes read, 0 when the file could not be extended (logged)."""
    def extend(txn: lmdb.Transaction) -> tuple[int, int]:
        head = env.used_bytes()
        size = os.fstat(fd).st_size
        end = min(head + want_bytes, env.max_size_bytes, size + lmdb_file.room_bytes(env.path))
        if end > size:
            os.ftruncate(fd, end)
        return head, end

    free = lmdb_file.free_memory_bytes()
    if free is not None:
        want_bytes = min(want_bytes, int(free * PREFAULT_FREE_SHARE))
    started = time.perf_counter()
    try:
        fd = os.open(env.path / lmdb_file.DATA_FILE, os.O_RDWR)
    except OSError as err:
        logger.warning("LMDB store %s: no prefault, data.mdb cannot be opened for "
                       "writing: %s", env.path, err)
        return 0
    try:
        head, end = env.txn(True, extend, make_room=False)
        done = lmdb_file.read_range(fd, head, end)
    except (OSError, lmdb.Error, Replaced, StoreClosed) as err:
        logger.warning("LMDB store %s: no prefault: %s", env.path, err)
        return 0
    finally:
        os.close(fd)
    logger.info("LMDB store %s: %.0f MB past its last page put in the page cache in "
                "%.2f s (prefault)", env.path, done / 1e6, time.perf_counter() - started)
    return done
