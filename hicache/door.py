"""The contract of the one door into the cache (`hicache.stack.CacheStack` answers it): the
request path in seven calls, each taking and giving opaque handles (`hicache.handles`), and
five parts reached as one attribute each, every part a small contract of its own.

    ranking      peek(key) -> int                 tokens cached, touching nothing
    admission    match(key, who) -> Hit;  admit(hit, evict_tokens) -> Admitted(lease, ...)
    the prefill  cache_prefix(lease, tokens, slots, who, shared) -> (lease, tree's slots)
    its end      release(lease, tokens, slots, who, shared, admitted)   (a retraction too)
    admin        flush(tiers) -> tokens freed per tier;  stats(counters) -> CacheStats

    slots        L1: alloc, free_slots, device_capacity, evict, evictable_size,
                 room_beyond, device_kv, leave_window, window_fits,
                 has_windows                               (`hicache.stack_slots`)
    retention    pins and sessions: pin, unpin, unpin_all, touch_session, close_session,
                 expire, max_pinned_tokens                 (`hicache.stack_retention`)
    steps        acks and events: poll, busy, wait_copies, launch_loads, quiesce,
                 publish_events                            (`hicache.stack_steps`)
    l3           the storage tier or its harmless answers: prefetch, ready, head_stop,
                 continue_head, head_computed, end, take_restarts, observe_forward,
                 estimates, set_policy                     (`hicache.stack_l3`)
    admin        tiers, attach_storage, detach_storage, set_observer, close
                                                           (`hicache.stack_admin`)

Units: tokens, always whole pages of `page_size`. `slots` are a request's L1 slots from
position 0, of which the first `shared` are the tree's (read through its lease). A request
is one use of each node it uses: `release` counts it once (`count_use=False`: a retraction).

Threading: the scheduler thread owns the cache and calls every method of the door and its
parts; another thread reaches it through the scheduler's queue. `stats` returns copies,
safe to read on another thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hicache.handles import Admitted, Hit, Lease, Requester
from hicache.stats import CacheStats, RequestCounters

if TYPE_CHECKING:
    from hicache.stack_admin import AdminCalls
    from hicache.stack_l3 import L3Calls
    from hicache.stack_retention import RetentionCalls
    from hicache.stack_slots import SlotCalls
    from hicache.stack_steps import StepCalls


class CacheDoor(ABC):
    """The request path, plus the parts (see the module docstring). `enabled` is False with
    --disable-radix-cache: every match is empty and nothing is kept."""

    page_size: int
    enabled: bool
    slots: SlotCalls
    retention: RetentionCalls
    steps: StepCalls
    l3: L3Calls
    admin: AdminCalls

    @abstractmethod
    def peek(self, key: Sequence[int], extra_key: str | None = None) -> int:
        """Tokens of `key` cached in any tier, touching nothing (for ranking)."""

    @abstractmethod
    def match(self, key: Sequence[int], who: Requester) -> Hit:
        """The longest cached prefix of `key` in L1 and L2, touched; nothing locked yet."""

    @abstractmethod
    def admit(self, hit: Hit, evict_tokens: int = 0) -> Admitted:
        """Lock `hit`'s path (the lease), evict `evict_tokens` of L1 besides it, and queue
        the load-back of its L2 part; the request's slots so far and the tokens loaded."""

    @abstractmethod
    def cache_prefix(self, lease: Lease, tokens: Sequence[int], slots: torch.Tensor,
                     who: Requester, shared: int) -> tuple[Lease, torch.Tensor]:
        """A prefill's end: the tree takes `tokens` (whole pages) with their `slots`; the
        new lease and the tree's slots for `tokens`, which the caller reads from now on."""

    @abstractmethod
    def release(self, lease: Lease, tokens: Sequence[int], slots: torch.Tensor,
                who: Requester, shared: int, admitted: int, *, count_use: bool = True) -> None:
        """A request's end (or retraction): the tree keeps `tokens` (empty: nothing), the
        other slots go back to L1, the lease ends."""

    @abstractmethod
    def flush(self, tiers: Sequence[str]) -> dict[str, int]:
        """Empty the named tiers (no request running); tokens freed per tier asked."""

    @abstractmethod
    def stats(self, requests: RequestCounters) -> CacheStats:
        """One snapshot of every tier, the pins and the sessions, in copies."""
