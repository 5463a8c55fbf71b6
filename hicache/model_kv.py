"""What the tiers need to know of the model they cache for."""

from __future__ import annotations

from typing import NamedTuple

import torch


class ModelKV(NamedTuple):
    """What the tiers need to know of the model: its KV geometry and its weights' identity
    (`fingerprint`, any string that differs between models: the page hashes' root)."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    fingerprint: str

    @property
    def geometry(self) -> tuple[int, int, int]:
        return (self.num_layers, self.kv_heads, self.head_dim)
