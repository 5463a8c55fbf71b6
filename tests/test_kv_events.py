"""KV events: vLLM's wire format, one event per tree operation, sequence numbers, replay,
and a subscriber's model of what each tier holds."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import msgspec
import pytest
import zmq
from test_engine import GREEDY, engine, tiered
from test_hiradix_cache import DIM, HEADS, LAYERS, forward, make_pools, make_tree

from hicache.events import EventRecorder, ZmqEventPublisher
from hicache.events import schema as ours
from hicache.storage.hashing import PageHasher
from hicache.transfer.controller import HiCacheController
from hicache.transfer.engines import CpuTransferEngine
from hicache.tree.hiradix import HiRadixCache

# ------------------------------------------------------ vLLM's schema, as a subscriber has it
# (vllm/distributed/kv_events.py, v0.32: no `reason`, which it must skip)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's base of the tagged events (a map with `"type"`)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """vLLM's: no fields."""


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


VLLM = msgspec.msgpack.Decoder(KVEventBatch)
OURS = msgspec.msgpack.Decoder(ours.KVEventBatch)  # the same bytes, with `reason`
END_SEQ = -1
TIMEOUT_S = 10.0
PS = 4


def connectable(endpoint: str) -> str:
    return endpoint.replace("0.0.0.0", "127.0.0.1")


class Subscriber:
    """A SUB socket on the PUB endpoint and a DEALER on the replay one."""

    def __init__(self, endpoint: str, replay: str | None = None) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sub.connect(connectable(endpoint))
        assert monitor.poll(int(TIMEOUT_S * 1000)), "no handshake with the publisher"
        self.sub.disable_monitor()
        monitor.close()
        time.sleep(0.2)  # the subscription reaches the PUB socket after the handshake
        self.replay_endpoint = replay

    def recv(self) -> tuple[int, bytes]:
        assert self.sub.poll(int(TIMEOUT_S * 1000)), "no batch arrived"
        _topic, seq, payload = self.sub.recv_multipart()
        return int.from_bytes(seq, "big"), payload

    def replay(self, start: int, until: int | None = None) -> list[tuple[int, bytes]]:
        """Every buffered batch from `start` (asking again until `until` is among them)."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(connectable(self.replay_endpoint))
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while True:
                dealer.send_multipart([b"", start.to_bytes(8, "big")])
                got = []
                while True:
                    assert dealer.poll(int(TIMEOUT_S * 1000)), "no replay answer"
                    _, _topic, seq, payload = dealer.recv_multipart()
                    seq = int.from_bytes(seq, "big", signed=True)
                    if seq == END_SEQ:
                        break
                    got.append((seq, payload))
                if until is None or any(s == until for s, _ in got):
                    return got
                assert time.monotonic() < deadline, f"seq {until} never buffered"
                time.sleep(0.01)
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def kinds(payload: bytes) -> list[tuple]:
    """(type, medium, reason, pages) of each event of a batch, decoded with our schema."""
    out = []
    for ev in OURS.decode(payload).events:
        if isinstance(ev, ours.AllBlocksCleared):
            out.append(("Cleared",))
        elif isinstance(ev, ours.BlockStored):
            out.append(("Stored", ev.medium, len(ev.block_hashes)))
        else:
            out.append(("Removed", ev.medium, ev.reason, len(ev.block_hashes)))
    return out


def hasher() -> PageHasher:
    return PageHasher(PS, "test-model", "float32", LAYERS, HEADS, DIM)


def event_tree(policy: str = "write_through", dev_pages: int = 32, host_pages: int = 64
               ) -> tuple[HiRadixCache, EventRecorder, Any]:
    dev, host = make_pools(dev_pages, host_pages, PS)
    controller = HiCacheController(dev, host, CpuTransferEngine(dev, host))
    tree = HiRadixCache(controller, PS, write_policy=policy, load_back_threshold=1,
                        events=EventRecorder(hasher(), PS))
    return tree, tree.events, dev


def put(tree: HiRadixCache, dev: Any, seq: list[int]) -> None:
    slots = dev.alloc(len(seq))
    forward(dev, seq, slots)
    dev.free(slots[:tree.insert(seq, slots)])


def summary(events: list) -> list[tuple]:
    return kinds(msgspec.msgpack.encode(ours.KVEventBatch(0.0, events)))


# ------------------------------------------------------------------- one event per operation


def test_tree_operations_and_their_events() -> None:
    tree, rec, dev = event_tree()
    assert summary(rec.take()) == [("Cleared",)]  # a fresh server starts empty
    a = list(range(1, 17))  # 4 pages
    put(tree, dev, a)
    [stored] = rec.take()
    assert (stored.medium, stored.parent_block_hash, stored.block_size) == ("GPU", None, PS)
    assert stored.block_hashes == hasher().hash_pages(a)
    assert stored.token_ids == a and stored.lora_id is None and stored.lora_name is None
    tree.writing_check(wait=True)  # write-through acknowledged
    assert summary(rec.take()) == [("Stored", "CPU", 4)]
    tree.match_prefix(a[:8])  # a split: no hash changes, no event
    assert rec.take() == []
    assert tree.evict(16) == 16  # L1 eviction with an L2 copy
    assert summary(rec.take()) == [("Removed", "GPU", "demoted", 2), ("Removed", "GPU", "demoted", 2)]
    m = tree.match_prefix(a)
    tree.init_load_back(m.last_host_node)  # L2 -> L1
    tree.start_loading()
    tree.loading_check(wait=True)
    events = rec.take()
    assert summary(events) == [("Stored", "GPU", 2), ("Stored", "GPU", 2)]
    assert events[1].parent_block_hash == events[0].block_hashes[-1]
    assert tree.evict(16) == 16
    rec.take()
    assert tree.evict_host(16) == 16  # L2 eviction: leaves first
    assert summary(rec.take()) == [("Removed", "CPU", "evicted", 2), ("Removed", "CPU", "evicted", 2)]
    tree.controller.close()


def test_eviction_without_copy_and_reclaimed_copies() -> None:
    tree, rec, dev = event_tree("write_through_selective")  # one use: no copy yet
    put(tree, dev, list(range(8)))
    rec.take()
    assert tree.evict(8) == 8
    assert summary(rec.take()) == [("Removed", "GPU", "evicted", 2)]
    tree.controller.close()
    tree, rec, dev = event_tree(dev_pages=32, host_pages=4)  # L2 smaller than L1
    put(tree, dev, list(range(16)))
    tree.writing_check(wait=True)
    put(tree, dev, list(range(100, 116)))  # no L2 room: the first copy is reclaimed
    tree.writing_check(wait=True)
    assert ("Removed", "CPU", "evicted", 4) in summary(rec.take())
    tree.controller.close()


def test_split_during_write_lands_both_halves_in_l2() -> None:
    tree, rec, dev = event_tree()
    a = list(range(16))
    put(tree, dev, a)
    tree.match_prefix(a[:8])  # splits the node whose copy is in flight
    rec.take()
    tree.writing_check(wait=True)
    events = rec.take()
    assert [e.block_hashes for e in events] == [hasher().hash_pages(a)[:2],
                                                 hasher().hash_pages(a)[2:]]
    assert {e.medium for e in events} == {"CPU"}
    tree.controller.close()


def test_without_events_no_page_is_hashed() -> None:
    dev, host = make_pools(32, 64, PS)
    tree = make_tree(dev, host, PS)
    put(tree, dev, list(range(16)))
    tree.writing_check(wait=True)
    tree.evict(16)
    assert all(n.hash_value is None for n in tree.iter_nodes())
    tree.controller.close()


# -------------------------------------------------------------------- a subscriber's model


def apply(model: dict[bytes, set[str]], events: list) -> None:
    for ev in events:
        if isinstance(ev, ours.AllBlocksCleared):
            model.clear()
        elif isinstance(ev, ours.BlockStored):
            for h in ev.block_hashes:
                model.setdefault(h, set()).add(ev.medium)
        else:
            for h in ev.block_hashes:
                model.get(h, set()).discard(ev.medium)
    for h in [h for h, media in model.items() if not media]:
        del model[h]


def held(tree: HiRadixCache) -> dict[bytes, set[str]]:
    """What the tree holds per page hash; a D->H copy counts once acknowledged."""
    out: dict[bytes, set[str]] = {}
    for node in tree.iter_nodes():
        for h in node.hash_value:
            media = out.setdefault(h, set())
            if node.value is not None:
                media.add("GPU")
            if node.host_value is not None and not tree.writes.writing(node.id):
                media.add("CPU")
    return {h: m for h, m in out.items() if m}


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_subscriber_model_equals_the_tree_after_a_random_workload(policy) -> None:
    rng = random.Random(7)
    tree, rec, dev = event_tree(policy, dev_pages=24, host_pages=32)
    model: dict[bytes, set[str]] = {}
    prefixes = [[rng.randrange(50) for _ in range(4 * rng.randrange(1, 5))] for _ in range(4)]
    for step in range(120):
        op = rng.random()
        if op < 0.5:
            seq = rng.choice(prefixes) + [rng.randrange(50) for _ in range(4 * rng.randrange(4))]
            m = tree.match_prefix(seq)
            if m.host_hit_length:
                tree.init_load_back(m.last_host_node)
                tree.start_loading()
                tree.loading_check(wait=True)
            need = len(seq) - len(seq) % PS
            if dev.available_size() < need:
                tree.evict(need)
            if dev.available_size() >= need:
                put(tree, dev, seq)
        elif op < 0.7:
            tree.writing_check(wait=True)
        elif op < 0.85:
            tree.writing_check(wait=True)
            tree.evict(rng.randrange(1, 5) * PS)
        elif op < 0.95:
            tree.evict_host(rng.randrange(1, 5) * PS)
        else:
            tree.writing_check(wait=True)
            tree.flush_host()
        apply(model, rec.take())
        assert model == held(tree), f"step {step}"
    tree.check_integrity()
    tree.controller.close()


# --------------------------------------------------------------------- publisher and replay


def test_zmq_sequence_numbers_replay_and_a_late_subscriber() -> None:
    pub = ZmqEventPublisher("tcp://*:0", "tcp://*:0", topic="kv")
    sub = Subscriber(pub.endpoint, pub.replay_endpoint)
    try:
        tree, rec, dev = event_tree()
        for i in range(5):
            put(tree, dev, [i + 1] * 8)
            pub.publish(rec.take())
        live = [sub.recv() for _ in range(5)]
        assert [s for s, _ in live] == list(range(5))  # one per batch, from 0
        assert kinds(live[0][1]) == [("Cleared",), ("Stored", "GPU", 2)]
        late = Subscriber(pub.endpoint, pub.replay_endpoint)  # asks from 0: every batch
        assert late.replay(0, until=4) == live
        assert [s for s, _ in late.replay(3)] == [3, 4]
        late.close()
        tree.controller.close()
    finally:
        sub.close()
        pub.shutdown()
    assert pub.counters.batches == 5 and pub.counters.events == 6
    assert not any(t.name == "hicache-kv-events" for t in threading.enumerate())


def test_a_full_queue_drops_the_oldest_and_counts_them() -> None:
    pub = ZmqEventPublisher("inproc://full", max_queue_size=2)
    gate = threading.Event()
    send = pub._send
    pub._send = lambda *a: (gate.wait(), send(*a))  # the thread is stuck on its first send
    try:
        for _ in range(6):
            pub.publish([ours.AllBlocksCleared()])
        time.sleep(0.1)
        assert pub.counters.dropped_batches >= 3
    finally:
        gate.set()
        pub.shutdown()
    assert pub.counters.batches + pub.counters.dropped_batches == 6


def test_a_failing_socket_loses_events_not_the_publisher(caplog) -> None:
    pub = ZmqEventPublisher("inproc://failing")
    pub._pub.close(linger=0)  # every send now raises ZMQError
    try:
        for _ in range(3):
            pub.publish([ours.AllBlocksCleared()])
        deadline = time.monotonic() + TIMEOUT_S
        while pub.counters.dropped_batches < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        pub.shutdown()
    assert pub.counters.dropped_batches == 3 and pub.counters.batches == 0
    assert sum("ZMQ socket failed" in r.message for r in caplog.records) == 1


# ----------------------------------------------------------------------- through the engine

EVENTS = {"events.publisher": "zmq", "events.endpoint": "tcp://*:0",
          "events.replay_endpoint": "tcp://*:0"}


def test_engine_events_through_every_tier(tmp_path) -> None:
    prompt = [(7 * i) % 250 for i in range(100)]  # 100 + 8 generated - 1: 6 whole pages
    with tiered(tmp_path, **EVENTS) as e:
        pub = e.cache.publisher
        sub = Subscriber(pub.endpoint, pub.replay_endpoint)
        try:
            e.generate(input_ids=prompt, sampling_params=GREEDY)
            e.flush_cache(["device"])
            e.flush_cache()
            e.generate(input_ids=prompt, sampling_params=GREEDY)
            deadline = time.monotonic() + TIMEOUT_S
            while pub.counters.batches < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            batches = sub.replay(0)
            counted = e.stats()["kv_events"]
        finally:
            sub.close()
    assert counted["batches"] >= len(batches) - 1 and counted["dropped_events"] == 0
    seqs = [s for s, _ in batches]
    assert seqs == list(range(len(seqs)))
    events = [ev for _, p in batches for ev in VLLM.decode(p).events]  # vLLM's decoder
    assert isinstance(events[0], AllBlocksCleared)
    flat = [k for _, p in batches for k in kinds(p)]
    first_clear = flat.index(("Cleared",), 1)
    assert flat[1:first_clear] == [("Stored", "GPU", 6), ("Stored", "CPU", 6),
                                   ("Stored", "DISK", 6), ("Removed", "GPU", "flushed", 6)]
    stored = next(ev for ev in events if isinstance(ev, BlockStored))
    fingerprint = e.cache.events.hasher
    assert stored.block_hashes == fingerprint.hash_pages(stored.token_ids)
    assert all(isinstance(h, bytes) and len(h) == 16 for h in stored.block_hashes)
    assert stored.token_ids == prompt[:96] and stored.parent_block_hash is None
    assert ("Stored", "GPU", 6) in flat[first_clear:]  # recomputed after the flush of all


def test_hashes_are_identical_across_two_engines_of_one_model(tmp_path) -> None:
    prompt = list(range(40, 88))
    hashes = []
    for run in range(2):
        with engine(tmp_path / str(run), **EVENTS) as e:
            e.generate(input_ids=prompt, sampling_params=GREEDY)
            rec = e.cache.events
            nodes = e.cache.tree.peek_path(prompt)
            hashes.append([h for n in nodes for h in n.hash_value])
            assert isinstance(rec, EventRecorder)
    assert hashes[0] == hashes[1] and len(hashes[0]) == 3
    assert hashes[0] == hasher_of(e).hash_pages(prompt)
    assert not any(t.name == "hicache-kv-events" for t in threading.enumerate())


def hasher_of(e: Any) -> PageHasher:
    return e.cache.events.hasher


def test_events_config_errors_name_the_key() -> None:
    from hicache.config import ConfigError
    from hicache_server.config import load_config
    with pytest.raises(ConfigError, match="events.publisher: 'kafka' is not one of null, zmq"):
        load_config(None, {"events.publisher": "kafka"})
    with pytest.raises(ConfigError, match="events.endpoint: 'localhost:5557' must start"):
        load_config(None, {"events.endpoint": "localhost:5557"})
    assert not load_config().events.enabled
    assert load_config(None, {"events.enable_kv_cache_events": True}).events.enabled
    assert not load_config(None, {"events.publisher": "zmq",
                                  "events.enable_kv_cache_events": False}).events.enabled


def test_kv_events_flag_is_vllms_json() -> None:
    from hicache_server.args import parse_config
    flag = ('{"publisher": "zmq", "endpoint": "tcp://*:6000", '
            '"replay_endpoint": "tcp://*:6001", "topic": "kv"}')
    cfg, _ = parse_config(["--kv-events-config", flag])
    assert cfg.events.enabled and cfg.events.endpoint == "tcp://*:6000"
    assert (cfg.events.replay_endpoint, cfg.events.topic) == ("tcp://*:6001", "kv")
    with pytest.raises(SystemExit):
        parse_config(["--kv-events-config", "[1]"])


def test_disabled_by_default_costs_no_publisher(tmp_path) -> None:
    with engine(tmp_path) as e:
        e.generate(input_ids=list(range(32)), sampling_params=GREEDY)
        assert e.cache.events is None and e.cache.tree.events is None
        assert all(n.hash_value is None for n in e.cache.tree.iter_nodes())


def test_an_endpoint_in_use_is_an_error_naming_the_keys() -> None:
    from hicache.build import _event_publisher
    from hicache_server.config import load_config
    first = _event_publisher(load_config(None, EVENTS).events)
    try:
        port = first.endpoint.rsplit(":", 1)[1]
        taken = load_config(None, {**EVENTS, "events.endpoint": f"tcp://*:{port}"}).events
        with pytest.raises(ValueError, match="events.endpoint .* cannot be opened"):
            _event_publisher(taken)
    finally:
        first.shutdown()
    assert not any(t.name == "hicache-kv-events" for t in threading.enumerate())


def test_flushing_l1_and_l2_keeps_what_routers_know_of_l3(tmp_path) -> None:
    """L3 still holds the pages after a flush of device and host: removals per tier, no
    AllBlocksCleared (which would make routers forget the DISK pages too)."""
    prompt = [(5 * i) % 250 for i in range(100)]
    with tiered(tmp_path, **EVENTS) as e:
        pub = e.cache.publisher
        sub = Subscriber(pub.endpoint, pub.replay_endpoint)
        try:
            e.generate(input_ids=prompt, sampling_params=GREEDY)
            e.flush_cache(["device", "host"])
            e.generate(input_ids=[1] * 16, sampling_params=GREEDY)  # a batch after the flush
            deadline = time.monotonic() + TIMEOUT_S
            while pub.counters.batches < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            batches = sub.replay(0)
        finally:
            sub.close()
    flat = [k for _, p in batches for k in kinds(p)]
    assert flat.count(("Cleared",)) == 1 and flat[0] == ("Cleared",)
    assert ("Removed", "GPU", "flushed", 6) in flat and ("Removed", "CPU", "flushed", 6) in flat
    assert ("Stored", "DISK", 6) in flat
