"""L3 reads of `HiCacheConnector`'s worker side: a request's pages read from the store and
checked (header and tag, under each page's key) into staging buffers, a buffer at a time,
for the worker to place into vLLM's blocks on vLLM's thread. Two kinds, one loader thread:

    StepRead     a request whose forward runs in this step: queued ahead of every other
                 read as soon as the step's metadata arrives (vLLM then prepares the
                 step's inputs), in runs of a few pages that the loader and vLLM's thread
                 share: when the forward needs the pages, vLLM's thread reads the runs the
                 loader has not begun (so a step never waits for another request's read).
                 With vLLM's caches in host memory each page is copied straight into its
                 blocks (`into`) and checked there: a page that fails leaves its blocks
                 undefined, which is no worse than the stale bytes the forward would read
                 (vLLM drops the step's output for the request and computes them again).
    async reads  a request vLLM holds back (WAITING_FOR_REMOTE_KVS): read beside the steps
                 of other requests; at most `kept` of its buffers wait for vLLM's thread.
                 In a step with no forward, a StepRead straight into its blocks instead
                 (caches in host memory), shared by both threads.

No torch op runs on the loader thread (one would start an OpenMP team of its own beside the
forward's): it fills buffers through their bytes. A store fault costs the buffer's pages.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hicache.integrations.vllm_buffers import Staging
from hicache.integrations.vllm_groups import by_group
from hicache.integrations.vllm_scheduler import PageLoad
from hicache.integrations.vllm_settings import store_key
from hicache.storage.backends.base import ValueStore
from hicache.storage.page_format import PageCodec

logger = logging.getLogger("vllm.hicache")  # under vLLM's logger: its handlers and level
STEP, LATER, STOP = 0, 1, 2  # the loader's queue order: in-step reads first, its stop last


@dataclass
class Staged:
    """A run of one request's L3 pages, read: into a staging buffer (`chunk`), or straight
    into their blocks (`placed`)."""

    req_id: str
    loads: Sequence[PageLoad]
    chunk: torch.Tensor | None  # the pages, in `loads`' order; None: none taken
    ok: list[bool]  # which arrived whole (header and checksum passed)
    total: int  # the request's L3 pages
    last: bool  # its last run
    held: bool = False  # one of the buffers the loader may hold for vLLM's thread
    placed: bool = False  # read straight into its blocks: nothing left to copy


BlockBytes = Callable[[int, int], list[Any]]  # (block id, group) -> its bytes in the group's
# layers, in order
STEP_RUN_PAGES = 4  # pages a thread claims at a time of an in-step read straight into blocks:
# a 46-page hit (SmolLM2 float32, 1,472 tokens) is 12 runs for two threads to share, and a
# run's read transaction and key hashing are spread over 4 pages of 1.5 MB


class StepRead:
    """One request's L3 pages for this step's forward, in runs that any thread claims
    (`take`) and reads; `done` is set once every run is read (`staged`, in run order).
    `into`: where each page goes (straight into its blocks), or None (staging buffers, a
    buffer's pages a run, placed by vLLM's thread)."""

    def __init__(self, req_id: str, loads: list[PageLoad], into: BlockBytes | None,
                 buffer_pages: int) -> None:
        self.req_id, self.loads, self.into = req_id, loads, into
        step = STEP_RUN_PAGES if into is not None else buffer_pages
        self.runs = [loads[i:i + step] for i in range(0, len(loads), step)]
        self.staged: list[Staged | None] = [None] * len(self.runs)
        self.done = threading.Event()
        self._next = 0  # the first run nobody has taken
        self._left = len(self.runs)  # runs not yet read
        self._lock = threading.Lock()
        if not self.runs:
            self.done.set()

    def take(self) -> int | None:
        """The next run for the calling thread to read, or None when all are taken."""
        with self._lock:
            if self._next == len(self.runs):
                return None
            self._next += 1
            return self._next - 1

    def read(self, k: int, staged: Staged | None) -> None:
        """Run `k` read (None: given up)."""
        self.staged[k] = staged
        with self._lock:
            self._left -= 1
            if not self._left:
                self.done.set()

    def drop(self) -> None:
        """The runs nobody has taken given up; those being read still finish."""
        while (k := self.take()) is not None:
            self.read(k, None)


class L3Reader:
    """The loader thread and the reads it shares with vLLM's thread. `store`: the L3 store
    (None: every page fails); `staging`: the worker's buffers; `kept`: how many buffers of
    asynchronous reads may wait for vLLM's thread."""

    def __init__(self, store: Callable[[], ValueStore | None], codecs: Sequence[PageCodec],
                 tp_rank: int, staging: Staging, kept: int) -> None:
        # `codecs`: per KV cache group, its units' (one group: every layer's pages)
        self.store, self.codecs, self.tp_rank, self.staging = store, codecs, tp_rank, staging
        self._jobs: queue.PriorityQueue[tuple[int, int, StepRead | tuple | None]] = (
            queue.PriorityQueue())
        self._order = itertools.count()  # FIFO within a kind
        self._read: list[Staged] = []  # asynchronous reads' buffers, not yet taken
        self._read_lock = threading.Lock()
        self._held = threading.Semaphore(kept)
        self._thread = threading.Thread(target=self._loop, daemon=True, name="hicache-l3-loader")
        self._thread.start()

    def ahead(self, read: StepRead) -> None:
        """An in-step read, before every asynchronous one queued."""
        self._jobs.put((STEP, next(self._order), read))

    def later(self, req_id: str, loads: list[PageLoad]) -> None:
        """An asynchronous read: its buffers come back through `take_read`."""
        self._jobs.put((LATER, next(self._order), (req_id, loads)))

    def wait(self, read: StepRead) -> list[Staged]:
        """`read`'s runs: those the loader has not begun read here, then the rest waited
        for."""
        self._work(read)
        read.done.wait()
        return [staged for staged in read.staged if staged is not None]

    def drop(self, read: StepRead) -> None:
        """`read` given up (its forward ran without it): what was read of it given back."""
        read.drop()
        read.done.wait()
        for staged in read.staged:
            if staged is not None:
                self.give(staged)

    def read_now(self, jobs: list[tuple[str, list[PageLoad]]], into: BlockBytes | None
                 ) -> Iterator[Staged]:
        """Held-back requests' pages (`jobs`) in a step with no forward, each request's
        runs in order: straight into their blocks (`into`) by this thread and the loader
        together, as an in-step read is; or (None: caches on a GPU) on this thread, a
        staging buffer at a time, which the caller places before the next is read. A page
        that fails in its blocks leaves them undefined: vLLM caches a held-back request's
        blocks only once its load is reported done, up to its first failed one, and
        computes the rest."""
        if into is None:
            for req_id, pages in jobs:
                yield from self.read(req_id, pages)
            return
        reads = [StepRead(req_id, pages, into, 0) for req_id, pages in jobs]
        for read in reads:
            self.ahead(read)
        for read in reads:
            yield from self.wait(read)

    def queued(self) -> tuple[str, list[PageLoad]] | None:
        """An asynchronous read the loader has not taken yet, or None (in-step reads left
        in the queue were read in their step already)."""
        while True:
            try:
                _, _, job = self._jobs.get_nowait()
            except queue.Empty:
                return None
            if isinstance(job, tuple):
                return job
            if job is None:  # the stop, queued by close() on this same thread
                self._jobs.put((STOP, next(self._order), None))
                return None

    def take_read(self) -> list[Staged]:
        """Asynchronous reads' buffers read since the last call."""
        with self._read_lock:
            read, self._read = self._read, []
        return read

    def read(self, req_id: str, loads: list[PageLoad], held: bool = False) -> Iterator[Staged]:
        """`loads` read into staging buffers, a buffer's pages at a time; `held`: each
        buffer one of those the loader may hold (it waits for one to come back)."""
        runs = list(self.staging.runs(loads))
        for k, run in enumerate(runs):
            if held:
                self._held.acquire()
            chunk = None
            try:
                chunk = self.staging.take()
                ok = self._read_l3(run, chunk)
            except Exception:  # a fault (the store, memory) costs these pages, no more
                logger.exception("hicache connector: an L3 read failed")
                ok = [False] * len(run)
            yield Staged(req_id, run, chunk, ok, len(loads), k == len(runs) - 1, held)

    def give(self, staged: Staged) -> None:
        """`staged`'s buffer back, and its place among those the loader may hold."""
        if staged.chunk is not None:
            self.staging.give(staged.chunk)
        if staged.held:
            self._held.release()

    def _read_l3(self, loads: Sequence[PageLoad], chunk: torch.Tensor) -> list[bool]:
        """L3's pages (at most `chunk`'s) into `chunk`, each checked as it is copied: which
        arrived whole."""
        return self._get(loads, lambda i: as_bytes(chunk[i, :self.codecs[
            loads[i].group].geometry.num_layers]))

    def _work(self, read: StepRead) -> None:
        """Runs of `read` read on this thread until none is left to take."""
        while (k := read.take()) is not None:
            run, last = read.runs[k], k == len(read.runs) - 1
            if read.into is None:
                staged = next(self.read(read.req_id, run))
            else:
                try:
                    ok = self._read_into(run, read.into)
                except Exception:  # a fault (the store) costs these pages, no more
                    logger.exception("hicache connector: an L3 read failed")
                    ok = [False] * len(run)
                staged = Staged(read.req_id, run, None, ok, len(read.loads), last, placed=True)
            read.read(k, staged)

    def _read_into(self, loads: Sequence[PageLoad], into: BlockBytes) -> list[bool]:
        """L3's pages straight into their blocks, each checked there: which arrived whole."""
        return self._get(loads, lambda i: into(loads[i].block_id, loads[i].group))

    def _get(self, loads: Sequence[PageLoad], into: Callable[[int], Any]) -> list[bool]:
        """Each page of `loads` copied into `into(its index)` and checked there, a group's
        at a time (each by its codec): which arrived whole."""
        ok = [False] * len(loads)
        store = self.store()
        if store is None:
            return ok
        for group, index in by_group(range(len(loads)), lambda i: loads[i].group):
            codec = self.codecs[group]
            keys = [store_key(loads[i].page_hash, self.tp_rank, group) for i in index]
            got = store.get_values(keys, lambda k, value, keys=keys, index=index, codec=codec:
                                   codec.copy_into(keys[k], value, into(index[k])), codec)
            for i, good in zip(index, got):
                ok[i] = good
        return ok

    def _loop(self) -> None:
        while True:
            _, _, job = self._jobs.get()
            if job is None:
                return
            if isinstance(job, StepRead):
                self._work(job)
                continue
            for staged in self.read(*job, held=True):
                with self._read_lock:
                    self._read.append(staged)

    def close(self) -> None:
        """Stop the loader; what it read and nobody placed is dropped (vLLM is stopping)."""
        self._jobs.put((STOP, next(self._order), None))
        while self._thread.is_alive():  # a loader waiting for buffers gets them back
            for staged in self.take_read():
                self.give(staged)
            self._thread.join(0.05)


def as_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, writable, without a copy."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")
