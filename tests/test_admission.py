"""Admission asked, then committed: the ask changes no room; the commit evicts exactly what
the ask counted on, never the request's own hit, and needs no undo."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hicache.config import load_config
from hicache.stack import CacheStack, ModelKV, build_stack
from server.request import Request, SamplingParams
from server.scheduler.admission import Admission
from server.scheduler.kv import RequestKV

PS = 4
L1_TOKENS = 64
MODEL = ModelKV(2, 2, 8, torch.float32, torch.device("cpu"), Path("unused"))


def stack_of(hierarchical: bool = False) -> CacheStack:
    cfg = load_config(None, {"cache.page_size": PS, "cache.max_total_tokens": L1_TOKENS,
                             "cache.hierarchical": hierarchical, "model.device": "cpu"})
    return build_stack(cfg, MODEL)


def cache(stack: CacheStack, tokens: list[int]) -> None:
    """A finished request's KV, in the tree and unlocked."""
    slots = stack.device_pool.alloc(len(tokens))
    stack.device_pool.free(slots[:stack.tree.insert(tokens, slots)])


def request(prompt: list[int], max_new: int) -> Request:
    return Request(prompt, SamplingParams(max_new_tokens=max_new, temperature=0.0))


def test_an_ask_that_says_no_evicts_nothing() -> None:
    stack = stack_of()
    cache(stack, list(range(1000, 1048)))  # 48 evictable tokens, 16 free
    admission = Admission(stack, [])
    assert admission.plan(request(list(range(80)), 8)) is None  # needs 88 of 64
    assert stack.tree.evictable_size() == 48 and stack.device_pool.available_size() == 16
    stack.check_integrity()


def test_the_requests_own_hit_is_not_counted_as_room() -> None:
    """All 48 evictable tokens are the request's own prefix: evicting them to make room
    for the rest of it would throw the hit away. The ask says no and changes nothing."""
    stack = stack_of()
    prefix = list(range(48))
    cache(stack, prefix)
    req = request(prefix + list(range(500, 509)), 8)  # 9 new prompt tokens + 8: 20 slots
    assert Admission(stack, []).plan(req) is None
    assert stack.tree.evictable_size() == 48
    assert stack.tree.match_prefix(prefix).device_indices.numel() == 48


def test_commit_evicts_the_shortfall_keeps_the_hit_and_releases_cleanly() -> None:
    stack = stack_of()
    prefix = list(range(16))
    cache(stack, prefix)
    cache(stack, list(range(1000, 1032)))  # 32 tokens of another context
    running: list[Request] = []
    admission, kv = Admission(stack, running), RequestKV(stack)
    req = request(prefix + list(range(500, 521)), 8)  # hit 16; 21 + 8 -> 32 slots
    plan = admission.plan(req)
    assert plan is not None and (plan.need_tokens, plan.evict_tokens) == (32, 16)
    assert stack.tree.evictable_size() == 48  # the ask changed nothing
    admission.commit(req, plan)
    assert req.cached_details == {"device": 16, "host": 0, "storage": 0}
    assert (req.tree_len, req.reserved) == (16, 32)
    assert stack.tree.protected_size() == 16  # the hit, locked
    assert stack.device_pool.available_size() >= 32  # the other context made room
    stack.check_integrity()
    kv.release(req, keep_cache=False)
    assert stack.tree.protected_size() == 0
    stack.check_integrity()


def test_a_commit_that_fails_lets_go_of_its_lock(monkeypatch) -> None:
    """The lock is recorded on the request the moment it is taken, so the release that
    fails a request takes it back; nothing else is undone because nothing else happened."""
    stack = stack_of(hierarchical=True)
    prefix = list(range(32))
    cache(stack, prefix[:16])
    cache(stack, prefix)  # two nodes of 16
    stack.quiesce()
    assert stack.tree.evict(16) == 16  # the deeper one: L2 only now
    monkeypatch.setattr(stack.tree, "init_load_back", lambda node: 1 / 0)
    req = request(prefix + [7, 7], 4)
    plan = Admission(stack, []).plan(req)
    assert plan is not None and plan.match.host_hit_length == 16
    with pytest.raises(ZeroDivisionError):
        Admission(stack, []).commit(req, plan)
    assert stack.tree.protected_size() == 16  # the device hit, locked for this request
    RequestKV(stack).release(req, keep_cache=False)
    assert stack.tree.protected_size() == 0
    stack.check_integrity()
    stack.close()
