"""A hybrid tree's KV events name their KV group (vLLM 0.32's hybrid fields): group 0 for the
full layers of every page, group 1 for the window layers of the pages whose window KV L1
holds; a tombstone removes group 1 alone; a restate after `AllBlocksCleared` says both again."""

from __future__ import annotations

from test_window_tree import PAGE, make_pool, put, seq

from hicache.events.recorder import EventRecorder
from hicache.storage.hashing import PageHasher
from hicache.tree.radix import RadixCache


def summary(events: list) -> list[tuple]:
    return [(type(e).__name__, e.medium, e.group_idx, getattr(e, "kv_cache_spec_kind", None),
             getattr(e, "kv_cache_spec_sliding_window", None), len(e.block_hashes))
            for e in events if hasattr(e, "block_hashes")]


def test_group_events_on_insert_tombstone_and_restate() -> None:
    pool = make_pool()
    recorder = EventRecorder(PageHasher(PAGE, "m", "float32", 3, 1, 2), PAGE, window=8)
    tree = RadixCache(pool, page_size=PAGE, events=recorder)
    recorder.take()
    put(tree, pool, seq(0, 24), live_from=12)  # pages 0-2 left the window: tombstones
    assert summary(recorder.take()) == [
        ("BlockStored", "GPU", 0, "full_attention", None, 6),
        ("BlockStored", "GPU", 1, "sliding_window", 8, 3)]
    tree.kv_events.record_all(tree.peek_path(seq(0, 24)))  # a restate says both again
    assert summary(recorder.take()) == [
        ("BlockStored", "GPU", 0, "full_attention", None, 3),
        ("BlockStored", "GPU", 0, "full_attention", None, 3),
        ("BlockStored", "GPU", 1, "sliding_window", 8, 3)]
    tree.windows.tombstone_until(10**9)
    assert summary(recorder.take()) == [("BlockRemoved", "GPU", 1, None, None, 3)]


def test_a_model_with_one_kind_sends_no_group() -> None:
    from test_kv_events import event_tree
    from test_kv_events import put as put_plain

    tree, recorder, dev = event_tree()
    recorder.take()
    put_plain(tree, dev, list(range(16)))
    events = recorder.take()
    assert events and all(e.group_idx is None for e in events)
