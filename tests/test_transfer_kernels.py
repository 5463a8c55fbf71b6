"""kernels/transfer_kv: every backend against a naive per-page oracle, validation, compilation.

The oracle below copies one (page, layer, K|V) chunk at a time with plain indexing; the backends
must produce the same bits. Destinations are poisoned first (NaN), so a page or layer that a
transfer must not touch is checked to keep its poison.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from conftest import compile_cubin, missing_tool

from hicache.kernels import cuda_utils, transfer_kv, transfer_kv_cuda
from hicache.kernels.transfer_kv import LAYER_FIRST, PAGE_FIRST, d2h_pages, h2d_pages, page_runs

NUM_LAYERS = 3
KV_HEADS = 2
HEAD_DIM = 8
NUM_DEVICE_PAGES = 17  # device pools carry a padding page, so sizes differ from the host's
NUM_HOST_PAGES = 23
NUM_MOVED = 6
RUN_LENGTH = 3  # the "runs" page pattern: blocks of this many consecutive pages
LAYER_SUBSET = (2, 0)  # not a range and not sorted: the general case of `layers`

PAGE_SIZES = (1, 16, 64)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LAYOUTS = (PAGE_FIRST, LAYER_FIRST)
# scattered: both lists random; runs: blocks of consecutive pages on both sides;
# dst_run / src_run: one side a single run (the reference's no-temporary paths).
PATTERNS = ("scattered", "runs", "dst_run", "src_run")

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ---------------------------------------------------------------------------------------------
# Helpers: pools, page lists, the oracle


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits, so NaN poison compares equal to itself."""
    return t.contiguous().view(_BITS[t.element_size()])


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    assert torch.equal(_bits(actual.cpu()), _bits(expected.cpu()))


def make_device_kv(page_size: int, dtype: torch.dtype, device: str = "cpu",
                   num_layers: int = NUM_LAYERS, kv_heads: int = KV_HEADS,
                   head_dim: int = HEAD_DIM) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (NUM_DEVICE_PAGES * page_size, kv_heads, head_dim)  # [num_slots, kv_heads, head_dim]
    k = [torch.randn(shape).to(dtype).to(device) for _ in range(num_layers)]
    v = [torch.randn(shape).to(dtype).to(device) for _ in range(num_layers)]
    return k, v


def host_shape(layout: str, page_size: int, num_layers: int = NUM_LAYERS,
               kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM) -> tuple[int, ...]:
    slab = (page_size, kv_heads, head_dim)
    if layout == PAGE_FIRST:
        return (NUM_HOST_PAGES, num_layers, 2, *slab)
    return (num_layers, 2, NUM_HOST_PAGES, *slab)


def make_host(layout: str, page_size: int, dtype: torch.dtype, fill: float | None,
              pin: bool = False, **geometry: int) -> torch.Tensor:
    shape = host_shape(layout, page_size, **geometry)
    if fill is None:
        return torch.randn(shape).to(dtype).pin_memory() if pin else torch.randn(shape).to(dtype)
    return torch.full(shape, fill, dtype=dtype, pin_memory=pin)


def page_lists(pattern: str, gen: torch.Generator, src_pool: int, dst_pool: int,
               n: int = NUM_MOVED) -> tuple[torch.Tensor, torch.Tensor]:
    """(source page ids, destination page ids), distinct within each list."""
    def scattered(pool: int) -> torch.Tensor:
        return torch.randperm(pool, generator=gen)[:n]

    def single_run(pool: int) -> torch.Tensor:
        start = int(torch.randint(0, pool - n + 1, (1,), generator=gen))
        return torch.arange(start, start + n)

    def runs(pool: int) -> torch.Tensor:
        blocks = torch.randperm(pool // RUN_LENGTH, generator=gen)[: -(-n // RUN_LENGTH)]
        return (blocks[:, None] * RUN_LENGTH + torch.arange(RUN_LENGTH)).flatten()[:n]

    make_src, make_dst = {
        "scattered": (scattered, scattered), "runs": (runs, runs),
        "dst_run": (scattered, single_run), "src_run": (single_run, scattered),
    }[pattern]
    return make_src(src_pool), make_dst(dst_pool)


def host_chunk(host: torch.Tensor, layout: str, page: int, layer: int, kv: int) -> torch.Tensor:
    return host[page, layer, kv] if layout == PAGE_FIRST else host[layer, kv, page]


def device_chunk(bufs: Sequence[torch.Tensor], page: int, layer: int,
                 page_size: int) -> torch.Tensor:
    return bufs[layer][page * page_size:(page + 1) * page_size]


def oracle_d2h(k: list[torch.Tensor], v: list[torch.Tensor], host: torch.Tensor, layout: str,
               device_pages: torch.Tensor, host_pages: torch.Tensor, page_size: int,
               layers: Sequence[int] | None) -> torch.Tensor:
    """The host buffer after the transfer, one chunk at a time."""
    out = host.clone()
    for layer in range(len(k)) if layers is None else layers:
        for d, h in zip(device_pages.tolist(), host_pages.tolist()):
            for kv, bufs in enumerate((k, v)):
                host_chunk(out, layout, h, layer, kv).copy_(
                    device_chunk(bufs, d, layer, page_size))
    return out


def oracle_h2d(host: torch.Tensor, layout: str, k: list[torch.Tensor], v: list[torch.Tensor],
               host_pages: torch.Tensor, device_pages: torch.Tensor, page_size: int,
               layers: Sequence[int] | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    out_k, out_v = [b.clone() for b in k], [b.clone() for b in v]
    for layer in range(len(k)) if layers is None else layers:
        for h, d in zip(host_pages.tolist(), device_pages.tolist()):
            for kv, bufs in enumerate((out_k, out_v)):
                device_chunk(bufs, d, layer, page_size).copy_(
                    host_chunk(host, layout, h, layer, kv))
    return out_k, out_v


def poisoned_like(bufs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.full_like(b, float("nan")) for b in bufs]


# ---------------------------------------------------------------------------------------------
# CPU: reference and direct against the oracle


@pytest.mark.parametrize("layers", [None, LAYER_SUBSET], ids=["all_layers", "subset"])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_d2h_matches_oracle(layout: str, page_size: int, dtype: torch.dtype, pattern: str,
                            layers: tuple[int, ...] | None) -> None:
    gen = torch.Generator().manual_seed(1)
    k, v = make_device_kv(page_size, dtype)
    dev_pages, host_pages = page_lists(pattern, gen, NUM_DEVICE_PAGES, NUM_HOST_PAGES)
    poison = make_host(layout, page_size, dtype, fill=float("nan"))
    expected = oracle_d2h(k, v, poison, layout, dev_pages, host_pages, page_size, layers)
    for backend in ("reference", "direct"):
        host = poison.clone()
        d2h_pages(k, v, host, layout, dev_pages, host_pages, page_size, layers, backend=backend)
        assert_same_bits(host, expected)
    # The oracle really left the untouched part poisoned (guards the oracle itself).
    untouched_layer = 1
    assert bool(host_chunk(expected, layout, int(host_pages[0]), untouched_layer, 0)
                .isnan().all()) == (layers is not None)


@pytest.mark.parametrize("layers", [None, LAYER_SUBSET], ids=["all_layers", "subset"])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_h2d_matches_oracle(layout: str, page_size: int, dtype: torch.dtype, pattern: str,
                            layers: tuple[int, ...] | None) -> None:
    gen = torch.Generator().manual_seed(2)
    src_k, _ = make_device_kv(page_size, dtype)
    poison_k, poison_v = poisoned_like(src_k), poisoned_like(src_k)
    host = make_host(layout, page_size, dtype, fill=None)
    host_pages, dev_pages = page_lists(pattern, gen, NUM_HOST_PAGES, NUM_DEVICE_PAGES)
    exp_k, exp_v = oracle_h2d(host, layout, poison_k, poison_v, host_pages, dev_pages,
                              page_size, layers)
    for backend in ("reference", "direct"):
        k, v = [b.clone() for b in poison_k], [b.clone() for b in poison_v]
        h2d_pages(host, layout, k, v, host_pages, dev_pages, page_size, layers, backend=backend)
        for got, want in zip(k + v, exp_k + exp_v):
            assert_same_bits(got, want)
    n_poisoned = sum(int(b.isnan().all(dim=(1, 2)).sum()) for b in exp_k)
    touched_layers = NUM_LAYERS if layers is None else len(layers)
    assert n_poisoned == (NUM_LAYERS * NUM_DEVICE_PAGES - touched_layers * NUM_MOVED) * page_size


@pytest.mark.parametrize("layout", LAYOUTS)
def test_staging_in_several_chunks(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both lists scattered and a staging buffer smaller than the transfer: the reference
    loops over staging chunks, including a short last one."""
    page_size, dtype = 16, torch.float32
    chunk_bytes = page_size * KV_HEADS * HEAD_DIM * dtype.itemsize
    monkeypatch.setattr(transfer_kv, "STAGING_BYTES", 4 * chunk_bytes)  # 6 pages -> 4 + 2
    gen = torch.Generator().manual_seed(3)
    k, v = make_device_kv(page_size, dtype)
    dev_pages, host_pages = page_lists("scattered", gen, NUM_DEVICE_PAGES, NUM_HOST_PAGES)
    poison = make_host(layout, page_size, dtype, fill=float("nan"))
    host = poison.clone()
    d2h_pages(k, v, host, layout, dev_pages, host_pages, page_size)
    assert_same_bits(host, oracle_d2h(k, v, poison, layout, dev_pages, host_pages, page_size,
                                      None))


@pytest.mark.parametrize("head_dim,dtype", [(3, torch.float16), (3, torch.float32),
                                            (6, torch.float16)])
@pytest.mark.parametrize("backend", ["reference", "direct"])
def test_chunks_not_a_multiple_of_16_bytes(head_dim: int, dtype: torch.dtype,
                                           backend: str) -> None:
    """6-, 12- and 12-byte chunks: the copies fall back to narrower elements, same bits."""
    gen = torch.Generator().manual_seed(4)
    geometry = {"kv_heads": 1, "head_dim": head_dim}
    k, v = make_device_kv(1, dtype, **geometry)
    dev_pages, host_pages = page_lists("scattered", gen, NUM_DEVICE_PAGES, NUM_HOST_PAGES)
    poison = make_host(PAGE_FIRST, 1, dtype, fill=float("nan"), **geometry)
    host = poison.clone()
    d2h_pages(k, v, host, PAGE_FIRST, dev_pages, host_pages, 1, backend=backend)
    assert_same_bits(host, oracle_d2h(k, v, poison, PAGE_FIRST, dev_pages, host_pages, 1, None))


def test_buffers_at_an_unaligned_offset() -> None:
    """A layer buffer that is a view 4 bytes into its storage: the wide reinterpretation must
    drop to an element that divides the offset (here int32), not fail or shift bytes."""
    page_size, dtype = 16, torch.float32
    k, v = make_device_kv(page_size, dtype)
    base = torch.randn(k[1].numel() + 1)
    k[1] = base[1:].view(k[1].shape)
    assert k[1].storage_offset() == 1
    assert transfer_kv._wide_dtype(transfer_kv._validate(
        k, v, make_host(PAGE_FIRST, page_size, dtype, fill=0.0), PAGE_FIRST, torch.tensor([0]),
        torch.tensor([0]), page_size, None, dst_is_host=True)) == torch.int32
    gen = torch.Generator().manual_seed(10)
    dev_pages, host_pages = page_lists("scattered", gen, NUM_DEVICE_PAGES, NUM_HOST_PAGES)
    for backend in ("reference", "direct"):
        poison = make_host(PAGE_FIRST, page_size, dtype, fill=float("nan"))
        host = poison.clone()
        d2h_pages(k, v, host, PAGE_FIRST, dev_pages, host_pages, page_size, backend=backend)
        assert_same_bits(host, oracle_d2h(k, v, poison, PAGE_FIRST, dev_pages, host_pages,
                                          page_size, None))


def test_nan_payload_bits_survive() -> None:
    """The wide (complex128) reinterpretation must not canonicalise NaN payloads."""
    k, v = make_device_kv(16, torch.float32)
    payload = torch.tensor([0x7FC00001, 0x7F800001, -0x00400001], dtype=torch.int32)  # qNaN,sNaN
    k[0].view(torch.int32).flatten()[:3] = payload
    host = make_host(PAGE_FIRST, 16, torch.float32, fill=0.0)
    d2h_pages(k, v, host, PAGE_FIRST, torch.tensor([0]), torch.tensor([5]), 16)
    assert torch.equal(host[5, 0, 0].contiguous().view(torch.int32).flatten()[:3], payload)


def test_empty_page_lists_touch_nothing() -> None:
    k, v = make_device_kv(16, torch.float32)
    host = make_host(LAYER_FIRST, 16, torch.float32, fill=float("nan"))
    empty = torch.empty(0, dtype=torch.int64)
    for backend in ("reference", "direct"):
        d2h_pages(k, v, host, LAYER_FIRST, empty, empty, 16, backend=backend)
        h2d_pages(host, LAYER_FIRST, k, v, empty, empty, 16, backend=backend)
    assert bool(host.isnan().all())
    assert not bool(k[0].isnan().any())


def test_page_runs() -> None:
    src = torch.tensor([4, 5, 6, 9, 10, 2, 3])
    dst = torch.tensor([0, 1, 2, 3, 7, 8, 9])
    assert page_runs(src, dst) == [(4, 0, 3), (9, 3, 1), (10, 7, 1), (2, 8, 2)]
    assert page_runs(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)) == []


# ---------------------------------------------------------------------------------------------
# Validation: every error names the argument and the value


def _valid_args(page_size: int = 16, layout: str = PAGE_FIRST) -> dict:
    k, v = make_device_kv(page_size, torch.float32)
    return {
        "k_buffers": k, "v_buffers": v,
        "host_buffer": make_host(layout, page_size, torch.float32, fill=0.0),
        "host_layout": layout, "device_pages": torch.tensor([1, 2]),
        "host_pages": torch.tensor([3, 4]), "page_size": page_size,
    }


def _noncontig_k(a: dict) -> None:
    a["k_buffers"][1] = a["k_buffers"][1].transpose(1, 2).contiguous().transpose(1, 2)


def _non_tensor_k(a: dict) -> None:
    a["k_buffers"][0] = [1, 2]


# (name, mutate the valid arguments, the message's pattern)
BAD_ARGS: list[tuple[str, Callable[[dict], None], str]] = [
    ("layout", lambda a: a.update(host_layout="pages"), r"host_layout.*'pages'"),
    ("page_size_0", lambda a: a.update(page_size=0), r"page_size.*0"),
    ("page_size_bool", lambda a: a.update(page_size=True), r"page_size.*True"),
    ("page_size_wrong", lambda a: a.update(page_size=8), r"host_buffer shape.*page_size=8"),
    ("no_layers", lambda a: a.update(k_buffers=[], v_buffers=[]), r"k_buffers.*0 and 0"),
    ("kv_lengths", lambda a: a["v_buffers"].pop(), r"k_buffers and v_buffers.*3 and 2"),
    ("k_not_tensor", _non_tensor_k, r"k_buffers\[0\].*list"),
    ("k_2d", lambda a: a["k_buffers"].__setitem__(0, a["k_buffers"][0].flatten(1)),
     r"k_buffers\[0\].*\(272, 16\)"),
    ("v_dtype", lambda a: a["v_buffers"].__setitem__(2, a["v_buffers"][2].half()),
     r"v_buffers\[2\].*torch.float16"),
    ("v_shape", lambda a: a["v_buffers"].__setitem__(1, a["v_buffers"][1][:256]),
     r"v_buffers\[1\].*\(256, 2, 8\)"),
    ("k_noncontig", _noncontig_k, r"k_buffers\[1\] must be contiguous"),
    ("slots", lambda a: [a[n].__setitem__(i, a[n][i][:270]) for n in ("k_buffers", "v_buffers")
                         for i in range(NUM_LAYERS)], r"270 slots.*page_size=16"),
    ("host_5d", lambda a: a.update(host_buffer=a["host_buffer"][0]), r"host_buffer.*6-d"),
    ("host_dtype", lambda a: a.update(host_buffer=a["host_buffer"].double()),
     r"host_buffer dtype torch.float64"),
    ("host_layers", lambda a: a.update(host_buffer=a["host_buffer"][:, :2].contiguous()),
     r"host_buffer shape \(23, 2, 2, 16, 2, 8\)"),
    ("host_layout_mismatch", lambda a: a.update(host_layout=LAYER_FIRST),
     r"host_buffer shape.*'layer_first'"),
    ("host_noncontig", lambda a: a.update(host_buffer=a["host_buffer"].transpose(4, 5)
                                          .contiguous().transpose(4, 5)),
     r"host_buffer must be contiguous"),
    ("pages_int32", lambda a: a.update(device_pages=torch.tensor([1, 2], dtype=torch.int32)),
     r"device_pages.*torch.int32"),
    ("pages_2d", lambda a: a.update(host_pages=torch.tensor([[3, 4]])),
     r"host_pages.*1-d.*\(1, 2\)"),
    ("pages_list", lambda a: a.update(host_pages=[3, 4]), r"host_pages.*list"),
    ("lengths", lambda a: a.update(host_pages=torch.tensor([3, 4, 5])),
     r"same length.*2 and 3"),
    ("device_page_high", lambda a: a.update(device_pages=torch.tensor([1, 17])),
     r"device_pages.*\[0, 17\).*17"),
    ("device_page_negative", lambda a: a.update(device_pages=torch.tensor([-1, 2])),
     r"device_pages.*-1"),
    ("host_page_high", lambda a: a.update(host_pages=torch.tensor([3, 99])),
     r"host_pages.*\[0, 23\).*99"),
    ("layers_range", lambda a: a.update(layers=[0, 3]), r"layers.*\[0, 3\).*3"),
    ("layers_dup", lambda a: a.update(layers=[1, 1]), r"layers must be distinct.*\[1, 1\]"),
    ("backend", lambda a: a.update(backend="triton"), r"backend.*'triton'"),
]


@pytest.mark.parametrize("mutate,pattern", [b[1:] for b in BAD_ARGS], ids=[b[0] for b in BAD_ARGS])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_validation_errors(direction: str, mutate: Callable[[dict], None], pattern: str) -> None:
    args = _valid_args()
    mutate(args)
    with pytest.raises(ValueError, match=pattern):
        _call(direction, args)


def test_duplicate_destination_pages_rejected() -> None:
    d2h = _valid_args()
    d2h["host_pages"] = torch.tensor([4, 4])
    with pytest.raises(ValueError, match=r"host_pages.*distinct.*4 twice"):
        _call("d2h", d2h)
    h2d = _valid_args()
    h2d["device_pages"] = torch.tensor([2, 2])
    with pytest.raises(ValueError, match=r"device_pages.*distinct.*2 twice"):
        _call("h2d", h2d)
    # A repeated *source* page is a legal broadcast.
    ok = _valid_args()
    ok["device_pages"] = torch.tensor([2, 2])
    _call("d2h", ok)
    assert torch.equal(ok["host_buffer"][3], ok["host_buffer"][4])


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_validation_is_shared_by_every_backend(direction: str) -> None:
    for backend in transfer_kv.BACKENDS:
        args = _valid_args()
        args["page_size"], args["backend"] = 0, backend
        with pytest.raises(ValueError, match="page_size"):
            _call(direction, args)


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_cuda_backend_on_cpu_raises(direction: str) -> None:
    args = _valid_args()
    args["backend"] = "cuda"
    with pytest.raises(RuntimeError, match="CUDA device.*cpu"):
        _call(direction, args)


def _positional(direction: str, a: dict) -> list:
    if direction == "d2h":
        return [a["k_buffers"], a["v_buffers"], a["host_buffer"], a["host_layout"],
                a["device_pages"], a["host_pages"], a["page_size"], a.get("layers")]
    return [a["host_buffer"], a["host_layout"], a["k_buffers"], a["v_buffers"],
            a["host_pages"], a["device_pages"], a["page_size"], a.get("layers")]


def _call(direction: str, a: dict) -> None:
    fn = d2h_pages if direction == "d2h" else h2d_pages
    fn(*_positional(direction, a), backend=a.get("backend", "reference"))


# ---------------------------------------------------------------------------------------------
# Compilation: nvcc for the GPUs we target, NVRTC exactly as CuPy would (no GPU needed)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvcc_compiles_cubin(arch: str, tmp_path: Path) -> None:
    data = compile_cubin(transfer_kv_cuda.SOURCE, arch, tmp_path)
    assert len(data) > 0
    assert b"gather_kv_d2h" in data and b"scatter_kv_h2d" in data  # extern "C": unmangled


def test_nvrtc_compiles_without_headers() -> None:
    if cuda_utils.load_nvrtc() is None:
        missing_tool("no NVRTC library installed (torch's CUDA wheels ship one)")
    ptx = cuda_utils.nvrtc_compile(cuda_utils.kernel_source(transfer_kv_cuda.SOURCE))
    assert ".entry gather_kv_d2h" in ptx and ".entry scatter_kv_h2d" in ptx
    with pytest.raises(RuntimeError, match="undefined"):
        cuda_utils.nvrtc_compile("__global__ void f() { undefined_function(); }")


# ---------------------------------------------------------------------------------------------
# The kernel's address arithmetic, run on CPU with the wrapper's own byte strides


def emulate_kernel(to_host: bool, k: list[torch.Tensor], v: list[torch.Tensor],
                   host: torch.Tensor, layout: str, device_pages: torch.Tensor,
                   host_pages: torch.Tensor, page_size: int, layers: Sequence[int]) -> None:
    """A line-by-line port of `chunk_addr` + `warp_copy` in transfer_kv.cu, copying between
    the real buffers' addresses, so a wrong stride or chunk size in the wrapper shows up."""
    t = transfer_kv._validate(k, v, host, layout, device_pages, host_pages, page_size, layers,
                              dst_is_host=to_host)
    page_s, layer_s, kv_s = transfer_kv_cuda._host_byte_strides(host, layout)
    k_ptrs, v_ptrs = [b.data_ptr() for b in k], [b.data_ptr() for b in v]
    num_sel = len(t.layers)
    for c in range(t.num_pages * num_sel * 2):
        kv, rest = c & 1, c >> 1
        sel, p = rest % num_sel, rest // num_sel
        layer = t.layers[sel]
        dev = (k_ptrs if kv == 0 else v_ptrs)[layer] + int(device_pages[p]) * t.chunk_bytes
        hst = host.data_ptr() + int(host_pages[p]) * page_s + layer * layer_s + kv * kv_s
        dst, src = (hst, dev) if to_host else (dev, hst)
        ctypes.memmove(dst, src, t.chunk_bytes)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_addressing_matches_reference(layout: str, page_size: int) -> None:
    gen = torch.Generator().manual_seed(9)
    k, v = make_device_kv(page_size, torch.bfloat16)
    dev_pages, host_pages = page_lists("scattered", gen, NUM_DEVICE_PAGES, NUM_HOST_PAGES)
    poison = make_host(layout, page_size, torch.bfloat16, fill=float("nan"))
    emulated, expected = poison.clone(), poison.clone()
    emulate_kernel(True, k, v, emulated, layout, dev_pages, host_pages, page_size, LAYER_SUBSET)
    d2h_pages(k, v, expected, layout, dev_pages, host_pages, page_size, LAYER_SUBSET)
    assert_same_bits(emulated, expected)
    back_k, back_v = poisoned_like(k), poisoned_like(v)
    emulate_kernel(False, back_k, back_v, emulated, layout, dev_pages, host_pages, page_size,
                   LAYER_SUBSET)
    exp_k, exp_v = oracle_h2d(emulated, layout, poisoned_like(k), poisoned_like(v), host_pages,
                              dev_pages, page_size, LAYER_SUBSET)
    for got, want in zip(back_k + back_v, exp_k + exp_v):
        assert_same_bits(got, want)


# ---------------------------------------------------------------------------------------------
# CUDA: every backend on a real GPU with a pinned host buffer

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_BACKENDS = ("cuda", "reference", "direct")


def _needs_cupy(backend: str) -> None:
    if backend == "cuda":
        pytest.importorskip("cupy", reason="the cuda backend needs the `cuda` extra (CuPy)")


@requires_cuda
@pytest.mark.parametrize("layers", [None, LAYER_SUBSET], ids=["all_layers", "subset"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_d2h_matches_oracle(backend: str, layout: str, page_size: int, dtype: torch.dtype,
                                layers: tuple[int, ...] | None) -> None:
    _needs_cupy(backend)
    gen = torch.Generator().manual_seed(5)
    k, v = make_device_kv(page_size, dtype, device="cuda")
    dev_pages, host_pages = page_lists("scattered", gen, NUM_DEVICE_PAGES, NUM_HOST_PAGES)
    host = make_host(layout, page_size, dtype, fill=float("nan"), pin=True)
    expected = oracle_d2h([b.cpu() for b in k], [b.cpu() for b in v], host, layout, dev_pages,
                          host_pages, page_size, layers)
    d2h_pages(k, v, host, layout, dev_pages, host_pages, page_size, layers, backend=backend)
    torch.cuda.synchronize()
    assert_same_bits(host, expected)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_h2d_layer_by_layer(backend: str, layout: str, page_size: int,
                                dtype: torch.dtype) -> None:
    """Load-back lands one layer per call on a side stream; after layer i only layers <= i
    are written."""
    _needs_cupy(backend)
    gen = torch.Generator().manual_seed(6)
    host = make_host(layout, page_size, dtype, fill=None, pin=True)
    host_pages, dev_pages = page_lists("runs", gen, NUM_HOST_PAGES, NUM_DEVICE_PAGES)
    k, v = make_device_kv(page_size, dtype, device="cuda")
    k, v = poisoned_like(k), poisoned_like(v)
    poison_cpu = ([b.cpu() for b in k], [b.cpu() for b in v])
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()  # the side stream must not overtake the buffers' initialisation
    for layer in range(NUM_LAYERS):
        h2d_pages(host, layout, k, v, host_pages, dev_pages, page_size, [layer],
                  backend=backend, stream=stream)
        stream.synchronize()
        exp_k, exp_v = oracle_h2d(host, layout, *poison_cpu, host_pages, dev_pages, page_size,
                                  range(layer + 1))
        for got, want in zip(k + v, exp_k + exp_v):
            assert_same_bits(got, want)


@requires_cuda
@pytest.mark.parametrize("head_dim,dtype", [(3, torch.float16), (3, torch.float32)])
def test_gpu_cuda_unaligned_chunks(head_dim: int, dtype: torch.dtype) -> None:
    """6- and 12-byte chunks take the kernel's byte and 4-byte paths."""
    _needs_cupy("cuda")
    gen = torch.Generator().manual_seed(7)
    geometry = {"kv_heads": 1, "head_dim": head_dim}
    k, v = make_device_kv(1, dtype, device="cuda", **geometry)
    dev_pages, host_pages = page_lists("scattered", gen, NUM_DEVICE_PAGES, NUM_HOST_PAGES)
    host = make_host(PAGE_FIRST, 1, dtype, fill=float("nan"), pin=True, **geometry)
    expected = oracle_d2h([b.cpu() for b in k], [b.cpu() for b in v], host, PAGE_FIRST,
                          dev_pages, host_pages, 1, None)
    d2h_pages(k, v, host, PAGE_FIRST, dev_pages, host_pages, 1, backend="cuda")
    torch.cuda.synchronize()
    assert_same_bits(host, expected)


@requires_cuda
def test_gpu_cuda_accepts_a_cupy_stream_and_rejects_pageable_host() -> None:
    cupy = pytest.importorskip("cupy", reason="the cuda backend needs the `cuda` extra (CuPy)")
    gen = torch.Generator().manual_seed(8)
    k, v = make_device_kv(16, torch.float32, device="cuda")
    dev_pages, host_pages = page_lists("scattered", gen, NUM_DEVICE_PAGES, NUM_HOST_PAGES)
    host = make_host(LAYER_FIRST, 16, torch.float32, fill=float("nan"), pin=True)
    expected = oracle_d2h([b.cpu() for b in k], [b.cpu() for b in v], host, LAYER_FIRST,
                          dev_pages, host_pages, 16, None)
    stream = cupy.cuda.Stream(non_blocking=True)
    torch.cuda.synchronize()  # the side stream must not overtake the buffers' initialisation
    d2h_pages(k, v, host, LAYER_FIRST, dev_pages, host_pages, 16, backend="cuda",
              stream=stream)
    stream.synchronize()
    assert_same_bits(host, expected)
    with pytest.raises(ValueError, match="pinned"):
        d2h_pages(k, v, host.clone(), LAYER_FIRST, dev_pages, host_pages, 16, backend="cuda")


# ---------------------------------------------------------------------------------------------
# The cuda backend's kernel arguments, built on CPU: CuPy packs each argument by its NumPy type,
# so the types must match the kernel's C signature one for one


_C_TO_NUMPY = {"u64*": "uint64", "i64*": "uint64", "i64": "int64", "u64": "uint64",
               "int": "int32", "float": "float32"}


def cu_signature(source: str, kernel: str) -> list[str]:
    """The C types of `kernel`'s parameters in a .cu source ("u64*", "i64", ...)."""
    import re

    params = source.split(f"{kernel}(", 1)[1].split(")", 1)[0]
    params = re.sub(r"//[^\n]*", "", params)
    types = []
    for p in params.split(","):
        words = p.replace("*", " * ").replace("const", "").split()
        types.append(words[0] + ("*" if "*" in words else ""))
    return types


class _FakeTable:
    """Stands in for a cached device pointer table (record_stream is a no-op on CPU)."""

    def __init__(self, ptrs: tuple[int, ...]) -> None:
        self.values = torch.tensor(ptrs, dtype=torch.int64)

    def data_ptr(self) -> int:
        return self.values.data_ptr()

    def record_stream(self, stream: object) -> None:
        """A host tensor has no stream to record."""


def _read_int64(ptr: int, n: int) -> list[int]:
    return list((ctypes.c_int64 * n).from_address(ptr))


@pytest.mark.parametrize("layers", [None, LAYER_SUBSET], ids=["all_layers", "subset"])
def test_kernel_args_match_the_kernel_signature_and_stay_alive(
        layers: tuple[int, ...] | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Types in the kernel's order; page lists contiguous (a strided list already on the
    device is made dense) and held by the returned tensors until the launch."""
    monkeypatch.setattr(transfer_kv_cuda, "_pointer_table", lambda index, ptrs: _FakeTable(ptrs))
    monkeypatch.setattr(transfer_kv_cuda, "to_device_async", lambda t, device: t)  # on device
    k, v = make_device_kv(16, torch.bfloat16)
    host = make_host(LAYER_FIRST, 16, torch.bfloat16, fill=0.0)
    dev_pages = torch.arange(2 * NUM_MOVED)[::2]  # strided, as a view of a device tensor
    host_pages = torch.randperm(NUM_HOST_PAGES)[:NUM_MOVED]
    t = transfer_kv._validate(k, v, host, LAYER_FIRST, dev_pages, host_pages, 16, layers,
                              dst_is_host=True)
    args, keep = transfer_kv_cuda._kernel_args(t, torch_stream=None)  # type: ignore[arg-type]
    source = cuda_utils.kernel_source(transfer_kv_cuda.SOURCE)
    for kernel in ("gather_kv_d2h", "scatter_kv_h2d"):
        want = [_C_TO_NUMPY[c] for c in cu_signature(source, kernel)]
        assert [type(a).__name__ for a in args] == want
    kept = {x.data_ptr() for x in keep}
    assert _read_int64(int(args[0]), NUM_LAYERS) == [b.data_ptr() for b in k]
    assert _read_int64(int(args[1]), NUM_LAYERS) == [b.data_ptr() for b in v]
    if layers is None:
        assert (int(args[2]), int(args[3]), int(args[4])) == (0, 0, NUM_LAYERS)
    else:
        assert int(args[2]) in kept and int(args[4]) == len(layers)
        assert _read_int64(int(args[2]), len(layers)) == list(layers)
    assert {int(args[5]), int(args[6])} <= kept
    assert _read_int64(int(args[5]), NUM_MOVED) == dev_pages.tolist()
    assert _read_int64(int(args[6]), NUM_MOVED) == host_pages.tolist()
    assert int(args[7]) == NUM_MOVED and int(args[8]) == host.data_ptr()
    assert int(args[9]) == t.chunk_bytes
    assert tuple(int(a) for a in args[10:]) == transfer_kv_cuda._host_byte_strides(host, LAYER_FIRST)
