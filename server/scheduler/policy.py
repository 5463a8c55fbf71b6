"""Scheduling policies: the order waiting requests are asked in, and the delay that lets a
request hit the prefix another request's prefill is computing (`server.schedule_policy`,
`--schedule-policy`; the names are `hicache_server.config.SCHEDULE_POLICIES`).

    lpm         longest cached prefix first (`peek_prefix`: a peek that touches nothing),
                first come first served among equals and past MAX_LPM_SCAN waiting
    fcfs        arrival order
    random      a shuffle by the policy's own generator, seeded with RANDOM_POLICY_SEED
    dfs-weight  the radix tree of the waiting requests' keys walked depth first, each node's
                requests first, then its children, the one with the most waiting requests
                below it first (RadixAttention's DFS order, SGLang's `dfs-weight`): requests
                sharing a prefix run back to back, the largest group first; arrival order
                among equals, and past MAX_LPM_SCAN waiting

Delay scheduling (SGLang's in-batch prefix caching, sgl-project/sglang#2442), for the
cache-aware policies (lpm, dfs-weight), as SGLang: a waiting request whose key shares at least
IN_BATCH_SHARE_MIN_TOKENS tokens no tier holds with a prefill in flight (a request admitted in
this step, or a running one still computing its prompt) waits. That prefill gives its prompt
to the tree the moment it ends (`RequestKV.cache_prompt`); the request, admitted then, hits it
instead of computing the same tokens beside it. A request is delayed at most
MAX_IN_BATCH_DELAYS steps while it waits, so it never starves: a prefill in flight ends
within a few steps, and the shared prefix is then cached (or, evicted meanwhile, the bound
lets the request go).

Threading: scheduler thread (the policies peek at the tree it owns).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import ClassVar

from hicache.door import CacheDoor
from hicache.pages import pages_down
from hicache_server.config import SCHEDULE_POLICIES
from hicache_server.request import Request
from hicache_server.scheduler.kv import cache_key

# Waiting requests ranked by the cache-aware policies each step; past this many, first come
# first served (matching every request every step would cost more than it saves; SGLang
# does the same for lpm, at 128).
MAX_LPM_SCAN = 128
# The `random` policy's generator seed: the same arrivals are shuffled the same way each run.
RANDOM_POLICY_SEED = 0
# Uncached tokens a waiting request must share with a prefill in flight to wait for it:
# SGLang's IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD and ..._DEPRIORITIZE_THRESHOLD (both 32,
# schedule_policy.py): a shorter shared prefix ("the") is not worth a step's wait.
IN_BATCH_SHARE_MIN_TOKENS = 32
# Steps a request may be delayed while it waits: a prefill in flight takes one step per
# max_batch_tokens of prompt (2048 in the engine), so this covers a shared prefix of
# 16 chunks (32k tokens); past it the request computes the prefix itself.
MAX_IN_BATCH_DELAYS = 16


class SchedulePolicy(ABC):
    """The order in which the scheduler asks waiting requests to be admitted, each step.

    `order(waiting)` returns a new list holding exactly the requests of `waiting` (left as
    it is), the first to be asked first. `waiting` is in arrival order, except that a
    retracted request, or one back for its L3 tail, waits at its head. A policy may peek at
    the tree (`CacheDoor.peek`), never change it: no touch, no hit counted, no lock.
    `cache_aware`: whether the order follows the cache, and so whether delay scheduling
    applies (`InBatchSharing`). Scheduler thread.
    """

    name: ClassVar[str]
    cache_aware: ClassVar[bool] = False

    @abstractmethod
    def order(self, waiting: Sequence[Request]) -> list[Request]: ...


class CacheAwarePolicy(SchedulePolicy):
    """An order that follows the tree (`_rank`); FCFS when the tree is off, or when more
    than MAX_LPM_SCAN requests wait (ranking them would cost more than it finds)."""

    cache_aware = True

    def __init__(self, cache: CacheDoor) -> None:
        self.cache = cache

    def order(self, waiting: Sequence[Request]) -> list[Request]:
        if not self.cache.enabled or len(waiting) > MAX_LPM_SCAN:
            return list(waiting)
        return self._rank(waiting)

    @abstractmethod
    def _rank(self, waiting: Sequence[Request]) -> list[Request]: ...


class LongestPrefixMatch(CacheAwarePolicy):
    name = "lpm"

    def _rank(self, waiting: Sequence[Request]) -> list[Request]:
        def hit(req: Request) -> int:
            return self.cache.peek(cache_key(req), req.input.extra_key)
        return sorted(waiting, key=hit, reverse=True)  # stable: FCFS among equals


class FirstComeFirstServed(SchedulePolicy):
    name = "fcfs"

    def order(self, waiting: Sequence[Request]) -> list[Request]:
        return list(waiting)


class RandomOrder(SchedulePolicy):
    name = "random"

    def __init__(self, seed: int = RANDOM_POLICY_SEED) -> None:
        self.rng = random.Random(seed)

    def order(self, waiting: Sequence[Request]) -> list[Request]:
        out = list(waiting)
        self.rng.shuffle(out)
        return out


class DfsWeight(CacheAwarePolicy):
    name = "dfs-weight"

    def _rank(self, waiting: Sequence[Request]) -> list[Request]:
        trie = PrefixTrie()
        for req in waiting:
            trie.insert(cache_key(req), req.input.extra_key)
        return [waiting[i] for i in trie.dfs_order()]


def make_policy(name: str, cache: CacheDoor) -> SchedulePolicy:
    """The policy called `name` (one of SCHEDULE_POLICIES) over `cache`."""
    if name == LongestPrefixMatch.name:
        return LongestPrefixMatch(cache)
    if name == FirstComeFirstServed.name:
        return FirstComeFirstServed()
    if name == RandomOrder.name:
        return RandomOrder()
    if name == DfsWeight.name:
        return DfsWeight(cache)
    raise ValueError(f"schedule policy {name!r} is not one of {', '.join(SCHEDULE_POLICIES)}")


# ----------------------------------------------------------------------- delay scheduling

def filling(req: Request) -> bool:
    """Whether a running request is still computing its fill (its prompt; a retracted one's
    prompt and output), which the tree gets when it ends. A decode is not a fill."""
    return not req.prefilled or req.kv.num_computed + 1 < (req.kv.head_stop or req.seq_len)


def filled_key(req: Request) -> list[int]:
    """The tokens an admitted request's fill computes, which the tree gets (whole pages)
    as it ends: its sequence, or the head of an L3 hit whose tail comes meanwhile."""
    return req.all_ids[:req.kv.head_stop or req.seq_len]


class InBatchSharing:
    """One step's delay scheduling (see the module docstring): the keys of the prefills in
    flight, and whether a waiting request waits for one of them.

    `delays` (waiting request -> steps delayed) is kept across steps by its owner
    (`Admission`) and counted here. Off (`enabled` False, or no tree): nothing is delayed.
    """

    def __init__(self, cache: CacheDoor, in_flight: Iterable[Request],
                 delays: dict[Request, int], enabled: bool) -> None:
        self.cache = cache
        self.enabled = enabled and cache.enabled
        self.delays = delays
        self.trie = PrefixTrie()
        if self.enabled:  # else the fills in flight are not even looked at
            for req in in_flight:
                self.admitted(req)

    def defers(self, req: Request) -> bool:
        """Whether `req` waits this step (and the delay is counted): a prefill in flight
        will cache IN_BATCH_SHARE_MIN_TOKENS or more tokens of its key that no tier holds
        now, and it has been delayed fewer than MAX_IN_BATCH_DELAYS steps."""
        if (not self.enabled or not self.trie.roots
                or self.delays.get(req, 0) >= MAX_IN_BATCH_DELAYS):
            return False
        key, page = cache_key(req), self.cache.page_size
        # whole pages: what the tree keeps
        shared = pages_down(self.trie.shared(key, req.input.extra_key), page)
        if shared < IN_BATCH_SHARE_MIN_TOKENS:
            return False  # without a peek
        if shared - self.cache.peek(key, req.input.extra_key) < IN_BATCH_SHARE_MIN_TOKENS:
            return False
        self.delays[req] = self.delays.get(req, 0) + 1
        return True

    def admitted(self, req: Request) -> None:
        """`req`'s fill is in flight (admitted in this step, or running and still filling)."""
        if self.enabled:
            self.trie.insert(filled_key(req), req.input.extra_key)


# ------------------------------------------------------------------------------- the trie

class _Node:
    __slots__ = ("children", "edge", "ends", "first", "weight")

    def __init__(self, edge: list[int], first: int) -> None:
        self.edge = edge                        # tokens from the parent to here
        self.children: dict[int, _Node] = {}    # by the first token of their edge
        self.ends: list[int] = []               # indices of the keys ending here, ascending
        self.weight = 0                         # keys ending here or below
        self.first = first                      # the smallest index here or below


class PrefixTrie:
    """A radix trie of token keys, one root per `extra_key` (keys of two namespaces share
    nothing, as in the cache tree); each node counts the keys ending at it or below. Keys
    get indices 0, 1, ... in insertion order. Plain data: no pages, no slots."""

    def __init__(self) -> None:
        self.roots: dict[str | None, _Node] = {}
        self.size = 0

    def insert(self, key: list[int], extra_key: str | None = None) -> int:
        """Add `key`; its index."""
        index, self.size = self.size, self.size + 1
        node = self.roots.setdefault(extra_key, _Node([], index))
        node.weight += 1
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                child = node.children[key[pos]] = _Node(key[pos:], index)
            n = _common(child.edge, key, pos)
            if n < len(child.edge):
                child = _split(node, child, n)
            node, pos = child, pos + n
            node.weight += 1
        node.ends.append(index)
        return index

    def shared(self, key: list[int], extra_key: str | None = None) -> int:
        """The longest prefix of `key` that an inserted key (same `extra_key`) starts with."""
        node, pos = self.roots.get(extra_key), 0
        while node is not None and pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common(child.edge, key, pos)
            pos += n
            node = child if n == len(child.edge) else None
        return pos

    def dfs_order(self) -> list[int]:
        """Every index, depth first: a node's own keys, then its children heaviest first
        (the most keys below), the earliest inserted first among equals; roots likewise."""
        def heaviest_last(nodes: Iterable[_Node]) -> list[_Node]:  # a stack pops the end
            return sorted(nodes, key=lambda n: (n.weight, -n.first))
        out: list[int] = []
        stack = heaviest_last(self.roots.values())
        while stack:
            node = stack.pop()
            out.extend(node.ends)
            stack.extend(heaviest_last(node.children.values()))
        return out


def _common(edge: list[int], key: list[int], pos: int) -> int:
    """How many leading tokens of `edge` equal `key[pos:]`'s: slice compares (C speed),
    by halving once the whole does not match."""
    m = min(len(edge), len(key) - pos)
    if key[pos:pos + m] == edge[:m]:
        return m
    lo, hi = 0, m  # edge[:lo] matches, edge[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if key[pos:pos + mid] == edge[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _split(parent: _Node, child: _Node, n: int) -> _Node:
    """Cut `child`'s edge after `n` tokens (0 < n < len); the new middle node."""
    mid = _Node(child.edge[:n], child.first)
    mid.weight = child.weight
    child.edge = child.edge[n:]
    mid.children[child.edge[0]] = child
    parent.children[mid.edge[0]] = mid
    return mid
