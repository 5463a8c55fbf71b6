"""The prefix-cache contract the scheduler calls, whatever tiers the tree spans.

`PrefixCache` is the L1 contract of docs/architecture.md ("Contracts"); its L2 side is the
tree's `host` (`host_tier.HostTier`): the harmless answers of a `NoHostTier` for a tree
without a host tier (no host hit, nothing to load back, zero host sizes, no copies in
flight), the two-tier tree itself otherwise. The tier owner (`hicache.stack.CacheStack`)
calls these and never asks which tree it holds.

Uses: a request uses the nodes it matches or inserts. Each use touches them (access time)
and raises their `priority` to the request's (the `priority` eviction policy); `hit_count`
(lfu, write_through_selective) should see each request once, so a caller that matches one
request several times (at arrival, at each admission attempt) matches with
`count_hit=False` and counts the use once, at its end (`insert`, or `count_use`).

Sizes are tokens. Threading: the scheduler thread owns the tree; nothing else calls it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from hicache.memory.device import INDEX_DTYPE
from hicache.policies import DEFAULT_PRIORITY
from hicache.tree.node import TreeNode

if TYPE_CHECKING:
    from hicache.transfer.engines import TransferHandle
    from hicache.tree.retention import Retention
    from hicache.tree.tree_events import TreeEvents
    from hicache.tree.window_kv import WindowKV

EMPTY = torch.empty(0, dtype=INDEX_DTYPE)  # no slots (never written to: slices, cats only)


def concat(values: list[torch.Tensor]) -> torch.Tensor:
    """The slot tensors of a path, end to end (no copy for one node)."""
    if len(values) == 1:
        return values[0]
    return torch.cat(values) if values else EMPTY


class MatchResult(NamedTuple):
    device_indices: torch.Tensor  # int64 slot indices of the L1 hit, page-aligned, maybe empty
    last_device_node: TreeNode    # deepest node whose pages are on the device (root if none)
    last_host_node: TreeNode      # deepest node of the whole hit (== last_device_node without L2)
    host_hit_length: int = 0      # tokens hit in L2 beyond the device hit


class LoadBack(NamedTuple):
    device_indices: torch.Tensor  # slots the H->D copy fills (empty when nothing was loaded)
    last_node: TreeNode           # deepest node now on the device


class HostSizes(NamedTuple):
    """L2 tokens held by the tree (the host pool's own count adds in-flight prefetches)."""

    total: int = 0
    evictable: int = 0   # L2-only leaves, unlocked and unprotected
    protected: int = 0   # host-protected (a backup or prefetch reads them) or locked


@dataclass
class HostCounters:
    """The L2 tree's token counts since start (scheduler thread; plain ints, one owner)."""

    written_tokens: int = 0         # D->H copies acknowledged
    write_dropped_tokens: int = 0   # writes skipped because L2 had no room
    device_evicted_tokens: int = 0  # L1 evictions (a demotion when an L2 copy stays)
    host_evicted_tokens: int = 0
    reclaimed_copy_tokens: int = 0  # of those, copies of pages L1 kept (L2 smaller than L1)
    load_back_tokens: int = 0
    transfer_failures: int = 0      # copies that failed (counted per copy, not in tokens)


class HostTier(Protocol):
    """A tree's L2 side, as the tier owner calls it (`tree.host`)."""

    def init_load_back(self, last_host_node: TreeNode) -> LoadBack:
        """Queue the H->D copy of the L2-only path ending at `last_host_node`."""

    def protect_host(self, node: TreeNode) -> None:
        """Keep `node`'s and its ancestors' host pages until `release_host`."""

    def release_host(self, node: TreeNode) -> None:
        """End a `protect_host`."""

    def host_sizes(self) -> HostSizes: ...

    def host_counters(self) -> HostCounters:
        """A copy of the L2 counters."""

    def forget_stored(self) -> None:
        """L3 was emptied or detached: no node is known to be there any more."""

    def back_up_path(self, node: TreeNode) -> bool:
        """Queue the copy of `node`'s path to L2; False when L2 has no room for it."""

    def flush_host(self) -> int:
        """Free every unprotected host page; the host tokens freed."""

    def writing_check(self, wait: bool = False, claim: bool = True) -> list[TreeNode]:
        """Apply finished D->H acks; the nodes that reached L2 since the last claim (for
        their L3 backup); `claim=False` keeps them for the next."""

    def loading_check(self, wait: bool = False) -> int:
        """Apply finished H->D acks; how many."""

    def copies_pending(self) -> bool:
        """Whether a D->H or H->D copy is queued or in flight."""

    def reload_windows(self, last: TreeNode) -> bool:
        """A hybrid model's hit ending at `last`: give the L1 tombstones in its window their
        window KV back from L2, now; False when it cannot (`HostLoads.reload_windows`)."""

    def start_loading(self) -> TransferHandle | None:
        """Launch the queued H->D copies (the model runner does this before a forward)."""

    def wait_copies(self) -> None:
        """Block until every copy queued so far has finished (flush, shutdown)."""


class PrefixCache(ABC):
    """A page-aligned prefix tree over token ids; see docs/architecture.md "Contracts".

    Keys are cut to whole pages of `page_size` tokens; `extra_key` is a namespace. Locks
    (`inc_lock_ref`) cover a node and its ancestors. Invariant:
    `evictable_size() + protected_size() == total_size()` (device tokens).
    """

    page_size: int
    disable: bool
    root: TreeNode
    host: HostTier  # the L2 side: a `host_tier.NoHostTier` without one
    retention: Retention  # who owns and pins which nodes (sessions, pins)
    kv_events: TreeEvents  # the KV events of its node operations
    windows: WindowKV | None  # a hybrid model's window layers; None: every layer alike
    # observer(name, seconds): latency hook for metrics, set by the tier owner
    observer: Callable[[str, float], None] | None = None

    # ------------------------------------------------------------------------- L1 (all trees)

    @abstractmethod
    def match_prefix(self, key: Sequence[int], extra_key: str | None = None, *,
                     priority: int | None = None, count_hit: bool = True) -> MatchResult:
        """Longest cached prefix; touches (access time, and raises the nodes' priority to the
        request's `priority` unless None), counts a use unless `count_hit=False`, splits the
        last edge if needed."""

    @abstractmethod
    def peek_prefix(self, key: Sequence[int], extra_key: str | None = None) -> int:
        """Tokens of `key` cached in any tier, touching nothing (for ranking)."""

    @abstractmethod
    def peek_path(self, key: Sequence[int], extra_key: str | None = None) -> list[TreeNode]:
        """The whole nodes spelling `key`'s cached prefix, root excluded, touching nothing."""

    @abstractmethod
    def insert(self, key: Sequence[int], value: torch.Tensor | None = None,
               extra_key: str | None = None, *, count_hit: bool = True,
               priority: int = DEFAULT_PRIORITY) -> int:
        """Add `key` -> `value`; the leading tokens already present (the caller frees those).
        Touches and raises priorities like a match; counts a use unless `count_hit=False`."""

    @abstractmethod
    def node_at(self, anchor: TreeNode, key: Sequence[int], extra_key: str | None = None
                ) -> TreeNode | None:
        """The node whose edge ends exactly after `key`'s whole pages below `anchor` (an
        edge split there if it runs on); `anchor` for an empty key; None when the tree does
        not spell them all."""

    @abstractmethod
    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before children."""

    @abstractmethod
    def count_use(self, node: TreeNode, priority: int | None = None) -> None:
        """Count one use of `node` (locked by the caller) and its ancestors, touching them:
        for a request matched with `count_hit=False` that inserts nothing at its end."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device tokens if possible; the tokens freed."""

    @abstractmethod
    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock `node` and its ancestors; the change of evictable size (<= 0)."""

    @abstractmethod
    def dec_lock_ref(self, node: TreeNode) -> int:
        """Release an `inc_lock_ref`; the change of evictable size (>= 0)."""

    @abstractmethod
    def unlocked_on_path(self, node: TreeNode) -> int:
        """Device tokens `inc_lock_ref(node)` would take out of `evictable_size()`."""

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def total_size(self) -> int: ...

    @abstractmethod
    def reset(self) -> None:
        """Forget everything (the caller owns the pools and resets them)."""

    @abstractmethod
    def check_integrity(self, held_host_tokens: int = 0) -> None:
        """Raise AssertionError when a structural invariant is broken (`held_host_tokens`:
        host pages in-flight L3 prefetches hold, which no node owns yet)."""
