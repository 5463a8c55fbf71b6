"""One KV transfer's validated arguments, shared by the torch paths (`transfer_kv.py`) and
the CUDA kernels (`transfer_kv_cuda.py`)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from hicache.kernels.layouts import PAGE_FIRST


class Transfer(NamedTuple):
    """Validated arguments of one transfer."""

    k_buffers: list[torch.Tensor]  # L x [num_slots, kv_heads, head_dim], num_slots per layer
    v_buffers: list[torch.Tensor]
    host_buffer: torch.Tensor  # see the layouts above
    host_layout: str
    device_pages: torch.Tensor  # [n] int64
    host_pages: torch.Tensor  # [n] int64
    page_size: int
    layers: list[int]

    @property
    def num_pages(self) -> int:
        return self.device_pages.numel()

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one page of one layer's K (or V)."""
        _, kv_heads, head_dim = self.k_buffers[0].shape
        return self.page_size * kv_heads * head_dim * self.host_buffer.element_size()

    @property
    def num_device_pages(self) -> int:
        """Pages every selected layer holds (layers may differ in their slot count: a hybrid
        pool's window layers have fewer), so a page id below it is in every one; with no
        layer selected, every layer's."""
        layers = self.layers or range(len(self.k_buffers))
        return min(self.k_buffers[i].shape[0] for i in layers) // self.page_size

    @property
    def num_host_pages(self) -> int:
        return self.host_buffer.shape[0 if self.host_layout == PAGE_FIRST else 2]
