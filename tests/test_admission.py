"""Admission asked, then committed: the ask changes no room; the commit evicts exactly what
the ask counted on, never the request's own hit, and needs no undo. Only the fill is
reserved; the new tokens of every request are estimated (`NewTokenRatio`)."""

from __future__ import annotations

import pytest
from conftest import cache_finished, cpu_stack

from hicache.stack import CacheStack
from hicache_server.request import Request, RequestInput, SamplingParams
from hicache_server.scheduler.admission import (
    INIT_NEW_TOKEN_RATIO,
    MIN_NEW_TOKEN_RATIO_FACTOR,
    NEW_TOKEN_RATIO_DECAY_STEPS,
    RETRACT_DECODE_STEPS,
    Admission,
    NewTokenRatio,
)
from hicache_server.scheduler.kv import RequestKV

PS = 4
L1_TOKENS = 64


def request(prompt: list[int], max_new: int) -> Request:
    return Request(RequestInput(prompt, SamplingParams(max_new_tokens=max_new,
                                                       temperature=0.0)))


def admission_of(stack: CacheStack, running: list[Request] | None = None
                 ) -> tuple[Admission, RequestKV]:
    kv = RequestKV(stack, [] if running is None else running)
    return Admission(stack, kv), kv


def test_an_ask_that_says_no_evicts_nothing() -> None:
    stack = cpu_stack(PS, L1_TOKENS)
    cache_finished(stack, list(range(1000, 1048)))  # 48 evictable tokens, 16 free
    admission, _ = admission_of(stack)
    assert admission.plan(request(list(range(80)), 8)) is None  # 80 + 0.7 * 8 of 64
    assert stack.tree.evictable_size() == 48 and stack.device_pool.available_size() == 16
    stack.check_integrity()


def test_the_requests_own_hit_is_not_counted_as_room() -> None:
    """All 48 evictable tokens are the request's own prefix: evicting them to make room
    for the rest of it would throw the hit away. The ask says no and changes nothing."""
    stack = cpu_stack(PS, L1_TOKENS)
    prefix = list(range(48))
    cache_finished(stack, prefix)
    req = request(prefix + list(range(500, 509)), 8)  # 9 new (12 in pages) + 0.7 * 8: 18
    assert admission_of(stack)[0].plan(req) is None
    assert stack.tree.evictable_size() == 48
    assert stack.tree.match_prefix(prefix).device_indices.numel() == 48


def test_commit_evicts_the_shortfall_keeps_the_hit_and_releases_cleanly() -> None:
    stack = cpu_stack(PS, L1_TOKENS)
    prefix = list(range(16))
    cache_finished(stack, prefix)
    cache_finished(stack, list(range(1000, 1032)))  # 32 tokens of another context
    admission, kv = admission_of(stack)
    req = request(prefix + list(range(500, 521)), 8)  # hit 16; fill 21 -> 24 slots, 6 more
    plan = admission.plan(req)  # estimated: asked for (30 of 16 free), not promised
    assert plan is not None and (plan.need_tokens, plan.evict_tokens) == (24, 8)
    assert stack.tree.evictable_size() == 48  # the ask changed nothing
    admission.commit(req, plan)
    assert req.kv.cached_details == {"device": 16, "host": 0, "storage": 0}
    assert (req.kv.tree_len, req.kv.reserved) == (16, 24)
    assert stack.tree.protected_size() == 16  # the hit, locked
    assert stack.device_pool.available_size() >= 24  # the other context made room
    stack.check_integrity()
    kv.release(req, keep_cache=False)
    assert stack.tree.protected_size() == 0
    stack.check_integrity()


def test_a_commit_that_fails_lets_go_of_its_lock(monkeypatch) -> None:
    """A commit whose load-back fails unlocks the path it had locked before the exception
    leaves the cache: the request holds no lease, and the release that fails it has nothing
    to give back; nothing else is undone because nothing else happened."""
    stack = cpu_stack(PS, L1_TOKENS, **{"cache.hierarchical": True})
    prefix = list(range(32))
    cache_finished(stack, prefix[:16])
    cache_finished(stack, prefix)  # two nodes of 16
    stack.steps.quiesce()
    assert stack.tree.evict(16) == 16  # the deeper one: L2 only now
    monkeypatch.setattr(stack.tree, "init_load_back", lambda node: 1 / 0)
    req = request(prefix + [7, 7], 4)
    admission, kv = admission_of(stack)
    plan = admission.plan(req)
    assert plan is not None and plan.match.host_tokens == 16
    with pytest.raises(ZeroDivisionError):
        admission.commit(req, plan)
    assert req.kv.lease is None and stack.tree.protected_size() == 0  # the device hit, let go
    kv.release(req, keep_cache=False)
    assert stack.tree.protected_size() == 0
    stack.check_integrity()
    stack.admin.close()


def test_the_running_requests_estimated_tokens_are_kept_free() -> None:
    """A running request that may still generate 40 tokens is expected to use 0.7 of them:
    a newcomer whose fill fits in the free slots waits while that estimate leaves it no room,
    and is admitted once the estimate has come down."""
    stack = cpu_stack(PS, L1_TOKENS)
    running: list[Request] = []
    admission, kv = admission_of(stack, running)
    first = request(list(range(20)), 40)  # fill 20, estimate 28: 48 of 64
    admission.commit(first, admission.plan(first))
    running.append(first)
    second = request(list(range(100, 116)), 8)  # fill 16, estimate 6
    assert kv.free_tokens() == 64 - 20 >= 16
    assert admission.plan(second) is None  # 44 free - 28 for the first < 22
    first.output.ids.extend([1] * 30)  # 10 left to generate: 7 expected
    assert admission.plan(second) is not None


def test_a_decode_beyond_the_fill_takes_unpromised_slots_and_evicts_for_them() -> None:
    stack = cpu_stack(PS, L1_TOKENS)
    cache_finished(stack, list(range(1000, 1020)))
    cache_finished(stack, list(range(2000, 2020)))  # 40 evictable in two leaves, 24 free
    running: list[Request] = []
    admission, kv = admission_of(stack, running)
    req = request(list(range(16)), 32)
    admission.commit(req, admission.plan(req))
    running.append(req)
    assert kv.ensure_slots(req, 16) and req.kv.reserved == 0  # the fill, from the reservation
    req.kv.num_computed = 16
    assert kv.ensure_slots(req, 40)  # 24 more: 8 free, one leaf evicted
    assert stack.tree.evictable_size() == 20 and len(req.kv.slots) == 40
    assert not kv.ensure_slots(req, 72)  # 32 more: 4 free and 20 evictable; none allocated
    assert len(req.kv.slots) == 40
    stack.check_integrity()


def test_a_retracted_request_readmitted_matches_its_prompt_and_output() -> None:
    """Retracted, a request's whole pages of prompt and output go to the tree, unlocked;
    readmitted, it matches them (all but its last token, whose logits pick the next one),
    fills the rest, and keeps the cached counts its client was told the first time."""
    stack = cpu_stack(PS, L1_TOKENS)
    running: list[Request] = []
    admission, kv = admission_of(stack, running)
    req = request(list(range(10)), 20)
    admission.commit(req, admission.plan(req))
    running.append(req)
    assert kv.ensure_slots(req, 10)
    req.kv.num_computed = 10
    for token in range(200, 207):  # decoded 7 tokens: positions [0, 16) computed
        assert kv.ensure_slots(req, req.kv.num_computed + 1)
        req.output.ids.append(token)
        req.kv.num_computed = req.seq_len - 1
    assert req.kv.num_computed == 16
    kv.retract(req)
    running.remove(req)
    req.kv.retractions += 1
    assert (req.kv.num_computed, req.kv.reserved, len(req.kv.slots)) == (0, 0, 0)
    assert stack.tree.protected_size() == 0 and stack.tree.evictable_size() == 16
    assert stack.device_pool.available_size() == L1_TOKENS - 16
    plan = admission.plan(req)
    assert plan is not None and plan.match.device_tokens == 16
    admission.commit(req, plan)
    assert (req.kv.num_computed, req.kv.admit_hit, req.kv.reserved) == (16, 16, 4)  # fill: 1 token
    assert req.kv.cached_details == {"device": 0, "host": 0, "storage": 0}
    kv.release(req, keep_cache=True)
    stack.check_integrity()


def test_the_new_token_ratio_decays_jumps_after_a_retraction_and_resets() -> None:
    ratio = NewTokenRatio()
    floor = INIT_NEW_TOKEN_RATIO * MIN_NEW_TOKEN_RATIO_FACTOR
    assert ratio.estimate(request([1], 100)) == 70
    for _ in range(NEW_TOKEN_RATIO_DECAY_STEPS // 2):
        ratio.decayed()
    assert ratio.value == pytest.approx((INIT_NEW_TOKEN_RATIO + floor) / 2)
    for _ in range(NEW_TOKEN_RATIO_DECAY_STEPS):
        ratio.decayed()
    assert ratio.value == pytest.approx(floor)
    left = [request([1], 200), request([2], 300)]
    left[0].output.ids.extend([5] * 60)
    ratio.retracted(left)
    assert ratio.value == pytest.approx((60 + 2 * RETRACT_DECODE_STEPS) / 500)
    ratio.retracted([request([1], 10)])  # 20 more tokens of a 10-token request: capped
    assert ratio.value == 1.0
    ratio.reset()
    assert ratio.value == INIT_NEW_TOKEN_RATIO
