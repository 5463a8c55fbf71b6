"""What the tiers need to know of the model they cache for."""

from __future__ import annotations

from typing import NamedTuple

import torch


class ModelKV(NamedTuple):
    """What the tiers need to know of the model: its KV geometry, its weights' identity
    (`fingerprint`, any string that differs between models: the page hashes' root) and its
    layers' windows."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    fingerprint: str
    # each layer's sliding window (tokens a query reads back, itself included), None for a
    # full layer; () when every layer is full
    layer_windows: tuple[int | None, ...] = ()

    @property
    def hybrid(self) -> bool:
        """Window layers beside full ones: L1 keeps the window layers by their window."""
        return (any(w is None for w in self.layer_windows)
                and any(w is not None for w in self.layer_windows))

    @property
    def geometry(self) -> tuple[int, int, int]:
        return (self.num_layers, self.kv_heads, self.head_dim)
