"""The `cuda` backend of transfer_kv.py: src/transfer_kv.cu launched through CuPy.

One launch moves every (page, layer, K|V) chunk of a transfer; the GPU reads and writes the
pinned host buffer directly through UVA. Arguments arrive validated (`transfer_kv._validate`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hicache.kernels.cuda_utils import as_torch_stream, import_cupy, raw_module, to_device_async
from hicache.kernels.layouts import PAGE_FIRST

if TYPE_CHECKING:
    from hicache.kernels.transfer_args import Transfer

# CUDA launch shape: one warp per chunk, 8 warps per block, and at most this many blocks per SM
# (enough 16-byte requests in flight to fill PCIe / C2C, leaving SMs to concurrent compute).
_THREADS_PER_BLOCK = 256
_WARPS_PER_BLOCK = _THREADS_PER_BLOCK // 32
_BLOCKS_PER_SM = 4

SOURCE = Path(__file__).with_name("src") / "transfer_kv.cu"

def launch(t: Transfer, kernel_name: str, stream: Any) -> None:
    device = t.k_buffers[0].device
    if device.type != "cuda":
        raise RuntimeError(
            f"backend='cuda' needs the device KV buffers on a CUDA device, they are on {device}; "
            "use backend='reference' or 'direct' on CPU")
    if not t.host_buffer.is_pinned():
        raise ValueError("backend='cuda' needs a pinned host_buffer (the GPU reads it through "
                         "UVA); allocate it with pin_memory=True")
    if t.num_pages == 0 or not t.layers:
        return
    cupy = import_cupy()  # imported here: CuPy is optional and only this path needs it
    torch_stream = as_torch_stream(stream, device)
    with torch.cuda.device(device), torch.cuda.stream(torch_stream):
        # `keep` holds the uploaded index tensors until the launch is enqueued: freed earlier,
        # the caching allocator could hand their blocks to another thread's work on this
        # stream, enqueued before the kernel that reads them. Freed after the launch, any reuse
        # on this stream is ordered after the kernel.
        args, keep = _kernel_args(t, torch_stream)
        num_chunks = t.num_pages * len(t.layers) * 2
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        blocks = max(1, min(-(-num_chunks // _WARPS_PER_BLOCK), sms * _BLOCKS_PER_SM))
        with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(
                torch_stream.cuda_stream, device.index):
            kernel = raw_module(SOURCE).get_function(kernel_name)
            kernel((blocks,), (_THREADS_PER_BLOCK,), args)
        del keep


def _kernel_args(t: Transfer, torch_stream: torch.cuda.Stream
                 ) -> tuple[tuple[Any, ...], tuple[torch.Tensor, ...]]:
    """(the arguments of gather_kv_d2h / scatter_kv_h2d, in order; the tensors they point
    into, which the caller keeps alive until the launch is enqueued).

    Runs inside `torch.cuda.stream(torch_stream)`: the uploads are enqueued there, so once
    released they are reused only by work ordered after the kernel that reads them. Page
    lists already on the GPU are made contiguous (the kernel indexes them densely).
    """
    device = t.k_buffers[0].device
    k_ptrs = _pointer_table(device.index, tuple(b.data_ptr() for b in t.k_buffers))
    v_ptrs = _pointer_table(device.index, tuple(b.data_ptr() for b in t.v_buffers))
    dev_ids = to_device_async(t.device_pages, device).contiguous()
    host_ids = to_device_async(t.host_pages, device).contiguous()
    first, layer_ids = _layer_args(t.layers, device)
    page_stride, layer_stride, kv_stride = _host_byte_strides(t.host_buffer, t.host_layout)
    args = (
        np.uint64(k_ptrs.data_ptr()), np.uint64(v_ptrs.data_ptr()),
        np.uint64(0 if layer_ids is None else layer_ids.data_ptr()),  # 0 = nullptr
        np.int64(first), np.int64(len(t.layers)),
        np.uint64(dev_ids.data_ptr()), np.uint64(host_ids.data_ptr()), np.int64(t.num_pages),
        np.uint64(t.host_buffer.data_ptr()), np.int64(t.chunk_bytes),
        np.int64(page_stride), np.int64(layer_stride), np.int64(kv_stride),
    )
    keep = (k_ptrs, v_ptrs, dev_ids, host_ids) + (() if layer_ids is None else (layer_ids,))
    return args, keep


def _host_byte_strides(host_buffer: torch.Tensor, host_layout: str) -> tuple[int, int, int]:
    """(page, layer, K->V) strides of the host buffer in bytes."""
    item = host_buffer.element_size()
    s = host_buffer.stride()
    page, layer, kv = (s[0], s[1], s[2]) if host_layout == PAGE_FIRST else (s[2], s[0], s[1])
    return page * item, layer * item, kv * item


def _layer_args(layers: list[int], device: torch.device) -> tuple[int, torch.Tensor | None]:
    """(first_layer, None) for a range of layers, else (0, the ids on the device)."""
    if layers == list(range(layers[0], layers[0] + len(layers))):
        return layers[0], None
    return 0, to_device_async(torch.tensor(layers, dtype=torch.int64), device)


@functools.cache
def _pointer_table(device_index: int, ptrs: tuple[int, ...]) -> torch.Tensor:
    """`[num_layers]` int64 device array of the layers' base addresses; keyed by the addresses,
    so a cached table is right for any buffers that live there. Uploaded (blocking) once per
    set of buffers.

    Never evicted (a server has one device pool; a table is a few hundred bytes): a table freed
    while another stream's kernel still reads it could be handed out again, and marking it with
    `record_stream` instead would make its free, at the latest at interpreter exit, record events
    on streams (and a context) that may be gone by then, which aborts the process."""
    return torch.tensor(ptrs, dtype=torch.int64).to(torch.device("cuda", device_index))
