"""L3 through the tree: backup after write-through, prefetch policies, restart, faults, races."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch
from test_hiradix_cache import LAYERS, assert_device_holds, forward, make_pools

from hicache.cache_controller import HiCacheController
from hicache.hashing import PageHasher
from hicache.hiradix_cache import HiRadixCache
from hicache.storage.base import StorageBackend
from hicache.storage.lmdb_store import LmdbStore
from hicache.storage.page_format import PageCodec, PageGeometry
from hicache.storage_controller import StorageController
from hicache.transfer import CpuTransferEngine

PS = 4
HASHER = PageHasher(PS, "test-model", "float32", LAYERS, 2, 4)
CODEC = PageCodec(PageGeometry(LAYERS, 2, 4, PS, torch.float32))


def lmdb(path: Path) -> LmdbStore:
    return LmdbStore(path, 64 << 20, CODEC, sync=False)


def make(backend: StorageBackend, policy: str = "wait_complete", threshold: int = 8,
         dev_pages: int = 32, host_pages: int = 64, **kw):
    dev, host = make_pools(dev_pages, host_pages, PS)
    tree = HiRadixCache(HiCacheController(dev, host, CpuTransferEngine(dev, host)), PS,
                        load_back_threshold=1)
    tree.enable_storage(StorageController(backend, host), HASHER, prefetch_policy=policy,
                        prefetch_threshold=threshold, **kw)
    return tree, dev


def compute(tree: HiRadixCache, dev, seq: list[int]) -> None:
    """What the scheduler does for a finished request: write KV, insert, acks, backups."""
    slots = dev.alloc(len(seq))
    forward(dev, seq, slots)
    dev.free(slots[:tree.insert(seq, slots)])
    settle(tree)


def settle(tree: HiRadixCache) -> None:
    tree.writing_check(wait=True)
    tree.storage.io.wait_backups()
    tree.storage.check()


def flush_l1_l2(tree: HiRadixCache) -> None:
    tree.evict(10**6)
    tree.evict_host(10**6)
    assert tree.total_size() == 0 and tree.host_sizes()["total"] == 0


def fetch(tree: HiRadixCache, req: str, seq: list[int], timeout: float = 10.0,
          extra_key: str | None = None) -> int:
    m = tree.match_prefix(seq, extra_key)
    hit = m.device_indices.numel() + m.host_hit_length
    if not tree.storage.prefetch(req, m.last_host_node, seq[hit:], extra_key):
        return 0
    deadline = time.monotonic() + timeout
    while not tree.storage.ready(req):
        assert time.monotonic() < deadline, "prefetch never became ready"
        tree.storage.check()
        time.sleep(0.001)
    return tree.storage.terminate(req)


def load_and_check(tree: HiRadixCache, dev, seq: list[int]) -> None:
    m = tree.match_prefix(seq)
    assert m.device_indices.numel() == 0 and m.host_hit_length == len(seq)
    lb = tree.init_load_back(m.last_host_node)
    handle = tree.controller.start_loading()
    for layer in range(LAYERS):
        handle.wait_layer(layer)
    assert_device_holds(dev, seq, lb.device_indices)
    tree.loading_check(wait=True)


def seq_of(seed: int, n: int = 32) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_pages_come_back_from_l3_after_l1_and_l2_are_flushed(tmp_path) -> None:
    tree, dev = make(lmdb(tmp_path / "db"))
    seq = seq_of(1)
    compute(tree, dev, seq)
    assert tree.storage.counters["backed_up_tokens"] == 32
    flush_l1_l2(tree)
    assert fetch(tree, "r1", seq) == 32
    tree.check_integrity()
    load_and_check(tree, dev, seq)
    tree.check_integrity()
    tree.storage.close()


def test_a_restarted_process_finds_the_pages(tmp_path) -> None:
    seq = seq_of(2, 48)
    tree, dev = make(lmdb(tmp_path / "db"))
    compute(tree, dev, seq)
    tree.storage.close()  # "shutdown"
    tree2, dev2 = make(lmdb(tmp_path / "db"))  # new pools, empty tree: a new process
    assert fetch(tree2, "r", seq) == 48
    load_and_check(tree2, dev2, seq)
    tree2.storage.close()


def test_prefetch_extends_an_l2_hit_and_skips_short_tails(tmp_path) -> None:
    tree, dev = make(lmdb(tmp_path / "db"), threshold=8)
    seq = seq_of(3, 40)
    compute(tree, dev, seq)
    flush_l1_l2(tree)
    compute(tree, dev, seq[:16])  # L1 holds the first 16 tokens again
    m = tree.match_prefix(seq)
    assert m.device_indices.numel() == 16
    assert fetch(tree, "r", seq) == 24
    m = tree.match_prefix(seq)
    assert m.device_indices.numel() == 16 and m.host_hit_length == 24
    assert not tree.storage.prefetch("r2", m.last_host_node, seq[40:] + [1, 2, 3, 4])
    tree.check_integrity()
    tree.storage.close()


def test_namespaces_never_share_pages(tmp_path) -> None:
    tree, dev = make(lmdb(tmp_path / "db"))
    seq = seq_of(4)
    slots = dev.alloc(32)
    forward(dev, seq, slots)
    tree.insert(seq, slots, extra_key="tenant-a")
    settle(tree)
    flush_l1_l2(tree)
    assert fetch(tree, "none", seq) == 0
    assert fetch(tree, "b", seq, extra_key="tenant-b") == 0
    assert fetch(tree, "a", seq, extra_key="tenant-a") == 32
    assert tree.match_prefix(seq, "tenant-a").host_hit_length == 32
    assert tree.match_prefix(seq).host_hit_length == 0
    tree.check_integrity()
    tree.storage.close()


class Flaky(StorageBackend):
    """Raises on every call, or sleeps, to inject faults."""

    def __init__(self, inner: StorageBackend, mode: str) -> None:
        self.inner, self.mode = inner, mode

    def _maybe(self):
        if self.mode == "raise":
            raise OSError("disk on fire")
        if self.mode == "slow":
            time.sleep(0.3)

    def batch_exists(self, keys):
        self._maybe()
        return self.inner.batch_exists(keys)

    def batch_get(self, keys, host_pool, host_indices):
        self._maybe()
        return self.inner.batch_get(keys, host_pool, host_indices)

    def batch_set(self, keys, host_pool, host_indices):
        self._maybe()
        return self.inner.batch_set(keys, host_pool, host_indices)

    def delete(self, keys):
        return self.inner.delete(keys)

    def clear(self):
        return self.inner.clear()

    def stats(self):
        return self.inner.stats()

    def close(self):
        self.inner.close()


def test_a_backend_that_raises_is_a_miss_and_a_skipped_backup(tmp_path) -> None:
    tree, dev = make(Flaky(lmdb(tmp_path / "db"), "raise"))
    seq = seq_of(5)
    compute(tree, dev, seq)
    assert tree.storage.counters["backup_failures"] == 1
    assert tree.storage.io.errors["set"] == 1
    flush_l1_l2(tree)
    assert fetch(tree, "r", seq) == 0
    assert tree.storage.io.errors["exists"] >= 1
    tree.check_integrity()
    tree.storage.close()


def test_timeout_policy_gives_up_on_a_slow_backend(tmp_path) -> None:
    inner = lmdb(tmp_path / "db")
    tree, dev = make(inner, policy="timeout", timeout_base=0.05, timeout_per_ki_token=0.0,
                     timeout_max=0.05)
    seq = seq_of(6)
    compute(tree, dev, seq)
    flush_l1_l2(tree)
    tree.storage.io.backend = Flaky(inner, "slow")
    m = tree.match_prefix(seq)
    assert tree.storage.prefetch("r", m.last_host_node, seq)
    t0 = time.monotonic()
    while not tree.storage.ready("r"):
        tree.storage.check()
        time.sleep(0.005)
    assert time.monotonic() - t0 < 0.3  # gave up before the backend answered
    assert tree.storage.terminate("r") == 0
    tree.storage.wait_idle()  # the cancelled op's pages are freed once the thread lets go
    tree.check_integrity()
    assert tree.controller.host_pool.available_size() == tree.controller.host_pool.total_size()
    tree.storage.close()


def test_best_effort_admits_at_once(tmp_path) -> None:
    tree, dev = make(lmdb(tmp_path / "db"), policy="best_effort")
    seq = seq_of(7)
    compute(tree, dev, seq)
    flush_l1_l2(tree)
    m = tree.match_prefix(seq)
    assert tree.storage.prefetch("r", m.last_host_node, seq)
    assert tree.storage.ready("r")
    inserted = tree.storage.terminate("r")
    assert inserted % PS == 0 and 0 <= inserted <= 32
    assert tree.match_prefix(seq).host_hit_length == inserted
    tree.storage.wait_idle()
    tree.check_integrity()
    tree.storage.close()


def test_clear_empties_l3(tmp_path) -> None:
    tree, dev = make(lmdb(tmp_path / "db"))
    seq = seq_of(8)
    compute(tree, dev, seq)
    assert tree.storage.clear() == 8
    flush_l1_l2(tree)
    assert fetch(tree, "r", seq) == 0
    tree.storage.close()


def test_prefetch_and_backup_racing_the_scheduler_keep_the_tree_intact(tmp_path) -> None:
    rng = random.Random(0)
    tree, dev = make(lmdb(tmp_path / "db"), policy="best_effort", threshold=4,
                     dev_pages=24, host_pages=40)
    seqs = [seq_of(100 + i, rng.choice([8, 16, 24, 32])) for i in range(12)]
    for step in range(300):
        seq = rng.choice(seqs)
        op = rng.random()
        if op < 0.35:
            if dev.available_size() < len(seq):
                tree.evict(len(seq))
            if dev.available_size() >= len(seq):
                slots = dev.alloc(len(seq))
                forward(dev, seq, slots)
                dev.free(slots[:tree.insert(seq, slots)])
        elif op < 0.6:
            m = tree.match_prefix(seq)
            hit = m.device_indices.numel() + m.host_hit_length
            tree.storage.prefetch(f"r{step}", m.last_host_node, seq[hit:])
        elif op < 0.75 and tree.storage.ops:
            tree.storage.terminate(rng.choice(sorted(tree.storage.ops)))
        elif op < 0.85:
            tree.evict(rng.randint(1, 40))
        else:
            tree.evict_host(rng.randint(1, 40))
        tree.writing_check()
        tree.loading_check()
        tree.storage.check()
        tree.check_integrity()
    tree.storage.wait_idle()
    tree.check_integrity()
    assert tree.storage.counters["backed_up_tokens"] > 0
    tree.storage.close()
    tree.controller.close()


@pytest.mark.parametrize("policy", ["bogus"])
def test_bad_policy_is_refused(tmp_path, policy) -> None:
    with pytest.raises(ValueError, match="best_effort, wait_complete, timeout"):
        make(lmdb(tmp_path / "db"), policy=policy)


def test_a_node_split_while_its_write_runs_is_backed_up_whole(tmp_path) -> None:
    from test_hiradix_cache import DeferredEngine

    dev, host = make_pools(32, 64, PS)
    engine = DeferredEngine(dev, host)
    tree = HiRadixCache(HiCacheController(dev, host, engine), PS, load_back_threshold=1)
    tree.enable_storage(StorageController(lmdb(tmp_path / "db"), host), HASHER,
                        prefetch_policy="wait_complete", prefetch_threshold=8)
    seq = seq_of(9)
    slots = dev.alloc(32)
    forward(dev, seq, slots)
    tree.insert(seq, slots)          # one node, its D->H copy pending
    tree.match_prefix(seq[:28])      # splits it at 28 tokens while the copy runs
    engine.complete(10)
    settle(tree)
    assert tree.storage.counters["backed_up_tokens"] == 32  # both halves, no hole
    flush_l1_l2(tree)
    assert fetch(tree, "r", seq) == 32
    tree.storage.close()


class GatedGets(Flaky):
    """`batch_get` blocks until `release` is set; queries answer at once."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner, "none")
        self.release = threading.Event()
        self.getting = threading.Event()

    def batch_get(self, keys, host_pool, host_indices):
        self.getting.set()
        assert self.release.wait(30), "test never released the fetch"
        return self.inner.batch_get(keys, host_pool, host_indices)


def test_a_miss_is_admitted_at_once_while_another_fetch_is_in_flight(tmp_path) -> None:
    """Queries do not queue behind fetches: with a slow fetch running, a request whose
    prefix storage lacks is ready as soon as its query answers (`settle`, then `check`)."""
    gated = GatedGets(lmdb(tmp_path / "db"))
    tree, dev = make(gated)
    stored, unknown = seq_of(8), seq_of(9)
    compute(tree, dev, stored)
    flush_l1_l2(tree)
    m = tree.match_prefix(stored)
    assert tree.storage.prefetch("slow", m.last_host_node, stored)
    tree.storage.settle(10.0)
    tree.storage.check()  # query answered: the fetch starts and blocks in batch_get
    assert gated.getting.wait(10)
    m = tree.match_prefix(unknown)
    assert tree.storage.prefetch("miss", m.last_host_node, unknown)
    tree.storage.settle(10.0)  # returns when the query answers, not when the fetch ends
    tree.storage.check()
    assert tree.storage.ready("miss") and not tree.storage.ready("slow")
    assert tree.storage.terminate("miss") == 0
    gated.release.set()
    while not tree.storage.ready("slow"):
        tree.storage.check()
        time.sleep(0.001)
    assert tree.storage.terminate("slow") == len(stored)
    tree.storage.wait_idle()
    tree.check_integrity()
    tree.storage.close()


def restart_waiting(tree: HiRadixCache, keys: dict[str, list[int]]) -> None:
    """What the scheduler does with `take_restarts`: match again, prefetch the rest."""
    for rid in tree.storage.take_restarts():
        resume = tree.storage.restart(rid)
        m = tree.match_prefix(keys[rid])
        hit = m.device_indices.numel() + m.host_hit_length
        tree.storage.prefetch(rid, m.last_host_node, keys[rid][hit:], resume=resume)


def two_in_l3_sharing_24(tmp_path, seed: int):
    """(tree, dev, a, b): 32-token sequences with 24 tokens in common, only in L3, and a
    prefetch started for each ("a" first), as two requests arriving together."""
    tree, dev = make(lmdb(tmp_path / "db"))
    a = seq_of(seed)
    b = a[:24] + seq_of(seed + 1, 8)
    for seq in (a, b):
        compute(tree, dev, seq)
    flush_l1_l2(tree)
    for rid, seq in (("a", a), ("b", b)):
        assert tree.storage.prefetch(rid, tree.match_prefix(seq).last_host_node, seq)
    return tree, dev, a, b


def test_prefetches_of_a_shared_prefix_fetch_it_once(tmp_path) -> None:
    """Two requests arriving together, 24 tokens in common: the second waits for the first's
    fetch, is matched again once those pages are in the tree, and fetches only its tail."""
    tree, dev, a, b = two_in_l3_sharing_24(tmp_path, 10)
    keys = {"a": a, "b": b}
    tree.storage.settle(10.0)
    tree.storage.check()
    assert tree.storage.ops["b"].blocked_by == "a"
    assert tree.storage.ops["b"].host_indices is None  # holds no L2 while it waits
    while not tree.storage.ready("a"):
        tree.storage.check()
        time.sleep(0.001)
    assert not tree.storage.ready("b")  # wait_complete: still waiting for its turn
    assert tree.storage.terminate("a") == 32
    restart_waiting(tree, keys)
    assert tree.storage.counters["prefetch_restarts"] == 1
    assert tree.match_prefix(b).host_hit_length == 24  # a's pages, matched again
    while not tree.storage.ready("b"):
        tree.storage.check()
        time.sleep(0.001)
    assert tree.storage.terminate("b") == 8
    assert tree.storage.counters["prefetched_tokens"] == 40  # not 32 + 32
    load_and_check(tree, dev, a)
    m = tree.match_prefix(b)  # the shared 24 tokens are on the device now, b's tail in L2
    assert (m.device_indices.numel(), m.host_hit_length) == (24, 8)
    lb = tree.init_load_back(m.last_host_node)
    handle = tree.controller.start_loading()
    for layer in range(LAYERS):
        handle.wait_layer(layer)
    assert_device_holds(dev, b, torch.cat([m.device_indices, lb.device_indices]))
    tree.loading_check(wait=True)
    tree.storage.wait_idle()
    tree.check_integrity()
    tree.storage.close()


def test_a_prefix_that_reached_the_tree_meanwhile_is_matched_again(tmp_path) -> None:
    """The first request's pages were inserted between the second's arrival and its query
    answer: the second is matched again instead of fetching them a second time."""
    tree, dev = make(lmdb(tmp_path / "db"))
    a = seq_of(12)
    compute(tree, dev, a)
    flush_l1_l2(tree)
    anchor = tree.match_prefix(a).last_host_node
    assert tree.storage.prefetch("a", anchor, a)
    assert tree.storage.prefetch("b", anchor, a)
    while not tree.storage.ops["a"].queried.is_set():
        time.sleep(0.001)
    tree.storage._start_fetch(tree.storage.ops["a"])
    tree.storage._querying.remove(tree.storage.ops["a"])
    while not tree.storage.ready("a"):
        time.sleep(0.001)
    assert tree.storage.terminate("a") == 32  # in the tree before b's query is looked at
    tree.storage.settle(10.0)
    tree.storage.check()
    assert tree.storage.take_restarts() == ["b"]
    assert tree.storage.restart("b") is not None
    assert tree.match_prefix(a).host_hit_length == 32  # nothing left to fetch
    assert tree.storage.counters["prefetched_tokens"] == 32
    load_and_check(tree, dev, a)
    tree.storage.wait_idle()
    tree.check_integrity()
    tree.storage.close()


def test_a_prefetch_stops_waiting_for_one_whose_request_cannot_be_admitted(tmp_path) -> None:
    """The first request fetched the shared pages but is not admitted (no L1 room): one
    step later the second stops waiting for it and fetches the pages itself."""
    tree, *_ = two_in_l3_sharing_24(tmp_path, 13)
    tree.storage.settle(10.0)
    tree.storage.check()
    assert tree.storage.ops["b"].blocked_by == "a"
    assert tree.storage.ops["a"].finished.wait(10)
    tree.storage.check()  # sees a's fetch done: a's request may still be admitted now
    assert tree.storage.ops["b"].blocked_by == "a"
    tree.storage.check()  # a step later a is still waiting: b fetches for itself
    assert tree.storage.ops["b"].blocked_by is None
    assert tree.storage.ops["b"].host_indices is not None
    assert tree.storage.ops["b"].finished.wait(10)
    assert tree.storage.terminate("b") == 32
    assert tree.storage.terminate("a") == 8  # the shared 24 tokens were in the tree by then
    tree.storage.wait_idle()
    tree.check_integrity()
    tree.storage.close()
