"""The hierarchical tree's node: device and host slots, host protection, L3 bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from hicache.radix_cache import TreeNode


class HiTreeNode(TreeNode):
    __slots__ = ("hash_value", "host_ref_counter", "host_value", "storage_backed")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.host_value: torch.Tensor | None = None
        self.host_ref_counter = 0
        self.hash_value: list[bytes] | None = None  # page hashes, computed when L3 needs them
        self.storage_backed = False  # known to be in L3

    @property
    def evicted(self) -> bool:
        """Not on the device (the root never is)."""
        return self.value is None

    @property
    def backuped(self) -> bool:
        """Has a copy in L2 (the root always counts as backed up)."""
        return self.host_value is not None

    def protect_host(self) -> None:
        """Keep this node's and its ancestors' host pages until `release_host`."""
        node: HiTreeNode | None = self
        while node is not None:
            node.host_ref_counter += 1
            node = node.parent

    def release_host(self) -> None:
        node: HiTreeNode | None = self
        if self.host_ref_counter <= 0:
            raise AssertionError(f"release_host on unprotected {self!r}")
        while node is not None:
            node.host_ref_counter -= 1
            node = node.parent


class LoadBack(NamedTuple):
    device_indices: torch.Tensor  # slots the H->D copy fills (empty when nothing was loaded)
    last_node: HiTreeNode         # deepest node now on the device


@dataclass
class HiCacheCounters:
    """Token counts since start (read by metrics and stats; plain ints, one owner)."""

    written_tokens: int = 0         # D->H copies acknowledged
    write_dropped_tokens: int = 0   # writes skipped because L2 had no room
    device_evicted_tokens: int = 0
    host_evicted_tokens: int = 0
    load_back_tokens: int = 0
    transfer_failures: int = 0
