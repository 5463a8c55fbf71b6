"""The `priority` eviction policy (SGLang's `--radix-eviction-policy priority`): lower request
priorities go first, LRU among equals, in L1 and in L2; `lru` and `lfu` unchanged; the
`priority` request field on the HTTP routes and the engine."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
import torch
from conftest import app_client
from hypothesis import given
from hypothesis import strategies as st
from test_hiradix_cache import make_pools

from hicache.transfer.controller import HiCacheController
from hicache.transfer.engines import CpuTransferEngine
from hicache.tree import eviction_order, radix
from hicache.tree.hiradix import HiRadixCache
from hicache.tree.node import UNUSED_PRIORITY
from hicache.tree.radix import RadixCache
from hicache_server.config import load_config
from hicache_server.engine import Engine
from hicache_server.request import InvalidRequest

Key = tuple[int, ...]


class FakeClock:
    """The tree's `time.monotonic`: a tick the test advances before each operation, so
    every operation has its own access time and the model knows it."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


@contextmanager
def fake_clock() -> Iterator[FakeClock]:
    clock = FakeClock()
    with mock.patch.object(radix, "time", clock):
        yield clock


class RecordingAllocator:
    def __init__(self) -> None:
        self.freed: list[int] = []

    def free(self, indices: torch.Tensor) -> None:
        self.freed.extend(indices.tolist())


# ------------------------------------------------------------------- reference model

class Use:
    """What the model keeps per cached prefix (page_size 1: every token ends one)."""

    def __init__(self, priority: int, tick: float, hits: int) -> None:
        self.priority, self.tick, self.hits = priority, tick, hits


class EvictionModel:
    """A cached prefix -> its users' highest priority, last access and use count; locks as
    the locked hits. A leaf is a prefix no cached prefix extends; it is evictable unless a
    lock ends exactly there (a lock splits the tree there and covers what is above)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.cached: dict[Key, Use] = {}
        self.locked: list[Key] = []

    def hit(self, key: Key) -> int:
        n = 0
        while n < len(key) and key[:n + 1] in self.cached:
            n += 1
        return n

    def use(self, key: Key, priority: int | None, tick: float, count: bool,
            create: bool) -> None:
        for i in range(1, len(key) + 1):
            use = self.cached.get(key[:i])
            if use is None:
                if create:
                    self.cached[key[:i]] = Use(priority, tick, int(count))
                continue
            use.tick, use.hits = tick, use.hits + int(count)
            if priority is not None:
                use.priority = max(use.priority, priority)

    def evictable(self) -> list[Key]:
        extended = {p[:-1] for p in self.cached}
        return [p for p in self.cached if p not in extended and p not in self.locked]

    def order(self, key: Key) -> tuple:
        use = self.cached[key]
        if self.policy == "lru":
            return (use.tick,)
        if self.policy == "lfu":
            return (use.hits, use.tick)
        return (use.priority, use.tick)


tokens = st.lists(st.integers(0, 2), min_size=1, max_size=6).map(tuple)
priorities = st.integers(-3, 3)
ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), tokens, priorities, st.booleans()),
    st.tuples(st.just("match"), tokens, st.none() | priorities, st.booleans(), st.booleans()),
    st.tuples(st.just("use"), st.integers(0, 7), st.none() | priorities),
    st.tuples(st.just("unlock"), st.integers(0, 7)),
    st.tuples(st.just("pin"), tokens),
    st.tuples(st.just("unpin"), st.integers(0, 7)),
    st.tuples(st.just("evict"), st.integers(1, 4)),
), max_size=40)


def check_one_eviction(tree: RadixCache, model: EvictionModel) -> None:
    """`evict(1)` frees one leaf: the model's evictable leaf of minimal order."""
    candidates = model.evictable()
    freed = tree.evict(1)
    if not candidates:
        assert freed == 0
        return
    gone = [p for p in candidates if tree.peek_prefix(p) < len(p)]
    assert len(gone) == 1, f"one eviction removed the leaves {gone}"
    expected = min(candidates, key=model.order)
    assert gone[0] == expected, (f"evicted {gone[0]} {model.order(gone[0])}, the minimum is "
                                 f"{expected} {model.order(expected)}")
    kept = tree.peek_prefix(expected)
    assert freed == len(expected) - kept
    for end in range(kept + 1, len(expected) + 1):
        del model.cached[expected[:end]]


def run_ops(policy: str, operations: list[tuple]) -> None:
    tree = RadixCache(RecordingAllocator(), page_size=1, eviction_policy=policy)
    model = EvictionModel(policy)
    locks: list[Any] = []  # (node, key) per lock taken
    pins: list[Any] = []   # (node, key) per pin: without L2 a pinned path is never evicted
    with fake_clock() as clock:
        for op in operations:
            clock.now += 1
            if op[0] == "insert":
                _, key, priority, count = op
                tree.insert(key, priority=priority, count_hit=count)
                model.use(key, priority, clock.now, count, create=True)
            elif op[0] == "match":
                _, key, priority, count, lock = op
                m = tree.match_prefix(key, priority=priority, count_hit=count)
                n = model.hit(key)
                assert m.device_indices.numel() == n
                model.use(key[:n], priority, clock.now, count, create=False)
                if lock and n:
                    tree.inc_lock_ref(m.last_device_node)
                    locks.append((m.last_device_node, key[:n]))
                    model.locked.append(key[:n])
            elif op[0] == "use" and locks:
                node, key = locks[op[1] % len(locks)]
                tree.count_use(node, op[2])
                model.use(key, op[2], clock.now, True, create=False)
            elif op[0] == "unlock" and locks:
                node, key = locks.pop(op[1] % len(locks))
                tree.dec_lock_ref(node)
                model.locked.remove(key)
            elif op[0] == "pin":
                m = tree.match_prefix(op[1], count_hit=False)
                n = model.hit(op[1])
                model.use(op[1][:n], None, clock.now, False, create=False)
                if n:
                    tree.retention.pin(m.last_device_node)
                    pins.append((m.last_device_node, op[1][:n]))
                    model.locked.append(op[1][:n])
            elif op[0] == "unpin" and pins:
                node, key = pins.pop(op[1] % len(pins))
                tree.retention.unpin(node)
                model.locked.remove(key)
            elif op[0] == "evict":
                for _ in range(op[1]):
                    check_one_eviction(tree, model)
            tree.check_integrity()


@pytest.mark.parametrize("policy", ["priority", "lru", "lfu"])
@given(operations=ops)
def test_evicted_leaves_are_always_the_minimum_of_the_policy(policy, operations) -> None:
    """Random inserts and matches (with priorities, counted or not), locks, pins and
    evictions: every evicted leaf has the minimal (priority, last access) among the
    evictable leaves under `priority` (a pinned path, in a tree without L2, is never one);
    lru and lfu keep their orders (access; uses, then access), whatever the priorities."""
    run_ops(policy, operations)


# ------------------------------------------------------------------------ unit tests

def node_at(tree: RadixCache, key: list[int]):
    return tree.peek_path(key)[-1]


def test_a_nodes_priority_is_the_highest_of_its_users() -> None:
    tree = RadixCache(page_size=2, eviction_policy="priority")
    tree.insert([1, 2, 3, 4], priority=1)
    node = node_at(tree, [1, 2, 3, 4])
    assert node.priority == 1
    tree.match_prefix([1, 2, 3, 4], priority=5)
    assert node.priority == 5
    tree.match_prefix([1, 2, 3, 4], priority=2)  # a lower user lowers nothing
    tree.insert([1, 2, 3, 4], priority=-1)
    tree.match_prefix([1, 2, 3, 4])  # None: a caller that does not know the priority
    assert node.priority == 5
    tree.insert([1, 2, 3, 4, 5, 6], priority=0)
    leaf = node_at(tree, [1, 2, 3, 4, 5, 6])
    assert (node.priority, leaf.priority) == (5, 0)
    tree.count_use(leaf, 7)  # a use counted at a request's end raises the whole path
    assert (node.priority, leaf.priority) == (7, 7)
    tree.check_integrity()


def test_insert_without_a_priority_is_the_default_and_unused_nodes_are_lowest() -> None:
    tree = RadixCache(page_size=1)
    tree.insert([1, 2])
    assert node_at(tree, [1, 2]).priority == 0
    assert UNUSED_PRIORITY < -10**9  # pages an L3 prefetch hung in: below every request


def test_a_split_copies_the_priority() -> None:
    tree = RadixCache(page_size=2, eviction_policy="priority")
    tree.insert([1, 2, 3, 4], priority=3)
    upper = tree.match_prefix([1, 2, 9, 9]).last_device_node  # splits after [1, 2]
    lower = node_at(tree, [1, 2, 3, 4])
    assert upper.key == (1, 2) and lower.parent is upper
    assert (upper.priority, lower.priority) == (3, 3)
    tree.match_prefix([1, 2], priority=8)  # only the hit is raised
    assert (upper.priority, lower.priority) == (8, 3)
    tree.check_integrity()


def test_l1_evicts_the_lower_priority_first_even_when_it_is_newer() -> None:
    alloc = RecordingAllocator()
    with fake_clock() as clock:
        tree = RadixCache(alloc, page_size=1, eviction_policy="priority")
        clock.now = 1
        tree.insert([1], torch.tensor([10]), priority=5)
        clock.now = 2
        tree.insert([2], torch.tensor([20]), priority=1)
        clock.now = 3
        tree.insert([3], torch.tensor([30]), priority=1)
        assert tree.evict(1) == 1 and alloc.freed == [20]  # priority 1, the older of two
        assert tree.evict(1) == 1 and alloc.freed == [20, 30]
        assert tree.evict(1) == 1 and alloc.freed == [20, 30, 10]


@pytest.mark.parametrize("policy, first", [("lru", 10), ("lfu", 10), ("priority", 20)])
def test_lru_and_lfu_ignore_priorities(policy, first) -> None:
    """[1] is older, used once and of high priority; [2] newer, used twice, of priority 0:
    lru (older) and lfu (fewer uses) evict [1], priority evicts [2]."""
    alloc = RecordingAllocator()
    with fake_clock() as clock:
        tree = RadixCache(alloc, page_size=1, eviction_policy=policy)
        clock.now = 1
        tree.insert([1], torch.tensor([10]), priority=9)
        clock.now = 2
        tree.insert([2], torch.tensor([20]), priority=0)
        clock.now = 3
        tree.match_prefix([2], priority=0)
        tree.evict(1)
    assert alloc.freed == [first]


def test_the_lru_and_lfu_keys_are_unchanged() -> None:
    tree = RadixCache(page_size=1)
    tree.insert([1], priority=4)
    node = node_at(tree, [1])
    assert eviction_order.PRIORITIES["lru"](node) == (node.last_access_time,)
    assert eviction_order.PRIORITIES["lfu"](node) == (node.hit_count, node.last_access_time)
    assert eviction_order.PRIORITIES["priority"](node) == (4, node.last_access_time)


def test_the_policy_is_a_choice_of_the_tree_and_of_the_config() -> None:
    with pytest.raises(ValueError, match="lru, lfu, priority"):
        RadixCache(page_size=1, eviction_policy="fifo")
    cfg = load_config(None, {"cache.eviction_policy": "priority"})
    assert cfg.cache.eviction_policy == "priority"


def hi_tree(policy: str) -> tuple[HiRadixCache, Any]:
    ps = 2
    dev, host = make_pools(32, 32, ps)
    controller = HiCacheController(dev, host, CpuTransferEngine(dev, host))
    tree = HiRadixCache(controller, ps, write_policy="write_through", eviction_policy=policy)
    return tree, dev


@pytest.mark.parametrize("policy, evicted_first", [("priority", "low"), ("lru", "high")])
def test_l2_evicts_in_the_same_order(policy, evicted_first) -> None:
    """Two L2-only prefixes: the older of high priority and the newer of low priority. L2
    eviction takes the low one first under `priority`, the older under `lru`."""
    with fake_clock() as clock:
        tree, dev = hi_tree(policy)
        prefixes = {"high": [1, 2, 3, 4], "low": [5, 6, 7, 8]}
        clock.now = 1
        tree.insert(prefixes["high"], dev.alloc(4), priority=5)
        clock.now = 2
        tree.insert(prefixes["low"], dev.alloc(4), priority=0)
        tree.writing_check(wait=True)
        assert tree.evict(100) == 8  # both demoted to L2
        assert tree.evict_host(4) == 4
        tree.check_integrity()
        kept = "high" if evicted_first == "low" else "low"
        assert tree.peek_prefix(prefixes[evicted_first]) == 0
        assert tree.peek_prefix(prefixes[kept]) == 4
        tree.controller.close()


def test_l2_only_nodes_keep_their_priority_and_raise_it_when_matched() -> None:
    with fake_clock() as clock:
        tree, dev = hi_tree("priority")
        clock.now = 1
        tree.insert([1, 2, 3, 4], dev.alloc(4), priority=0)
        clock.now = 2
        tree.insert([5, 6, 7, 8], dev.alloc(4), priority=1)
        tree.writing_check(wait=True)
        tree.evict(100)
        clock.now = 3
        m = tree.match_prefix([1, 2, 3, 4], priority=2)  # an L2 hit raises it above [5..8]
        assert m.host_hit_length == 4 and m.last_host_node.priority == 2
        assert tree.evict_host(4) == 4
        assert tree.peek_prefix([5, 6, 7, 8]) == 0 and tree.peek_prefix([1, 2, 3, 4]) == 4
        tree.controller.close()


# ------------------------------------------------------------------------------ engine

PAGE = 16


def small_l1(policy: str) -> Engine:
    return Engine(load_config(None, {"cache.page_size": PAGE, "cache.max_total_tokens": 256,
                                     "cache.eviction_policy": policy, "model.device": "cpu"}))


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


@pytest.mark.parametrize("policy, survivor", [("priority", "high"), ("lru", "low")])
def test_under_l1_pressure_the_low_priority_prefix_goes_first(policy, survivor) -> None:
    """A high-priority prompt, then a newer low-priority one, each 5 pages in a 16-page L1;
    a third prompt needs 8 pages: one of the two is evicted. Under `priority` the newer
    low-priority one goes; under `lru` the older one does, whatever its priority."""
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    prompts = {"high": prompt(1, 5 * PAGE), "low": prompt(2, 5 * PAGE)}
    with small_l1(policy) as e:
        e.generate(input_ids=prompts["high"], sampling_params=params, priority=10)
        e.generate(input_ids=prompts["low"], sampling_params=params)  # None: priority 0
        e.generate(input_ids=prompt(3, 8 * PAGE - 8), sampling_params=params, priority=0)
        cached = {name: e._call(lambda p=p: e.cache.tree.peek_prefix(p))
                  for name, p in prompts.items()}
    victim = "low" if survivor == "high" else "high"
    assert cached[survivor] == 5 * PAGE and cached[victim] == 0, cached


def test_the_engine_checks_and_passes_the_priority() -> None:
    with small_l1("priority") as e:
        with pytest.raises(InvalidRequest, match="`priority` must be an integer"):
            e.make_requests(input_ids=[1, 2, 3], priority="high")
        reqs = e.make_requests(input_ids=[1, 2, 3], sampling_params={"n": 2}, priority=-4)
        assert [r.input.priority for r in reqs] == [-4, -4]  # every choice
        assert e.make_request(input_ids=[1, 2, 3]).input.priority == 0


# -------------------------------------------------------------------------------- HTTP

@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with small_l1("priority") as e:
        yield e


def tree_priority(e: Engine, ids: list[int]) -> float:
    return e._call(lambda: e.cache.tree.peek_path(ids)[-1].priority)


async def test_generate_and_completions_take_a_priority(engine) -> None:
    ids = {route: prompt(seed, 2 * PAGE + 1) for seed, route in enumerate("abc", 10)}
    params = {"temperature": 0, "max_new_tokens": 1}
    async with app_client(engine) as c:
        resp = await c.post("/generate", json={"input_ids": ids["a"], "priority": 7,
                                               "sampling_params": params})
        assert resp.status == 200, await resp.text()
        resp = await c.post("/generate", json={"input_ids": [ids["b"], ids["c"]],
                                               "priority": [3, None], "sampling_params": params})
        assert resp.status == 200, await resp.text()
        assert tree_priority(engine, ids["a"][:2 * PAGE]) == 7
        assert tree_priority(engine, ids["b"][:2 * PAGE]) == 3
        assert tree_priority(engine, ids["c"][:2 * PAGE]) == 0
        ids2 = prompt(20, 2 * PAGE + 1)
        resp = await c.post("/v1/completions", json={"prompt": ids2, "max_tokens": 1,
                                                     "priority": -2})
        assert resp.status == 200, await resp.text()
        assert tree_priority(engine, ids2[:2 * PAGE]) == -2
        resp = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "q" * 3 * PAGE}], "max_tokens": 1,
            "priority": 5})
        assert resp.status == 200, await resp.text()
        # the chat template wraps the text, so look for the priority anywhere in the tree
        priorities = engine._call(lambda: {n.priority for n in engine.cache.tree.iter_nodes()})
        assert 5 in priorities


@pytest.mark.parametrize("route, body", [
    ("/generate", {"text": "a", "priority": "high"}),
    ("/generate", {"text": "a", "priority": 1.5}),
    ("/generate", {"text": "a", "priority": True}),
    ("/generate", {"text": ["a", "b"], "priority": [1, "x"]}),
    ("/generate", {"text": ["a", "b"], "priority": [1]}),
    ("/v1/completions", {"prompt": "a", "priority": "high"}),
    ("/v1/completions", {"prompt": "a", "priority": 2.5}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "priority": "high"}),
])
async def test_a_priority_that_is_not_an_integer_is_a_400(engine, route, body) -> None:
    async with app_client(engine) as c:
        resp = await c.post(route, json=body)
        assert resp.status == 400, await resp.text()
        message = (await resp.json())["error"]["message"]
        assert "`priority`" in message, message
