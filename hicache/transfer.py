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

Threading: `copy_d2h`, `copy_h2d` and the handles' methods are called by the scheduler thread
(the model runner runs on it); the engine's own worker/streams only touch the bytes of the
slots they were handed.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from hicache.memory_pool import DeviceKVPool, pages_of
from hicache.memory_pool_host import HostKVPool
from kernels.transfer_kv import d2h_pages, h2d_pages

IO_BACKENDS = ("kernel", "direct")


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
        try:
            self.wait()
        except RuntimeError:
            pass  # reported through failed() / the ack

class TransferEngine(ABC):
    """Copies whole pages between a DeviceKVPool and a HostKVPool.

    Indices are slot indices (int64, CPU, whole pages, same length on both sides); the
    engine reads `device_indices` / writes `host_indices` (or the reverse) and nothing else.
    The caller keeps the source and destination slots allocated and unused until the
    handle is done (the cache locks the node / protects the host pages until the ack).
    """

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool,
                 io_backend: str = "kernel") -> None:
        if io_backend not in IO_BACKENDS:
            raise ValueError(f"io_backend {io_backend!r} is not one of {', '.join(IO_BACKENDS)}")
        if device_pool.page_size != host_pool.page_size:
            raise ValueError(f"device page_size {device_pool.page_size} != host page_size "
                             f"{host_pool.page_size}")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.io_backend = io_backend
        self.page_size = device_pool.page_size

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

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool,
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
        handle = CpuHandle(self.device_pool.num_layers)

        def job() -> None:
            d = self.device_pool
            d2h_pages(d.k_buffers, d.v_buffers, self.host_pool.buffer, self.host_pool.layout,
                      dev_pages, host_pages, self.page_size, backend=self._backend)
            for layer in range(handle.num_layers):
                handle._set(layer)

        self._submit(handle, job)
        return handle

    def copy_h2d(self, host_indices: torch.Tensor, device_indices: torch.Tensor
                 ) -> TransferHandle:
        host_pages, dev_pages = self._pages(host_indices, device_indices)
        handle = CpuHandle(self.device_pool.num_layers)

        def job() -> None:
            d = self.device_pool
            for layer in range(handle.num_layers):
                h2d_pages(self.host_pool.buffer, self.host_pool.layout, d.k_buffers,
                          d.v_buffers, host_pages, dev_pages, self.page_size,
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
        while (job := self._jobs.get()) is not None:
            job()

    def close(self) -> None:
        if self._worker.is_alive():
            self._jobs.put(None)
            self._worker.join()


# ---------------------------------------------------------------------------------- CUDA


class CudaHandle(TransferHandle):
    """Per-layer CUDA events recorded on a copy stream."""

    def __init__(self, events: list) -> None:
        self.num_layers = len(events)
        self._events = events  # cupy.cuda.Event, one per layer (the last one ends the copy)

    def wait_layer(self, layer: int) -> None:
        import cupy

        compute = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        compute.wait_event(self._events[layer])  # the GPU waits; the CPU goes on

    def wait(self) -> None:
        self._events[-1].synchronize()

    def done(self) -> bool:
        return self._events[-1].done


class CudaTransferEngine(TransferEngine):
    """Copies on two CuPy non-blocking streams (one per direction) with per-layer events.

    `io_backend="kernel"` launches `kernels/transfer_kv.cu` (one launch for all layers D->H,
    one per layer H->D so layers land in order); `"direct"` uses torch copies over runs of
    consecutive pages on the same streams. The host pool must be pinned.
    """

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool,
                 io_backend: str = "kernel") -> None:
        super().__init__(device_pool, host_pool, io_backend)
        if not torch.cuda.is_available():
            raise RuntimeError("CudaTransferEngine needs a CUDA device; use CpuTransferEngine")
        if not host_pool.is_pinned:
            raise ValueError("CudaTransferEngine needs a pinned host pool (pin_memory=True)")
        import cupy

        self._cupy = cupy
        self._backend = "cuda" if io_backend == "kernel" else "direct"
        self._d2h_stream = cupy.cuda.Stream(non_blocking=True)
        self._h2d_stream = cupy.cuda.Stream(non_blocking=True)

    def _after_compute(self, stream) -> None:
        """Order `stream` after everything queued on the compute stream so far."""
        producer = self._cupy.cuda.Event(disable_timing=True)
        producer.record(self._cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream))
        stream.wait_event(producer)

    def _run_on(self, stream, fn: Callable[[], None]) -> None:
        with torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr)), stream:
            fn()

    def _event(self, stream):
        ev = self._cupy.cuda.Event(disable_timing=True)
        ev.record(stream)
        return ev

    def copy_d2h(self, device_indices: torch.Tensor, host_indices: torch.Tensor
                 ) -> TransferHandle:
        dev_pages, host_pages = self._pages(device_indices, host_indices)
        dev_pages = dev_pages.to(self.device_pool.device, non_blocking=True)
        d, stream = self.device_pool, self._d2h_stream
        self._after_compute(stream)
        self._run_on(stream, lambda: d2h_pages(
            d.k_buffers, d.v_buffers, self.host_pool.buffer, self.host_pool.layout, dev_pages,
            host_pages, self.page_size, backend=self._backend, stream=stream))
        ev = self._event(stream)
        return CudaHandle([ev] * d.num_layers)

    def copy_h2d(self, host_indices: torch.Tensor, device_indices: torch.Tensor
                 ) -> TransferHandle:
        host_pages, dev_pages = self._pages(host_indices, device_indices)
        dev_pages = dev_pages.to(self.device_pool.device, non_blocking=True)
        d, stream = self.device_pool, self._h2d_stream
        # The destination slots may have been written by an earlier forward (slot reuse).
        self._after_compute(stream)
        events = []
        for layer in range(d.num_layers):
            self._run_on(stream, lambda layer=layer: h2d_pages(
                self.host_pool.buffer, self.host_pool.layout, d.k_buffers, d.v_buffers,
                host_pages, dev_pages, self.page_size, layers=[layer], backend=self._backend,
                stream=stream))
            events.append(self._event(stream))
        return CudaHandle(events)

    def close(self) -> None:
        self._d2h_stream.synchronize()
        self._h2d_stream.synchronize()


def make_transfer_engine(device_pool: DeviceKVPool, host_pool: HostKVPool,
                         io_backend: str = "kernel") -> TransferEngine:
    """The CUDA engine when the device pool lives on a GPU, else the CPU engine."""
    if device_pool.device.type == "cuda":
        return CudaTransferEngine(device_pool, host_pool, io_backend)
    return CpuTransferEngine(device_pool, host_pool, io_backend)
