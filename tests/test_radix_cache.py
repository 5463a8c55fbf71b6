"""RadixCache: scenario tests of the docs/architecture.md contract and a stateful model test."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache.tree.node import TreeNode
from hicache.tree.radix import RadixCache


def toks(s: str) -> list[int]:
    return [ord(c) for c in s]


class RecordingAllocator:
    """Records every slot the tree frees; a slot freed twice is a bug."""

    def __init__(self) -> None:
        self.freed: list[int] = []

    def free(self, indices: torch.Tensor) -> None:
        self.freed.extend(indices.tolist())
        assert len(set(self.freed)) == len(self.freed), "slot freed twice"


def keys_of(tree: RadixCache) -> set[tuple]:
    """Every (extra_key, page-aligned prefix) the tree stores."""
    out = set()

    def walk(node, prefix):
        for child in node.children.values():
            p = prefix + child.key
            for end in range(len(prefix) + tree.page_size, len(p) + 1, tree.page_size):
                out.add((child.extra_key, p[:end]))
            walk(child, p)

    walk(tree.root, ())
    return out


# ------------------------------------------------------------------------------ scenarios


def test_peek_path_spells_an_inserted_key_without_touching_the_tree() -> None:
    tree = RadixCache(page_size=2)
    tree.insert([1, 2, 3, 4, 5, 6], torch.tensor([10, 11, 12, 13, 14, 15]))
    tree.insert([1, 2, 3, 4, 7, 8], torch.tensor([10, 11, 12, 13, 16, 17]))
    before = {n.id: (n.hit_count, n.last_access_time) for n in tree.iter_nodes()}
    path = tree.peek_path([1, 2, 3, 4, 7, 8])
    assert [n.key for n in path] == [(1, 2, 3, 4), (7, 8)]
    assert torch.cat([n.value for n in path]).tolist() == [10, 11, 12, 13, 16, 17]
    assert tree.peek_path([1, 2, 3, 9]) == []  # ends inside an edge: no whole node
    assert tree.peek_prefix([1, 2, 3, 9]) == 2
    assert {n.id: (n.hit_count, n.last_access_time) for n in tree.iter_nodes()} == before
    tree.check_integrity()


def test_split_in_the_middle_of_an_edge() -> None:
    tree = RadixCache(page_size=1)
    tree.insert([1, 2, 3, 4, 5, 6, 7, 8])
    res = tree.match_prefix([1, 2, 3, 4, 9])
    assert res.device_indices.tolist() == [1, 2, 3, 4]
    assert res.last_device_node.key == (1, 2, 3, 4)
    assert len(tree.root.children) == 1
    (upper,) = tree.root.children.values()
    assert upper is res.last_device_node
    assert [c.key for c in upper.children.values()] == [(5, 6, 7, 8)]
    tree.check_integrity()
    assert tree.total_size() == 8


def test_mismatch_inside_an_edge_never_continues_into_a_grandchild() -> None:
    # SGLang PR #7: "Hello_world" matched through "Hello_L.A.!" + "world".
    tree = RadixCache(page_size=1)
    tree.insert(toks("Hello_L.A.!world"))
    tree.insert(toks("Hello_L.A.!"))
    res = tree.match_prefix(toks("Hello_world"))
    assert res.device_indices.tolist() == toks("Hello_")
    tree.check_integrity()


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_mismatch_inside_a_page_stops_at_the_page_boundary(page_size: int) -> None:
    tree = RadixCache(page_size=page_size)
    tree.insert(list(range(4 * page_size)))
    probe = list(range(4 * page_size))
    probe[2 * page_size + page_size - 1] = 999  # last token of the third page differs
    res = tree.match_prefix(probe)
    assert res.device_indices.tolist() == list(range(2 * page_size))
    tree.check_integrity()


def test_keys_are_cut_to_whole_pages() -> None:
    tree = RadixCache(page_size=4)
    assert tree.insert(list(range(10))) == 0
    assert tree.total_size() == 8
    assert tree.match_prefix(list(range(10))).device_indices.tolist() == list(range(8))
    assert tree.match_prefix(list(range(3))).device_indices.numel() == 0
    assert tree.insert(list(range(3))) == 0 and tree.total_size() == 8


def test_insert_returns_the_tokens_already_present() -> None:
    tree = RadixCache(page_size=2)
    assert tree.insert([1, 2, 3, 4], torch.tensor([10, 11, 12, 13])) == 0
    assert tree.insert([1, 2, 3, 4, 5, 6], torch.tensor([20, 21, 22, 23, 24, 25])) == 4
    assert tree.insert([1, 2, 7, 8], torch.tensor([30, 31, 32, 33])) == 2
    # the tree keeps the first owner's slots for shared prefixes
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).device_indices.tolist() == [
        10, 11, 12, 13, 24, 25]
    assert tree.match_prefix([1, 2, 7, 8]).device_indices.tolist() == [10, 11, 32, 33]
    tree.check_integrity()


def test_value_none_stores_the_key() -> None:
    tree = RadixCache()
    tree.insert([5, 6, 7])
    assert tree.match_prefix([5, 6, 7, 8]).device_indices.tolist() == [5, 6, 7]


def test_eviction_is_least_recently_used_first() -> None:
    alloc = RecordingAllocator()
    tree = RadixCache(alloc, page_size=1)
    tree.insert([1, 1], torch.tensor([0, 1]))
    tree.insert([2, 2], torch.tensor([2, 3]))
    tree.insert([3, 3], torch.tensor([4, 5]))
    tree.match_prefix([1, 1])  # now [2, 2] is the oldest
    assert tree.evict(1) == 2
    assert alloc.freed == [2, 3]
    assert tree.evict(2) == 2
    assert alloc.freed == [2, 3, 4, 5]
    assert tree.match_prefix([1, 1]).device_indices.tolist() == [0, 1]
    tree.check_integrity()


def test_a_parent_that_becomes_a_leaf_is_evicted_in_the_same_call() -> None:
    alloc = RecordingAllocator()
    tree = RadixCache(alloc, page_size=1)
    tree.insert([1, 2, 3, 4])
    tree.insert([1, 2, 5, 6])
    assert tree.evict(6) == 6
    assert sorted(alloc.freed) == [1, 2, 3, 4, 5, 6]
    assert tree.total_size() == 0 and not tree.root.children
    tree.check_integrity()


def test_lfu_evicts_the_least_hit_first() -> None:
    alloc = RecordingAllocator()
    tree = RadixCache(alloc, page_size=1, eviction_policy="lfu")
    tree.insert([1], torch.tensor([1]))
    tree.insert([2], torch.tensor([2]))
    for _ in range(3):
        tree.match_prefix([1])
    tree.match_prefix([2])  # most recent, but hit less often
    tree.evict(1)
    assert alloc.freed == [2]


def test_locks_protect_a_node_and_its_ancestors() -> None:
    alloc = RecordingAllocator()
    tree = RadixCache(alloc, page_size=1)
    tree.insert([1, 2, 3, 4])
    tree.insert([1, 2, 5, 6])
    node = tree.match_prefix([1, 2, 3, 4]).last_device_node
    assert tree.inc_lock_ref(node) == -4  # [3, 4] and the shared [1, 2]
    assert tree.evictable_size() == 2 and tree.protected_size() == 4
    assert tree.evict(100) == 2  # only [5, 6]
    assert sorted(alloc.freed) == [5, 6]
    assert tree.inc_lock_ref(node) == 0  # already protected
    assert tree.dec_lock_ref(node) == 0
    assert tree.dec_lock_ref(node) == 4
    assert tree.evictable_size() == 4 and tree.protected_size() == 0
    with pytest.raises(AssertionError):
        tree.dec_lock_ref(node)
    tree.check_integrity()
    assert tree.evict(100) == 4


def test_extra_key_is_a_namespace() -> None:
    tree = RadixCache(page_size=1)
    tree.insert([1, 2, 3], extra_key="tenant-a")
    assert tree.match_prefix([1, 2, 3], extra_key="tenant-b").device_indices.numel() == 0
    assert tree.match_prefix([1, 2, 3]).device_indices.numel() == 0
    assert tree.match_prefix([1, 2, 3], extra_key="tenant-a").device_indices.numel() == 3
    assert tree.insert([1, 2, 3], extra_key="tenant-b") == 0
    assert tree.total_size() == 6
    tree.check_integrity()


def test_disabled_tree_stores_nothing() -> None:
    tree = RadixCache(page_size=1, disable=True)
    assert tree.insert([1, 2, 3]) == 3
    assert tree.match_prefix([1, 2, 3]).device_indices.numel() == 0
    assert tree.total_size() == 0


def test_reset_forgets_everything() -> None:
    tree = RadixCache(page_size=1)
    tree.insert([1, 2, 3])
    tree.inc_lock_ref(tree.match_prefix([1, 2, 3]).last_device_node)
    tree.reset()
    assert tree.total_size() == 0 and tree.protected_size() == 0
    assert tree.match_prefix([1, 2, 3]).device_indices.numel() == 0
    tree.check_integrity()


def test_tensor_keys_are_accepted() -> None:
    tree = RadixCache(page_size=2)
    tree.insert(torch.tensor([1, 2, 3, 4]))
    assert tree.match_prefix(torch.tensor([1, 2, 3, 4])).device_indices.tolist() == [1, 2, 3, 4]


def test_constructor_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(page_size=0)
    with pytest.raises(ValueError, match="lru, lfu"):
        RadixCache(eviction_policy="fifo")


@pytest.mark.parametrize("breakage", ["size", "link", "empty", "lock", "align"])
def test_check_integrity_catches_a_broken_tree(breakage: str) -> None:
    tree = RadixCache(page_size=2)
    tree.insert([1, 2, 3, 4])
    tree.insert([1, 2, 5, 6])
    upper = next(iter(tree.root.children.values()))
    leaf = next(iter(upper.children.values()))
    if breakage == "size":
        tree._evictable += 2
    elif breakage == "link":
        leaf.parent = tree.root
    elif breakage == "empty":
        leaf.key, leaf.value = (), leaf.value[:0]
    elif breakage == "lock":
        leaf.lock_ref = -1
    else:
        leaf.key, leaf.value = leaf.key + (7,), torch.cat([leaf.value, torch.tensor([7])])
    with pytest.raises(AssertionError):
        tree.check_integrity()


def test_eviction_heap_stays_bounded_under_repeated_access() -> None:
    tree = RadixCache(page_size=1)
    for i in range(10):
        tree.insert([i, i + 100])
    for _ in range(2000):
        tree.match_prefix([3, 103])
    assert len(tree._device_heap) < 4 * 11 + 64 + 2


def test_hit_counts_and_access_times_follow_the_contract(monkeypatch) -> None:
    ticks = itertools.count(1)
    monkeypatch.setattr(time, "monotonic", lambda: float(next(ticks)))
    tree = RadixCache(page_size=2)
    tree.insert([1, 2, 3, 4])
    (leaf,) = tree.root.children.values()
    assert leaf.hit_count == 1  # its creation is its first use
    created = leaf.last_access_time
    upper = tree.match_prefix([1, 2, 9, 9]).last_device_node  # splits; the hit is on [1, 2]
    assert upper.key == (1, 2) and leaf.key == (3, 4) and leaf.parent is upper
    assert (upper.hit_count, leaf.hit_count) == (2, 1)
    assert upper.last_access_time > created == leaf.last_access_time
    tree.insert([1, 2, 3, 4], count_hit=False)  # touches every node, counts no use
    assert (upper.hit_count, leaf.hit_count) == (2, 1)
    assert leaf.last_access_time == upper.last_access_time > created
    tree.insert([1, 2, 3, 4])
    assert (upper.hit_count, leaf.hit_count) == (3, 2)
    tree.insert([1, 2, 5, 6], count_hit=False)
    new = tree.peek_path([1, 2, 5, 6])[-1]
    assert new.hit_count == 0 and upper.hit_count == 3  # counted at its next insert
    tree.match_prefix([1, 2, 5, 6])
    assert (upper.hit_count, new.hit_count) == (4, 1)


def test_a_split_keeps_the_lock_of_the_node_it_cuts() -> None:
    alloc = RecordingAllocator()
    tree = RadixCache(alloc, page_size=1)
    tree.insert([1, 2, 3, 4])
    node = tree.match_prefix([1, 2, 3, 4]).last_device_node
    tree.inc_lock_ref(node)
    upper = tree.match_prefix([1, 2, 7]).last_device_node
    assert upper.key == (1, 2) and node.parent is upper and upper.lock_ref == node.lock_ref == 1
    assert tree.protected_size() == 4 and tree.evict(4) == 0
    assert tree.dec_lock_ref(node) == 4 and tree.evict(4) == 4
    tree.check_integrity()


def test_bad_values_are_refused_with_the_lengths() -> None:
    tree = RadixCache(page_size=2)
    with pytest.raises(ValueError, match="3 slots.*need 4"):
        tree.insert([1, 2, 3, 4, 5], torch.tensor([0, 1, 2]))
    assert tree.total_size() == 0


def reference_walk(start: TreeNode, key: list[int], extra_key: str | None, page_size: int
                   ) -> tuple[list[TreeNode], int, TreeNode | None]:
    """The walk written the slow, obvious way: children scanned, tokens compared one by one,
    rounded down to whole pages. (whole nodes spelled, tokens matched, node ended inside)."""
    end, node, pos, path = len(key) // page_size * page_size, start, 0, []
    while pos < end:
        first = key[pos:pos + page_size]
        nxt = [c for c in node.children.values()
               if c.extra_key == extra_key and list(c.key[:page_size]) == first]
        if not nxt:
            break
        (child,) = nxt
        n = 0
        while n < len(child.key) and pos + n < end and child.key[n] == key[pos + n]:
            n += 1
        n = n // page_size * page_size
        if n < len(child.key):
            return path, pos + n, child
        path.append(child)
        node, pos = child, pos + n
    return path, pos, None


# Few distinct tokens: keys share prefixes, and pages differ in one token only.
small_keys = st.lists(st.integers(0, 2), max_size=10)
namespaces = st.sampled_from([None, "ns"])


@pytest.mark.parametrize("page_size", [1, 2, 4])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_walk_agrees_with_a_token_by_token_reference(page_size: int, data) -> None:
    """peek_path, peek_prefix, reach_below (from the root and from a node below it),
    match_prefix and insert against `reference_walk`, for list, tuple and tensor keys."""
    tree = RadixCache(page_size=page_size)  # value=None: the slots are the tokens themselves
    for key, extra in data.draw(st.lists(st.tuples(small_keys, namespaces), max_size=8)):
        tree.insert(key, extra_key=extra)
    for key, extra, write in data.draw(st.lists(st.tuples(small_keys, namespaces,
                                                          st.booleans()), max_size=8)):
        path, matched, inside = reference_walk(tree.root, key, extra, page_size)
        deepest = inside if inside is not None else (path[-1] if path else tree.root)
        for form in (key, tuple(key), torch.tensor(key, dtype=torch.int64)):
            assert tree.peek_path(form, extra) == path
            assert tree.peek_prefix(form, extra) == matched
            assert tree.reach_below(tree.root, form, extra) == (deepest, matched)
        if path:
            skip = len(path[0].key)
            sub, sub_matched, sub_inside = reference_walk(path[0], key[skip:], extra, page_size)
            assert tree.reach_below(path[0], key[skip:], extra) == (
                sub_inside if sub_inside is not None else (sub[-1] if sub else path[0]),
                sub_matched)
        if write:
            assert tree.insert(key, extra_key=extra) == matched
            end = len(key) // page_size * page_size
            assert sum(len(n.key) for n in tree.peek_path(key, extra)) == end
        else:
            assert tree.match_prefix(key, extra).device_indices.tolist() == key[:matched]
        tree.check_integrity()


# ------------------------------------------------------------------- stateful model test


def page_strategy(page_size: int) -> st.SearchStrategy[list[int]]:
    """Pages drawn from a few patterns, two of which differ only in their last token."""
    patterns = [[0] * page_size, [0] * (page_size - 1) + [1], [1] * page_size]
    return st.sampled_from(patterns)


class RadixModel(RuleBasedStateMachine):
    """The tree against a brute-force dict from page-aligned prefix to that page's slots."""

    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        self.alloc = RecordingAllocator()
        self.tree = RadixCache(self.alloc, page_size=self.page_size)
        self.model: dict[tuple, list[int]] = {}  # (extra_key, prefix) -> slots of its last page
        self.slots = itertools.count()
        self.locks: list = []  # (node, set of model keys it protects)

    def _expected(self, key: list[int], extra_key: str | None) -> list[int]:
        out: list[int] = []
        for end in range(self.page_size, len(key) + 1, self.page_size):
            slots = self.model.get((extra_key, tuple(key[:end])))
            if slots is None:
                break
            out.extend(slots)
        return out

    @rule(data=st.data(), extra=st.sampled_from([None, "ns"]))
    def insert(self, data, extra) -> None:
        ps = self.page_size
        pages = data.draw(st.lists(page_strategy(ps), max_size=5))
        tail = data.draw(st.lists(st.integers(0, 1), max_size=ps - 1))
        key = [t for p in pages for t in p] + tail
        value = torch.tensor([next(self.slots) for _ in key], dtype=torch.int64)
        expected_present = len(self._expected(key, extra))
        present = self.tree.insert(key, value, extra_key=extra)
        assert present == expected_present
        self.alloc.freed.extend(value[:present].tolist())  # the caller frees duplicates
        for end in range(present + ps, len(pages) * ps + 1, ps):
            self.model[(extra, tuple(key[:end]))] = value[end - ps:end].tolist()

    @rule(data=st.data(), extra=st.sampled_from([None, "ns"]), lock=st.booleans())
    def match(self, data, extra, lock) -> None:
        ps = self.page_size
        pages = data.draw(st.lists(page_strategy(ps), max_size=6))
        key = [t for p in pages for t in p]
        expected = self._expected(key, extra)
        assert self.tree.peek_prefix(key, extra_key=extra) == len(expected)
        res = self.tree.match_prefix(key, extra_key=extra)
        assert res.device_indices.tolist() == expected
        assert res.last_host_node is res.last_device_node and res.host_hit_length == 0
        if lock and expected:
            self.tree.inc_lock_ref(res.last_device_node)
            protected = {(extra, tuple(key[:e])) for e in range(ps, len(expected) + 1, ps)}
            self.locks.append((res.last_device_node, protected))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i) -> None:
        node, _ = self.locks.pop(i % len(self.locks))
        self.tree.dec_lock_ref(node)

    @rule(n=st.integers(0, 40))
    def evict(self, n) -> None:
        evictable = self.tree.evictable_size()
        freed_before = len(self.alloc.freed)
        freed = self.tree.evict(n)
        assert freed >= min(n, evictable) or freed == evictable
        assert len(self.alloc.freed) - freed_before == freed
        now = keys_of(self.tree)
        gone = set(self.model) - now
        assert now <= set(self.model), "eviction created keys"
        assert sum(len(self.model[k]) for k in gone) == freed
        for _, protected in self.locks:
            assert not (protected & gone), "a locked prefix was evicted"
        for k in gone:
            del self.model[k]

    @invariant()
    def consistent(self) -> None:
        self.tree.check_integrity()
        t = self.tree
        assert t.evictable_size() + t.protected_size() == t.total_size()
        assert t.total_size() == sum(len(v) for v in self.model.values())
        assert keys_of(t) == set(self.model)
        owned = t.all_values().tolist()
        assert len(set(owned)) == len(owned), "a slot is owned twice"
        assert not set(owned) & set(self.alloc.freed), "a freed slot is still owned"


class RadixModelPage1(RadixModel):
    page_size = 1


class RadixModelPage2(RadixModel):
    page_size = 2


class RadixModelPage16(RadixModel):
    page_size = 16


TestRadixModelPage1 = RadixModelPage1.TestCase
TestRadixModelPage2 = RadixModelPage2.TestCase
TestRadixModelPage16 = RadixModelPage16.TestCase
