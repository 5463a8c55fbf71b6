"""HiCacheConnector's two sides without vLLM: the scheduler side on plain objects carrying the
fields of vLLM's Request / SchedulerOutput, the worker side on per-layer caches shaped as
vLLM's CPU backend lays them out ([num_blocks, kv_heads, block_size, 2 * head_dim]), in the
order vLLM calls them each step: match, allocate, build the step's plan, load before the
forward, save after it; a request whose hit reaches into L3 runs in the step that allocated
its blocks, or, where its L3 pages are too many for a step (`ASYNC`: any), is held back a
step and more, as vLLM holds it (WAITING_FOR_REMOTE_KVS), until the worker reports its
loads finished.
vLLM itself runs them in tests/integrations/test_vllm_connector.py."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import lmdb
import pytest
import torch

from hicache.config import ConfigError
from hicache.integrations import vllm_scheduler, vllm_worker
from hicache.integrations.vllm_buffers import Staging, WriteBehind, WriteRing
from hicache.integrations.vllm_groups import NULL_BLOCK_ID, KVGroup, KVGroups
from hicache.integrations.vllm_layers import ByLayer, layer_loads
from hicache.integrations.vllm_scheduler import ConnectorScheduler, StepPlan
from hicache.integrations.vllm_settings import (
    BlockGeometry,
    ConnectorSettings,
    ConnectorSpace,
    HostIndex,
    namespace_fingerprint,
    store_key,
    unit_id,
)
from hicache.integrations.vllm_worker import ConnectorWorker

LAYERS, HEADS, DIM, BLOCK, NUM_BLOCKS = 2, 2, 8, 4, 32
# `make gpu-check` runs this file again with HICACHE_TEST_DEVICE=cuda: the caches on the GPU,
# the host buffers pinned
DEVICE = os.environ.get("HICACHE_TEST_DEVICE", "cpu")
# vLLM's two layouts of a layer's cache: the block at dim 0 (its CPU backend), or K and V
# first (FlashAttention on CUDA)
LAYOUTS = {"blocks_first": (NUM_BLOCKS, HEADS, BLOCK, 2 * DIM),
           "kv_first": (2, NUM_BLOCKS, BLOCK, HEADS, DIM)}
GEOMETRY = BlockGeometry(LAYERS, HEADS, DIM, BLOCK, "float32",
                         layer_block_bytes=HEADS * BLOCK * 2 * DIM * 4)
PROMPT = list(range(100, 100 + 4 * BLOCK + 1))  # 4 whole blocks and one token
PAGE = LAYERS * GEOMETRY.layer_block_bytes
ASYNC = {"l3_step_load_mb": 0}  # every L3 hit loads asynchronously


def ring_gb(pages: int) -> float:
    """`write_buffer_gb` that holds `pages` pages."""
    return (pages + 0.5) * PAGE / 1e9


class Server:
    """One vLLM server's connector pair over `l3`, with its own KV caches."""

    def __init__(self, l3: Path | None, seed: int, fingerprint: str = "test-model",
                 layout: str = "blocks_first", **extra: object) -> None:
        # not the 2 GB prefault nor the 0.5 GB write ring of vLLM's defaults
        config = {"storage_backend": "none"} if l3 is None else \
            {"lmdb": {"path": str(l3), "prefault_gb": 0}, "write_buffer_gb": ring_gb(64)}
        settings = ConnectorSettings.from_extra_config({**config, **extra})
        g = torch.Generator().manual_seed(seed)
        self.kv = {f"model.layers.{i}.self_attn.attn":
                   torch.randn(LAYOUTS[layout], generator=g).to(DEVICE)
                   for i in range(LAYERS)}
        self.block_dim = 1 if layout == "kv_first" else 0
        self.scheduler = ConnectorScheduler(ConnectorSpace(settings, GEOMETRY, fingerprint))
        self.worker_space = ConnectorSpace(settings, GEOMETRY, fingerprint)
        self.worker = ConnectorWorker(self.worker_space, tp_rank=0)
        self.worker.register(self.kv)
        self.errors: set[int] = set()  # blocks the worker reported it could not load
        self.waited: list[str] = []  # requests held back for their L3 loads

    def prefill(self, req_id: str, tokens: list[int], block_ids: list[int],
                others: int = 0) -> int:
        """One request as vLLM runs it: its matched tokens (what vLLM would not compute;
        after a failed load, only those before the first block that failed: an in-step
        load's step is run again from there). `others`: tokens of other requests (not the
        connector's) in the step that allocates it."""
        _, (hit, wait) = self.allocate(req_id, tokens, block_ids)
        if wait:  # a step without the request; its loads finish beside later steps
            errors = self.step([], {}, others)
            self.waited.append(req_id)
            errors |= self.wait_for_loads(req_id)
            hit = min([hit] + [block_ids.index(b) * BLOCK for b in errors if b in block_ids])
        while True:
            new = SimpleNamespace(req_id=req_id, block_ids=(block_ids,),
                                  num_computed_tokens=hit)
            errors = self.step([new], {req_id: len(tokens) - hit})
            failed = [block_ids.index(b) * BLOCK for b in errors if b in block_ids]
            if not failed:
                break
            hit = min(failed)  # vLLM drops the step's output and computes from there
        self.scheduler.finished(req_id)
        return hit

    def allocate(self, req_id: str, tokens: list[int],
                 block_ids: list[int]) -> tuple[SimpleNamespace, tuple[int, bool]]:
        """vLLM's first two calls for a new request: match, then allocate its blocks; the
        request and the match."""
        request = SimpleNamespace(request_id=req_id, all_token_ids=tokens,
                                  num_prompt_tokens=len(tokens), num_computed_tokens=0)
        hit = self.scheduler.matched(request, 0)
        self.scheduler.allocated(request, SimpleNamespace(get_block_ids=lambda: (block_ids,)),
                                 hit[0])
        return request, hit

    def step(self, new: list[SimpleNamespace], scheduled: dict[str, int],
             others: int = 0) -> set[int]:
        """One step (with no forward when it schedules no token); the blocks the worker
        reported it could not load."""
        plan = self.plan(new, scheduled, others)
        self.worker.prefetch(plan)  # vLLM's handle_preemptions
        self.worker.load(plan)
        if not plan.idle:  # the forward: each layer's attention waits for its loads
            for name in self.kv:
                self.worker.wait_layer(name)
        self.worker.finish_loads()  # vLLM's wait_for_save, then its saves
        self.worker.save(plan.saves)  # the forward has written the blocks it computed
        errors = self.worker.take_load_errors()
        self.errors |= errors
        return errors

    def plan(self, new: list[SimpleNamespace], scheduled: dict[str, int],
             others: int = 0) -> StepPlan:
        """The scheduler side's plan for a step of the new requests `new`."""
        cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                 num_computed_tokens=[])
        return self.scheduler.step(SimpleNamespace(
            scheduled_new_reqs=new, scheduled_cached_reqs=cached,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()) + others))

    def wait_for_loads(self, req_id: str) -> set[int]:
        """Steps (empty ones: vLLM runs them while a request waits for its KV) until the
        worker reports `req_id`'s loads finished, as `get_finished` does after a step; the
        load errors reported meanwhile."""
        errors: set[int] = set()

        def finished() -> bool:
            errors.update(self.step([], {}))  # its start_load_kv places what was read
            done = self.worker.take_finished_loads()
            assert done <= {req_id}
            return req_id in done

        until(finished)
        return errors

    def block(self, block_id: int) -> list[torch.Tensor]:
        return [kv.select(self.block_dim, block_id).clone() for kv in self.kv.values()]

    def close(self) -> None:
        self.worker.close()
        self.worker_space.close_store()
        self.scheduler.c.close_store()


def until(condition) -> None:
    """Wait (30 s at most) for `condition()` to hold."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def restarted(tmp_path: Path, **extra: object) -> tuple[Server, list[list[torch.Tensor]]]:
    """A server over an L3 that holds PROMPT's four pages, and those pages' blocks as
    another server computed them."""
    first = Server(tmp_path / "l3", seed=1)
    first.prefill("a", PROMPT, [3, 5, 7, 9, 11])
    computed = [first.block(b) for b in (3, 5, 7, 9)]
    first.close()
    return Server(tmp_path / "l3", seed=2, **extra), computed


def reading_threads(store: object) -> list[str]:
    """The names of the threads that call `store.get_values`, as they call it."""
    names, real = [], store.get_values

    def read(*args, **kwargs):
        names.append(threading.current_thread().name)
        return real(*args, **kwargs)

    store.get_values = read
    return names


def hold(store: object, method: str, only: str | None = None) -> threading.Event:
    """`store.<method>` made to wait, in whichever thread calls it (or only in the thread
    named `only`), until the event is set."""
    go, real = threading.Event(), getattr(store, method)

    def held(*args, **kwargs):
        if only in (None, threading.current_thread().name):
            go.wait(30)
        return real(*args, **kwargs)

    setattr(store, method, held)
    return go


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_restarted_server_loads_a_big_hit_from_l3_bit_for_bit(tmp_path: Path,
                                                                  layout: str) -> None:
    first = Server(tmp_path / "l3", seed=1, layout=layout)
    assert first.prefill("a", PROMPT, [3, 5, 7, 9, 11]) == 0
    computed = [first.block(b) for b in (3, 5, 7, 9)]
    first.close()
    again = Server(tmp_path / "l3", seed=2, layout=layout, **ASYNC)
    readers = reading_threads(again.worker_space.store)
    untouched = again.block(0)
    assert again.prefill("a", PROMPT, [1, 2, 4, 6, 8]) == 4 * BLOCK
    assert all(same(again.block(b), c) for b, c in zip((1, 2, 4, 6), computed))
    assert same(again.block(0), untouched)  # only the loaded blocks changed
    assert again.worker.counters["l3_loaded_pages"] == 4
    assert again.errors == set() and again.waited == ["a"]
    # nothing else ran: the step that waits for the load, with no forward, read it itself
    assert readers == [threading.current_thread().name]
    again.close()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_l2_serves_a_prefix_without_a_store(tmp_path: Path, layout: str) -> None:
    server = Server(None, seed=1, layout=layout)
    server.prefill("a", PROMPT, [3, 5, 7, 9, 11])
    computed = [server.block(b) for b in (3, 5)]
    longer = PROMPT[:2 * BLOCK] + [7] * (2 * BLOCK + 1)  # shares two blocks
    assert server.prefill("b", longer, [0, 1, 2, 4, 6]) == 2 * BLOCK
    assert same(server.block(0), computed[0]) and same(server.block(1), computed[1])
    assert server.worker.counters["l2_loaded_pages"] == 2
    assert server.waited == []  # a copy from host memory, made in the request's step
    server.close()


def test_a_small_l3_hit_lands_in_its_step_before_its_forward_reads_it(tmp_path: Path) -> None:
    """vLLM runs the request in the step that allocated its blocks: the loader reads its
    pages straight into them from start_load_kv (vLLM zeroes new blocks before that), and
    they are in place before the forward's first layer reads its cache (at start_load_kv
    until a forward has shown that vLLM waits on every layer)."""
    again, computed = restarted(tmp_path)
    names, ids = list(again.kv), [1, 2, 4, 6, 8]
    readers = reading_threads(again.worker_space.store)
    again.prefill("x", [7] * (BLOCK + 1), [0, 3])  # its forward waits on every layer
    assert again.worker.gate.state is ByLayer.ON
    assert again.allocate("a", PROMPT, ids)[1] == (4 * BLOCK, False)
    new = SimpleNamespace(req_id="a", block_ids=(ids,), num_computed_tokens=4 * BLOCK)
    plan = again.plan([new], {"a": 1})
    before = again.block(1)
    again.worker.prefetch(plan)  # vLLM's handle_preemptions; then it zeroes the new blocks
    time.sleep(0.05)
    assert readers == [] and same(again.block(1), before)
    again.worker.load(plan)
    again.worker.wait_layer(names[0])
    assert all(same(again.block(b), c) for b, c in zip(ids, computed))
    again.worker.wait_layer(names[1])
    again.worker.finish_loads()
    again.worker.save(plan.saves)
    assert readers and set(readers) <= {"hicache-l3-loader", threading.current_thread().name}
    assert again.worker.take_load_errors() == set()
    assert again.worker.counters["l3_step_pages"] == 4
    assert again.worker.take_finished_loads() == set()  # never held back: nothing to hand
    again.close()


def test_a_step_reads_its_own_l3_pages_while_the_loader_is_busy(tmp_path: Path) -> None:
    """A hit of more pages than `l3_step_load_mb` loads asynchronously; a smaller one in
    its step, read on vLLM's thread while the loader is still held by the larger one."""
    first = Server(tmp_path / "l3", seed=1)
    first.prefill("a", PROMPT, [3, 5, 7, 9, 11])
    short = [7] * (2 * BLOCK + 1)
    first.prefill("b", short, [0, 1, 2])
    computed = [first.block(b) for b in (3, 5, 7, 9, 0, 1)]
    first.close()
    again = Server(tmp_path / "l3", seed=2, l3_step_load_mb=3.5 * PAGE / 1e6)  # 3 pages
    go = hold(again.worker_space.store, "get_values", only="hicache-l3-loader")
    readers = reading_threads(again.worker_space.store)
    assert again.allocate("a", PROMPT, [1, 2, 4, 6, 8])[1] == (4 * BLOCK, True)
    again.step([], {}, others=1)
    until(lambda: readers)  # the loader holds "a"
    assert again.prefill("b", short, [0, 10, 12]) == 2 * BLOCK
    assert same(again.block(0), computed[4]) and same(again.block(10), computed[5])
    assert readers == ["hicache-l3-loader", threading.current_thread().name]
    go.set()
    again.wait_for_loads("a")
    assert all(same(again.block(b), c) for b, c in zip((1, 2, 4, 6), computed))
    assert again.errors == set() and again.waited == []
    again.close()


def test_blocks_computed_over_a_failed_in_step_load_are_never_saved(tmp_path: Path) -> None:
    """The forward ran over blocks that failed to load: vLLM drops its output, and the
    blocks it computed after them reach neither L2 (its index never names them) nor L3."""
    again, _ = restarted(tmp_path)
    store = again.worker_space.store
    read, store.get_values = store.get_values, lambda *args, **kwargs: 1 / 0
    longer, ids = PROMPT[:4 * BLOCK] + [7] * (2 * BLOCK + 1), [1, 2, 4, 6, 8, 10, 12]
    assert again.allocate("a", longer, ids)[1] == (4 * BLOCK, False)
    new = SimpleNamespace(req_id="a", block_ids=(ids,), num_computed_tokens=4 * BLOCK)
    assert again.step([new], {"a": 2 * BLOCK + 1}) == {1, 2, 4, 6}  # in its step
    assert again.worker.counters["l3_dropped_saves"] == 2 and len(again.scheduler.index) == 0
    new.num_computed_tokens = 0  # vLLM computes the request from its first block
    assert again.step([new], {"a": len(longer)}) == set()
    assert len(again.scheduler.index) == 6 and again.worker.counters["l2_saved_pages"] == 6
    store.get_values = read
    again.close()


def test_another_request_s_blocks_over_a_failed_in_step_load_are_never_saved(
        tmp_path: Path) -> None:
    """B shares A's blocks through vLLM's prefix cache in the step A loads them from L3 (vLLM
    caches them at allocation): when A's load fails, B's blocks computed over them reach
    neither L2 nor L3 (vLLM computes B again)."""
    again, _ = restarted(tmp_path)
    again.worker_space.store.get_values = lambda *args, **kwargs: 1 / 0  # every read fails
    ids_a, ids_b = [1, 2, 4, 6, 8], [1, 2, 4, 6, 10, 12, 14]
    assert again.allocate("a", PROMPT, ids_a)[1] == (4 * BLOCK, False)  # in its step
    b_tokens = PROMPT[:4 * BLOCK] + [7] * (2 * BLOCK + 1)
    req_b = SimpleNamespace(request_id="b", all_token_ids=b_tokens,
                            num_prompt_tokens=len(b_tokens), num_computed_tokens=0)
    assert again.scheduler.matched(req_b, 4 * BLOCK) == (0, False)  # vLLM's own hit
    again.scheduler.allocated(req_b, SimpleNamespace(get_block_ids=lambda: (ids_b,)), 0)
    new_a = SimpleNamespace(req_id="a", block_ids=(ids_a,), num_computed_tokens=4 * BLOCK)
    new_b = SimpleNamespace(req_id="b", block_ids=(ids_b,), num_computed_tokens=4 * BLOCK)
    plan = again.plan([new_a, new_b], {"a": 1, "b": 2 * BLOCK + 1})
    assert [(x.block_id, x.slot, x.over) for x in plan.saves] == [
        (10, None, ("a",)), (12, None, ("a",))]  # L3 only, over A's load
    again.worker.prefetch(plan)
    again.worker.load(plan)
    for name in again.kv:
        again.worker.wait_layer(name)
    again.worker.finish_loads()
    again.worker.save(plan.saves)
    assert again.worker.take_load_errors() == {1, 2, 4, 6}
    assert again.worker.counters["l3_dropped_saves"] == 2 and len(again.scheduler.index) == 0
    again.close()


def test_in_step_l3_pages_left_for_a_wait_never_made_are_load_errors(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    again, _ = restarted(tmp_path)
    again.prefill("x", [7] * (BLOCK + 1), [0, 3])
    assert again.worker.gate.state is ByLayer.ON
    again.allocate("a", PROMPT, [1, 2, 4, 6, 8])
    new = SimpleNamespace(req_id="a", block_ids=([1, 2, 4, 6, 8],), num_computed_tokens=4 * BLOCK)
    again.worker.load(again.plan([new], {"a": 1}))
    again.worker.finish_loads()  # a forward that waited on no layer ran without them
    assert again.worker.take_load_errors() == {1, 2, 4, 6}
    assert again.worker.gate.state is ByLayer.OFF and "waited on no layer" in caplog.text
    again.close()


def test_l3_loads_run_beside_other_requests_steps(tmp_path: Path) -> None:
    """A hit from L3 holds its request back while the loader reads it; the steps of other
    requests go on meanwhile, and the request is handed back with its blocks in place."""
    again, computed = restarted(tmp_path, **ASYNC)
    go = hold(again.worker_space.store, "get_values")
    readers = reading_threads(again.worker_space.store)  # named as they start to read
    assert again.allocate("a", PROMPT, [1, 2, 4, 6, 8])[1] == (4 * BLOCK, True)
    again.step([], {}, others=1)  # other requests' forward (the connector's saves none)
    until(lambda: readers)  # the loader has taken the request (a step with no forward would)
    other = [7] * (2 * BLOCK + 1)
    assert again.prefill("b", other, [0, 10, 12]) == 0  # steps without "a"
    assert again.worker.take_finished_loads() == set()
    go.set()
    again.wait_for_loads("a")
    assert all(same(again.block(b), c) for b, c in zip((1, 2, 4, 6), computed))
    assert again.errors == set() and again.worker.counters["l3_loaded_pages"] == 4
    assert readers == ["hicache-l3-loader"]
    again.close()


@pytest.mark.parametrize("extra", [{}, ASYNC], ids=["in_step", "async"])
def test_a_store_that_fails_a_load_fails_only_that_request(tmp_path: Path,
                                                           extra: dict) -> None:
    again, _ = restarted(tmp_path, **extra)
    waited = ["a"] if extra else []
    before = [again.block(b) for b in (1, 2, 4, 6)]
    store = again.worker_space.store
    read = store.get_values
    store.get_values = lambda *args, **kwargs: 1 / 0
    assert again.prefill("a", PROMPT, [1, 2, 4, 6, 8]) == 0  # every page recomputed
    assert again.errors == {1, 2, 4, 6} and again.waited == waited
    assert all(same(again.block(b), x) for b, x in zip((1, 2, 4, 6), before))
    store.get_values = read
    # the blocks computed again were saved: L2 serves them
    assert again.prefill("b", PROMPT, [0, 10, 12, 13, 14]) == 4 * BLOCK
    assert again.worker.counters["l2_loaded_pages"] == 4 and again.waited == waited
    again.close()


def test_load_errors_from_the_loader_come_with_the_requests_finish(tmp_path: Path) -> None:
    again, _ = restarted(tmp_path, **ASYNC)
    store = again.worker_space.store
    store.get_values = lambda *args, **kwargs: 1 / 0
    go = hold(store, "get_values")
    readers = reading_threads(store)
    assert again.allocate("a", PROMPT, [1, 2, 4, 6, 8])[1] == (4 * BLOCK, True)
    assert again.step([], {}, others=1) == set()
    until(lambda: readers)
    go.set()
    assert again.wait_for_loads("a") == {1, 2, 4, 6}
    assert readers == ["hicache-l3-loader"]
    again.close()


def test_a_request_whose_l3_load_failed_is_matched_again_from_l2_alone(tmp_path: Path) -> None:
    """After a load that failed from its first block, vLLM frees the blocks and looks the
    request up again: L3 is not planned again (its pages may fail the same way forever)."""
    again, _ = restarted(tmp_path, **ASYNC)
    again.worker_space.store.get_values = lambda *args, **kwargs: 1 / 0
    request, hit = again.allocate("a", PROMPT, [1, 2, 4, 6, 8])
    assert hit == (4 * BLOCK, True)
    assert again.step([], {}) | again.wait_for_loads("a") == {1, 2, 4, 6}
    assert again.scheduler.matched(request, 0) == (0, False)
    again.close()


def test_a_hit_from_l2_then_l3_copies_its_l2_pages_in_its_step(tmp_path: Path) -> None:
    """The first two pages in L2, the last two in L3 only: the request waits for L3, and
    its L2 pages are copied in the step that allocated its blocks (a later step's save may
    take their slots)."""
    again, computed = restarted(tmp_path, **ASYNC)
    hashes = again.scheduler.c.hasher.hash_pages(PROMPT[:4 * BLOCK])
    for h, page in zip(hashes[:2], computed[:2]):  # what a save of these pages leaves in L2
        slot = again.scheduler.index.assign(h, set())
        again.worker.host[slot] = torch.stack([x.reshape(-1) for x in page]).cpu().view(
            torch.uint8)
    assert again.allocate("a", PROMPT, [1, 2, 4, 6, 8])[1] == (4 * BLOCK, True)
    assert again.scheduler.counters["l2_hit_tokens"] == 2 * BLOCK
    again.step([], {}, others=1)
    assert again.worker.counters["l2_loaded_pages"] == 2  # in this step, beside the forward
    again.wait_for_loads("a")
    assert all(same(again.block(b), c) for b, c in zip((1, 2, 4, 6), computed))
    assert again.worker.counters["l3_loaded_pages"] == 2 and again.errors == set()
    again.close()


def test_close_returns_while_the_loader_waits_for_buffers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader holds at most STAGING_KEPT_CHUNKS buffers that vLLM's thread has not
    placed; with no step to place them (vLLM stopping), close() still returns."""
    monkeypatch.setattr(vllm_worker, "STAGING_CHUNK_BYTES", PAGE)
    monkeypatch.setattr(vllm_worker, "STAGING_KEPT_CHUNKS", 1)
    again, _ = restarted(tmp_path, **ASYNC)
    again.allocate("a", PROMPT, [1, 2, 4, 6, 8])
    again.step([], {}, others=1)  # four buffers to read, one may wait
    until(lambda: again.worker._reader._read)
    time.sleep(0.05)
    assert len(again.worker._reader._read) == 1  # the loader waits for a buffer back
    closing = threading.Thread(target=again.close)
    closing.start()
    closing.join(30)
    assert not closing.is_alive()


def forward_step(server: Server, req_id: str, tokens: list[int], block_ids: list[int],
                 waits: list[str]) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """`req_id` matched, allocated and started in a step whose forward waits on the layers
    `waits` names, in that order; the request's hit blocks, by layer, right after the
    step's start and after each wait; then the step finished and saved."""
    _, (hit, wait) = server.allocate(req_id, tokens, block_ids)
    assert not wait
    hit_blocks = block_ids[:hit // BLOCK]
    new = SimpleNamespace(req_id=req_id, block_ids=(block_ids,), num_computed_tokens=hit)
    plan = server.plan([new], {req_id: len(tokens) - hit})
    server.worker.load(plan)

    def by_layer() -> list[list[torch.Tensor]]:
        return [[kv.select(server.block_dim, b).clone() for b in hit_blocks]
                for kv in server.kv.values()]

    seen = [by_layer()]
    for name in waits:
        server.worker.wait_layer(name)
        seen.append(by_layer())
    server.worker.finish_loads()
    server.worker.save(plan.saves)
    server.scheduler.finished(req_id)
    return seen, [by_layer()]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_l2_loads_land_layer_by_layer_once_a_forward_waited_on_every_layer(
        tmp_path: Path, layout: str) -> None:
    server = Server(None, seed=1, layout=layout)
    names = list(server.kv)
    assert server.worker.gate.state is ByLayer.UNPROVEN
    server.step([], {})  # a step with no forward proves nothing
    assert server.worker.gate.state is ByLayer.UNPROVEN
    server.prefill("a", PROMPT, [3, 5, 7, 9, 11])  # its forward waits on both layers
    assert server.worker.gate.state is ByLayer.ON
    want = [[server.kv[n].select(server.block_dim, b).clone() for b in (3, 5, 7, 9)]
            for n in names]
    seen, after = forward_step(server, "b", PROMPT, [0, 1, 2, 4, 6], names)
    if DEVICE == "cpu":  # a layer's pages are copied when the forward reaches it
        assert not same(seen[0][0], want[0]) and not same(seen[0][1], want[1])
        assert same(seen[1][0], want[0]) and not same(seen[1][1], want[1])
    assert same(seen[2][0], want[0]) and same(seen[2][1], want[1])
    assert same(after[0][0], want[0]) and same(after[0][1], want[1])
    assert server.worker.counters["l2_layered_pages"] == 4
    assert server.worker.counters["l2_loaded_pages"] == 4
    server.close()


def test_the_first_forward_gets_its_l2_loads_before_it_runs(tmp_path: Path) -> None:
    """Until a forward has waited on every layer, nothing says vLLM will: loads are in
    place when the step starts."""
    server = Server(None, seed=1)
    names = list(server.kv)
    # the first request is computed in a step whose forward waits on one layer only
    forward_step(server, "a", PROMPT, [3, 5, 7, 9, 11], names[:1])
    assert server.worker.gate.state is ByLayer.UNPROVEN
    want = [[server.kv[n].select(server.block_dim, b).clone() for b in (3, 5, 7, 9)]
            for n in names]
    seen, _ = forward_step(server, "b", PROMPT, [0, 1, 2, 4, 6], [])
    assert same(seen[0][0], want[0]) and same(seen[0][1], want[1])  # before any wait
    assert server.worker.counters["l2_loaded_pages"] == 4
    assert server.worker.counters["l2_layered_pages"] == 0
    server.close()


def test_a_forward_that_skips_a_layer_turns_layer_loads_off(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = Server(None, seed=1)
    names = list(server.kv)
    server.prefill("a", PROMPT, [3, 5, 7, 9, 11])
    assert server.worker.gate.state is ByLayer.ON
    want = [[server.kv[n].select(server.block_dim, b).clone() for b in (3, 5, 7, 9)]
            for n in names]
    longer = PROMPT[:4 * BLOCK] + [7] * (BLOCK + 1)
    _, after = forward_step(server, "b", longer, [0, 1, 2, 4, 6, 8], names[:1])
    # every layer is in place by the end of the step, and the skip is said loudly
    assert same(after[0][0], want[0]) and same(after[0][1], want[1])
    assert server.worker.gate.state is ByLayer.OFF
    assert "did not wait for layers [1]" in caplog.text
    # from then on loads are placed before the forward, even one that waits on every layer
    seen, _ = forward_step(server, "c", PROMPT, [10, 12, 13, 14, 15], names)
    assert same(seen[0][0], want[0]) and same(seen[0][1], want[1])
    assert server.worker.gate.state is ByLayer.OFF
    assert server.worker.counters["l2_layered_pages"] == 4
    server.close()


def test_layer_loads_started_again_unfinished_finish_the_earlier_step_first() -> None:
    """Never in vLLM's order (every step ends in wait_for_save), and still no page lost."""
    kv = [torch.zeros(LAYOUTS["blocks_first"]).to(DEVICE) for _ in range(LAYERS)]
    host = torch.randint(0, 256, (4, LAYERS, GEOMETRY.layer_block_bytes), dtype=torch.uint8)
    staging = Staging(1, LAYERS, GEOMETRY.layer_block_bytes, pin=DEVICE == "cuda", keep=2)
    loads = layer_loads(kv, [0] * LAYERS, host.pin_memory() if DEVICE == "cuda" else host,
                        staging)
    loads.start([0, 1], [5, 6])
    loads.wait(0)
    loads.start([2, 3], [7, 8])  # the first step's layer 1 is placed before this starts
    assert loads.finish() == [0, 1]
    for layer in range(LAYERS):
        for slot, block in zip(range(4), (5, 6, 7, 8)):
            got = kv[layer][block].cpu().contiguous().view(torch.uint8).view(-1)
            assert torch.equal(got, host[slot, layer])


def test_layer_loads_larger_than_a_staging_buffer_move_every_page(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A staging buffer of one page holds one layer of `LAYERS` pages: a layer's loads go
    through it in several runs."""
    monkeypatch.setattr(vllm_worker, "STAGING_CHUNK_BYTES", PAGE)
    server = Server(None, seed=1, layout="kv_first")
    server.prefill("a", PROMPT, [3, 5, 7, 9, 11])
    computed = [server.block(b) for b in (3, 5, 7, 9)]
    assert server.worker._staging.pages == 1
    assert server.prefill("b", PROMPT, [0, 1, 2, 4, 6]) == 4 * BLOCK
    assert all(same(server.block(b), c) for b, c in zip((0, 1, 2, 4), computed))
    assert server.worker.counters["l2_layered_pages"] == 4
    server.close()


def test_staging_buffers_smaller_than_a_step_move_every_page(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two pages per staging buffer: a step's loads (from L2 and from L3) go through
    several buffers, reused, and every block arrives whole."""
    monkeypatch.setattr(vllm_worker, "STAGING_CHUNK_BYTES", 2 * PAGE + 1)
    first = Server(tmp_path / "l3", seed=1, layout="kv_first")
    # made before the first request, which then faults no new buffer in
    assert len(first.worker._staging._free) == vllm_worker.STAGING_READY_CHUNKS
    first.prefill("a", PROMPT, [3, 5, 7, 9, 11])
    computed = [first.block(b) for b in (3, 5, 7, 9)]
    assert first.worker._staging.pages == 2
    assert first.prefill("b", PROMPT, [0, 1, 2, 4, 6]) == 4 * BLOCK  # from L2
    assert all(same(first.block(b), c) for b, c in zip((0, 1, 2, 4), computed))
    assert first.worker.counters["l2_loaded_pages"] == 4
    first.close()
    assert len(first.worker._staging._free) <= vllm_worker.STAGING_KEPT_CHUNKS
    again = Server(tmp_path / "l3", seed=2, layout="kv_first")
    again.worker._into = None  # through staging buffers, read from `prefetch` on, as on a GPU
    assert again.prefill("a", PROMPT, [1, 2, 4, 6, 8]) == 4 * BLOCK  # from L3
    assert all(same(again.block(b), c) for b, c in zip((1, 2, 4, 6), computed))
    assert again.worker.counters["l3_loaded_pages"] == 4
    assert again.errors == set() and again.waited == []
    assert again.worker.counters["l3_step_pages"] == 4
    again.close()


def test_saves_past_a_full_write_ring_reach_l3_from_l2_once_rows_free(tmp_path: Path) -> None:
    """A writer that is behind: the ring's three rows take a step's first three pages for
    L3; the fourth, and every page of the next step, goes to L2 and waits there (counted),
    no buffer made for it. Once the writer goes on, the ring takes them from L2 (here at
    close, which writes what L2 still holds for L3): a restart hits every page."""
    server = Server(tmp_path / "l3", seed=1, write_buffer_gb=ring_gb(3))
    go = hold(server.worker_space.store, "put_values")
    ring = server.worker._ring
    assert ring.capacity == 3
    server.prefill("a", PROMPT, [3, 5, 7, 9, 11])
    computed = [server.block(b) for b in (3, 5, 7, 9)]
    other = [7] * (2 * BLOCK + 1)
    server.prefill("b", other, [0, 1, 2])
    other_blocks = [server.block(b) for b in (0, 1)]
    counters = server.worker.counters
    assert ring.used == 3
    assert counters["l3_deferred_pages"] == 1 + 2 and counters["l2_saved_pages"] == 4 + 2
    assert counters["l3_skipped_pages"] == 0
    go.set()
    server.close()
    assert counters["l3_written_pages"] == 6 and ring.used == 0
    again = Server(tmp_path / "l3", seed=2)
    assert again.prefill("a", PROMPT, [1, 2, 4, 6, 8]) == 4 * BLOCK
    assert all(same(again.block(b), c) for b, c in zip((1, 2, 4, 6), computed))
    assert again.prefill("b", other, [10, 12, 13]) == 2 * BLOCK
    assert all(same(again.block(b), c) for b, c in zip((10, 12), other_blocks))
    again.close()


def test_a_page_waiting_in_l2_whose_slot_is_reused_never_reaches_l3(tmp_path: Path) -> None:
    """L2 of four slots, a ring of one row, the writer held: the first page of PROMPT goes
    to the ring, the other three wait in L2. The next prompt's two pages take the two least
    recently used L2 slots, PROMPT's first two pages': the second, still waiting, is
    forgotten, never written (its slot holds other bytes now); the last two are written
    once the writer goes on, so a restart hits PROMPT's first page only."""
    server = Server(tmp_path / "l3", seed=1, write_buffer_gb=ring_gb(1), host_size_gb=ring_gb(4))
    go = hold(server.worker_space.store, "put_values")
    server.prefill("a", PROMPT, [3, 5, 7, 9, 11])
    computed = [server.block(b) for b in (3, 5, 7, 9)]
    counters = server.worker.counters
    assert counters["l3_deferred_pages"] == 3
    server.prefill("b", [7] * (2 * BLOCK + 1), [0, 1, 2])
    assert counters["l3_skipped_pages"] == 1
    go.set()
    server.close()
    assert counters["l3_written_pages"] == 1 + 2 + 2
    again = Server(tmp_path / "l3", seed=2)
    assert again.prefill("a", PROMPT, [1, 2, 4, 6, 8]) == BLOCK
    assert same(again.block(1), computed[0])
    again.close()


def test_the_l3_writer_commits_a_page_per_transaction(tmp_path: Path) -> None:
    """LMDB mallocs a transaction's new pages and frees them at commit: a page at a time
    its memory is reused, a batch's goes back to the kernel (vllm_worker._write_loop)."""
    server = Server(tmp_path / "l3", seed=1)
    env = server.worker_space.store.env._env
    before = env.info()["last_txnid"]
    server.prefill("a", PROMPT, [3, 5, 7, 9, 11])
    server.worker.close()  # the writer has written what was queued
    assert server.worker.counters["l3_written_pages"] == 4
    assert env.info()["last_txnid"] - before == 4
    server.close()


def test_pages_waiting_in_l2_go_to_the_ring_oldest_first_a_step_s_worth_at_most() -> None:
    ring = WriteRing(4, layers=1, block_bytes=8, pin=False)
    host = torch.arange(10 * 8, dtype=torch.uint8).view(10, 1, 8)
    behind = WriteBehind()
    for slot in (5, 2, 7):
        behind.add(slot, bytes([slot]), 0)
    queued: list = []
    behind.to_ring(ring, host, queued.append, most=2)
    assert [keys for keys, _ in queued] == [[(b"\x05", 0), (b"\x02", 0)]]
    assert torch.equal(ring.rows[queued[0][1]], host[[5, 2]])
    assert list(behind.pages) == [7]
    assert behind.forget([7, 9]) == 1 and not behind.pages


def test_the_write_ring_hands_out_rows_in_order_and_wraps() -> None:
    ring = WriteRing(4, layers=1, block_bytes=8, pin=False)
    first = ring.reserve(3)
    assert first == slice(0, 3)
    assert ring.reserve(3) == slice(3, 4)  # up to the end; the rest comes after the wrap
    assert ring.reserve(1) is None  # full
    ring.release(first)
    assert ring.reserve(5) == slice(0, 3) and ring.used == 4
    with pytest.raises(ValueError, match="latest"):
        ring.cancel(slice(3, 4))
    ring.cancel(slice(0, 3))
    assert ring.used == 1 and ring.reserve(2) == slice(0, 2)
    with pytest.raises(ValueError):
        WriteRing(0, layers=1, block_bytes=8, pin=False)


def test_a_corrupted_page_is_a_load_error_never_served(tmp_path: Path) -> None:
    first = Server(tmp_path / "l3", seed=1)
    first.prefill("a", PROMPT, [3, 5, 7, 9, 11])
    second_page = first.scheduler.c.hasher.hash_pages(PROMPT[:2 * BLOCK])[1]
    first.close()
    with lmdb.open(str(tmp_path / "l3"), max_dbs=2) as env:  # a raw writer, stores closed
        db = env.open_db(b"pages")
        with env.begin(write=True, db=db) as txn:
            key = store_key(second_page, 0)
            value = bytearray(txn.get(key))
            value[-1] ^= 0x10
            txn.put(key, bytes(value))
    # asynchronously (in its step the page is checked in its blocks, left undefined there
    # while vLLM drops the step's output: test_blocks_computed_over_a_failed_in_step_load_...)
    # in a step with no forward: read into its blocks too, reported before vLLM caches them
    again = Server(tmp_path / "l3", seed=2, **ASYNC)
    assert again.prefill("a", PROMPT, [1, 2, 4, 6, 8]) == BLOCK
    assert again.errors == {2}  # vLLM recomputes block 2 and later
    assert again.worker.counters["load_errors"] == 1
    again.close()
    # through staging buffers (caches on a GPU): the bad page never reaches its block
    corrupt(tmp_path / "l3", key)  # again: the read dropped it, a save stored it anew
    again = Server(tmp_path / "l3", seed=2, **ASYNC)
    again.worker._into = None
    before = again.block(2)
    assert again.prefill("a", PROMPT, [1, 2, 4, 6, 8]) == BLOCK
    assert again.errors == {2} and same(again.block(2), before)
    again.close()
    # the read dropped the bad value, and the recomputed block was stored anew
    third = Server(tmp_path / "l3", seed=3)
    assert third.prefill("a", PROMPT, [1, 2, 4, 6, 8]) == 4 * BLOCK
    assert third.errors == set() and same(third.block(2), before)
    third.close()


def test_another_namespace_never_sees_the_pages(tmp_path: Path) -> None:
    first = Server(tmp_path / "l3", seed=1)
    first.prefill("a", PROMPT, [3, 5, 7, 9, 11])
    first.close()
    cpu = namespace_fingerprint("m", GEOMETRY, {"attention_backend": "auto"}, "cpu", (0, 1), "")
    others = [namespace_fingerprint("m", GEOMETRY, {"attention_backend": "auto"}, "cuda", (0, 1),
                                    ""),
              namespace_fingerprint("m", GEOMETRY, {"attention_backend": "auto"}, "cpu", (0, 1),
                                    "salt"),
              namespace_fingerprint("m", GEOMETRY._replace(dtype="bfloat16"),
                                    {"attention_backend": "auto"}, "cpu", (0, 1), "")]
    assert len({cpu, *others}) == 4
    other = Server(tmp_path / "l3", seed=2, fingerprint=others[0])
    assert other.prefill("a", PROMPT, [1, 2, 4, 6, 8]) == 0
    other.close()


def test_the_worker_prefaults_l3_and_the_scheduler_shares_its_store(tmp_path: Path) -> None:
    """The worker side applies the LMDB section's prefault_gb as it registers vLLM's caches;
    the scheduler side, which opens L3 at its first request, never prefaults, and in one
    process the two use one environment."""
    assert ConnectorSettings.from_extra_config({}).sections["lmdb"]["prefault_gb"] == 2.0
    lmdb_section = {"path": str(tmp_path / "l3"), "prefault_gb": 0.002}
    server = Server(tmp_path / "l3", seed=1, lmdb=lmdb_section)
    store = server.worker_space.store
    assert store is not None and store.prefaulted_bytes == 2_000_000
    assert server.prefill("a", PROMPT, [3, 5, 7, 9, 11]) == 0
    assert server.scheduler.c.store is store
    server.close()
    again = Server(tmp_path / "l3", seed=2, lmdb=lmdb_section)  # pages written into the tail
    assert again.prefill("a", PROMPT, [1, 2, 4, 6, 8]) == 4 * BLOCK
    again.close()
    alone = ConnectorSpace(ConnectorSettings.from_extra_config(
        {"lmdb": {**lmdb_section, "path": str(tmp_path / "other")}}), GEOMETRY, "m")
    store = alone.open_store(prefault=False)  # a scheduler in a process of its own
    assert store is not None and store.prefaulted_bytes == 0
    alone.close_store()


def test_the_host_index_evicts_least_recent_but_not_what_a_step_reads() -> None:
    index = HostIndex(2)
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    slot_a, slot_b = index.assign(a, set()), index.assign(b, set())
    index.find(a)  # a is now the more recent
    assert index.assign(c, keep=set()) == slot_b and index.find(b) is None
    assert index.assign(b, keep={slot_a, slot_b}) is None  # both slots read this step
    assert index.find(a) == slot_a and len(index) == 2


@pytest.mark.parametrize("extra, key", [
    ({"storage_backend": "disk"}, "storage_backend"),
    ({"host_size_gb": -1}, "host_size_gb"),
    ({"write_buffer_gb": 0}, "write_buffer_gb"),
    ({"write_buffer_gb": float("nan")}, "write_buffer_gb"),
    ({"write_buffer_gb": "1"}, "write_buffer_gb"),
    ({"host_size_gb": float("inf")}, "host_size_gb"),
    ({"storage_backend": "lmdb", "redis": {}}, "redis"),
    ({"host_size_gb": 0, "storage_backend": "none"}, "kv_connector_extra_config"),
    ({"lmdb": {"paht": "/x"}}, "paht"),
])
def test_bad_extra_config_names_the_key(extra: dict, key: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=key):
        ConnectorSettings.from_extra_config(extra)


@pytest.mark.parametrize("shape, why", [
    ((NUM_BLOCKS, HEADS, BLOCK, DIM), "neither"),  # half a block: K only
    ((2, 2, BLOCK, HEADS, DIM), "both"),  # two blocks, or K and V of two? nothing tells
])
def test_a_layout_of_no_whole_blocks_is_refused_by_name(shape, why: str) -> None:
    settings = ConnectorSettings.from_extra_config({"storage_backend": "none"})
    worker = ConnectorWorker(ConnectorSpace(settings, GEOMETRY, "m"), tp_rank=0)
    kv = {f"model.layers.{i}.self_attn.attn": torch.zeros(shape) for i in range(LAYERS)}
    with pytest.raises(ValueError, match=f"model.layers.0.self_attn.attn.*{why}"):
        worker.register(kv)


@pytest.mark.parametrize("encrypt", [False, True])
def test_with_the_fleet_secret_only_a_server_of_that_secret_loads_the_pages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, encrypt: bool) -> None:
    """`secret_file` (else HICACHE_STORAGE_SECRET) and `encrypt` in the extra config: keyed
    page keys and sealed pages; the same secret loads them bit for bit, another never."""
    secret = tmp_path / "secret"
    secret.write_text("v" * 64)
    secret.chmod(0o600)
    first = Server(tmp_path / "l3", seed=1, secret_file=str(secret), encrypt=encrypt)
    first.prefill("a", PROMPT, [3, 5, 7, 9, 11])
    computed = [first.block(b) for b in (3, 5, 7, 9)]
    assert first.worker_space.codec.protection == (2 if encrypt else 1)
    first.close()
    monkeypatch.setenv("HICACHE_STORAGE_SECRET", "w" * 64)
    other = Server(tmp_path / "l3", seed=2, encrypt=encrypt)  # the environment's secret
    assert other.prefill("a", PROMPT, [1, 2, 4, 6, 8]) == 0
    other.close()
    again = Server(tmp_path / "l3", seed=3, secret_file=str(secret), encrypt=encrypt)
    assert again.prefill("a", PROMPT, [1, 2, 4, 6, 8]) == 4 * BLOCK
    assert all(same(again.block(b), c) for b, c in zip((1, 2, 4, 6), computed))
    again.close()


# ---------------------------------------------------------------- a hybrid model's groups

# Gemma 3's shape in small: six layers, 2 and 5 full attention, the rest a window of
# WINDOW tokens; vLLM's hybrid manager groups them two by two, the groups' layers at one
# position sharing one tensor (its block pool is shared: block ids never collide).
WINDOW = 6  # a query at token 16 reads tokens [11, 16]: blocks 2 and 3
HYBRID = KVGroups((KVGroup(("model.layers.2.attn", "model.layers.5.attn"), (2, 5), None),
                   KVGroup(("model.layers.0.attn", "model.layers.1.attn"), (0, 1), WINDOW),
                   KVGroup(("model.layers.3.attn", "model.layers.4.attn"), (3, 4), WINDOW)),
                  BLOCK)
HIT = 4  # PROMPT's whole blocks
WINDOW_FROM = HYBRID.needed_from(HIT)  # 2: window blocks [2, 4) a hit of 4 blocks reads


class HybridServer:
    """A connector pair of a hybrid model over `l3`; block ids by group, as vLLM's."""

    def __init__(self, l3: Path | None, seed: int, **extra: object) -> None:
        config = {"storage_backend": "none"} if l3 is None else \
            {"lmdb": {"path": str(l3), "prefault_gb": 0}, "write_buffer_gb": ring_gb(64)}
        settings = ConnectorSettings.from_extra_config({**config, **extra})
        g = torch.Generator().manual_seed(seed)
        shared = [torch.randn(LAYOUTS["blocks_first"], generator=g) for _ in range(LAYERS)]
        self.kv = {name: shared[k] for group in HYBRID.groups
                   for k, name in enumerate(group.names)}
        self.scheduler = ConnectorScheduler(ConnectorSpace(settings, GEOMETRY, "gemma", HYBRID))
        self.space = ConnectorSpace(settings, GEOMETRY, "gemma", HYBRID)
        self.worker = ConnectorWorker(self.space, tp_rank=0)
        self.worker.register(self.kv)
        self.failed: set[str] = set()

    def run(self, req_id: str, ids: tuple[list[int], ...], prompt: list[int] = PROMPT) -> int:
        """`prompt` as vLLM runs it: matched, allocated (the window groups' blocks before
        the hit's window null), held back while its L3 units load, then computed from its
        hit (from 0 after a failed load); the tokens matched."""
        request = SimpleNamespace(request_id=req_id, all_token_ids=prompt,
                                  num_prompt_tokens=len(prompt), num_computed_tokens=0)
        hit, wait = self.scheduler.matched(request, 0)
        skipped = HYBRID.needed_from(hit // BLOCK) if hit else 0
        ids = tuple([0] * skipped + x[skipped:] if g in HYBRID.windowed else x
                    for g, x in enumerate(ids))
        self.scheduler.allocated(request, SimpleNamespace(get_block_ids=lambda: ids), hit)
        if wait:
            self.step([], {})
            until(lambda: self.step([], {}) or req_id in self.worker.take_finished_loads())
            if req_id in self.failed:
                hit = 0
        new = SimpleNamespace(req_id=req_id, block_ids=ids, num_computed_tokens=hit)
        self.step([new], {req_id: len(prompt) - hit})
        self.scheduler.finished(req_id)
        return hit

    def step(self, new: list[SimpleNamespace], scheduled: dict[str, int]) -> bool:
        cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                 num_computed_tokens=[])
        plan = self.scheduler.step(SimpleNamespace(
            scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values())))
        self.worker.prefetch(plan)
        self.worker.load(plan)
        self.worker.finish_loads()
        self.worker.save(plan.saves)
        assert self.worker.take_load_errors() == set()  # vLLM refuses them with groups
        self.failed |= self.worker.take_failed_loads()
        return False

    def blocks(self, ids: tuple[list[int], ...], upto: int) -> list[torch.Tensor]:
        """Each group's layers' blocks [0, upto) (`ids`: by group)."""
        return [self.kv[name][b].clone() for group, gids in zip(HYBRID.groups, ids)
                for name in group.names for b in gids[:upto]]

    def close(self) -> None:
        self.worker.close()
        self.space.close_store()
        self.scheduler.c.close_store()


FIRST_IDS = ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15])
AGAIN_IDS = ([15, 14, 13, 12, 11], [10, 9, 8, 7, 6], [5, 4, 3, 2, 1])  # of NUM_BLOCKS


def stored_hybrid(tmp_path: Path) -> list[torch.Tensor]:
    """L3 after a server computed PROMPT; each group's blocks as it computed them."""
    first = HybridServer(tmp_path / "l3", seed=1)
    assert first.run("a", FIRST_IDS) == 0
    computed = first.blocks(FIRST_IDS, HIT)
    first.close()
    return computed


def test_the_hybrid_hit_rule_needs_the_window_of_its_end() -> None:
    assert HYBRID.hybrid and HYBRID.full == (0,) and HYBRID.windowed == (1, 2)
    assert WINDOW_FROM == 2 and HYBRID.needed_from(3) == 1
    full, window = [True] * 4, [False, False, True, True]
    assert HYBRID.hit_end(0, full, window) == 4  # blocks 0 and 1 lie before the window
    assert HYBRID.hit_end(0, full, [True, True, True, False]) == 3
    assert HYBRID.hit_end(0, [True, False, True, True], [True] * 4) == 1
    assert HYBRID.hit_end(2, full[2:], [False, False]) == 2  # vLLM's own hit, no more
    assert HYBRID.hit_end(1, full[1:], [False, True, True]) == 4


def test_a_hybrid_restart_loads_each_group_from_l3_bit_for_bit(tmp_path: Path) -> None:
    computed = stored_hybrid(tmp_path)
    again = HybridServer(tmp_path / "l3", seed=2)
    null = [kv[0].clone() for kv in again.kv.values()]
    assert again.run("a", AGAIN_IDS) == HIT * BLOCK
    got = again.blocks(AGAIN_IDS, HIT)
    per_group = 2 * HIT  # two layers of four blocks
    assert same(got[:per_group], computed[:per_group])  # the full group: every block
    for g in (1, 2):  # the window groups: the blocks of the hit's window, no others
        mine = got[g * per_group:(g + 1) * per_group]
        theirs = computed[g * per_group:(g + 1) * per_group]
        for k in range(2 * HIT):
            assert torch.equal(mine[k], theirs[k]) == (k % HIT >= WINDOW_FROM)
    assert same([kv[0] for kv in again.kv.values()], null)  # the null block untouched
    # 4 full units, 2 of each window group
    assert again.worker.counters["l3_loaded_pages"] == HIT + 2 * (HIT - WINDOW_FROM)
    again.close()


@pytest.mark.parametrize("full_last", [False, True])
def test_a_hit_from_l3_sends_none_of_its_window_units_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full_last: bool) -> None:
    """The boundary where a restart's hit ends is one a later request may hit at, but the
    window units a query there reads are those the hit loaded from L3: none is saved or
    written again, whichever group holds the full layers (not the first of Gemma 3's)."""
    if full_last:
        monkeypatch.setattr(sys.modules[__name__], "HYBRID",
                            KVGroups((*HYBRID.groups[1:], HYBRID.groups[0]), BLOCK))
    stored_hybrid(tmp_path)
    again = HybridServer(tmp_path / "l3", seed=2)
    assert again.run("a", AGAIN_IDS) == HIT * BLOCK
    assert again.scheduler.counters["saved_pages"] == 0
    again.close()
    assert again.worker.counters["l3_written_pages"] == 0
    assert again.worker.counters["l3_loaded_pages"] == HIT + 2 * (HIT - WINDOW_FROM)


def test_a_step_with_no_forward_reads_held_back_units_straight_into_their_blocks(
        tmp_path: Path) -> None:
    computed = stored_hybrid(tmp_path)
    again = HybridServer(tmp_path / "l3", seed=2)
    taken, real = [], again.worker._staging.take
    again.worker._staging.take = lambda: taken.append(1) or real()
    readers = reading_threads(again.space.store)
    assert again.run("a", AGAIN_IDS) == HIT * BLOCK
    assert not taken  # no staging buffer, no copy out of one
    assert set(readers) <= {"MainThread", "hicache-l3-loader"} and readers
    got = again.blocks(AGAIN_IDS, HIT)
    assert same(got[:2 * HIT], computed[:2 * HIT])
    again.close()


@pytest.mark.parametrize("idle", [True, False])
def test_a_held_back_request_with_no_l3_unit_left_is_finished_at_once(
        tmp_path: Path, idle: bool) -> None:
    """vLLM holds a request back once the match said asynchronous; when every L3 unit it
    planned turns out a null block (a narrower window group), the worker still hands it
    back (it would wait forever)."""
    stored_hybrid(tmp_path)
    again = HybridServer(tmp_path / "l3", seed=2)
    request = SimpleNamespace(request_id="a", all_token_ids=PROMPT,
                              num_prompt_tokens=len(PROMPT), num_computed_tokens=0)
    hit, wait = again.scheduler.matched(request, 0)
    assert wait and hit == HIT * BLOCK
    # every planned unit dropped, as a window block vLLM skipped is
    nulls = tuple([NULL_BLOCK_ID] * len(ids) for ids in AGAIN_IDS)
    again.scheduler.allocated(request, SimpleNamespace(get_block_ids=lambda: nulls), hit)
    plan = again.scheduler.step(SimpleNamespace(
        scheduled_new_reqs=[], num_scheduled_tokens={}, total_num_scheduled_tokens=int(
            not idle), scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])))
    assert plan.async_loads == {"a": []} and plan.idle == idle
    again.worker.prefetch(plan)
    again.worker.load(plan)
    again.worker.finish_loads()
    assert again.worker.take_finished_loads() == {"a"}
    assert again.worker.counters["l3_loaded_pages"] == 0
    again.close()


def window_units_in_l3(server: HybridServer, prompt: list[int], blocks: int
                       ) -> list[list[bool]]:
    """Per window group, whether L3 holds each of `prompt`'s first `blocks` blocks' units."""
    store = server.scheduler.c.open_store(prefault=False)
    hashes = server.space.hasher.hash_pages(prompt[:blocks * BLOCK])
    return [store.batch_present([store_key(h, 0, g) for h in hashes]) for g in HYBRID.windowed]


def test_l3_keeps_the_window_units_of_a_prompt_s_end_and_l2_every_one(tmp_path: Path) -> None:
    """hicache's rule (L3 by kind): the full group's unit of every block, a window group's
    only for the blocks a query at the prompt's end reads (and after); L2 keeps them all."""
    stored_hybrid(tmp_path)
    again = HybridServer(tmp_path / "l3", seed=2)
    for present in window_units_in_l3(again, PROMPT, HIT):
        assert present == [i >= WINDOW_FROM for i in range(HIT)]
    store = again.scheduler.c.open_store(prefault=False)
    hashes = again.space.hasher.hash_pages(PROMPT[:HIT * BLOCK])
    assert all(store.batch_present([store_key(h, 0, 0) for h in hashes]))
    again.close()
    server = HybridServer(None, seed=1)
    server.run("a", FIRST_IDS)
    assert all(server.scheduler.index.find(unit_id(h, g)) is not None
               for h in hashes for g in range(len(HYBRID.groups)))
    server.close()


def test_a_boundary_hit_from_l2_sends_its_window_units_to_l3(tmp_path: Path) -> None:
    """A second prompt sharing PROMPT's first 3 blocks hits them from L2: that boundary's
    window units ([1, 3)) go to L3, so after a restart a third prompt sharing them hits
    the 3 blocks from L3 (block 1's units lay before PROMPT's end's window)."""
    shared = PROMPT[:3 * BLOCK]
    second = shared + list(range(900, 900 + 2 * BLOCK + 1))
    third = shared + list(range(700, 700 + BLOCK + 1))
    first = HybridServer(tmp_path / "l3", seed=1)
    assert first.run("a", FIRST_IDS) == 0
    until(lambda: window_units_in_l3(first, shared, 3) == [[False, False, True]] * 2)
    assert first.run("b", AGAIN_IDS, second) == 3 * BLOCK  # from L2
    # block 0's none: no query at 3 reads it
    until(lambda: window_units_in_l3(first, shared, 3) == [[False, True, True]] * 2)
    first.close()
    again = HybridServer(tmp_path / "l3", seed=2)
    assert again.run("c", FIRST_IDS, third) == 3 * BLOCK  # from L3
    again.close()


def test_where_two_prompts_part_with_no_hit_l3_keeps_that_boundary_s_window(
        tmp_path: Path) -> None:
    """Two prompts sharing PROMPT's first 3 blocks, neither hitting (as with vLLM's prefix
    cache off for them, or the first one's blocks gone from vLLM and L2): the window units
    of the boundary where they part ([1, 3)) go to L3 with the second, as a split in
    hicache's tree writes them, so after a restart a third prompt sharing the 3 blocks
    hits them from L3. The prompt ends' rule alone leaves block 1's out (it lies before
    the window of a query at 4)."""
    shared = PROMPT[:3 * BLOCK]
    prompts = {"a": shared + list(range(900, 900 + BLOCK + 1)),
               "b": shared + list(range(800, 800 + BLOCK + 1))}
    ids = {"a": FIRST_IDS, "b": tuple([16 + 5 * g + i for i in range(5)] for g in range(3))}
    first = HybridServer(tmp_path / "l3", seed=1)
    new = []
    for req_id, prompt in prompts.items():
        request = SimpleNamespace(request_id=req_id, all_token_ids=prompt,
                                  num_prompt_tokens=len(prompt), num_computed_tokens=0)
        assert first.scheduler.matched(request, 0) == (0, False)
        first.scheduler.allocated(
            request, SimpleNamespace(get_block_ids=lambda i=ids[req_id]: i), 0)
        new.append(SimpleNamespace(req_id=req_id, block_ids=ids[req_id], num_computed_tokens=0))
    assert [first.scheduler.tracked[r].split for r in prompts] == [0, 3]
    first.step(new, {r: len(p) for r, p in prompts.items()})
    until(lambda: window_units_in_l3(first, shared, 3) == [[False, True, True]] * 2)
    first.close()
    again = HybridServer(tmp_path / "l3", seed=2)
    third = shared + list(range(700, 700 + BLOCK + 1))
    assert again.run("c", AGAIN_IDS, third) == 3 * BLOCK  # from L3
    again.close()


def test_the_pages_seen_are_forgotten_first_in_first_out(monkeypatch) -> None:
    """A third prompt sharing only PROMPT's first 2 blocks does not keep them longer than
    PROMPT's later ones: when the memory is full, a chain's earliest pages go first, so a
    prompt that shares PROMPT's 4 blocks later still parts from it at 4, not at 2."""
    monkeypatch.setattr(vllm_scheduler, "PAGES_SEEN_REMEMBERED", 6)
    server = HybridServer(None, seed=1)
    prompts = {"a": PROMPT,
               "c": PROMPT[:2 * BLOCK] + list(range(900, 900 + 2 * BLOCK + 1)),
               "e": list(range(700, 700 + 2 * BLOCK + 1)),  # 2 new pages: 2 forgotten
               "d": PROMPT[:4 * BLOCK] + list(range(800, 800 + BLOCK + 1))}
    for req_id, prompt in prompts.items():
        server.scheduler.matched(SimpleNamespace(
            request_id=req_id, all_token_ids=prompt, num_prompt_tokens=len(prompt),
            num_computed_tokens=0), 0)
    assert [server.scheduler.tracked[r].split for r in prompts] == [0, 2, 0, 4]
    server.close()


def test_a_hybrid_hit_without_its_window_units_ends_where_they_are(tmp_path: Path) -> None:
    stored_hybrid(tmp_path)
    again = HybridServer(tmp_path / "l3", seed=2)
    store = again.scheduler.c.open_store(prefault=False)
    last = again.space.hasher.hash_pages(PROMPT[:HIT * BLOCK])[HIT - 1]
    assert store.delete([store_key(last, 0, 2)]) == 1  # block 3 of one window group
    # a hit of 3 blocks would read the window of blocks [1, 3): block 1's units lie before
    # the prompt's end's window, never stored; no boundary before has its window in L3
    assert again.run("a", AGAIN_IDS) == 0
    again.close()


def corrupt(l3: Path, key: bytes) -> None:
    """The value under `key` flipped a bit, by a raw writer (the stores closed)."""
    with lmdb.open(str(l3), max_dbs=2) as env, env.begin(
            write=True, db=env.open_db(b"pages")) as txn:
        value = bytearray(txn.get(key))
        value[-1] ^= 0x10
        txn.put(key, bytes(value))


def test_a_failed_hybrid_unit_fails_its_request_never_a_block_id(tmp_path: Path) -> None:
    stored_hybrid(tmp_path)
    probe = HybridServer(None, seed=0)
    hashes = probe.space.hasher.hash_pages(PROMPT[:HIT * BLOCK])
    probe.close()
    again = HybridServer(tmp_path / "l3", seed=2)
    # block 0's window units lie before the hit's window (never stored): a hit of 4 blocks
    # never reads them
    assert window_units_in_l3(again, PROMPT, 1) == [[False], [False]]
    assert again.run("a", AGAIN_IDS) == HIT * BLOCK and not again.failed
    again.close()
    corrupt(tmp_path / "l3", store_key(hashes[HIT - 1], 0, 1))
    again = HybridServer(tmp_path / "l3", seed=2)
    assert again.run("a", AGAIN_IDS) == 0  # vLLM computes it whole
    assert again.failed == {"a"} and again.worker.counters["load_errors"] == 1
    again.close()
    # the unit that failed was stored anew by that computation: a restart hits it whole
    third = HybridServer(tmp_path / "l3", seed=3)
    assert third.run("a", FIRST_IDS) == HIT * BLOCK and not third.failed
    third.close()


def test_l2_serves_a_hybrid_prefix_by_group(tmp_path: Path) -> None:
    server = HybridServer(None, seed=1)
    assert server.run("a", FIRST_IDS) == 0
    computed = server.blocks(FIRST_IDS, HIT)
    assert server.run("b", AGAIN_IDS) == HIT * BLOCK  # from L2, in its step
    got = server.blocks(AGAIN_IDS, HIT)
    assert same(got[:2 * HIT], computed[:2 * HIT])
    assert server.worker.counters["l2_loaded_pages"] == HIT + 2 * (HIT - WINDOW_FROM)
    server.close()


def test_a_model_of_one_group_keeps_its_keys() -> None:
    import xxhash
    page = b"\x01" * 16
    assert store_key(page, 3) == xxhash.xxh3_128_digest(page + (3).to_bytes(4, "little"))
    assert len({store_key(page, 0, g) for g in range(3)}) == 3
    one = ConnectorSpace(ConnectorSettings.from_extra_config({"storage_backend": "none"}),
                         GEOMETRY, "m", KVGroups(HYBRID.groups[:1], BLOCK))
    assert one.groups is None and len(one.codecs) == 1
