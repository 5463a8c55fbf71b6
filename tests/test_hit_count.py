"""One request is one use (`hit_count`, which lfu and write_through_selective read) of each
node it uses, however often it is matched: at arrival (the L3 prefetch), at every admission
attempt while it waits, at its prefill's insert and at its end."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Sequence

import pytest
from conftest import WAIT_S, submit_in_one_step
from test_hiradix_cache import make_pools, make_tree

from hicache.tree.radix import RadixCache
from hicache_server.config import load_config
from hicache_server.engine import Engine

PAGE = 16


# ------------------------------------------------------------------------------- tree

def test_a_match_without_counting_touches_and_count_use_counts_once() -> None:
    tree = RadixCache(page_size=2)
    tree.insert([1, 2, 3, 4])
    (node,) = tree.root.children.values()
    before = node.last_access_time
    for _ in range(3):
        m = tree.match_prefix([1, 2, 3, 4, 5, 6], count_hit=False)
    assert node.hit_count == 1 and node.last_access_time >= before
    tree.inc_lock_ref(m.last_device_node)
    tree.count_use(m.last_device_node)
    tree.dec_lock_ref(m.last_device_node)
    assert node.hit_count == 2
    tree.check_integrity()


def test_count_use_counts_the_ancestors_too() -> None:
    tree = RadixCache(page_size=1)
    tree.insert([1, 2, 3])
    tree.insert([1, 2, 4])
    upper, leaf = tree.peek_path([1, 2, 3])
    assert (upper.hit_count, leaf.hit_count) == (2, 1)
    tree.count_use(leaf)
    assert (upper.hit_count, leaf.hit_count) == (3, 2)
    assert tree.peek_path([1, 2, 4])[-1].hit_count == 1


@pytest.mark.parametrize("threshold", [2, 3])
def test_selective_copies_after_threshold_requests_not_after_repeated_matches(threshold
                                                                               ) -> None:
    """Each request: matched three times without counting (arrival, two admission
    attempts), then its use counted once at its end. The prefix is copied to L2 by the
    `threshold`-th request, never earlier."""
    ps = 2
    dev, host = make_pools(32, 32, ps)
    tree = make_tree(dev, host, ps, "write_through_selective")
    tree.write_through_threshold = threshold
    prefix = [1, 2, 3, 4]
    tree.insert(prefix, dev.alloc(4))  # request 1 computed it: one use
    for request in range(2, threshold + 1):
        for _ in range(3):
            m = tree.match_prefix(prefix + [9, 9], count_hit=False)
            tree.writing_check(wait=True)
            assert tree.counters.written_tokens == 0, f"copied at a match of request {request}"
        tree.inc_lock_ref(m.last_device_node)
        tree.count_use(m.last_device_node)  # its end
        tree.dec_lock_ref(m.last_device_node)
        tree.writing_check(wait=True)
        copied = tree.counters.written_tokens
        assert copied == (4 if request == threshold else 0), (request, copied)
    tree.check_integrity()
    tree.controller.close()


# ----------------------------------------------------------------------------- engine

def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def counting_matches(e: Engine) -> Counter:
    """Count the tree's matches per first page of key (wraps the engine's tree)."""
    tree, counts = e.cache.tree, Counter()
    match = tree.match_prefix

    def counted(key: Sequence[int], *args, **kwargs):
        counts[tuple(key[:PAGE])] += 1
        return match(key, *args, **kwargs)
    tree.match_prefix = counted
    return counts


def generated(e: Engine) -> int:
    return e.stats()["counters"]["generated_tokens"]


def wait_decoding(e: Engine, tokens_out: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while generated(e) < tokens_out:
        assert time.monotonic() < deadline, "the long request never started decoding"
        time.sleep(0.005)


def hit_counts(e: Engine, key: list[int], n: int) -> list[int]:
    """The hit counts of the nodes of `key`'s cached path that hold its first `n` tokens."""
    def read() -> list[int]:
        out, start = [], 0
        for node in e.cache.tree.peek_path(key):
            if start < n:
                out.append(node.hit_count)
            start += len(node.key)
        return out
    return e._call(read)


def test_a_request_waiting_through_admission_attempts_counts_one_use(tmp_path) -> None:
    """A 16-page L1. `c` caches a 4-page prefix P. A long request `a` then decodes and
    holds L1 so that `b` (P and 5 pages more) cannot be admitted: `b` is matched at arrival
    (its L3 prefetch) and at every admission attempt until `a` ends. P's nodes count one
    use per request (c, b), and under write_through_selective with threshold 3 nothing is
    copied to L2 until a third request (d) uses P."""
    prefix = tokens(1, 4 * PAGE)
    short = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    cfg = load_config(None, {
        "cache.page_size": PAGE, "cache.max_total_tokens": 16 * PAGE, "model.device": "cpu",
        "cache.hierarchical": True, "host.write_policy": "write_through_selective",
        "host.write_through_threshold": 3, "storage.backend": "lmdb",
        "storage.lmdb.path": str(tmp_path / "lmdb"), "storage.prefetch_threshold": PAGE,
        "storage.prefetch_policy": "wait_complete"})
    with Engine(cfg) as e:
        c = prefix + tokens(2, PAGE)
        e.generate(input_ids=c, sampling_params=short)
        assert hit_counts(e, c, len(prefix)) == [1]
        matches, before = counting_matches(e), generated(e)
        long = threading.Thread(target=e.generate, kwargs={
            "input_ids": tokens(3, 40), "sampling_params": {
                "temperature": 0, "max_new_tokens": 150, "ignore_eos": True}})
        long.start()
        wait_decoding(e, before + 2)
        b_ids = prefix + tokens(4, 5 * PAGE)
        b = e.generate(input_ids=b_ids, sampling_params=short)
        long.join()
        assert matches[tuple(prefix[:PAGE])] >= 3, "b was admitted at once: no test"
        assert b["meta_info"]["cached_tokens"] >= len(prefix)
        assert hit_counts(e, b_ids, len(prefix)) == [2], "b counted more than once"
        assert hit_counts(e, b_ids, len(b_ids)) == [2, 1]  # b's own pages: b alone
        e._call(e.cache.steps.quiesce)
        assert e.stats()["tiers"]["host"]["written_tokens"] == 0
        e.generate(input_ids=prefix + tokens(5, PAGE), sampling_params=short)  # d
        assert hit_counts(e, b_ids, len(prefix)) == [3]
        e._call(e.cache.steps.quiesce)
        assert e.stats()["tiers"]["host"]["written_tokens"] == len(prefix)


def test_a_retracted_request_counts_one_use(tmp_path) -> None:
    """Six distinct prompts decoding 40 tokens each outgrow a 128-token L1 (4-token pages):
    some are retracted, give their pages to the tree and match them back when readmitted.
    Every node still counts one use: each is used by one request alone."""
    cfg = load_config(None, {"cache.page_size": 4, "cache.max_total_tokens": 128,
                             "model.device": "cpu"})
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    with Engine(cfg) as e:
        reqs = [e.make_request(input_ids=tokens(10 + i, 12), sampling_params=params)
                for i in range(6)]
        for fut in submit_in_one_step(e, reqs):
            fut.result(WAIT_S)
        assert e.stats()["counters"]["retracted_requests"] > 0, "no retraction: no test"
        counts = e._call(lambda: [n.hit_count for n in e.cache.tree.iter_nodes()])
    assert counts and set(counts) == {1}, counts
