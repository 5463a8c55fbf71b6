"""A hybrid model's L3 by kind (`hicache.storage.kinds`), through the real engine: random-weight
Gemma 3 (windows of 40 tokens, pages of 16) stores full-layer parts for every page and
window-layer parts only for the trailing window of each boundary it kept; after a restart a
prefix is a hit exactly where the tree's rule would make it one (its trailing window whole),
and every answer is the tokens of recomputation."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import tier_workload as tiers
from test_gemma3_tiers import WINDOW, write_random_gemma3

from hicache.memory.windowed import WindowedKVPool
from hicache.pages import pages_down

PAGE = tiers.PAGE
PROMPT = [random.Random(5).randrange(256) for _ in range(300)]
# shares PROMPT's first 200 tokens: its L3 pages to 192, but no window part near 192
BRANCH = PROMPT[:200] + [random.Random(6).randrange(256) for _ in range(100)]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_gemma3(tmp_path_factory.mktemp("gemma3l3"))


@pytest.fixture(scope="module")
def answers(served: Path) -> dict[str, list[int]]:
    with tiers.engine(served, **{"cache.enable_radix_cache": False}) as e:
        return {name: e.generate(input_ids=p, sampling_params=tiers.GREEDY)["output_ids"]
                for name, p in (("prompt", PROMPT), ("branch", BRANCH))}


def _storage(e: tiers.Engine) -> dict:
    return e.stats()["tiers"]["storage"]


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_l3_keeps_every_page_s_full_layers_and_only_the_windows_of_boundaries(
        served: Path, answers: dict[str, list[int]], policy: str, tmp_path: Path) -> None:
    """write_back copies a node when L1 must drop it: a second long prompt pushes the
    first out of an L1 of 512 tokens."""
    lmdb = tmp_path / "lmdb"
    with tiers.tiered(served, lmdb, **{"host.write_policy": policy,
                                       "cache.max_total_tokens": 512}) as e:
        assert isinstance(e.cache.slots.device_kv(), WindowedKVPool)  # L1 split beside L3
        out = e.generate(input_ids=PROMPT, sampling_params=tiers.GREEDY)
        assert out["output_ids"] == answers["prompt"]
        if policy == "write_back":
            e.generate(input_ids=BRANCH[::-1], sampling_params=tiers.GREEDY)
        e.flush_cache(["device", "host"])  # every copy and backup lands first
        storage = _storage(e)
    end = pages_down(len(PROMPT) + tiers.GREEDY["max_new_tokens"], PAGE)
    assert storage["backed_up_tokens"] >= end  # full layers: every page
    # window layers: the prompt's boundary (what a query at 288 or 272 reads) and the
    # answer's (one page), nothing before
    windows = storage["window_backed_up_tokens"]
    assert 0 < windows <= pages_down(WINDOW + 2 * PAGE, PAGE) + 2 * PAGE
    assert windows <= 5 * PAGE  # of 19 pages

    with tiers.tiered(served, lmdb) as again:  # a restart: L3 alone has the prompt
        out = again.generate(input_ids=PROMPT, sampling_params=tiers.GREEDY)
        assert out["output_ids"] == answers["prompt"]
        assert out["meta_info"]["cached_tokens_details"] == {
            "device": 0, "host": 0, "storage": pages_down(len(PROMPT) - 1, PAGE)}
        assert _storage(again)["window_prefetched_tokens"] > 0
        again.cache.check_integrity()


def test_after_a_restart_a_prefix_without_its_window_in_l3_is_no_hit(
        served: Path, answers: dict[str, list[int]], tmp_path: Path) -> None:
    """BRANCH shares 192 tokens of pages with PROMPT in L3, but L3 holds no window part a
    query at 192 reads: it is computed, with the same tokens, and the full parts L3 holds
    are not fetched for nothing."""
    lmdb = tmp_path / "lmdb"
    with tiers.tiered(served, lmdb) as e:
        e.generate(input_ids=PROMPT, sampling_params=tiers.GREEDY)
        e.flush_cache(["device", "host"])
    with tiers.tiered(served, lmdb) as again:
        out = again.generate(input_ids=BRANCH, sampling_params=tiers.GREEDY)
        assert out["output_ids"] == answers["branch"]
        assert out["meta_info"]["cached_tokens_details"]["storage"] == 0
        assert _storage(again)["prefetched_tokens"] == 0
        # the prompt itself is still a whole hit: the shared pages' full layers from L1,
        # the rest and its window from L3
        out = again.generate(input_ids=PROMPT, sampling_params=tiers.GREEDY)
        assert out["output_ids"] == answers["prompt"]
        details = out["meta_info"]["cached_tokens_details"]
        assert details["storage"] > 0
        assert details["device"] + details["storage"] == pages_down(len(PROMPT) - 1, PAGE)
        again.cache.check_integrity()


def test_in_one_process_l3_brings_back_what_l1_and_l2_dropped(
        served: Path, answers: dict[str, list[int]], tmp_path: Path) -> None:
    """Flushing L1 and L2 between the turns of the tier workload: every later turn is
    served from L3, the window KV with it, with the tokens of recomputation."""
    recomputed = tiers.recompute(served)
    with tiers.tiered(served, tmp_path / "lmdb") as e:
        assert tiers.run_workload(e, between_turns=lambda e: e.flush_cache(
            ["device", "host"])) == recomputed
        storage = _storage(e)
        assert e.stats()["counters"]["cached_storage"] > 0
        assert storage["window_prefetched_tokens"] > 0
        assert storage["window_backed_up_tokens"] > 0
        e.cache.check_integrity()


def test_kv_events_name_each_kind_as_vllm_s_hybrid_manager_does(served: Path,
                                                                tmp_path: Path) -> None:
    """Group 0 (full layers) for every page on every tier; group 1 (window layers, their
    window) only for the pages whose window KV a tier holds: L1's (spare pages kept while
    the pool has room), the L2 copies that hold it, L3's window parts (the boundaries')."""
    from test_kv_events import EVENTS, OURS, TIMEOUT_S, Subscriber

    with tiers.tiered(served, tmp_path / "lmdb", **EVENTS) as e:
        pub = e.cache.publisher
        sub = Subscriber(pub.endpoint, pub.replay_endpoint)
        try:
            e.generate(input_ids=PROMPT, sampling_params=tiers.GREEDY)
            e.flush_cache(["device"])
            deadline = time.monotonic() + TIMEOUT_S
            while pub.counters.batches < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            events = [ev for _, p in sub.replay(0) for ev in OURS.decode(p).events]
        finally:
            sub.close()
    pages: dict[tuple, int] = {}
    for ev in events:
        if hasattr(ev, "block_hashes"):
            key = (type(ev).__name__, ev.medium, ev.group_idx)
            pages[key] = pages.get(key, 0) + len(ev.block_hashes)
    stored = [ev for ev in events if type(ev).__name__ == "BlockStored"]
    assert {(ev.group_idx, ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window)
            for ev in stored} == {(0, "full_attention", None), (1, "sliding_window", WINDOW)}
    end = pages_down(len(PROMPT) + tiers.GREEDY["max_new_tokens"], PAGE) // PAGE
    for medium in ("GPU", "CPU", "DISK"):
        assert pages[("BlockStored", medium, 0)] == end
        assert 0 < pages[("BlockStored", medium, 1)] <= end
    assert pages[("BlockStored", "DISK", 1)] <= 5  # L3: the boundaries' windows alone
    assert pages[("BlockRemoved", "GPU", 0)] == end  # the flush of L1
    assert pages[("BlockRemoved", "GPU", 1)] == pages[("BlockStored", "GPU", 1)]


def test_a_boundary_made_by_a_split_gets_its_window_parts_in_l3(
        served: Path, tmp_path: Path) -> None:
    """BRANCH splits PROMPT's stored node at 192: L3 gets the window parts a query at 192
    reads (the L2 copy holds them), so after a restart a third prompt sharing those 192
    tokens hits them from L3 with the tokens of recomputation."""
    third = PROMPT[:200] + [random.Random(7).randrange(256) for _ in range(60)]
    with tiers.engine(served, **{"cache.enable_radix_cache": False}) as e:
        want = e.generate(input_ids=third, sampling_params=tiers.GREEDY)["output_ids"]
    lmdb = tmp_path / "lmdb"
    with tiers.tiered(served, lmdb) as e:
        e.generate(input_ids=PROMPT, sampling_params=tiers.GREEDY)
        e._call(e.cache.steps.quiesce)  # PROMPT's pages are in L3 before the split
        e.generate(input_ids=BRANCH, sampling_params=tiers.GREEDY)
        e.flush_cache(["device", "host"])
    with tiers.tiered(served, lmdb) as again:
        out = again.generate(input_ids=third, sampling_params=tiers.GREEDY)
        assert out["output_ids"] == want
        assert out["meta_info"]["cached_tokens_details"]["storage"] == 192
        again.cache.check_integrity()


def test_a_stored_node_whose_l2_copy_comes_back_writes_no_window_part_again(
        served: Path, answers: dict[str, list[int]], tmp_path: Path) -> None:
    """PROMPT's nodes are in L3 with their boundaries' window parts (`window_stored`); L2 is
    flushed, and asking PROMPT again copies its L1 pages to L2 again: L3 is written nothing,
    neither full nor window parts."""
    with tiers.tiered(served, tmp_path / "lmdb") as e:
        e.generate(input_ids=PROMPT, sampling_params=tiers.GREEDY)
        e._call(e.cache.steps.quiesce)
        before = _storage(e)
        assert before["window_backed_up_tokens"] > 0
        e.flush_cache(["host"])
        out = e.generate(input_ids=PROMPT, sampling_params=tiers.GREEDY)
        assert out["output_ids"] == answers["prompt"]
        e._call(e.cache.steps.quiesce)
        assert e.stats()["tiers"]["host"]["used"] > 0  # the copies came back
        after = _storage(e)
        for key in ("backed_up_tokens", "window_backed_up_tokens"):
            assert after[key] == before[key], key
        e.cache.check_integrity()
