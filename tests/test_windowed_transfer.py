"""L1 <-> L2 copies of a hybrid model's L1 (`WindowedKVPool`): the full layers by the full
pages, each window group's layers by that group's page of each page, in the buffers they
share with the full layers (hicache/transfer/engines.py), through kernels that also take
per-layer buffers of different slot counts (hicache/kernels/transfer_kv.py).

A page without a window page is skipped for the window layers both ways: its host copy keeps
that host page's window-layer bytes (poisoned here, so a stray copy would show), and a load
writes no window page for it."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import requires_cuda
from test_transfer import _Recorder, fake_cuda  # noqa: F401 - the fixture, by its name

from hicache.kernels import transfer_kv
from hicache.kernels.transfer_kv import d2h_pages, h2d_pages
from hicache.memory.device import PADDING_PAGE
from hicache.memory.host import HostKVPool
from hicache.memory.windowed import WindowedKVPool
from hicache.transfer.engines import CpuTransferEngine, CudaTransferEngine, make_transfer_engine

WINDOWS = (8, None, 8)  # layers 0 and 2 slide, layer 1 is full
HEADS, DIM, PS = 2, 4, 4
FULL_PAGES, WINDOW_PAGES, HOST_PAGES = 16, 6, 12
DEVICE_POISON, HOST_POISON = -1.0, -7.0
# Which of the five pages have a window page: on the device before the D->H copy, and in the
# fresh slots of the H->D copy. Every combination: both, source only, destination only, none.
SRC_WINDOWED = (True, False, True, False, True)
DST_WINDOWED = (True, True, False, False, True)
LAYOUTS = ["page_first", "layer_first"]
BACKENDS = ["kernel", "direct"]


def make_pools(layout: str, device: str = "cpu") -> tuple[WindowedKVPool, HostKVPool]:
    torch.manual_seed(0)
    pool = WindowedKVPool(FULL_PAGES, WINDOW_PAGES, PS, WINDOWS, HEADS, DIM, torch.float32,
                          device)
    host = HostKVPool(HOST_PAGES, PS, len(WINDOWS), HEADS, DIM, torch.float32, layout,
                      pin_memory=device != "cpu", check_available=False)
    start = 0.0
    for k, v in zip(pool.k_buffers, pool.v_buffers):  # distinct values in every buffer
        for buf in (k, v):
            buf.copy_(torch.arange(buf.numel(), dtype=torch.float32).view_as(buf) + start)
            start += buf.numel()
    host.buffer.fill_(HOST_POISON)
    return pool, host


def pages(pool: WindowedKVPool, windowed: tuple[bool, ...]) -> torch.Tensor:
    """Full slots of `len(windowed)` pages, page i with a window page when windowed[i]."""
    slots = []
    for w in windowed:
        s = pool.alloc(PS)
        assert s is not None
        if not w:
            pool.drop_window(s)
        slots.append(s)
    return torch.cat(slots)


def window_slots(pool: WindowedKVPool, slots: torch.Tensor, group: int = 0) -> torch.Tensor:
    return pool.window_slots(slots.to(pool.device), group)


def kv(pool: WindowedKVPool, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """Layer `layer`'s K and V at full `slots` (through its group's map for a window
    layer)."""
    at = (window_slots(pool, slots, pool.kv_group(layer) - 1) if pool.is_window_layer(layer)
          else slots.to(pool.device))
    return torch.stack([pool.k_buffers[layer][at], pool.v_buffers[layer][at]]).cpu()


def check_round_trip(pool: WindowedKVPool, host: HostKVPool, engine) -> None:
    src = pages(pool, SRC_WINDOWED)
    expect = [kv(pool, layer, src) for layer in range(pool.num_layers)]
    hidx = host.alloc(len(src))
    engine.copy_d2h(src, hidx).wait()
    for i, page in enumerate((hidx[::PS] // PS).tolist()):
        got = host.get_page(page)  # [layers, 2, PS, HEADS, DIM]
        for layer in range(pool.num_layers):
            want = expect[layer].view(2, -1, PS, HEADS, DIM)[:, i]
            if pool.is_window_layer(layer) and not SRC_WINDOWED[i]:  # skipped
                assert bool((got[layer] == HOST_POISON).all()), (i, layer)
            else:
                assert torch.equal(got[layer], want), (i, layer)
    for buf in (*pool.k_buffers, *pool.v_buffers):
        buf.fill_(DEVICE_POISON)

    dst = pages(pool, DST_WINDOWED)
    handle = engine.copy_h2d(hidx, dst)
    for layer in range(pool.num_layers):
        handle.wait_layer(layer)  # this layer has landed (later ones may not have)
        got = kv(pool, layer, dst).view(2, len(SRC_WINDOWED), PS, HEADS, DIM)
        want = expect[layer].view_as(got)
        if not pool.is_window_layer(layer):
            assert torch.equal(got, want), layer
            continue
        for i, (s, d) in enumerate(zip(SRC_WINDOWED, DST_WINDOWED)):
            if s and d:  # a window page on both sides: the values round-trip
                assert torch.equal(got[:, i], want[:, i]), (layer, i)
            elif d:  # the host copy had none: the host page's bytes, as the tree knows
                assert bool((got[:, i] == HOST_POISON).all()), (layer, i)
            else:  # skipped: read through the padding page, which nothing wrote
                assert bool((got[:, i] == DEVICE_POISON).all()), (layer, i)
    handle.wait()
    assert handle.done() and not handle.failed()
    # Nothing else was written in the buffers the layers share: no slot but `dst`'s and
    # those of each group's pages of `dst`'s pages (not the padding page).
    written = torch.zeros(pool.shared.k_buffers[0].shape[0], dtype=torch.bool)
    written[dst] = True
    mapped = pool.window_pages_of(dst)
    assert PADDING_PAGE in mapped.tolist()
    for group in range(pool.groups):
        written[window_slots(pool, dst, group).cpu()[(mapped != PADDING_PAGE)
                                                     .repeat_interleave(PS)]] = True
    assert not bool(written[:PS].any())
    for buf in (*pool.shared.k_buffers, *pool.shared.v_buffers):
        assert bool((buf.cpu()[~written] == DEVICE_POISON).all())
    engine.close()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("io_backend", BACKENDS)
def test_cpu_round_trip_full_layers_by_pages_window_layers_by_window_pages(
        layout: str, io_backend: str) -> None:
    pool, host = make_pools(layout)
    engine = make_transfer_engine(pool, host, io_backend)
    assert isinstance(engine, CpuTransferEngine)
    check_round_trip(pool, host, engine)


@requires_cuda
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("io_backend", BACKENDS)
def test_cuda_round_trip_full_layers_by_pages_window_layers_by_window_pages(
        layout: str, io_backend: str) -> None:
    pool, host = make_pools(layout, "cuda")
    engine = make_transfer_engine(pool, host, io_backend)
    assert isinstance(engine, CudaTransferEngine)
    check_round_trip(pool, host, engine)


def test_a_load_reads_the_page_map_when_queued() -> None:
    """The tree sets the map, then queues the load: a later change of the map (here, the
    window pages dropped while the worker is busy) does not redirect the queued copy."""
    pool, host = make_pools("page_first")
    engine = CpuTransferEngine(pool, host, "kernel")
    hidx = host.alloc(2 * PS)
    host.buffer.fill_(0.5)  # no device value (those are whole numbers)
    dst = pages(pool, (True, True))
    window = window_slots(pool, dst)
    gate = threading.Event()
    engine._jobs.put(gate.wait)  # the worker is busy until the gate opens
    handle = engine.copy_h2d(hidx, dst)
    pool.drop_window(dst)  # the map now says: no window pages
    gate.set()
    handle.wait()
    for layer in pool.window_layers:
        assert bool((pool.k_buffers[layer][window] == 0.5).all())
        assert bool((pool.k_buffers[layer][:PS] != 0.5).all())  # not the padding page
    engine.close()


def test_cuda_engine_queues_one_list_per_kind_of_layer_and_an_event_per_layer(
        fake_cuda: _Recorder) -> None:  # noqa: F811 - the fixture
    """Stream order of the CUDA engine with a hybrid pool, on CPU (copies recorded, not run):
    D->H one launch per kind of layer, H->D one per layer with its own event, the window
    layers by the window pages of the pages that have one."""
    pool, host = make_pools("page_first")
    engine = CudaTransferEngine(pool, host, "kernel")
    src, hidx = pages(pool, (True, False, True)), host.alloc(3 * PS)
    groups = pool.group_pages_of(src)  # layer 0: group 0, layer 2: group 1
    first, second = [groups[0, 0].item(), groups[2, 0].item()], \
        [groups[0, 1].item(), groups[2, 1].item()]
    full_pages, host_pages = (src[::PS] // PS).tolist(), (hidx[::PS] // PS).tolist()
    engine.copy_d2h(src, hidx)
    log = fake_cuda.log
    assert log[0] == ("wait_stream", "d2h", "compute")
    copies = [e for e in log if e[0] == "d2h"]
    windowed_host = [host_pages[0], host_pages[2]]
    assert [(e[4], e[5]) for e in copies] == [
        (pool.full_layers, (full_pages, host_pages)),
        ((0,), (first, windowed_host)), ((2,), (second, windowed_host))]
    assert len([e for e in log if e[0] == "upload"]) == 6 and log[-1][:2] == ("record", "d2h")

    fake_cuda.log.clear()
    handle = engine.copy_h2d(hidx, src)
    copies = [e for e in log if e[0] == "h2d"]
    assert [(e[4], e[5]) for e in copies] == [
        ([0], (windowed_host, first)),
        ([1], (host_pages, full_pages)),
        ([2], (windowed_host, second))]
    records = [e for e in log if e[0] == "record"]
    assert handle.num_layers == 3 and len(records) == 3
    assert len([e for e in log if e[0] == "upload"]) == 6  # once per copy, not per layer

    fake_cuda.log.clear()  # no page with a window page: no window-layer copy, every event
    bare = pages(pool, (False,))
    engine.copy_h2d(host.alloc(PS), bare)
    assert [e[4] for e in log if e[0] == "h2d"] == [[1]]
    assert len([e for e in log if e[0] == "record"]) == 3


def test_cuda_engine_checks_window_pages_against_the_pool(
        fake_cuda: _Recorder) -> None:  # noqa: F811 - the fixture
    pool, host = make_pools("page_first")
    engine = CudaTransferEngine(pool, host, "kernel")
    slots = pages(pool, (True,))
    pool._map[slots[0] // PS, 1] = pool.num_pages + 1  # past the pool (a corrupt map)
    with pytest.raises(ValueError, match=rf"device pages must lie in \[0, {pool.num_pages + 1}\)"):
        engine.copy_h2d(host.alloc(PS), slots)
    assert not [e for e in fake_cuda.log if e[0] in ("h2d", "upload")]


# ---------------------------------------------------------------------------------------------
# The kernels with layers of different slot counts (what the engines above rely on)


def mixed_buffers() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Layer 1 with 8 pages, layers 0 and 2 with 3 (PS slots each), distinct values."""
    torch.manual_seed(1)
    sizes = (3, 8, 3)
    k = [torch.randn(n * PS, HEADS, DIM) for n in sizes]
    v = [torch.randn(n * PS, HEADS, DIM) for n in sizes]
    return k, v


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", ["reference", "direct"])
def test_kernels_move_layers_of_different_slot_counts(layout: str, backend: str) -> None:
    k, v = mixed_buffers()
    shape = ((5, 3, 2, PS, HEADS, DIM) if layout == "page_first"
             else (3, 2, 5, PS, HEADS, DIM))
    host = torch.zeros(shape)
    d2h_pages(k, v, host, layout, torch.tensor([7, 6, 2]), torch.tensor([0, 1, 4]), PS,
              layers=[1], backend=backend)
    d2h_pages(k, v, host, layout, torch.tensor([2, 0]), torch.tensor([0, 4]), PS,
              layers=[0, 2], backend=backend)
    k2 = [torch.zeros_like(b) for b in k]
    v2 = [torch.zeros_like(b) for b in v]
    h2d_pages(host, layout, k2, v2, torch.tensor([0, 1, 4]), torch.tensor([7, 6, 2]), PS,
              layers=[1], backend=backend)
    h2d_pages(host, layout, k2, v2, torch.tensor([0, 4]), torch.tensor([2, 0]), PS,
              layers=[0, 2], backend=backend)
    for layer, moved in ((1, [7, 6, 2]), (0, [2, 0]), (2, [2, 0])):
        for src, dst in ((k, k2), (v, v2)):
            a, b = src[layer].view(-1, PS, HEADS, DIM), dst[layer].view(-1, PS, HEADS, DIM)
            assert torch.equal(a[moved], b[moved]), layer
            rest = [p for p in range(a.shape[0]) if p not in moved]
            assert bool((b[rest] == 0).all()), layer


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_kernels_check_pages_against_the_smallest_selected_layer(direction: str) -> None:
    k, v = mixed_buffers()
    host = torch.zeros(5, 3, 2, PS, HEADS, DIM)

    def call(device_pages: list[int], layers: list[int] | None) -> None:
        dev, hp = torch.tensor(device_pages), torch.tensor([0] * len(device_pages))
        if direction == "d2h":
            hp = torch.arange(len(device_pages))
            d2h_pages(k, v, host, "page_first", dev, hp, PS, layers=layers)
        else:
            h2d_pages(host, "page_first", k, v, hp, dev, PS, layers=layers)

    call([7], [1])  # in the full layer's 8 pages
    for layers in ([0], [1, 2], None):
        with pytest.raises(ValueError, match=r"device_pages must lie in \[0, 3\), got 7"):
            call([7], layers)
    call([2], None)


def test_kernels_still_refuse_layers_that_differ_in_more_than_slots() -> None:
    k, v = mixed_buffers()
    host = torch.zeros(5, 3, 2, PS, HEADS, DIM)
    one = (torch.tensor([0]), torch.tensor([0]), PS)
    bad = [
        (lambda: k.__setitem__(2, torch.zeros(3 * PS, HEADS, DIM + 4)), r"k_buffers\[2\]"),
        (lambda: v.__setitem__(1, v[1][:4 * PS]), r"v_buffers\[1\].*\(16, 2, 4\)"),  # not as K
        (lambda: k.__setitem__(0, k[0].half()), r"k_buffers\[0\]|v_buffers\[0\]"),
        (lambda: [b.__setitem__(1, b[1][:30]) for b in (k, v)], r"30 slots.*page_size=4"),
    ]
    for mutate, pattern in bad:
        k[:], v[:] = mixed_buffers()
        mutate()
        with pytest.raises(ValueError, match=pattern):
            transfer_kv.d2h_pages(k, v, host, "page_first", *one)
