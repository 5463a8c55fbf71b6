"""Transfer engines: whole-page copies, per-layer readiness, FIFO acks, failures, shutdown."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import requires_cuda

from hicache.cache_controller import HiCacheController
from hicache.memory_pool import DeviceKVPool
from hicache.memory_pool_host import HostKVPool
from hicache.transfer import CpuTransferEngine, make_transfer_engine

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
