"""Transfer engines: whole-page copies, per-layer readiness, FIFO acks, failures, shutdown."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from conftest import requires_cuda

from hicache.memory.device import DeviceKVPool
from hicache.memory.host import HostKVPool
from hicache.transfer import engines as transfer
from hicache.transfer.controller import HiCacheController
from hicache.transfer.engines import CpuTransferEngine, CudaTransferEngine, make_transfer_engine

LAYERS, HEADS, DIM, PS = 3, 2, 8, 4


def pools(layout: str = "page_first", device: str = "cpu", pin: bool = False):
    dev = DeviceKVPool(16, PS, LAYERS, HEADS, DIM, torch.float32, device)
    host = HostKVPool(32, PS, LAYERS, HEADS, DIM, torch.float32, layout, pin_memory=pin,
                      check_available=False)
    return dev, host


def fill_unique(dev: DeviceKVPool) -> None:
    n = dev.num_slots * HEADS * DIM
    for layer in range(LAYERS):
        base = torch.arange(n, dtype=torch.float32).view(-1, HEADS, DIM)
        dev.k_buffers[layer].copy_(base + layer * 2 * n)
        dev.v_buffers[layer].copy_(base + (layer * 2 + 1) * n)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_round_trip_through_the_host_lands_in_new_slots(layout, io_backend) -> None:
    dev, host = pools(layout)
    fill_unique(dev)
    engine = CpuTransferEngine(dev, host, io_backend)
    src = torch.cat([dev.alloc(PS * 3), dev.alloc(PS * 2)])  # 5 pages
    expect = [(dev.k_buffers[i][src].clone(), dev.v_buffers[i][src].clone())
              for i in range(LAYERS)]
    hidx = host.alloc(len(src))
    engine.copy_d2h(src, hidx).wait()
    dst = dev.alloc(len(src))
    for layer in range(LAYERS):  # poison the destination
        dev.k_buffers[layer][dst] = -1.0
        dev.v_buffers[layer][dst] = -1.0
    handle = engine.copy_h2d(hidx, dst)
    for layer in range(LAYERS):
        handle.wait_layer(layer)
        assert torch.equal(dev.k_buffers[layer][dst], expect[layer][0])
        assert torch.equal(dev.v_buffers[layer][dst], expect[layer][1])
    assert handle.done() and not handle.failed()
    engine.close()


def test_layers_land_in_order_while_the_consumer_computes() -> None:
    dev, host = pools()
    engine = CpuTransferEngine(dev, host)
    gate = threading.Event()
    engine._jobs.put(gate.wait)  # hold the worker so the copy is observably pending
    handle = engine.copy_h2d(host.alloc(8), dev.alloc(8))
    assert not handle.done()
    gate.set()
    for layer in range(LAYERS):
        handle.wait_layer(layer)
        assert handle._events[layer].is_set()
    handle.wait()
    assert handle.done()
    engine.close()


def test_a_failed_copy_is_reported_and_the_worker_keeps_serving() -> None:
    dev, host = pools()
    engine = CpuTransferEngine(dev, host)
    bad = engine.copy_d2h(torch.tensor([9999 * PS + i for i in range(PS)]), host.alloc(PS))
    with pytest.raises(RuntimeError, match="transfer failed"):
        bad.wait()
    assert bad.done() and bad.failed()
    good = engine.copy_d2h(dev.alloc(PS), host.alloc(PS))
    good.wait()
    assert not good.failed()
    engine.close()


def test_partial_pages_are_refused() -> None:
    dev, host = pools()
    engine = CpuTransferEngine(dev, host)
    with pytest.raises(ValueError, match="whole pages"):
        engine.copy_d2h(torch.arange(PS, PS + 3), torch.arange(3))
    with pytest.raises(ValueError, match="io_backend"):
        CpuTransferEngine(dev, host, "dma")
    engine.close()


def test_close_joins_the_worker_thread() -> None:
    dev, host = pools()
    engine = CpuTransferEngine(dev, host)
    engine.copy_d2h(dev.alloc(PS), host.alloc(PS))
    engine.close()
    assert not engine._worker.is_alive()


def test_controller_acks_in_queue_order_and_batches_loads() -> None:
    dev, host = pools()
    fill_unique(dev)
    ctl = HiCacheController(dev, host, make_transfer_engine(dev, host))
    a, b = dev.alloc(PS), dev.alloc(2 * PS)
    ha, hb = ctl.write(a, 1), ctl.write(b, 2)
    ctl.wait_writes()
    assert [ack.node_id for ack in ctl.poll_writes()] == [1, 2]
    da, db = ctl.load(ha, 3), ctl.load(hb, 4)
    assert ctl.poll_loads() == []  # nothing launched yet
    handle = ctl.start_loading()
    assert ctl.current_load is handle
    ctl.wait_loads()
    acks = ctl.poll_loads()
    assert [(ack.node_id, ack.ok) for ack in acks] == [(3, True), (4, True)]
    for layer in range(LAYERS):
        k = dev.k_buffers[layer]
        assert torch.equal(k[da], k[a]) and torch.equal(k[db], k[b])
    assert ctl.write(dev.alloc(PS), 5) is not None
    assert ctl.load(torch.arange(16 * PS), 6) is None  # L1 has fewer free pages
    ctl.close()


def test_a_forward_waits_for_a_load_launched_while_no_forward_ran() -> None:
    """The loop launches queued loads when no forward runs; the next forward, with no load
    of its own, gets the last one in flight to wait on (its pages may be the ones it reads),
    not None: else it reads pages the worker has not written yet."""
    dev, host = pools()
    fill_unique(dev)
    engine = CpuTransferEngine(dev, host)
    ctl = HiCacheController(dev, host, engine)
    assert ctl.start_loading() is None  # nothing queued or in flight
    gate = threading.Event()
    engine._jobs.put(gate.wait)  # the worker is busy until the gate opens
    d = ctl.load(ctl.write(dev.alloc(PS), 2), 3)
    launched = ctl.start_loading()  # the loop's launch, no forward waiting
    assert d is not None and launched is not None and not launched.done()
    assert ctl.start_loading() is launched  # the next forward's handle: still in flight
    gate.set()
    ctl.wait_loads()
    assert [ack.node_id for ack in ctl.poll_loads()] == [3]
    assert ctl.start_loading() is None  # acked: nothing to wait on
    ctl.close()


@requires_cuda
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_cuda_engine_round_trip(layout, io_backend) -> None:
    dev, host = pools(layout, "cuda", pin=True)
    fill_unique(dev)
    engine = make_transfer_engine(dev, host, io_backend)
    assert type(engine).__name__ == "CudaTransferEngine"
    src = dev.alloc(5 * PS)
    expect = [dev.k_buffers[i][src.cuda()].clone() for i in range(LAYERS)]
    hidx = host.alloc(len(src))
    engine.copy_d2h(src, hidx).wait()
    dst = dev.alloc(len(src))
    handle = engine.copy_h2d(hidx, dst)
    for layer in range(LAYERS):
        handle.wait_layer(layer)  # the compute stream waits on the layer's event
        assert torch.equal(dev.k_buffers[layer][dst.cuda()], expect[layer])
    handle.wait()
    assert handle.done()
    engine.close()


# ---------------------------------------------------------------------------------------------
# CudaTransferEngine's stream and event ordering, on CPU: torch.cuda's streams and events and
# the kernels' entry points are replaced by recorders, so the test checks the order in which
# work is queued (never a copy's result).


class _Recorder:
    """A log of queued work and a stack of current streams, for the fakes below."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.current = ["compute"]


class _FakeStream:
    def __init__(self, rec: _Recorder, name: str) -> None:
        self.rec, self.name = rec, name

    def wait_stream(self, other: _FakeStream) -> None:
        self.rec.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: _FakeEvent) -> None:
        self.rec.log.append(("wait_event", self.name, event.number))

    def synchronize(self) -> None:
        self.rec.log.append(("synchronize", self.name))


class _FakeEvent:
    count = 0

    def __init__(self, rec: _Recorder) -> None:
        self.rec, self.number = rec, _FakeEvent.count
        _FakeEvent.count += 1

    def record(self, stream: _FakeStream) -> None:
        self.rec.log.append(("record", stream.name, self.number))

    def query(self) -> bool:
        self.rec.log.append(("query", self.number))
        return True

    def synchronize(self) -> None:
        self.rec.log.append(("event_sync", self.number))


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    rec = _Recorder()
    names = iter(["d2h", "h2d"])  # the engine creates its D->H stream first
    streams = {"compute": _FakeStream(rec, "compute")}

    def make_stream(device: torch.device) -> _FakeStream:
        name = next(names)
        streams[name] = _FakeStream(rec, name)
        return streams[name]

    @contextlib.contextmanager
    def use(stream: _FakeStream):
        rec.current.append(stream.name)
        yield
        rec.current.pop()

    def copy(direction: str):
        def record(*args, backend: str, stream: _FakeStream, layers=None) -> None:
            pages = (args[4], args[5])  # (device, host) for d2h; (host, device) for h2d
            rec.log.append((direction, rec.current[-1], stream.name, backend, layers,
                            tuple(p.tolist() for p in pages), tuple(id(p) for p in pages)))
        return record

    def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        moved = t.clone()
        rec.log.append(("upload", rec.current[-1], id(moved)))
        return moved

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", make_stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda: _FakeEvent(rec))
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: streams[rec.current[-1]])
    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(HostKVPool, "is_pinned", property(lambda self: True))
    monkeypatch.setattr(transfer, "d2h_pages", copy("d2h"))
    monkeypatch.setattr(transfer, "h2d_pages", copy("h2d"))
    monkeypatch.setattr(transfer, "to_device_async", upload)
    monkeypatch.setattr(torch.cuda, "ExternalStream",
                        lambda ptr, device=None: make_stream(device))
    monkeypatch.setattr(transfer, "import_cupy", lambda: _FakeCupy)
    return rec


class _FakeCupy:
    """Just enough of cupy for the engine to create its streams."""

    class cuda:
        @staticmethod
        @contextlib.contextmanager
        def Device(index: int):
            yield

        class Stream:
            def __init__(self, non_blocking: bool) -> None:
                assert non_blocking, "copy streams must not sync with the legacy stream"
                self.ptr = 0xC0FFEE


def test_cuda_engine_d2h_waits_for_the_forward_and_uploads_on_its_stream(
        fake_cuda: _Recorder) -> None:
    dev, host = pools()
    engine = CudaTransferEngine(dev, host, "kernel")
    src, hidx = dev.alloc(2 * PS), host.alloc(2 * PS)
    handle = engine.copy_d2h(src, hidx)
    log = fake_cuda.log
    assert log[0] == ("wait_stream", "d2h", "compute")  # vLLM #45704: after the forward
    assert [e[:2] for e in log[1:3]] == [("upload", "d2h")] * 2  # allocated on the copy stream
    kind, current, stream, backend, layers, pages, ids = log[3]
    assert (kind, current, stream, backend, layers) == ("d2h", "d2h", "d2h", "cuda", None)
    assert pages == ((src[::PS] // PS).tolist(), (hidx[::PS] // PS).tolist())
    assert ids == (log[1][2], log[2][2])  # the kernel reads the lists uploaded there
    assert log[4][:2] == ("record", "d2h") and len(log) == 5
    assert handle.num_layers == LAYERS
    assert handle.done() and log[-1] == ("query", log[4][2])
    handle.wait()
    assert log[-1] == ("event_sync", log[4][2])
    engine.close()
    assert log[-2:] == [("synchronize", "d2h"), ("synchronize", "h2d")]


def test_cuda_engine_h2d_lands_layer_by_layer_and_compute_waits_per_layer(
        fake_cuda: _Recorder) -> None:
    dev, host = pools()
    engine = CudaTransferEngine(dev, host, "kernel")
    hidx, dst = host.alloc(3 * PS), dev.alloc(3 * PS)
    handle = engine.copy_h2d(hidx, dst)
    log = fake_cuda.log
    assert log[0] == ("wait_stream", "h2d", "compute")  # slots reused after earlier forwards
    uploads = {e[2] for e in log[1:3] if e[:2] == ("upload", "h2d")}
    assert len(uploads) == 2  # once per copy, not once per layer
    copies, records = log[3::2], log[4::2]
    assert len(copies) == len(records) == LAYERS
    for layer, (copy, record) in enumerate(zip(copies, records)):
        assert copy[:5] == ("h2d", "h2d", "h2d", "cuda", [layer])
        assert copy[5] == ((hidx[::PS] // PS).tolist(), (dst[::PS] // PS).tolist())
        assert set(copy[6]) == uploads
        assert record[:2] == ("record", "h2d")
    handle.wait_layer(1)  # the compute stream waits on layer 1's event, the CPU does not
    assert log[-1] == ("wait_event", "compute", records[1][2])
    assert handle.done() and log[-1] == ("query", records[-1][2])


def test_cuda_engine_direct_copies_take_cpu_page_lists(fake_cuda: _Recorder) -> None:
    """Direct copies find page runs on the CPU: a list uploaded to the GPU would cost a
    device-to-host sync per call (per layer for loads)."""
    dev, host = pools()
    engine = CudaTransferEngine(dev, host, "direct")
    engine.copy_h2d(host.alloc(PS), dev.alloc(PS))
    assert not [e for e in fake_cuda.log if e[0] == "upload"]
    assert {e[3] for e in fake_cuda.log if e[0] == "h2d"} == {"direct"}


def test_cuda_engine_without_cupy_falls_back_to_direct(
        fake_cuda: _Recorder, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def missing() -> None:
        raise RuntimeError("the 'cuda' backend needs CuPy")

    monkeypatch.setattr(transfer, "import_cupy", missing)
    dev, host = pools()
    with caplog.at_level("WARNING", logger="hicache.transfer.engines"):
        engine = CudaTransferEngine(dev, host, "kernel")
    assert "CuPy" in caplog.text
    engine.copy_d2h(dev.alloc(PS), host.alloc(PS))
    assert [e[3] for e in fake_cuda.log if e[0] == "d2h"] == ["direct"]


def test_cuda_engine_refuses_pages_outside_the_pools_before_queueing(
        fake_cuda: _Recorder) -> None:
    """The kernel takes uploaded page lists unchecked: a page past a pool would be a write
    outside it, so the engine checks the range on the CPU first."""
    dev, host = pools()
    engine = CudaTransferEngine(dev, host, "kernel")
    far = torch.arange(PS) + host.num_pages * PS
    with pytest.raises(ValueError, match="host pages must lie in"):
        engine.copy_d2h(dev.alloc(PS), far)
    with pytest.raises(ValueError, match="device pages must lie in"):
        engine.copy_h2d(host.alloc(PS), torch.arange(PS) + 10**6 * PS)
    assert fake_cuda.log == []
