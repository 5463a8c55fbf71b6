"""The worker side of `HiCacheConnector`: pages between vLLM's per-layer KV caches, the L2
host pool and L3. Torch and hicache's stores only (no vLLM), so it runs in a test on plain
tensors shaped as vLLM's CPU backend lays them out.

A page is one block of every layer, each copied whole (in vLLM's own layout, which the
namespace names); with several KV cache groups (vLLM's hybrid manager) a unit is one group's
block of its layers (`vllm_groups`), its L2 loads placed before the forward, its failed L3
loads reported by request. L2 loads are copies in the step, before its saves: layer by layer
as the forward reaches each layer once a forward has shown that vLLM waits on every layer,
before the forward until then (`vllm_layers`, `LayerGate`). L3 pages are read and checked
(header and checksum) by the loader thread or vLLM's (`vllm_reads`) and placed on vLLM's
thread: a step's own as its metadata arrives (`prefetch`), before the forward's first layer
reads its cache; a held-back request's beside later steps, placed at the next, the request
then reported (`take_finished_loads`); in a step with no forward straight into their blocks
by both threads (caches in host memory: `L3Reader.read_now`). A failed page is reported
(`take_load_errors`, in its step) and vLLM computes it; blocks a step computed over its
failed in-step load are not saved. A save gathers the step's blocks into the write ring's
free rows, copies them into their L2 slots and queues the rows for the L3 writer thread (a
store fault costs the pages, never the step), which runs on the cores' leftovers
(`hicache.threads.background_priority`). Blocks the ring has no room for (the writer is
behind) go to L2 through a staging buffer and on to L3 from there as rows free
(`WriteBehind`, `l3_deferred_pages`), unless L2 reuses the slot first (`l3_skipped_pages`).
Every buffer is made once and reused (`vllm_buffers`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence

import torch

from hicache.integrations import vllm_buffers as buffers
from hicache.integrations.vllm_buffers import Staging, WriteBehind, WriteRing
from hicache.integrations.vllm_groups import by_group
from hicache.integrations.vllm_layers import (
    LayerGate,
    block_bytes,
    block_dim,
    block_shape,
    layer_loads,
    layer_order,
    scatter_layer,
)
from hicache.integrations.vllm_reads import BlockBytes, L3Reader, Staged, StepRead, as_bytes
from hicache.integrations.vllm_scheduler import PageLoad, PageSave, StepPlan
from hicache.integrations.vllm_settings import ConnectorSpace, store_key
from hicache.threads import background_priority

logger = logging.getLogger("vllm.hicache")  # under vLLM's logger: its handlers and level
STAGING_CHUNK_BYTES = 32 << 20  # one staging buffer: whole pages, about this many bytes
STAGING_KEPT_CHUNKS = 8  # free staging buffers kept for reuse at most (~256 MiB)
STAGING_READY_CHUNKS = 2  # made and touched at start-up: the first loads'
BEHIND_STEP_PAGES = 8  # L2 pages a step queues for L3 at most (SmolLM2: 12 MB, ~3 ms)
CLOSE_WRITE_BEHIND_S = 30.0  # at close, how long the L2 pages due to L3 may take to queue


class ConnectorWorker:
    """The worker side: vLLM's per-layer caches, the L2 host pool, L3 reads and writes."""

    def __init__(self, c: ConnectorSpace, tp_rank: int) -> None:
        self.c = c
        self.tp_rank = tp_rank
        self.layers: list[torch.Tensor] = []  # each layer's cache
        self._block_dims: list[int] = []  # each layer's block dim: 0, or 1 after K / V
        self._groups: list[list[int]] = []  # per KV cache group, its layers' indices
        self.failed_loads: set[str] = set()  # hybrid: requests whose L3 load failed
        self.host: torch.Tensor | None = None  # [slots, layers, layer block bytes] uint8
        self.load_errors: set[int] = set()
        self.finished_loads: set[str] = set()  # requests whose L3 pages are all placed
        self._failed: dict[str, list[int]] = {}  # blocks that failed, of requests placing
        self._reader: L3Reader | None = None  # with an L3 (from `register`)
        self._into: BlockBytes | None = None  # CPU caches: where in-step pages are read to
        self._plan: StepPlan | None = None  # the step's plan, once `prefetch` queued its reads
        self._step_reads: list[StepRead] = []  # the step's L3 reads, not yet placed
        self._step_failed: set[str] = set()  # requests whose in-step L3 load failed
        self.counters = {"l2_loaded_pages": 0, "l2_layered_pages": 0, "l3_loaded_pages": 0,
                         "l3_step_pages": 0, "load_errors": 0, "l2_saved_pages": 0,
                         "l3_written_pages": 0, "l3_skipped_pages": 0, "l3_dropped_saves": 0,
                         "l3_deferred_pages": 0}
        # (stored key, group) per page, and the ring's rows that hold them
        self._writes: queue.Queue[tuple[list[tuple[bytes, int]], slice] | None] = queue.Queue()
        self._staging: Staging | None = None
        self._ring: WriteRing | None = None  # pages waiting for the L3 writer
        self._behind = WriteBehind()  # pages for L3 the ring had no room for, in L2
        self._writer: threading.Thread | None = None
        self._pin = False
        self.gate = LayerGate([], None)  # L2 loads layer by layer (from `register`)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's per-layer caches, in layer order, in either of vLLM's layouts: the block at
        dim 0 (`[num_blocks, ...]`: the CPU backend, FlashInfer) or K and V first, then the
        block (`[2, num_blocks, ...]`: FlashAttention on CUDA); one block of one layer is
        `layer_block_bytes` long either way."""
        groups = self.c.groups
        names = (sorted(kv_caches, key=layer_order) if groups is None
                 else [name for group in groups.groups for name in group.names])
        layers = [kv_caches[n] for n in names]
        want = self.c.geometry.layer_block_bytes
        self._block_dims = [block_dim(name, kv, want) for name, kv in zip(names, layers)]
        if want % buffers.WORD_BYTES:
            raise ValueError(f"hicache connector: a layer's block is {want} bytes, not a "
                             f"multiple of {buffers.WORD_BYTES}")
        sizes = [self.c.unit_layers(g) for g in range(len(self.c.codecs))]
        if len(layers) != sum(sizes):
            raise ValueError(f"hicache connector: {len(layers)} KV layers registered, the KV "
                             f"cache config has {sum(sizes)}")
        self.layers = layers
        starts = [sum(sizes[:g]) for g in range(len(sizes))]
        self._groups = [list(range(a, a + n)) for a, n in zip(starts, sizes)]
        self._into = block_bytes(layers, self._block_dims, self._groups)
        self._pin = layers[0].is_cuda  # host buffers pinned for the copies to and from CUDA
        unit = self.c.geometry.num_layers  # layers of a page (hybrid: of a group's block)
        # ready buffers: the first request's loads (a restart's first replay) would
        # otherwise fault their memory in on the forward's thread
        self._staging = Staging(max(1, STAGING_CHUNK_BYTES // (unit * want)), unit, want,
                                self._pin, keep=STAGING_KEPT_CHUNKS, ready=STAGING_READY_CHUNKS)
        # zeros, not empty: every page of L2 is touched here, at start-up, as vLLM's own KV
        # cache is, and not by the first save into each slot on the forward's thread
        self.host = torch.zeros((self.c.slots, unit, want), dtype=torch.uint8,
                                pin_memory=self._pin) if self.c.slots else None
        if self.host is not None and groups is None:  # a hybrid model's: before the forward
            self.gate = LayerGate(names, layer_loads(layers, self._block_dims, self.host,
                                                     self._staging))
        if self.c.settings.has_storage:
            self._start_l3(unit * want, unit, want)

    def _start_l3(self, page_bytes: int, unit: int, want: int) -> None:
        self.c.open_store()
        self._ring = WriteRing(self.c.settings.write_ring_pages(page_bytes), unit, want,
                               self._pin)
        self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                        name="hicache-l3-writer")
        self._writer.start()
        self._reader = L3Reader(lambda: self.c.store, self.c.codecs, self.tp_rank,
                                self._staging, STAGING_KEPT_CHUNKS)

    def _gather(self, block_ids: list[int], pages: torch.Tensor, group: int = 0) -> None:
        """Blocks `block_ids` of every layer of `group` into `pages` ([n, layers, bytes]
        uint8, CPU), each layer's in its own dtype (a byte-wise copy of a strided view is
        many times slower); a `[2, blocks, ...]` layer's as its K rows, then its V rows."""
        n = len(block_ids)
        index = torch.tensor(block_ids, dtype=torch.long, device=self.layers[0].device)
        for row, layer in enumerate(self._groups[group]):
            kv, dim = self.layers[layer], self._block_dims[layer]
            dst = pages[:, row].view(kv.dtype).view(n, *block_shape(kv, dim))
            if dim == 0 and not kv.is_cuda:
                torch.index_select(kv, 0, index, out=dst)
            else:
                dst.copy_(kv.index_select(dim, index).movedim(dim, 0))

    def _scatter(self, block_ids: list[int], pages: torch.Tensor, group: int = 0) -> None:
        """`pages` ([n, layers, bytes] uint8, CPU) into blocks `block_ids` of every layer of
        `group`."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.layers[0].device)
        for row, layer in enumerate(self._groups[group]):
            scatter_layer(self.layers[layer], self._block_dims[layer], index, pages[:, row])
        if self.layers and self.layers[0].is_cuda:  # the staging buffer is reused next
            torch.cuda.current_stream(self.layers[0].device).synchronize()

    # ------------------------------------------------------------------ loads

    def prefetch(self, plan: StepPlan) -> None:
        """As the step's metadata arrives (vLLM's `handle_preemptions`, before it prepares
        the inputs), on vLLM's thread: the step's L3 reads queued for the loader, ahead of
        held-back requests', where they go through staging buffers (caches on a GPU); reads
        straight into the blocks wait for `load` (vLLM zeroes new blocks meanwhile)."""
        assert self._staging is not None or not plan.l3_loads, "loads before register"
        self._plan, self._step_failed = plan, set()
        self._step_reads = [StepRead(r, loads, self._into, self._staging.pages)
                            for r, loads in plan.l3_loads.items()]
        if self._into is None:
            self._queue_step_reads()

    def _queue_step_reads(self) -> None:
        for read in self._step_reads:
            assert self._reader is not None, "L3 loads need an L3"
            self._reader.ahead(read)

    def load(self, plan: StepPlan) -> None:
        """The step's loads, on vLLM's thread (start_load_kv): L2 pages into their blocks
        (`LayerGate`); its L3 pages read (by the loader, and this thread once the forward
        needs them) and placed now, or before the forward's first layer once vLLM has shown
        that it waits on every layer; held-back requests' L3 pages queued for the loader,
        what it read placed (a request with all placed, or none to load, is finished). In
        an `idle` step (no forward) this thread reads those too (`L3Reader.read_now`)."""
        if self._plan is not plan:
            self.prefetch(plan)
        if self._into is not None:
            self._queue_step_reads()
        async_loads = {r: pages for r, pages in plan.async_loads.items() if pages}
        self.finished_loads.update(r for r in plan.async_loads if r not in async_loads)
        if self._reader is not None and not plan.idle:
            for req_id, pages in async_loads.items():
                self._reader.later(req_id, pages)
        elif self._reader is not None:  # what is queued first, then this step's
            jobs = [*iter(self._reader.queued, None), *async_loads.items()]
            for staged in self._reader.read_now(jobs, self._into):
                self._place_async(staged)
        self.gate.begin(plan.idle)
        if plan.loads and self.layers:
            assert all(x.slot is not None for x in plan.loads), "L3 pages are l3_loads"
            if self.c.groups is not None:
                self._load_units(plan.loads)
            elif self.gate.load([x.slot for x in plan.loads], [x.block_id for x in plan.loads]):
                self.counters["l2_layered_pages"] += len(plan.loads)
            self.counters["l2_loaded_pages"] += len(plan.loads)
        for staged in self._reader.take_read() if self._reader is not None else []:
            self._place_async(staged)
        if not self.gate.defers:
            self._place_step()

    def _load_units(self, loads: list[PageLoad]) -> None:
        """A hybrid model's L2 units into their blocks now, before the forward, a group and
        a staging buffer at a time."""
        assert self.host is not None and self._staging is not None
        for group, units in by_group(loads):
            for run in self._staging.runs(units):
                with self._staging.lent() as chunk:
                    buffers.read_slots(self.host, [x.slot for x in run], chunk[:len(run)])
                    self._scatter([x.block_id for x in run], chunk[:len(run)], group)

    def wait_layer(self, name: str) -> None:
        """Before layer `name`'s attention reads its cache (vLLM's `wait_for_layer_load`)."""
        if self._step_reads:
            self._place_step()
        self.gate.wait(name)

    def finish_loads(self) -> None:
        """After the step's forward (vLLM's `wait_for_save`, before its saves): every L2
        page in place. In-step L3 pages still unplaced were left for a layer's wait that
        the forward never made: it ran without them, so they are load errors."""
        if self._step_reads:
            self.gate.turn_off("the forward waited on no layer (wait_for_layer_load)")
            for read in self._step_reads:
                self._fail_step(read.req_id, [x.block_id for x in read.loads])
                assert self._reader is not None
                self._reader.drop(read)
            self._step_reads = []
        self.gate.finish()
        self._plan = None

    def _place_step(self) -> None:
        """The step's L3 pages into their blocks, each request's as soon as it is read;
        a request with a page that failed is reported, and its step's saves dropped."""
        reads, self._step_reads = self._step_reads, []
        for read in reads:
            assert self._reader is not None
            bad = [block for staged in self._reader.wait(read) for block in self._place(staged)]
            self.counters["l3_step_pages"] += len(read.loads) - len(bad)
            if bad:
                self._fail_step(read.req_id, bad, len(read.loads))

    def _fail_step(self, req_id: str, blocks: list[int], total: int | None = None) -> None:
        self._step_failed.add(req_id)
        self._report(blocks, total or len(blocks))

    def _place(self, staged: Staged) -> list[int]:
        """Pages read into their blocks, on vLLM's thread, the buffer given back; the blocks
        of those that did not arrive whole (from a buffer: never copied; vLLM computes
        them)."""
        n, ok = len(staged.loads), staged.ok
        good = [i for i in range(n) if ok[i]]
        try:
            for group, rows in by_group(good if not staged.placed else [],
                                        lambda i: staged.loads[i].group):
                assert staged.chunk is not None
                self._scatter([staged.loads[i].block_id for i in rows],
                              staged.chunk[:n] if len(rows) == n else staged.chunk[rows], group)
        finally:
            assert self._reader is not None
            self._reader.give(staged)
        self.counters["l3_loaded_pages"] += len(good)
        return [staged.loads[i].block_id for i in range(n) if not ok[i]]

    def _place_async(self, staged: Staged) -> None:
        """A buffer of a request vLLM holds back placed; after its last, the request is
        finished, its failed blocks reported in the same step."""
        bad = self._failed.setdefault(staged.req_id, [])
        bad += self._place(staged)
        if staged.last:
            del self._failed[staged.req_id]
            self._report(bad, staged.total, staged.req_id)
            self.finished_loads.add(staged.req_id)

    def _report(self, bad: list[int], total: int, req_id: str | None = None) -> None:
        """Blocks that failed to load; a hybrid model's as their request's (vLLM cannot map
        block ids of several groups back to requests: it computes the request whole)."""
        if bad:
            self.counters["load_errors"] += len(bad)
            if self.c.groups is not None and req_id is not None:
                self.failed_loads.add(req_id)
            else:
                self.load_errors.update(bad)
            logger.warning("hicache connector: %d of %d L3 pages could not be loaded (missing "
                           "or failed their checksum): vLLM recomputes them", len(bad), total)

    def take_load_errors(self) -> set[int]:
        """Blocks that could not be loaded, since the last call."""
        errors, self.load_errors = self.load_errors, set()
        return errors

    def take_failed_loads(self) -> set[str]:
        """Requests whose L3 load failed (a hybrid model's), since the last call; they are
        in `take_finished_loads` too."""
        failed, self.failed_loads = self.failed_loads, set()
        return failed

    def take_finished_loads(self) -> set[str]:
        """Requests whose L3 loads are done (placed or failed), since the last call; their
        failed blocks are in `take_load_errors` from the same step on."""
        done, self.finished_loads = self.finished_loads, set()
        return done

    # ------------------------------------------------------------------ saves

    def save(self, saves: list[PageSave]) -> None:
        """Every step (vLLM's wait_for_save): its filled blocks gathered into the write
        ring's free rows, copied on into their L2 slots, and queued for the L3 writer (the
        ring's copy: a later step may reassign the slot). Those the ring has no room for go
        to L2 (a staging buffer at a time, as L2-only saves do) and wait there for rows a
        later step's saves leave free (`WriteBehind`: a step's own first, so a new prompt's
        first pages never queue behind old ones' last). Blocks over a failed load dropped."""
        if self._step_failed:
            kept = [x for x in saves if self._step_failed.isdisjoint(x.over)]
            self.counters["l3_dropped_saves"] += len(saves) - len(kept)
            saves = kept
        # a waiting page whose slot a save reuses is never written (other bytes now)
        self.counters["l3_skipped_pages"] += self._behind.forget(
            x.slot for x in saves if x.slot is not None)
        if saves and self.layers:
            self._save_step(saves)
        if self._behind.pages:
            self._behind.to_ring(self._ring, self.host, self._writes.put, BEHIND_STEP_PAGES)

    def _save_step(self, saves: list[PageSave]) -> None:
        l2_only = [x for x in saves if not x.l3]
        rest: Sequence[PageSave] = sorted((x for x in saves if x.l3), key=lambda x: x.group)
        while rest and self._ring is not None:
            rows = self._ring.reserve(len(rest))
            if rows is None:
                break
            run, rest = rest[:rows.stop - rows.start], rest[rows.stop - rows.start:]
            try:
                self._save_rows(run, self._ring.rows[rows])
            except BaseException:
                self._ring.cancel(rows)
                raise
            self._writes.put(([(store_key(x.page_hash, self.tp_rank, x.group), x.group)
                               for x in run], rows))
        if self._ring is not None:  # the ring is full: the rest waits in L2 (or is lost)
            for x in rest:
                if x.slot is None:
                    self.counters["l3_skipped_pages"] += 1
                    continue
                self._behind.add(x.slot, store_key(x.page_hash, self.tp_rank, x.group), x.group)
                self.counters["l3_deferred_pages"] += 1
        rest = sorted([x for x in rest if x.slot is not None] + l2_only, key=lambda x: x.group)
        assert self._staging is not None
        for run in self._staging.runs(rest):
            with self._staging.lent() as chunk:
                self._save_rows(run, chunk[:len(run)])

    def _save_rows(self, saves: Sequence[PageSave], rows: torch.Tensor) -> None:
        """`saves`' blocks gathered into `rows` ([n, layers, bytes]), then those with an L2
        slot copied into it."""
        start = 0
        for group, units in by_group(saves):
            self._gather([x.block_id for x in units], rows[start:start + len(units)], group)
            start += len(units)
        in_l2 = [i for i, x in enumerate(saves) if x.slot is not None]
        if in_l2 and self.host is not None:
            src = rows if len(in_l2) == len(saves) else rows[in_l2]
            buffers.write_slots(self.host, [saves[i].slot for i in in_l2], src)
            self.counters["l2_saved_pages"] += len(in_l2)

    def _write_loop(self) -> None:
        background_priority()  # the forward pass keeps the cores; L3 takes what it leaves
        assert self._ring is not None
        ring = self._ring
        while True:
            item = self._writes.get()
            if item is None:
                return
            keys, rows = item
            try:
                # a transaction (and sync) per page: LMDB mallocs a transaction's new pages
                # and frees them at commit; a page's worth is reused by the next, while a
                # batch's is handed back to the kernel and faulted in again, drawing on the
                # free memory vLLM's own activations fault in from (docs/integrations.md)
                for row, (key, group) in zip(range(rows.start, rows.stop), keys):
                    page = ring.rows[row, :self.c.unit_layers(group)]
                    stored = self.c.store.put_values([key], lambda _, page=page: [as_bytes(page)],
                                                     self.c.codecs[group])
                    self.counters["l3_written_pages"] += sum(stored)
            except Exception:  # a store fault costs the pages, never the server
                logger.exception("hicache connector: an L3 write failed")
            finally:
                ring.release(rows)

    def close(self) -> None:
        """Stop the loader (what it read is dropped: vLLM is stopping), write what is queued
        and what L2 holds for L3 (for CLOSE_WRITE_BEHIND_S at most), stop the writer."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._writer is not None:
            deadline = time.monotonic() + CLOSE_WRITE_BEHIND_S
            while self._behind.pages and time.monotonic() < deadline:  # rows as they free
                self._behind.to_ring(self._ring, self.host, self._writes.put)
                time.sleep(0.01)
            self._writes.put(None)
            self._writer.join()
            self._writer = None

