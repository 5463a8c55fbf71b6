"""Moving KV pages between the device pool (L1) and the host pool (L2).

A `TransferEngine` copies whole pages: the caller passes page-aligned slot indices (as the
allocators hand them out) and gets a `TransferHandle` whose layers complete one by one, so
the model runner can compute layer i while layer i+1 is still arriving.

    CpuTransferEngine   one worker thread, torch copies, a threading.Event per layer
    CudaTransferEngine  CuPy non-blocking streams, pinned host memory, a CUDA event per layer;
                        the compute stream waits on the events (the CPU never blocks)

Ordering rule (vLLM #45704): a D->H copy must start after the forward pass that wrote its
slots, and attention must not read loaded slots before their layer's copy ends. The CPU
engine gets the first for free (the scheduler queues copies after its synchronous forward)
and the second from `wait_layer`; the CUDA engine records an event on the compute stream at
queue time and makes the copy stream wait on it, and `wait_layer` makes the compute stream
wait on the layer's event.

Hybrid models (`WindowedKVPool`, `has_windows`): a host page holds every layer of a page, as
for any pool; a window layer's side of it lives in its group's page for the full page, read
from the pool's page map when `copy_d2h` / `copy_h2d` is called. A page without them (PADDING_PAGE) is
skipped for the window layers both ways: its host copy keeps whatever window-layer bytes
that host page held (the tree records it has no window KV), and a load writes no window page
for it. So a copy is one page list per group of layers (`_PageGroup`); a plain DeviceKVPool's
is one group of every layer, the very calls of a pool without windows.

Threading: `copy_d2h`, `copy_h2d` and the handles' methods are called by the scheduler thread
(the model runner runs on it); the engine's own worker/streams only touch the bytes of the
slots they were handed (and of their window pages, which the caller keeps mapped as long).
"""

from __future__ import annotations

import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from hicache.kernels.cuda_utils import import_cupy, to_device_async
from hicache.kernels.transfer_kv import d2h_pages, h2d_pages
from hicache.memory.device import PADDING_PAGE, DeviceKVPool, pages_of
from hicache.memory.host import HostKVPool
from hicache.policies import IO_BACKENDS, check_choice
from hicache.threads import one_openmp_thread

if TYPE_CHECKING:
    from hicache.memory.windowed import WindowedKVPool

    KVPool = DeviceKVPool | WindowedKVPool


class _PageGroup(NamedTuple):
    """The pages of one copy that a set of layers moves (see the module docstring)."""

    layers: tuple[int, ...] | None  # None: every layer of the pool
    device_pages: torch.Tensor  # [n] int64, CPU
    host_pages: torch.Tensor  # [n] int64, CPU
    device_limit: int  # pages in those layers' buffers (the range check of the CUDA engine)


class TransferHandle(ABC):
    """One queued copy. Layers complete in order 0..num_layers-1."""

    num_layers: int

    @abstractmethod
    def wait_layer(self, layer: int) -> None:
        """Make the consumer of layer `layer` wait until that layer's pages have landed."""

    @abstractmethod
    def wait(self) -> None:
        """Block the calling thread until the whole copy has finished."""

    @abstractmethod
    def done(self) -> bool:
        """Whether the whole copy has finished, successfully or not (never blocks)."""

    def failed(self) -> bool:
        """Whether the copy raised (only meaningful once `done()`)."""
        return False

    def wait_quietly(self) -> None:
        """Like `wait`, but a failed copy does not raise (its ack reports it)."""
        self.wait()

class TransferEngine(ABC):
    """Copies whole pages between a DeviceKVPool and a HostKVPool.

    Indices are slot indices (int64, CPU, whole pages, same length on both sides); the
    engine reads `device_indices` / writes `host_indices` (or the reverse) and nothing else.
    The caller keeps the source and destination slots allocated and unused until the
    handle is done (the cache locks the node / protects the host pages until the ack).
    """

    def __init__(self, device_pool: KVPool, host_pool: HostKVPool,
                 io_backend: str = "kernel") -> None:
        check_choice("io_backend", io_backend, IO_BACKENDS)
        if device_pool.page_size != host_pool.page_size:
            raise ValueError(f"device page_size {device_pool.page_size} != host page_size "
                             f"{host_pool.page_size}")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.io_backend = io_backend
        self.page_size = device_pool.page_size
        self._windows = getattr(device_pool, "has_windows", False)  # a WindowedKVPool
        # pages in the buffers of every layer (a hybrid pool's window layers share them)
        self._device_pages = device_pool.k_buffers[0].shape[0] // self.page_size

    @abstractmethod
    def copy_d2h(self, device_indices: torch.Tensor, host_indices: torch.Tensor
                 ) -> TransferHandle: ...

    @abstractmethod
    def copy_h2d(self, host_indices: torch.Tensor, device_indices: torch.Tensor
                 ) -> TransferHandle: ...

    def close(self) -> None:
        """Finish queued copies and release threads / streams."""

    def _pages(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if len(a) != len(b) or len(a) % self.page_size:
            raise ValueError(f"copies move whole pages: got {len(a)} and {len(b)} slots with "
                             f"page_size {self.page_size}")
        return pages_of(a, self.page_size), pages_of(b, self.page_size)

    def _groups(self, device_indices: torch.Tensor, dev_pages: torch.Tensor,
                host_pages: torch.Tensor) -> tuple[list[_PageGroup], list[int]]:
        """(the copy's page groups, the group of each layer): one group of every layer for a
        pool without windows; else the full layers by `dev_pages`, and each window group's
        layers by that group's pages of the pages that have them (read from the page map
        now)."""
        d = self.device_pool
        if not self._windows:
            return [_PageGroup(None, dev_pages, host_pages, self._device_pages)], [0] * d.num_layers
        window = d.group_pages_of(device_indices)  # [pages, groups]
        live = window[:, 0] != PADDING_PAGE
        groups = [_PageGroup(d.full_layers, dev_pages, host_pages, self._device_pages)]
        groups += [_PageGroup(layers, window[live, g], host_pages[live], self._device_pages)
                   for g, layers in enumerate(d.group_layers)]
        return groups, [d.kv_group(i) for i in range(d.num_layers)]


# ----------------------------------------------------------------------------------- CPU


class CpuHandle(TransferHandle):
    """Per-layer `threading.Event`s set by the worker thread."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._events = [threading.Event() for _ in range(num_layers)]
        self.error: BaseException | None = None

    def wait_layer(self, layer: int) -> None:
        self._events[layer].wait()
        self._raise()

    def wait(self) -> None:
        self._events[-1].wait()
        self._raise()

    def done(self) -> bool:
        return self._events[-1].is_set()

    def wait_quietly(self) -> None:
        self._events[-1].wait()  # a failure is left to failed() and the ack

    def failed(self) -> bool:
        return self.error is not None

    def _set(self, layer: int) -> None:
        self._events[layer].set()

    def _fail(self, error: BaseException) -> None:
        self.error = error
        for ev in self._events:
            ev.set()

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError("KV page transfer failed") from self.error


class CpuTransferEngine(TransferEngine):
    """One daemon worker thread runs the copies in FIFO order with torch (GIL released)."""

    def __init__(self, device_pool: KVPool, host_pool: HostKVPool,
                 io_backend: str = "kernel") -> None:
        super().__init__(device_pool, host_pool, io_backend)
        # On the CPU the "kernel" backend is the kernels' torch reference (whole-page index
        # copies); "direct" copies runs of consecutive pages with plain copy_.
        self._backend = "reference" if io_backend == "kernel" else "direct"
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="hicache-transfer", daemon=True)
        self._worker.start()

    def copy_d2h(self, device_indices: torch.Tensor, host_indices: torch.Tensor
                 ) -> TransferHandle:
        dev_pages, host_pages = self._pages(device_indices, host_indices)
        groups, _ = self._groups(device_indices, dev_pages, host_pages)
        handle = CpuHandle(self.device_pool.num_layers)

        def job() -> None:
            d = self.device_pool
            for g in groups:
                if g.layers is None or g.device_pages.numel():
                    d2h_pages(d.k_buffers, d.v_buffers, self.host_pool.buffer,
                              self.host_pool.layout, g.device_pages, g.host_pages,
                              self.page_size, layers=g.layers, backend=self._backend)
            for layer in range(handle.num_layers):
                handle._set(layer)

        self._submit(handle, job)
        return handle

    def copy_h2d(self, host_indices: torch.Tensor, device_indices: torch.Tensor
                 ) -> TransferHandle:
        host_pages, dev_pages = self._pages(host_indices, device_indices)
        groups, group_of = self._groups(device_indices, dev_pages, host_pages)
        handle = CpuHandle(self.device_pool.num_layers)

        def job() -> None:
            d = self.device_pool
            for layer in range(handle.num_layers):
                g = groups[group_of[layer]]
                if g.layers is None or g.device_pages.numel():
                    h2d_pages(self.host_pool.buffer, self.host_pool.layout, d.k_buffers,
                              d.v_buffers, g.host_pages, g.device_pages, self.page_size,
                              layers=[layer], backend=self._backend)
                handle._set(layer)

        self._submit(handle, job)
        return handle

    def _submit(self, handle: CpuHandle, job: Callable[[], None]) -> None:
        def guarded() -> None:
            try:
                job()
            except Exception as exc:  # noqa: BLE001 - surfaced to the waiter; worker goes on
                handle._fail(exc)

        self._jobs.put(guarded)

    def _run(self) -> None:
        one_openmp_thread()  # beside the forward pass: no pool of its own (hicache.threads)
        while (job := self._jobs.get()) is not None:
            job()

    def close(self) -> None:
        if self._worker.is_alive():
            self._jobs.put(None)
            self._worker.join()


# ---------------------------------------------------------------------------------- CUDA


class CudaHandle(TransferHandle):
    """Per-layer `torch.cuda.Event`s recorded on a copy stream.

    `wait_layer` makes the calling thread's current stream on the pool's device (the compute
    stream) wait on the GPU, the CPU goes on; `wait` blocks the CPU; `done` never blocks.
    """

    def __init__(self, events: list[torch.cuda.Event], device: torch.device) -> None:
        self.num_layers = len(events)
        self._events = events  # one per layer, in order (the last one ends the copy)
        self._device = device

    def wait_layer(self, layer: int) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._events[layer])

    def wait(self) -> None:
        self._events[-1].synchronize()

    def done(self) -> bool:
        return self._events[-1].query()


class CudaTransferEngine(TransferEngine):
    """Copies on two non-blocking CuPy streams (one per direction) with per-layer events.

    `io_backend="kernel"` launches `kernels/src/transfer_kv.cu` through CuPy (one launch for all
    layers D->H, one per layer H->D so layers land in order); without CuPy it falls back, with
    a warning, to `"direct"`: torch copies over runs of consecutive pages on the same streams.
    The host pool must be pinned (the kernel reads and writes it through UVA, and a direct
    copy is asynchronous only from or to pinned memory).

    Stream rule: every copy first waits for the work queued so far on the caller's current
    stream of the pool's device (the compute stream), and its page lists are uploaded on the
    copy stream itself, so the caching allocator reuses their blocks only for work ordered
    after the copy that reads them.
    """

    def __init__(self, device_pool: KVPool, host_pool: HostKVPool,
                 io_backend: str = "kernel") -> None:
        super().__init__(device_pool, host_pool, io_backend)
        if not torch.cuda.is_available():
            raise RuntimeError("CudaTransferEngine needs a CUDA device; use CpuTransferEngine")
        if not host_pool.is_pinned:
            raise ValueError("CudaTransferEngine needs a pinned host pool (pin_memory=True)")
        # The buffers' device carries its index ("cuda" alone means whichever is current).
        self._device = device_pool.k_buffers[0].device
        self._backend = self._kernels_backend(io_backend)
        self._cupy_streams: list = []  # owners of the streams below (kept alive)
        self._d2h_stream = self._new_stream()
        self._h2d_stream = self._new_stream()

    def _new_stream(self) -> torch.cuda.Stream:
        """A non-blocking CuPy stream on the pool's device, which torch sees as an
        ExternalStream (so torch copies and events use it too); a torch stream when CuPy,
        the optional `cuda` extra, is missing."""
        if self._backend != "cuda":
            return torch.cuda.Stream(self._device)
        cupy = import_cupy()
        with cupy.cuda.Device(self._device.index or 0):
            owner = cupy.cuda.Stream(non_blocking=True)
        self._cupy_streams.append(owner)
        return torch.cuda.ExternalStream(owner.ptr, device=self._device)

    def copy_d2h(self, device_indices: torch.Tensor, host_indices: torch.Tensor
                 ) -> TransferHandle:
        groups, _ = self._checked_groups(device_indices, host_indices)
        d, stream = self.device_pool, self._d2h_stream
        stream.wait_stream(torch.cuda.current_stream(self._device))  # after the forward
        with torch.cuda.stream(stream):
            for g in filter(None, self._for_backend(groups)):  # one launch per group
                d2h_pages(d.k_buffers, d.v_buffers, self.host_pool.buffer,
                          self.host_pool.layout, g.device_pages, g.host_pages, self.page_size,
                          layers=g.layers, backend=self._backend, stream=stream)
            event = self._record(stream)
        return CudaHandle([event] * d.num_layers, self._device)

    def copy_h2d(self, host_indices: torch.Tensor, device_indices: torch.Tensor
                 ) -> TransferHandle:
        groups, group_of = self._checked_groups(device_indices, host_indices)
        d, stream = self.device_pool, self._h2d_stream
        # The destination slots may have been read or written by earlier forwards (slot reuse).
        stream.wait_stream(torch.cuda.current_stream(self._device))
        events = []
        with torch.cuda.stream(stream):
            uploaded = self._for_backend(groups)  # once per copy, not once per layer
            for layer in range(d.num_layers):
                g = uploaded[group_of[layer]]
                if g is not None:
                    h2d_pages(self.host_pool.buffer, self.host_pool.layout, d.k_buffers,
                              d.v_buffers, g.host_pages, g.device_pages, self.page_size,
                              layers=[layer], backend=self._backend, stream=stream)
                events.append(self._record(stream))  # layer `layer` has landed
        return CudaHandle(events, self._device)

    def close(self) -> None:
        self._d2h_stream.synchronize()
        self._h2d_stream.synchronize()

    def _checked_groups(self, device_indices: torch.Tensor, host_indices: torch.Tensor
                        ) -> tuple[list[_PageGroup], list[int]]:
        """`_groups`, range-checked on the CPU: the kernel takes uploaded lists unchecked,
        and a page past a pool is a write outside it."""
        dev_pages, host_pages = self._pages(device_indices, host_indices)
        groups, group_of = self._groups(device_indices, dev_pages, host_pages)
        for g in groups:
            for name, pages, limit in (("device", g.device_pages, g.device_limit),
                                       ("host", g.host_pages, self.host_pool.num_pages)):
                if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= limit):
                    raise ValueError(f"{name} pages must lie in [0, {limit}), got "
                                     f"[{int(pages.min())}, {int(pages.max())}]")
        return groups, group_of

    def _for_backend(self, groups: list[_PageGroup]) -> list[_PageGroup | None]:
        """The groups with their page lists as the backend wants them: on the device for the
        kernel (uploaded once per copy on the current, i.e. copy, stream), on the CPU for
        direct copies (which find runs of consecutive pages there, without a sync); None
        for a hybrid pool's group with no page (nothing to queue)."""
        out: list[_PageGroup | None] = []
        for g in groups:
            if g.layers is not None and not g.device_pages.numel():
                out.append(None)
            elif self._backend != "cuda":
                out.append(g)
            else:
                out.append(g._replace(device_pages=to_device_async(g.device_pages, self._device),
                                      host_pages=to_device_async(g.host_pages, self._device)))
        return out

    @staticmethod
    def _kernels_backend(io_backend: str) -> str:
        """The kernels' backend for `io_backend`: the CuPy kernel, or direct copies when CuPy
        (the optional `cuda` extra) is missing."""
        if io_backend == "direct":
            return "direct"
        try:
            import_cupy()
        except RuntimeError as e:
            logging.getLogger(__name__).warning(
                "io_backend=kernel: %s; KV pages move by torch copies instead", e)
            return "direct"
        return "cuda"

    @staticmethod
    def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event


def make_transfer_engine(device_pool: KVPool, host_pool: HostKVPool,
                         io_backend: str = "kernel") -> TransferEngine:
    """The CUDA engine when the device pool lives on a GPU, else the CPU engine."""
    if device_pool.device.type == "cuda":
        return CudaTransferEngine(device_pool, host_pool, io_backend)
    return CpuTransferEngine(device_pool, host_pool, io_backend)
