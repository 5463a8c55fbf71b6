"""Scheduling policies (`server/scheduler/policy.py`): each one's order on hand-built waiting
lists over a real tree, and delay scheduling, which has a request whose long uncached prefix
another request's prefill is computing wait for it, then hit it; end to end through the
engine on the CPU, with the same greedy tokens."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import (
    WAIT_S,
    cache_finished,
    cpu_stack,
    record_forwards,
    submit_in_one_step,
)

from hicache.stack import CacheStack
from hicache_server.config import SCHEDULE_POLICIES, load_config
from hicache_server.engine import Engine
from hicache_server.request import Request, RequestInput, SamplingParams
from hicache_server.scheduler import policy
from hicache_server.scheduler.admission import Admission
from hicache_server.scheduler.kv import RequestKV
from hicache_server.scheduler.policy import (
    IN_BATCH_SHARE_MIN_TOKENS,
    MAX_IN_BATCH_DELAYS,
    RANDOM_POLICY_SEED,
    PrefixTrie,
    RandomOrder,
    make_policy,
)

PS = 4
L1_TOKENS = 256


def stack_of(enable_radix_cache: bool = True) -> CacheStack:
    return cpu_stack(PS, L1_TOKENS, **{"cache.enable_radix_cache": enable_radix_cache})


def request(prompt: list[int], max_new: int = 4, extra_key: str | None = None) -> Request:
    return Request(RequestInput(prompt, SamplingParams(max_new_tokens=max_new,
                                                       temperature=0.0), extra_key))


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def names(order: list[Request], reqs: dict[str, Request]) -> list[str]:
    by_id = {id(r): name for name, r in reqs.items()}
    return [by_id[id(r)] for r in order]


# ------------------------------------------------------------------------------ orders

def test_lpm_ranks_by_cached_prefix_stable_among_equals_and_fcfs_past_the_scan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    stack = stack_of()
    cache_finished(stack, seq(0, 16))
    cache_finished(stack, seq(100, 32))
    reqs = {"none": request(seq(500, 9)), "short": request(seq(0, 8) + [7]),
            "long": request(seq(100, 32) + [7]), "none2": request(seq(600, 9)),
            "mid": request(seq(0, 16) + [7])}
    waiting = list(reqs.values())
    lpm = make_policy("lpm", stack)
    assert names(lpm.order(waiting), reqs) == ["long", "mid", "short", "none", "none2"]
    assert names(waiting, reqs) == list(reqs)  # left as it was
    assert names(Admission(stack, RequestKV(stack, [])).order(waiting), reqs) == [
        "long", "mid", "short", "none", "none2"]  # the default
    monkeypatch.setattr(policy, "MAX_LPM_SCAN", len(waiting) - 1)
    assert names(lpm.order(waiting), reqs) == list(reqs)


def test_fcfs_keeps_arrival_order_whatever_is_cached() -> None:
    stack = stack_of()
    cache_finished(stack, seq(0, 32))
    reqs = {"a": request(seq(500, 9)), "b": request(seq(0, 32) + [1]), "c": request([3, 4])}
    assert names(make_policy("fcfs", stack).order(list(reqs.values())), reqs) == ["a", "b", "c"]


def test_random_is_a_seeded_permutation() -> None:
    stack = stack_of()
    waiting = [request([i, i + 1]) for i in range(20)]
    first, again = make_policy("random", stack), RandomOrder(RANDOM_POLICY_SEED)
    orders = [first.order(waiting) for _ in range(3)]
    assert [again.order(waiting) for _ in range(3)] == orders  # the seed decides all
    for order in orders:
        assert sorted(map(id, order)) == sorted(map(id, waiting))  # each request once
    assert orders[0] != waiting and orders[0] != orders[1]  # it shuffles, step after step
    assert RandomOrder(RANDOM_POLICY_SEED + 1).order(waiting) != orders[0]


def test_dfs_weight_runs_groups_back_to_back_heaviest_first() -> None:
    """Three requests under one system prompt (two of them under a longer shared part),
    two under another, one alone; arrival interleaves them. The heaviest subtree comes
    first, and inside it the heavier branch; equal weights keep arrival order."""
    stack = stack_of()
    sys_a, sys_b = seq(1000, 40), seq(2000, 40)
    reqs = {"lone": request(seq(9000, 20)),
            "b1": request(sys_b + seq(1, 8)),
            "a1": request(sys_a + seq(10, 8)),
            "b2": request(sys_b + seq(20, 8)),
            "a2": request(sys_a + seq(30, 16) + seq(40, 4)),
            "a3": request(sys_a + seq(30, 16) + seq(50, 4))}
    order = make_policy("dfs-weight", stack).order(list(reqs.values()))
    assert names(order, reqs) == ["a2", "a3", "a1", "b1", "b2", "lone"]


def test_dfs_weight_puts_a_prefix_before_its_extensions_and_keeps_namespaces_apart() -> None:
    stack = stack_of()
    shared = seq(0, 24)
    reqs = {"x_other_ns": request(shared + [5, 5], extra_key="other"),
            "long": request(shared + [6, 6, 6]),
            "prefix": request(shared + [6]),
            "y_other_ns": request(shared + [5, 6], extra_key="other"),
            "z_other_ns": request(seq(90, 9), extra_key="other")}
    order = make_policy("dfs-weight", stack).order(list(reqs.values()))
    # namespace "other" holds 3 (heaviest); a key that is another's prefix ends above it
    assert names(order, reqs) == ["x_other_ns", "y_other_ns", "z_other_ns", "prefix", "long"]


def test_dfs_weight_is_arrival_order_without_a_tree() -> None:
    stack = stack_of(enable_radix_cache=False)
    reqs = {"a": request(seq(0, 9)), "b": request(seq(500, 9)), "c": request(seq(0, 9))}
    assert names(make_policy("dfs-weight", stack).order(list(reqs.values())), reqs) == [
        "a", "b", "c"]


def test_the_prefix_trie_counts_and_matches() -> None:
    trie = PrefixTrie()
    keys = [[1, 2, 3, 4], [5, 6], [1, 2, 9], [1, 2, 3, 4, 5], [5, 6, 7], [1, 2]]
    assert [trie.insert(k) for k in keys] == list(range(6))
    assert trie.dfs_order() == [5, 0, 3, 2, 1, 4]
    assert (trie.shared([1, 2, 3, 7]), trie.shared([5, 6, 7, 8]), trie.shared([9])) == (3, 3, 0)
    assert trie.shared([1, 2, 3, 4, 5, 6]) == 5 and trie.shared([1, 2], "ns") == 0
    long = list(range(3000))
    trie.insert(long)
    assert trie.shared(long[:2999] + [-1]) == 2999  # found by halving


def test_every_policy_name_builds_and_a_bad_one_names_the_allowed() -> None:
    stack = stack_of()
    assert [make_policy(name, stack).name for name in SCHEDULE_POLICIES] == list(
        SCHEDULE_POLICIES)
    assert [make_policy(n, stack).cache_aware for n in SCHEDULE_POLICIES] == [
        True, False, False, True]
    with pytest.raises(ValueError, match="'sjf' is not one of lpm, fcfs, random, dfs-weight"):
        make_policy("sjf", stack)


# ------------------------------------------------------------------ delay, one step

SHARED = seq(1000, 40)  # 40 tokens: 10 pages, past IN_BATCH_SHARE_MIN_TOKENS


def admitted_one(stack: CacheStack, prompt: list[int], name: str = "lpm"
                 ) -> tuple[Admission, Request]:
    """An admission with one running request, admitted and still filling its prompt."""
    running: list[Request] = []
    admission = Admission(stack, RequestKV(stack, running), name)
    first = request(prompt)
    admission.commit(first, admission.plan(first))
    running.append(first)
    return admission, first


def test_a_request_sharing_a_long_uncached_prefix_with_a_filling_one_waits() -> None:
    assert len(SHARED) >= IN_BATCH_SHARE_MIN_TOKENS
    stack = stack_of()
    admission, _ = admitted_one(stack, SHARED + seq(1, 8))
    sharer, short, other_ns = (request(SHARED + seq(50, 8)),
                               request(SHARED[:IN_BATCH_SHARE_MIN_TOKENS - PS] + seq(50, 8)),
                               request(SHARED + seq(50, 8), extra_key="tenant"))
    sharing = admission.sharing([sharer, short, other_ns])
    assert sharing.defers(sharer)
    assert not sharing.defers(short)  # 28 shared tokens: computed beside it
    assert not sharing.defers(other_ns)  # another namespace shares nothing
    assert admission.delays == {sharer: 1}


def test_a_shared_prefix_already_cached_is_no_reason_to_wait() -> None:
    stack = stack_of()
    cache_finished(stack, SHARED[:24])
    admission, _ = admitted_one(stack, SHARED + seq(1, 8))
    partly = request(SHARED + seq(50, 8))  # 40 shared, 24 of them cached: 16 to gain
    assert not admission.sharing([partly]).defers(partly)


def test_a_request_admitted_in_this_step_delays_the_next_sharer() -> None:
    stack = stack_of()
    running: list[Request] = []
    admission = Admission(stack, RequestKV(stack, running))
    first, second = request(SHARED + seq(1, 8)), request(SHARED + seq(50, 8))
    sharing = admission.sharing([first, second])
    assert not sharing.defers(first)
    admission.commit(first, admission.plan(first))
    running.append(first)
    sharing.admitted(first)
    assert sharing.defers(second)


@pytest.mark.parametrize("name", ["fcfs", "random"])
def test_cache_agnostic_policies_never_delay(name: str) -> None:
    stack = stack_of()
    admission, _ = admitted_one(stack, SHARED + seq(1, 8), name)
    sharer = request(SHARED + seq(50, 8))
    assert not admission.sharing([sharer]).defers(sharer)


def test_a_delayed_request_is_not_delayed_forever() -> None:
    """A prefill that never ends (it is never run here) delays its sharer at most
    MAX_IN_BATCH_DELAYS steps; a request that leaves the queue loses its count."""
    stack = stack_of()
    admission, _ = admitted_one(stack, SHARED + seq(1, 8), "dfs-weight")
    sharer = request(SHARED + seq(50, 8))
    steps = [admission.sharing([sharer]).defers(sharer) for _ in range(MAX_IN_BATCH_DELAYS + 3)]
    assert steps == [True] * MAX_IN_BATCH_DELAYS + [False] * 3
    admission.sharing([])
    assert admission.delays == {}


# ------------------------------------------------------------ delay, end to end

PAGE = 4
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
PREFIX = [(7 * i + 3) % 251 for i in range(64)]  # 64 tokens: 16 pages
PROMPTS = [PREFIX + [11, 12, 13, 14, 15, 16, 17], PREFIX + [21, 22, 23, 24, 25]]


def make_engine(**overrides: object) -> Engine:
    return Engine(load_config(None, {"cache.page_size": PAGE, "cache.max_total_tokens": 4096,
                                     "model.device": "cpu", **overrides}))


@pytest.fixture(scope="module")
def alone_tokens() -> list[list[int]]:
    with make_engine(**{"cache.enable_radix_cache": False}) as e:
        return [e.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in PROMPTS]


@pytest.fixture
def engine() -> Iterator[Engine]:
    with make_engine() as e:
        yield e


def use_policy(e: Engine, name: str, max_batch_tokens: int | None = None) -> None:
    """Switch the scheduler's policy (and batch budget) between steps."""
    def switch() -> None:
        e.scheduler.admission.policy = make_policy(name, e.cache)
        if max_batch_tokens is not None:
            e.scheduler.max_batch_tokens = max_batch_tokens
    e.scheduler.call(switch).result(WAIT_S)


def batches(e: Engine, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Records the requests of each forward pass (their rids)."""
    return record_forwards(e, monkeypatch, lambda reqs: [r.rid for r in reqs])


def run_together(e: Engine) -> tuple[list[Request], list[dict]]:
    """Submit PROMPTS while the scheduler waits in a command, so one step takes both in, in
    this order; the requests and their results."""
    reqs = [e.make_request(input_ids=p, sampling_params=GREEDY) for p in PROMPTS]
    return reqs, [f.result(WAIT_S) for f in submit_in_one_step(e, reqs)]


@pytest.mark.parametrize("name", ["lpm", "dfs-weight"])
def test_the_second_sharer_waits_one_step_and_hits_the_prefix_in_l1(
        engine: Engine, alone_tokens: list[list[int]], monkeypatch: pytest.MonkeyPatch,
        name: str) -> None:
    use_policy(engine, name)
    seen = batches(engine, monkeypatch)
    (first, second), results = run_together(engine)
    assert seen[0] == [first.rid] and seen[1] == [first.rid, second.rid]
    assert results[0]["meta_info"]["cached_tokens"] == 0
    assert results[1]["meta_info"]["cached_tokens_details"]["device"] == len(PREFIX)
    assert [r["output_ids"] for r in results] == alone_tokens


def test_fcfs_admits_both_at_once_and_computes_the_prefix_twice(
        engine: Engine, alone_tokens: list[list[int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    use_policy(engine, "fcfs")
    seen = batches(engine, monkeypatch)
    reqs, results = run_together(engine)
    assert seen[0] == [r.rid for r in reqs]
    assert [r["meta_info"]["cached_tokens"] for r in results] == [0, 0]
    assert [r["output_ids"] for r in results] == alone_tokens


def test_a_sharer_waits_for_a_prefill_chunked_over_several_steps(
        engine: Engine, alone_tokens: list[list[int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With 32 tokens a step the first prompt (71 tokens) fills in three steps; the second
    waits through all three, then hits the whole shared prefix."""
    use_policy(engine, "lpm", max_batch_tokens=32)
    seen = batches(engine, monkeypatch)
    delayed = engine.stats()["counters"]["delayed_admissions"]
    (first, second), results = run_together(engine)
    assert seen[:4] == [[first.rid]] * 3 + [[first.rid, second.rid]]
    assert engine.stats()["counters"]["delayed_admissions"] - delayed >= 1
    assert results[1]["meta_info"]["cached_tokens_details"]["device"] == len(PREFIX)
    assert [r["output_ids"] for r in results] == alone_tokens
