"""L3 in two parts: a local store in front of a shared one (`storage.backend: lmdb+redis`).

    batch_exists  local from keys[0]; the shared store for the rest, from the first local miss
    batch_get     local; the pages it missed (absent or corrupt) from the shared store in one
                  call (one pipeline for Redis); shared hits are written into the local store,
                  so the next read of them is local
    batch_set     local, then shared (SET NX for Redis); True per page either part holds
    get_values,   the same at the bytes level (`ValueStore`); a shared hit is promoted from
    put_values    the value it was read from (a copy: the taker may have been handed a view)
    delete        both parts: a deleted page must not come back through the shared store
    clear         the local part only: the shared store is every server's (docs/redis.md)

Each part keeps its own `StorageBackend` contract, which is what makes this one hold: a Redis
that is down, slow or full is a miss or a skipped write, counted in the Redis part's `errors`
(and backed off), so the store degrades to LMDB alone; a value failing its check in either
part is deleted and counted there, never served, and a page LMDB found corrupt is asked of
Redis like any other local miss. A page whose Redis write was skipped is not retried (the
local part holds it, so its backup succeeded); another server that needs it computes it.

`batch_exists` asks the shared store only from the first local miss: a page the local store
holds past a page that only the shared store lacks is not counted (both parts normally hold
every page, so this undercounts only after Redis evicted or lost pages).

Threads: as `StorageBackend`; both parts are safe for any mix of callers, and this class's
own state is its counters (one lock).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hicache.config_storage import TIERED_PARTS
from hicache.memory.host import HostKVPool
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
    PayloadSource,
    ValueStore,
    ValueTaker,
)
from hicache.storage.page_format import PageCodec

LOCAL, SHARED = TIERED_PARTS  # "lmdb", "redis": config sections, and keys in `stats()`
STAT_PROMOTED = "promoted_pages"  # pages served by the shared part and written locally
# Top-level `stats()` keys taken from the local part (the capacity this server bounds and
# what it wrote, promotions included), and those summed over both parts.
_LOCAL_STATS = (STAT_PAGES, STAT_BYTES, STAT_CAPACITY, STAT_EVICTED, STAT_WRITTEN, STAT_SKIPPED)
_SUMMED_STATS = (STAT_CORRUPT, STAT_ERRORS)


class TieredStore(ValueStore):
    """`ValueStore` over a local store (an `LmdbStore`) in front of a shared one (a
    `RedisStore`) of the same page geometry (see the module docstring). Owns both: `close`
    closes them."""

    def __init__(self, local: ValueStore, shared: ValueStore) -> None:
        self.local, self.shared = local, shared
        self.codec = local.codec
        self._counts = Counters((STAT_HITS, STAT_MISSES, STAT_PROMOTED))

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        found = self.local.batch_exists(keys)
        if found == len(keys):
            return found
        return found + self.shared.batch_exists(keys[found:])

    def batch_present(self, keys: Sequence[bytes]) -> list[bool]:
        local = self.local.batch_present(keys)
        missed = [i for i, ok in enumerate(local) if not ok]
        for i, ok in zip(missed, self.shared.batch_present([keys[i] for i in missed])):
            local[i] = ok
        return local

    def batch_get(self, keys: Sequence[bytes], host_pool: HostKVPool,
                  host_indices: torch.Tensor) -> list[bool]:
        served = self.local.batch_get(keys, host_pool, host_indices)  # checks the arguments
        missed = [i for i, ok in enumerate(served) if not ok]
        if missed:
            missed_keys, missed_slots = _pick(keys, host_indices, missed)
            fetched = self.shared.batch_get(missed_keys, host_pool, missed_slots)
            hits = [j for j, ok in enumerate(fetched) if ok]
            for j in hits:
                served[missed[j]] = True
            if hits:  # the pages are in host memory now: this copy costs no network
                hit_keys, hit_slots = _pick(missed_keys, missed_slots, hits)
                self._counts.add(STAT_PROMOTED, sum(self.local.batch_set(hit_keys, host_pool,
                                                                    hit_slots)))
        self._counts.add(STAT_HITS, sum(served))
        self._counts.add(STAT_MISSES, len(keys) - sum(served))
        return served

    def batch_set(self, keys: Sequence[bytes], host_pool: HostKVPool,
                  host_indices: torch.Tensor) -> list[bool]:
        local = self.local.batch_set(keys, host_pool, host_indices)
        shared = self.shared.batch_set(keys, host_pool, host_indices)
        return [a or b for a, b in zip(local, shared)]

    def get_values(self, keys: Sequence[bytes], take: ValueTaker,
                   codec: PageCodec | None = None) -> list[bool]:
        codec = codec or self.codec
        served = self.local.get_values(keys, take, codec)
        missed = [i for i, ok in enumerate(served) if not ok]
        if missed:
            # index in missed -> the payload of the shared value taken, decoded again (the
            # taker's copy is its own; an encrypted value's bytes are not the payload)
            promoted: dict[int, bytearray] = {}

            def take_shared(j: int, value: memoryview | bytes) -> bool:
                if not take(missed[j], value):
                    return False
                payload = codec.decode(keys[missed[j]], value)
                if payload is not None:
                    promoted[j] = payload
                return True

            self.shared.get_values([keys[i] for i in missed], take_shared, codec)
            for j in promoted:
                served[missed[j]] = True
            if promoted:
                order = sorted(promoted)
                stored = self.local.put_values(
                    [keys[missed[j]] for j in order],
                    lambda k: promoted[order[k]], codec)
                self._counts.add(STAT_PROMOTED, sum(stored))
        self._counts.add(STAT_HITS, sum(served))
        self._counts.add(STAT_MISSES, len(keys) - sum(served))
        return served

    def put_values(self, keys: Sequence[bytes], payload_of: PayloadSource,
                   codec: PageCodec | None = None) -> list[bool]:
        local = self.local.put_values(keys, payload_of, codec)
        shared = self.shared.put_values(keys, payload_of, codec)
        return [a or b for a, b in zip(local, shared)]

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove `keys` from both parts; the larger of the parts' counts."""
        return max(self.local.delete(keys), self.shared.delete(keys))

    def clear(self) -> int:
        """Remove every page of the local part (the number removed); the shared part keeps
        its pages, which other servers use (clear it with a `redis` backend, docs/redis.md)."""
        return self.local.clear()

    def stats(self) -> dict[str, Any]:
        """`STAT_KEYS` for the whole: `hits` / `misses` of this store, sizes, capacity,
        evictions and writes of the local part, `corrupt_pages` and `errors` of both (and
        `errors_by_op` with each part's operations as "lmdb.<op>" / "redis.<op>"); plus
        `promoted_pages` and each part's own stats under `"lmdb"` and `"redis"`."""
        local, shared = self.local.stats(), self.shared.stats()
        out = self._counts.snapshot()
        out.update({key: local[key] for key in _LOCAL_STATS})
        out.update({key: local[key] + shared[key] for key in _SUMMED_STATS})
        out[STAT_ERRORS_BY_OP] = {f"{name}.{op}": n for name, part in ((LOCAL, local),
                                  (SHARED, shared)) for op, n in part[STAT_ERRORS_BY_OP].items()}
        out.update({LOCAL: local, SHARED: shared})
        return out

    def sample_keys(self, count: int) -> list[bytes]:
        """The local part's (what a fetch reads first), else the shared part's."""
        return self.local.sample_keys(count) or self.shared.sample_keys(count)

    def sample_read(self, keys: Sequence[bytes]) -> int:
        return self.local.sample_read(keys) or self.shared.sample_read(keys)

    def close(self) -> None:
        self.local.close()
        self.shared.close()


def _pick(keys: Sequence[bytes], host_indices: torch.Tensor,
          picks: list[int]) -> tuple[list[bytes], torch.Tensor]:
    """Keys `picks` and the host slot indices of their pages (indices hold whole pages)."""
    per_page = host_indices.reshape(len(keys), -1)  # [pages, page_size]
    rows = torch.tensor(picks, device=host_indices.device)
    return [keys[i] for i in picks], per_page[rows].reshape(-1)
