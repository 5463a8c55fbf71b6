"""The opaque handles `hicache.stack.CacheStack` hands the server: a `Hit` (a match), a
`Lease` (a request's lock on a cached path), what an admission holds (`Admitted`), and the
`Requester` fields the cache reads off a request, and the `Resume` of a prefetch to start
again (`cache.l3.take_restarts`). Each keeps its tree node private: no node crosses into
the server, which passes the handles back to the stack and never looks inside.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from hicache.storage.tier_state import Resume
from hicache.tree.node import TreeNode

__all__ = ["Admitted", "Hit", "Lease", "Requester", "Resume"]


class Requester(Protocol):
    """Who uses the cache: a request's namespace, eviction priority and session."""

    extra_key: str | None
    priority: int
    session_id: str | None


@dataclass(frozen=True, eq=False)
class Hit:
    """A match: the L1 hit's slots (page-aligned, maybe empty) and the L2 tokens beyond it.
    Valid until the tree next changes (admit it in the same step)."""

    device_slots: torch.Tensor
    host_tokens: int
    _device_end: TreeNode = field(repr=False)  # deepest node on L1 (the root if none)
    _host_end: TreeNode = field(repr=False)    # deepest node of the whole hit

    @property
    def device_tokens(self) -> int:
        return self.device_slots.numel()

    @property
    def tokens(self) -> int:
        """Tokens cached in L1 and L2."""
        return self.device_slots.numel() + self.host_tokens


@dataclass(frozen=True, eq=False)
class Lease:
    """A request's lock on a cached path: its pages stay on L1 until `release`."""

    _end: TreeNode = field(repr=False)


class Admitted(NamedTuple):
    lease: Lease
    slots: torch.Tensor  # the L1 slots of the prefix it holds: the hit's, then the load-back's
    loaded: int          # tokens loaded back from L2 (0: none, or too few to pay)
