"""L3 through the tree: backup after write-through, prefetch policies, restart, faults, races."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch
from test_hiradix_cache import LAYERS, assert_device_holds, forward, make_pools

from hicache.stack import CacheStack
from hicache.storage import PageCodec, PageGeometry, PageHasher, StorageController, StorageTier
from hicache.storage.backends.base import StorageBackend
from hicache.storage.backends.lmdb_store import LmdbStore
from hicache.storage.io import PrefetchState
from hicache.transfer import CpuTransferEngine, HiCacheController
from hicache.tree import HiRadixCache

PS = 4
HASHER = PageHasher(PS, "test-model", "float32", LAYERS, 2, 4)
CODEC = PageCodec(PageGeometry(LAYERS, 2, 4, PS, torch.float32))


def lmdb(path: Path) -> LmdbStore:
    return LmdbStore(path, 64 << 20, CODEC, sync=False)


def make(backend: StorageBackend, policy: str = "wait_complete", threshold: int = 8,
         dev_pages: int = 32, host_pages: int = 64, **kw):
    # a hit is fetched whole (overlap off): nothing here computes a raced head, which the
    # scheduler does (tests/test_l3_overlap.py, tests/test_storage_race.py)
    kw.setdefault("overlap", False)
    dev, host = make_pools(dev_pages, host_pages, PS)
    controller = HiCacheController(dev, host, CpuTransferEngine(dev, host))
    tree = HiRadixCache(controller, PS, load_back_threshold=1)
    storage = StorageTier(tree, StorageController(backend, host), HASHER,
                          prefetch_policy=policy, prefetch_threshold=threshold, **kw)
    return CacheStack(dev, tree, host, controller, storage), dev


def compute(stack: CacheStack, dev, seq: list[int]) -> None:
    """What the scheduler does for a finished request: write KV, insert, acks, backups."""
    tree = stack.tree
    slots = dev.alloc(len(seq))
    forward(dev, seq, slots)
    dev.free(slots[:tree.insert(seq, slots)])
    settle(stack)


def settle(stack: CacheStack) -> None:
    for node in stack.tree.writing_check(wait=True):
        stack.storage.backups.backup(node)
    stack.storage.io.wait_backups()
    stack.storage.check()


def flush_l1_l2(tree: HiRadixCache) -> None:
    tree.evict(10**6)
    tree.evict_host(10**6)
    assert tree.total_size() == 0 and tree.host_sizes().total == 0


def fetch(stack: CacheStack, req: str, seq: list[int], timeout: float = 10.0,
          extra_key: str | None = None) -> int:
    m = stack.tree.match_prefix(seq, extra_key)
    hit = m.device_indices.numel() + m.host_hit_length
    if not stack.storage.prefetch(req, m.last_host_node, seq[hit:], extra_key):
        return 0
    deadline = time.monotonic() + timeout
    while not stack.storage.ready(req):
        assert time.monotonic() < deadline, "prefetch never became ready"
        stack.storage.check()
        time.sleep(0.001)
    return stack.storage.terminate(req)


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
    stack, dev = make(lmdb(tmp_path / "db"))
    tree = stack.tree
    seq = seq_of(1)
    compute(stack, dev, seq)
    assert stack.storage.counters.backed_up_tokens == 32
    flush_l1_l2(tree)
    assert fetch(stack, "r1", seq) == 32
    stack.check_integrity()
    load_and_check(tree, dev, seq)
    stack.check_integrity()
    stack.storage.close()


def test_a_restarted_process_finds_the_pages(tmp_path) -> None:
    seq = seq_of(2, 48)
    stack, dev = make(lmdb(tmp_path / "db"))
    compute(stack, dev, seq)
    stack.storage.close()  # "shutdown"
    stack2, dev2 = make(lmdb(tmp_path / "db"))  # new pools, empty tree: a new process
    tree2 = stack2.tree
    assert fetch(stack2, "r", seq) == 48
    load_and_check(tree2, dev2, seq)
    stack2.storage.close()


def test_prefetch_extends_an_l2_hit_and_skips_short_tails(tmp_path) -> None:
    stack, dev = make(lmdb(tmp_path / "db"), threshold=8)
    tree = stack.tree
    seq = seq_of(3, 40)
    compute(stack, dev, seq)
    flush_l1_l2(tree)
    compute(stack, dev, seq[:16])  # L1 holds the first 16 tokens again
    m = tree.match_prefix(seq)
    assert m.device_indices.numel() == 16
    assert fetch(stack, "r", seq) == 24
    m = tree.match_prefix(seq)
    assert m.device_indices.numel() == 16 and m.host_hit_length == 24
    assert not stack.storage.prefetch("r2", m.last_host_node, seq[40:] + [1, 2, 3, 4])
    stack.check_integrity()
    stack.storage.close()


def test_namespaces_never_share_pages(tmp_path) -> None:
    stack, dev = make(lmdb(tmp_path / "db"))
    tree = stack.tree
    seq = seq_of(4)
    slots = dev.alloc(32)
    forward(dev, seq, slots)
    tree.insert(seq, slots, extra_key="tenant-a")
    settle(stack)
    flush_l1_l2(tree)
    assert fetch(stack, "none", seq) == 0
    assert fetch(stack, "b", seq, extra_key="tenant-b") == 0
    assert fetch(stack, "a", seq, extra_key="tenant-a") == 32
    assert tree.match_prefix(seq, "tenant-a").host_hit_length == 32
    assert tree.match_prefix(seq).host_hit_length == 0
    stack.check_integrity()
    stack.storage.close()


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
    stack, dev = make(Flaky(lmdb(tmp_path / "db"), "raise"))
    tree = stack.tree
    seq = seq_of(5)
    compute(stack, dev, seq)
    assert stack.storage.counters.backup_failures == 1
    assert stack.storage.io.errors["set"] == 1
    flush_l1_l2(tree)
    assert fetch(stack, "r", seq) == 0
    assert stack.storage.io.errors["exists"] >= 1
    stack.check_integrity()
    stack.storage.close()


def test_timeout_policy_gives_up_on_a_slow_backend(tmp_path) -> None:
    inner = lmdb(tmp_path / "db")
    stack, dev = make(inner, policy="timeout", timeout_base=0.05, timeout_per_ki_token=0.0,
                     timeout_max=0.05)
    tree = stack.tree
    seq = seq_of(6)
    compute(stack, dev, seq)
    flush_l1_l2(tree)
    stack.storage.io.backend = Flaky(inner, "slow")
    m = tree.match_prefix(seq)
    assert stack.storage.prefetch("r", m.last_host_node, seq)
    t0 = time.monotonic()
    while not stack.storage.ready("r"):
        stack.storage.check()
        time.sleep(0.005)
    assert time.monotonic() - t0 < 0.3  # gave up before the backend answered
    assert stack.storage.terminate("r") == 0
    stack.storage.wait_idle()  # the cancelled op's pages are freed once the thread lets go
    stack.check_integrity()
    assert tree.controller.host_pool.available_size() == tree.controller.host_pool.total_size()
    stack.storage.close()


def test_best_effort_admits_at_once(tmp_path) -> None:
    stack, dev = make(lmdb(tmp_path / "db"), policy="best_effort")
    tree = stack.tree
    seq = seq_of(7)
    compute(stack, dev, seq)
    flush_l1_l2(tree)
    m = tree.match_prefix(seq)
    assert stack.storage.prefetch("r", m.last_host_node, seq)
    assert stack.storage.ready("r")
    inserted = stack.storage.terminate("r")
    assert inserted % PS == 0 and 0 <= inserted <= 32
    assert tree.match_prefix(seq).host_hit_length == inserted
    stack.storage.wait_idle()
    stack.check_integrity()
    stack.storage.close()


class CountingSets(Flaky):
    """Passes every call through and records the keys of each `batch_set`."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner, "none")
        self.set_keys: list[bytes] = []

    def batch_set(self, keys, host_pool, host_indices):
        self.set_keys.extend(keys)
        return self.inner.batch_set(keys, host_pool, host_indices)


def test_a_recomputed_hit_backs_up_only_the_pages_l3_lacks(tmp_path) -> None:
    """L3 holds a prompt's first 8 pages; the cost model recomputes them within a longer
    prompt: its backup sends only the 4 pages after them (a store that skips a page it
    has still moves it: Redis SET NX carries the value)."""
    from hicache.storage.planner import FetchPlan

    counting = CountingSets(lmdb(tmp_path / "db"))
    stack, dev = make(counting)
    seq = seq_of(12, 48)
    compute(stack, dev, seq[:32])
    assert len(counting.set_keys) == 8
    flush_l1_l2(stack.tree)
    stack.storage.planner.plan = lambda hit, prefix: FetchPlan(None, None)  # recompute
    assert fetch(stack, "again", seq) == 0
    assert stack.storage.counters.recomputed_hits == 1
    compute(stack, dev, seq)
    assert len(counting.set_keys) == 12  # the 4 new pages, not the 8 L3 said it holds
    assert counting.stats()["pages"] == 12
    flush_l1_l2(stack.tree)
    del stack.storage.planner.plan  # the model again
    stack.storage.planner.cost_model = False  # fetch whatever L3 holds
    assert fetch(stack, "all", seq) == 48
    load_and_check(stack.tree, dev, seq)
    stack.check_integrity()
    stack.storage.close()


def test_clear_empties_l3(tmp_path) -> None:
    stack, dev = make(lmdb(tmp_path / "db"))
    tree = stack.tree
    seq = seq_of(8)
    compute(stack, dev, seq)
    assert stack.storage.clear() == 8
    flush_l1_l2(tree)
    assert fetch(stack, "r", seq) == 0
    stack.storage.close()


def test_prefetch_and_backup_racing_the_scheduler_keep_the_tree_intact(tmp_path) -> None:
    rng = random.Random(0)
    stack, dev = make(lmdb(tmp_path / "db"), policy="best_effort", threshold=4,
                     dev_pages=24, host_pages=40)
    tree = stack.tree
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
            stack.storage.prefetch(f"r{step}", m.last_host_node, seq[hit:])
        elif op < 0.75 and stack.storage.ops:
            stack.storage.terminate(rng.choice(sorted(stack.storage.ops)))
        elif op < 0.85:
            tree.evict(rng.randint(1, 40))
        else:
            tree.evict_host(rng.randint(1, 40))
        stack.steps.poll()
        stack.check_integrity()
    stack.storage.wait_idle()
    stack.check_integrity()
    assert stack.storage.counters.backed_up_tokens > 0
    stack.storage.close()
    tree.controller.close()


@pytest.mark.parametrize("policy", ["bogus"])
def test_bad_policy_is_refused(tmp_path, policy) -> None:
    with pytest.raises(ValueError, match="best_effort, wait_complete, timeout"):
        make(lmdb(tmp_path / "db"), policy=policy)


def test_a_node_split_while_its_write_runs_is_backed_up_whole(tmp_path) -> None:
    from test_hiradix_cache import DeferredEngine

    dev, host = make_pools(32, 64, PS)
    engine = DeferredEngine(dev, host)
    controller = HiCacheController(dev, host, engine)
    tree = HiRadixCache(controller, PS, load_back_threshold=1)
    stack = CacheStack(dev, tree, host, controller, StorageTier(
        tree, StorageController(lmdb(tmp_path / "db"), host), HASHER,
        prefetch_policy="wait_complete", prefetch_threshold=8, overlap=False))
    seq = seq_of(9)
    slots = dev.alloc(32)
    forward(dev, seq, slots)
    tree.insert(seq, slots)          # one node, its D->H copy pending
    tree.match_prefix(seq[:28])      # splits it at 28 tokens while the copy runs
    engine.complete(10)
    settle(stack)
    assert stack.storage.counters.backed_up_tokens == 32  # both halves, no hole
    flush_l1_l2(tree)
    assert fetch(stack, "r", seq) == 32
    stack.storage.close()


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
    stack, dev = make(gated)
    tree = stack.tree
    stored, unknown = seq_of(8), seq_of(9)
    compute(stack, dev, stored)
    flush_l1_l2(tree)
    m = tree.match_prefix(stored)
    assert stack.storage.prefetch("slow", m.last_host_node, stored)
    stack.storage.settle(10.0)
    stack.storage.check()  # query answered: the fetch starts and blocks in batch_get
    assert gated.getting.wait(10)
    m = tree.match_prefix(unknown)
    assert stack.storage.prefetch("miss", m.last_host_node, unknown)
    stack.storage.settle(10.0)  # returns when the query answers, not when the fetch ends
    stack.storage.check()
    assert stack.storage.ready("miss") and not stack.storage.ready("slow")
    assert stack.storage.terminate("miss") == 0
    gated.release.set()
    while not stack.storage.ready("slow"):
        stack.storage.check()
        time.sleep(0.001)
    assert stack.storage.terminate("slow") == len(stored)
    stack.storage.wait_idle()
    stack.check_integrity()
    stack.storage.close()


def restart_waiting(stack: CacheStack, keys: dict[str, list[int]]) -> None:
    """What the scheduler does with `take_restarts`: match again, prefetch the rest."""
    for rid in stack.storage.take_restarts():
        resume = stack.storage.restart(rid)
        m = stack.tree.match_prefix(keys[rid])
        hit = m.device_indices.numel() + m.host_hit_length
        stack.storage.prefetch(rid, m.last_host_node, keys[rid][hit:], resume=resume)


def waiting_for(stack: CacheStack, rid: str) -> str | None:
    """The request whose fetch `rid`'s prefetch waits for (None unless WAITING)."""
    op = stack.storage.ops[rid]
    assert (op.state is PrefetchState.WAITING) == (op.waiting_for is not None), op.state
    return op.waiting_for


def two_in_l3_sharing_24(tmp_path, seed: int):
    """(stack, dev, a, b): 32-token sequences with 24 tokens in common, only in L3, and a
    prefetch started for each ("a" first), as two requests arriving together."""
    stack, dev = make(lmdb(tmp_path / "db"))
    tree = stack.tree
    a = seq_of(seed)
    b = a[:24] + seq_of(seed + 1, 8)
    for seq in (a, b):
        compute(stack, dev, seq)
    flush_l1_l2(tree)
    for rid, seq in (("a", a), ("b", b)):
        assert stack.storage.prefetch(rid, tree.match_prefix(seq).last_host_node, seq)
    return stack, dev, a, b


def test_prefetches_of_a_shared_prefix_fetch_it_once(tmp_path) -> None:
    """Two requests arriving together, 24 tokens in common: the second waits for the first's
    fetch, is matched again once those pages are in the tree, and fetches only its tail."""
    stack, dev, a, b = two_in_l3_sharing_24(tmp_path, 10)
    tree = stack.tree
    keys = {"a": a, "b": b}
    stack.storage.settle(10.0)
    stack.storage.check()
    assert waiting_for(stack, "b") == "a"
    assert stack.storage.ops["b"].host_indices is None  # holds no L2 while it waits
    while not stack.storage.ready("a"):
        stack.storage.check()
        time.sleep(0.001)
    assert not stack.storage.ready("b")  # wait_complete: still waiting for its turn
    assert stack.storage.terminate("a") == 32
    restart_waiting(stack, keys)
    assert stack.storage.counters.prefetch_restarts == 1
    assert tree.match_prefix(b).host_hit_length == 24  # a's pages, matched again
    while not stack.storage.ready("b"):
        stack.storage.check()
        time.sleep(0.001)
    assert stack.storage.terminate("b") == 8
    assert stack.storage.counters.prefetched_tokens == 40  # not 32 + 32
    load_and_check(tree, dev, a)
    m = tree.match_prefix(b)  # the shared 24 tokens are on the device now, b's tail in L2
    assert (m.device_indices.numel(), m.host_hit_length) == (24, 8)
    lb = tree.init_load_back(m.last_host_node)
    handle = tree.controller.start_loading()
    for layer in range(LAYERS):
        handle.wait_layer(layer)
    assert_device_holds(dev, b, torch.cat([m.device_indices, lb.device_indices]))
    tree.loading_check(wait=True)
    stack.storage.wait_idle()
    stack.check_integrity()
    stack.storage.close()


def test_a_prefix_that_reached_the_tree_meanwhile_is_matched_again(tmp_path) -> None:
    """The first request's pages were inserted between the second's arrival and its query
    answer: the second is matched again instead of fetching them a second time."""
    stack, dev = make(lmdb(tmp_path / "db"))
    tree = stack.tree
    a = seq_of(12)
    compute(stack, dev, a)
    flush_l1_l2(tree)
    anchor = tree.match_prefix(a).last_host_node
    assert stack.storage.prefetch("a", anchor, a)
    assert stack.storage.prefetch("b", anchor, a)
    while not stack.storage.ops["a"].queried.is_set():
        time.sleep(0.001)
    stack.storage._decide(stack.storage.ops["a"])  # a's fetch starts before b's query is seen
    assert stack.storage.ops["a"].state is PrefetchState.FETCHING
    while not stack.storage.ready("a"):
        time.sleep(0.001)
    assert stack.storage.terminate("a") == 32  # in the tree before b's query is looked at
    stack.storage.settle(10.0)
    stack.storage.check()
    assert stack.storage.take_restarts() == ["b"]
    assert stack.storage.restart("b") is not None
    assert tree.match_prefix(a).host_hit_length == 32  # nothing left to fetch
    assert stack.storage.counters.prefetched_tokens == 32
    load_and_check(tree, dev, a)
    stack.storage.wait_idle()
    stack.check_integrity()
    stack.storage.close()


def test_a_prefetch_stops_waiting_for_one_whose_request_cannot_be_admitted(tmp_path) -> None:
    """The first request fetched the shared pages but is not admitted (no L1 room): one
    step later the second stops waiting for it and fetches the pages itself."""
    stack, *_ = two_in_l3_sharing_24(tmp_path, 13)
    stack.storage.settle(10.0)
    stack.storage.check()
    assert waiting_for(stack, "b") == "a"
    assert stack.storage.ops["a"].finished.wait(10)
    stack.storage.check()  # sees a's fetch done: a's request may still be admitted now
    assert waiting_for(stack, "b") == "a"
    stack.storage.check()  # a step later a is still waiting: b fetches for itself
    assert waiting_for(stack, "b") is None
    assert stack.storage.ops["b"].state is PrefetchState.FETCHING
    assert stack.storage.ops["b"].host_indices is not None
    assert stack.storage.ops["b"].finished.wait(10)
    assert stack.storage.terminate("b") == 32
    assert stack.storage.terminate("a") == 8  # the shared 24 tokens were in the tree by then
    stack.storage.wait_idle()
    stack.check_integrity()
    stack.storage.close()
