"""L2 smaller than L1: under write_through the host pool reclaims its copies of nodes that
L1 holds too, so new writes are not dropped, and the tiers stay consistent."""

from __future__ import annotations

import random

import pytest
import torch
from test_engine import GREEDY, conversations, engine, run_workload, tiered
from test_hiradix_cache import assert_device_holds, forward, make_pools, make_tree

PS = 4


def compute(tree, dev, seq: list[int]) -> torch.Tensor:
    slots = dev.alloc(len(seq))
    forward(dev, seq, slots)
    present = tree.insert(seq, slots)
    dev.free(slots[:present])
    tree.writing_check(wait=True)
    return slots


def test_writes_reclaim_copies_of_device_nodes_instead_of_dropping() -> None:
    """L1 of 32 pages, L2 of 8: every sequence written through finds room, by dropping the
    copies of older sequences that L1 still holds (deepest first, no L2 node without its
    parent), and what L1 holds stays byte-exact."""
    dev, host = make_pools(32, 8, PS)
    tree = make_tree(dev, host, PS)
    rng = random.Random(0)
    seqs = [[rng.randrange(1000) for _ in range(4 * PS)] for _ in range(6)]
    for seq in seqs:
        compute(tree, dev, seq)
        tree.check_integrity()
    assert tree.counters.write_dropped_tokens == 0
    assert tree.counters.written_tokens == 6 * 4 * PS
    assert tree.counters.reclaimed_copy_tokens == (6 - 2) * 4 * PS  # L2 holds two of six
    last = tree.peek_path(seqs[-1])
    assert all(n.host_value is not None for n in last)  # the newest copy is kept
    for seq in seqs:  # L1 kept every sequence (it has the room)
        m = tree.match_prefix(seq)
        assert m.device_indices.numel() == len(seq)
        assert_device_holds(dev, seq, m.device_indices)


def test_a_reclaimed_node_evicted_from_l1_is_deleted_not_demoted() -> None:
    dev, host = make_pools(16, 4, PS)
    tree = make_tree(dev, host, PS)
    a, b = list(range(4 * PS)), list(range(100, 100 + 4 * PS))
    compute(tree, dev, a)
    compute(tree, dev, b)  # L2 holds b now; a's copy was reclaimed
    assert all(n.host_value is None for n in tree.peek_path(a))
    tree.evict(tree.total_size())
    tree.check_integrity()
    assert tree.match_prefix(a).device_indices.numel() == 0
    assert tree.match_prefix(a).host_hit_length == 0  # gone from both tiers
    assert tree.match_prefix(b).host_hit_length == len(b)  # demoted to L2


def test_protected_copies_are_not_reclaimed() -> None:
    dev, host = make_pools(16, 4, PS)
    tree = make_tree(dev, host, PS)
    a, b = list(range(4 * PS)), list(range(100, 100 + 4 * PS))
    compute(tree, dev, a)
    node = tree.peek_path(a)[-1]
    tree.protect_host(node)  # an L3 backup reads it
    compute(tree, dev, b)
    assert node.host_value is not None and tree.counters.write_dropped_tokens == len(b)
    tree.release_host(node)
    tree.check_integrity()


@pytest.mark.parametrize("ratio", [0.25, 0.5])
def test_an_engine_with_l2_smaller_than_l1_gives_the_tokens_of_recomputation(
        tmp_path, ratio) -> None:
    with engine(tmp_path, **{"cache.enable_radix_cache": False}) as e:
        reference = run_workload(e)
    flushes = []
    with engine(tmp_path, **{"cache.hierarchical": True, "host.ratio": ratio,
                             "cache.max_total_tokens": 1024}) as e:
        assert run_workload(e, between_turns=lambda e: flushes.append(
            e.flush_cache(["device"]))) == reference
        host = e.stats()["tiers"]["host"]
        e.scheduler.call(lambda: (e.cache.steps.quiesce(), e.cache.check_integrity())).result(60)
        again = e.generate(input_ids=conversations()[0][0], sampling_params=GREEDY)
    assert host["capacity"] == int(1024 * ratio)
    assert host["write_dropped_tokens"] == 0
    assert again["output_ids"] == reference[0]


def l3_pages_after_workload(tmp_path, ratio: float, reference) -> tuple[int, dict]:
    with tiered(tmp_path, **{"host.ratio": ratio, "cache.max_total_tokens": 1024}) as e:
        assert run_workload(e) == reference
        e.scheduler.call(lambda: e.cache.steps.quiesce()).result(60)
        tiers = e.stats()["tiers"]
    return tiers["storage"]["pages"], tiers["host"]


def test_with_l2_a_quarter_of_l1_every_page_still_reaches_l3_and_a_restart_serves_it(
        tmp_path) -> None:
    """L3 backups go through L2: if writes to a small L2 were dropped, pages would never
    reach L3 (SGLang #33862). With L2 a quarter of L1, L3 ends up with as many pages as with
    L2 four times L1, and after a restart it serves the prompts with the same tokens."""
    with engine(tmp_path, **{"cache.enable_radix_cache": False}) as e:
        reference = run_workload(e)
    large, _ = l3_pages_after_workload(tmp_path / "large", 4.0, reference)
    small, host = l3_pages_after_workload(tmp_path / "small", 0.25, reference)
    assert host["write_dropped_tokens"] == 0 and host["reclaimed_copy_tokens"] > 0
    assert small == large > 0
    with tiered(tmp_path / "small", **{"host.ratio": 0.25, "cache.max_total_tokens": 1024}
                ) as e:
        assert run_workload(e) == reference
        assert e.stats()["counters"]["cached_storage"] > 0
