"""HiRadixCache: byte integrity across tier moves, write policies, and a stateful model test."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache.kernels.transfer_kv import d2h_pages, h2d_pages
from hicache.memory.device import DeviceKVPool
from hicache.memory.host import HostKVPool
from hicache.transfer.controller import HiCacheController
from hicache.transfer.engines import CpuTransferEngine, TransferEngine, TransferHandle
from hicache.tree.hiradix import LOAD_BACK_THRESHOLD, HiRadixCache

LAYERS, HEADS, DIM = 2, 2, 4
MAX_POS = 256


def make_pools(dev_pages: int, host_pages: int, page_size: int, layout: str = "page_first"
               ) -> tuple[DeviceKVPool, HostKVPool]:
    dev = DeviceKVPool(dev_pages, page_size, LAYERS, HEADS, DIM, torch.float32, "cpu")
    host = HostKVPool(host_pages, page_size, LAYERS, HEADS, DIM, torch.float32, layout,
                      pin_memory=False, check_available=False)
    return dev, host


def content(tokens: list[int], layer: int, kv: int) -> torch.Tensor:
    """KV that a forward pass would write for `tokens`: unique per (token, position, layer,
    K/V, head, dim), identical for identical prefixes."""
    pos = torch.arange(len(tokens), dtype=torch.float32)
    tok = torch.tensor(tokens, dtype=torch.float32)
    base = ((tok * MAX_POS + pos) * LAYERS + layer) * 2 + kv  # [n]
    return base[:, None, None] * (HEADS * DIM) + torch.arange(HEADS * DIM).view(1, HEADS, DIM)


def forward(dev: DeviceKVPool, tokens: list[int], slots: torch.Tensor) -> None:
    for layer in range(LAYERS):
        dev.set_kv(layer, slots, content(tokens, layer, 0), content(tokens, layer, 1))


def assert_device_holds(dev: DeviceKVPool, tokens: list[int], slots: torch.Tensor) -> None:
    for layer in range(LAYERS):
        k, v = dev.get_kv(layer)
        assert torch.equal(k[slots], content(tokens, layer, 0)), f"K of layer {layer} differs"
        assert torch.equal(v[slots], content(tokens, layer, 1)), f"V of layer {layer} differs"


def make_tree(dev, host, page_size, policy="write_through", engine=None,
              load_back_threshold=1) -> HiRadixCache:
    engine = engine or CpuTransferEngine(dev, host)
    return HiRadixCache(HiCacheController(dev, host, engine), page_size, write_policy=policy,
                        load_back_threshold=load_back_threshold)


# ------------------------------------------------------------------- byte integrity (real)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_bytes_survive_write_evict_and_load_back(layout, policy, io_backend) -> None:
    ps = 4
    dev, host = make_pools(32, 64, ps, layout)
    tree = make_tree(dev, host, ps, policy, CpuTransferEngine(dev, host, io_backend))
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 50, (48,), generator=g).tolist()
    b = a[:24] + torch.randint(50, 100, (16,), generator=g).tolist()
    for seq in (a, b):
        slots = dev.alloc(len(seq))
        forward(dev, seq, slots)
        present = tree.insert(seq, slots)
        dev.free(slots[:present])
    for _ in range(2):  # hits that make write_through_selective copy
        tree.match_prefix(a)
        tree.match_prefix(b)
    tree.writing_check(wait=True)
    assert tree.evict(10_000) == 64
    tree.check_integrity()
    assert dev.available_size() == 32 * ps
    for layer in range(LAYERS):  # poison: a load must bring every byte back from L2
        dev.k_buffers[layer].fill_(float("nan"))
        dev.v_buffers[layer].fill_(float("nan"))
    hold = dev.alloc(8)  # the load lands in other slots than the originals
    m = tree.match_prefix(a)
    assert m.device_indices.numel() == 0 and m.host_hit_length == 48
    lb = tree.init_load_back(m.last_host_node)
    handle = tree.controller.start_loading()
    for layer in range(LAYERS):
        handle.wait_layer(layer)
    assert not set(lb.device_indices.tolist()) & set(hold.tolist())
    assert_device_holds(dev, a, lb.device_indices)
    assert tree.loading_check(wait=True) == 1
    m2 = tree.match_prefix(b)
    assert m2.device_indices.numel() == 24 and m2.host_hit_length == 16
    tree.check_integrity()
    tree.controller.close()


def test_write_through_copies_on_insert_and_selective_waits_for_a_second_hit() -> None:
    ps = 2
    for policy, expect_written in (("write_through", 8), ("write_through_selective", 0),
                                   ("write_back", 0)):
        dev, host = make_pools(16, 32, ps)
        tree = make_tree(dev, host, ps, policy)
        slots = dev.alloc(8)
        tree.insert(list(range(8)), slots)
        tree.writing_check(wait=True)
        assert tree.counters.written_tokens == expect_written, policy
        if policy == "write_through_selective":
            tree.match_prefix(list(range(8)))
            tree.writing_check(wait=True)
            assert tree.counters.written_tokens == 8
        tree.controller.close()


def test_l1_eviction_deletes_unbacked_nodes_and_demotes_backed_ones() -> None:
    ps = 2
    dev, host = make_pools(16, 32, ps)
    tree = make_tree(dev, host, ps, "write_through_selective")
    tree.insert([1, 2, 3, 4], dev.alloc(4))
    tree.insert([5, 6, 7, 8], dev.alloc(4))
    for _ in range(2):
        tree.match_prefix([5, 6, 7, 8])
    tree.writing_check(wait=True)
    assert tree.evict(100) == 8
    assert tree.match_prefix([1, 2, 3, 4]).host_hit_length == 0  # deleted
    assert tree.match_prefix([5, 6, 7, 8]).host_hit_length == 4  # demoted to L2
    tree.check_integrity()
    tree.controller.close()


def test_full_l2_evicts_host_leaves_then_copies_then_drops_the_write() -> None:
    ps = 2
    dev, host = make_pools(16, 4, ps)  # L2 holds two sequences of 4 tokens
    tree = make_tree(dev, host, ps)
    tree.insert([1, 1, 1, 1], dev.alloc(4))
    tree.writing_check(wait=True)
    tree.evict(4)  # [1,1,1,1] now L2 only
    tree.insert([2, 2, 2, 2], dev.alloc(4))  # fills L2 with no eviction needed
    tree.writing_check(wait=True)
    tree.insert([3, 3, 3, 3], dev.alloc(4))  # evicts [1,1,1,1] from L2
    tree.writing_check(wait=True)
    assert tree.match_prefix([1, 1, 1, 1]).host_hit_length == 0
    assert tree.counters.host_evicted_tokens == 4
    tree.insert([4, 4, 4, 4], dev.alloc(4))  # no L2-only leaf: [2,2,2,2]'s copy goes
    tree.writing_check(wait=True)
    two, three, four = (tree.peek_path([t] * 4)[-1] for t in (2, 3, 4))
    assert two.host_value is None and not two.evicted  # still on L1
    assert three.backuped and four.backuped and tree.counters.write_dropped_tokens == 0
    tree.protect_host(three)
    tree.protect_host(four)
    tree.insert([5, 5, 5, 5], dev.alloc(4))  # nothing reclaimable: dropped, counted
    assert tree.counters.write_dropped_tokens == 4
    assert tree.counters.host_evicted_tokens == 8
    tree.release_host(three)
    tree.release_host(four)
    tree.check_integrity()
    tree.controller.close()


def test_a_write_never_reclaims_its_own_ancestors_copies() -> None:
    """L2 full of one path's copies: writing a child below it must not free the parent's
    copy to make room (that would leave a child in L2 without its parent)."""
    ps = 2
    dev, host = make_pools(16, 2, ps)  # L2: 4 tokens
    tree = make_tree(dev, host, ps)
    tree.insert([1, 1, 2, 2], dev.alloc(4))
    tree.writing_check(wait=True)
    tree.insert([1, 1, 2, 2, 3, 3], dev.alloc(6))  # the child finds no room: dropped
    tree.writing_check(wait=True)
    path = tree.peek_path([1, 1, 2, 2, 3, 3])
    assert [n.backuped for n in path] == [True, False]
    assert tree.counters.write_dropped_tokens == 2
    tree.check_integrity()
    tree.controller.close()


def test_load_back_evicts_l1_once_and_otherwise_loads_nothing() -> None:
    ps = 2
    dev, host = make_pools(4, 16, ps)  # L1: 8 tokens
    tree = make_tree(dev, host, ps)
    tree.insert([1] * 8, dev.alloc(8))
    tree.writing_check(wait=True)
    tree.evict(8)
    tree.insert([2] * 8, dev.alloc(8))
    tree.writing_check(wait=True)
    m = tree.match_prefix([1] * 8)
    lb = tree.init_load_back(m.last_host_node)  # evicts [2]*8 to make room
    assert lb.device_indices.numel() == 8
    tree.controller.start_loading()
    tree.loading_check(wait=True)
    # now lock [1]*8 and ask for [2]*8: no room even after eviction, nothing is loaded
    tree.inc_lock_ref(lb.last_node)
    m2 = tree.match_prefix([2] * 8)
    lb2 = tree.init_load_back(m2.last_host_node)
    assert lb2.device_indices.numel() == 0 and lb2.last_node is tree.root
    tree.dec_lock_ref(lb.last_node)
    tree.check_integrity()
    tree.controller.close()


def test_tiny_loads_are_not_worth_a_transfer() -> None:
    dev, host = make_pools(16, 32, 1)
    tree = make_tree(dev, host, 1, load_back_threshold=LOAD_BACK_THRESHOLD)
    assert LOAD_BACK_THRESHOLD > 3
    tree.insert([1, 2, 3], dev.alloc(3))
    tree.writing_check(wait=True)
    tree.evict(3)
    m = tree.match_prefix([1, 2, 3])
    assert m.host_hit_length == 3
    assert tree.init_load_back(m.last_host_node).device_indices.numel() == 0
    tree.controller.close()


def test_protected_host_pages_are_never_evicted() -> None:
    dev, host = make_pools(16, 32, 2)
    tree = make_tree(dev, host, 2)
    tree.insert([1, 1, 2, 2], dev.alloc(4))
    tree.insert([1, 1, 3, 3], dev.alloc(4))
    tree.writing_check(wait=True)
    tree.evict(100)
    node = tree.match_prefix([1, 1, 2, 2]).last_host_node
    tree.protect_host(node)
    assert tree.evict_host(100) == 2  # only [3, 3]; [1, 1] is an ancestor of [2, 2]
    assert tree.match_prefix([1, 1, 2, 2]).host_hit_length == 4
    tree.release_host(node)
    assert tree.evict_host(100) == 4
    tree.check_integrity()
    tree.controller.close()


def test_release_host_at_zero_raises() -> None:
    dev, host = make_pools(4, 8, 1)
    tree = make_tree(dev, host, 1)
    tree.insert([1], dev.alloc(1))
    node = tree.match_prefix([1]).last_device_node
    with pytest.raises(AssertionError):
        node.release_host()
    tree.controller.close()


def test_a_failed_write_leaves_the_node_on_l1_only() -> None:
    ps = 2
    dev, host = make_pools(8, 16, ps)

    class Failing(CpuTransferEngine):
        def copy_d2h(self, device_indices, host_indices):
            return super().copy_d2h(device_indices[:1], host_indices)  # raises in _pages

    with pytest.raises(ValueError):
        Failing(dev, host).copy_d2h(torch.arange(2), torch.arange(2))
    tree = make_tree(dev, host, ps)
    handle = tree.controller.transfer.copy_d2h(torch.arange(2, 4), torch.arange(2))
    handle.wait()
    assert not handle.failed()
    tree.controller.close()


def test_a_split_cuts_the_host_copy_hashes_and_protection_with_the_edge() -> None:
    ps = 2
    dev, host = make_pools(16, 32, ps)
    tree = make_tree(dev, host, ps)
    tree.insert([1, 1, 2, 2, 3, 3], dev.alloc(6))
    tree.writing_check(wait=True)
    (node,) = tree.root.children.values()
    host_slots = node.host_value.tolist()
    node.hash_value, node.storage_backed = [b"a", b"b", b"c"], True
    tree.protect_host(node)
    upper = tree.match_prefix([1, 1, 9, 9]).last_device_node
    assert node.parent is upper and upper.key == (1, 1) and node.key == (2, 2, 3, 3)
    assert upper.host_value.tolist() + node.host_value.tolist() == host_slots
    assert (upper.hash_value, node.hash_value) == ([b"a"], [b"b", b"c"])
    assert upper.storage_backed and node.storage_backed
    assert upper.host_ref_counter == node.host_ref_counter == 1
    tree.release_host(node)
    assert upper.host_ref_counter == node.host_ref_counter == 0
    tree.check_integrity()
    tree.controller.close()


def test_pages_from_l3_hang_below_the_anchor_as_l2_only_nodes() -> None:
    ps = 2
    dev, host = make_pools(16, 32, ps)
    tree = make_tree(dev, host, ps, "write_back")  # nothing reaches L2 by itself
    tree.insert([1, 1, 2, 2], dev.alloc(4))
    fetched, hashes = host.alloc(8), [b"p0", b"p1", b"p2", b"p3"]
    assert tree.insert_host_pages(tree.root, (1, 1, 2, 2, 3, 3, 4, 4), fetched, hashes) == 8
    on_device, leaf = tree.peek_path([1, 1, 2, 2, 3, 3, 4, 4])
    assert not on_device.evicted and on_device.host_value.tolist() == fetched[:4].tolist()
    assert leaf.evicted and leaf.host_value.tolist() == fetched[4:].tolist()
    assert (on_device.hash_value, leaf.hash_value) == (hashes[:2], hashes[2:])
    assert on_device.storage_backed and leaf.storage_backed and leaf.hit_count == 0
    # fetched again with a different last page: the known pages are freed, [3, 3] is split off
    assert tree.insert_host_pages(tree.root, [1, 1, 2, 2, 3, 3, 9, 9], host.alloc(8),
                                  [b"p0", b"p1", b"p2", b"q3"]) == 2
    assert tree.match_prefix([1, 1, 2, 2, 3, 3, 9, 9]).host_hit_length == 4
    assert tree.insert_host_pages(on_device, (5, 5), host.alloc(2), [b"r"]) == 2
    assert tree.peek_prefix([1, 1, 2, 2, 5, 5]) == 6
    tree.check_integrity()  # the host pool holds exactly the tree's host slots: no leak
    with pytest.raises(ValueError, match="3 tokens are not whole pages of 2"):
        tree.insert_host_pages(tree.root, (1, 1, 2), torch.arange(3), [b"p0"])
    tree.controller.close()


# --------------------------------------------------------------- stateful test, tiny pools


class DeferredHandle(TransferHandle):
    """Runs its copy only when completed by the test or waited on by a consumer."""

    def __init__(self, job, num_layers: int) -> None:
        self.num_layers = num_layers
        self._job = job
        self._done = False

    def run(self) -> None:
        if not self._done:
            self._job()
            self._done = True

    def wait_layer(self, layer: int) -> None:
        self.run()

    def wait(self) -> None:
        self.run()

    def done(self) -> bool:
        return self._done


class DeferredEngine(TransferEngine):
    def __init__(self, dev, host) -> None:
        super().__init__(dev, host)
        self.pending: list[DeferredHandle] = []

    def copy_d2h(self, device_indices, host_indices):
        dp, hp = self._pages(device_indices, host_indices)
        d, h = self.device_pool, self.host_pool
        return self._queue(lambda: d2h_pages(d.k_buffers, d.v_buffers, h.buffer, h.layout,
                                             dp, hp, self.page_size))

    def copy_h2d(self, host_indices, device_indices):
        hp, dp = self._pages(host_indices, device_indices)
        d, h = self.device_pool, self.host_pool
        return self._queue(lambda: h2d_pages(h.buffer, h.layout, d.k_buffers, d.v_buffers,
                                             hp, dp, self.page_size))

    def _queue(self, job) -> DeferredHandle:
        handle = DeferredHandle(job, self.device_pool.num_layers)
        self.pending.append(handle)
        return handle

    def complete(self, n: int) -> None:
        """Finish the n oldest copies (the real engines are FIFO too)."""
        while n > 0 and self.pending:
            self.pending.pop(0).run()
            n -= 1


def seq_strategy(page_size: int):
    pages = st.lists(st.lists(st.integers(0, 2), min_size=page_size, max_size=page_size),
                     max_size=5)
    return pages.map(lambda ps: [t for p in ps for t in p])


class HiCacheModel(RuleBasedStateMachine):
    page_size = 2
    policy = "write_through"

    def __init__(self) -> None:
        super().__init__()
        # L2 smaller than L1: writes get dropped, which must never leave a backup hole
        self.dev, self.host = make_pools(10, 8, self.page_size)
        self.engine = DeferredEngine(self.dev, self.host)
        self.tree = HiRadixCache(HiCacheController(self.dev, self.host, self.engine),
                                 self.page_size, write_policy=self.policy,
                                 load_back_threshold=1)
        self.locks: list = []
        self.protected: list = []

    @rule(data=st.data())
    def insert(self, data) -> None:
        seq = data.draw(seq_strategy(self.page_size))
        slots = self.dev.alloc(len(seq))
        if slots is None:
            self.tree.evict(len(seq))
            slots = self.dev.alloc(len(seq))
        if slots is None:
            return
        forward(self.dev, seq, slots)
        present = self.tree.insert(seq, slots)
        self.dev.free(slots[:present])

    @rule(data=st.data(), load=st.booleans(), lock=st.booleans(), protect=st.booleans())
    def match(self, data, load, lock, protect) -> None:
        seq = data.draw(seq_strategy(self.page_size))
        peeked = self.tree.peek_prefix(seq)
        m = self.tree.match_prefix(seq)
        assert peeked == m.device_indices.numel() + m.host_hit_length
        hit = m.device_indices.numel()
        node = m.last_device_node
        if load and m.host_hit_length:
            lb = self.tree.init_load_back(m.last_host_node)
            if lb.device_indices.numel():
                node, hit = lb.last_node, hit + lb.device_indices.numel()
        handle = self.tree.controller.start_loading()
        if handle is not None:  # the forward pass waits per layer before reading
            for layer in range(LAYERS):
                handle.wait_layer(layer)
        slots = self.tree.match_prefix(seq[:hit]).device_indices
        assert slots.numel() == hit
        assert_device_holds(self.dev, seq[:hit], slots)
        if lock and node is not self.tree.root:
            self.tree.inc_lock_ref(node)
            self.locks.append((node, slots))
        if protect and m.last_host_node is not self.tree.root and m.last_host_node.backuped:
            self.tree.protect_host(m.last_host_node)
            self.protected.append(m.last_host_node)

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 10))
    def unlock(self, i) -> None:
        node, _ = self.locks.pop(i % len(self.locks))
        self.tree.dec_lock_ref(node)

    @precondition(lambda self: self.protected)
    @rule(i=st.integers(0, 10))
    def release(self, i) -> None:
        self.tree.release_host(self.protected.pop(i % len(self.protected)))

    @rule(n=st.integers(1, 24))
    def evict(self, n) -> None:
        self.tree.evict(n)

    @rule(n=st.integers(1, 24))
    def evict_host(self, n) -> None:
        self.tree.evict_host(n)

    @rule(n=st.integers(1, 4))
    def ack(self, n) -> None:
        self.engine.complete(n)
        self.tree.writing_check()
        self.tree.loading_check()

    @invariant()
    def consistent(self) -> None:
        t = self.tree
        t.check_integrity()
        owned = t.all_values()
        assert self.dev.allocator.used_size() == len(owned), (
            "device slots leaked or double-owned")
        for node, slots in self.locks:
            assert node.parent is not None and not node.evicted, "a locked node was evicted"
        for node in self.protected:
            assert node.parent is not None and node.host_value is not None, (
                "protected host pages were freed")


class HiCacheModelThrough(HiCacheModel):
    policy = "write_through"


class HiCacheModelSelective(HiCacheModel):
    policy = "write_through_selective"


class HiCacheModelBack(HiCacheModel):
    policy = "write_back"


class HiCacheModelPage1(HiCacheModel):
    page_size = 1


TestHiCacheThrough = HiCacheModelThrough.TestCase
TestHiCacheSelective = HiCacheModelSelective.TestCase
TestHiCacheBack = HiCacheModelBack.TestCase
TestHiCachePage1 = HiCacheModelPage1.TestCase
