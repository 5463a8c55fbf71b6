"""The request part of the one door (`hicache.stack.CacheStack` holds one): one call per
event of a request's life, each taking and giving opaque handles (`hicache.handles`).

    arrival, ranking   peek(key)                     tokens cached, touching nothing
    admission          match(key) -> Hit;  room_beyond(hit);  admit(hit) -> Admitted
    its prefill's end  cache_prefix(lease, ...) -> (lease, the tree's slots)
    its end            release(lease, ...)           (a retraction too, counting no use)

`slots` are a request's L1 slots from position 0, of which the first `shared` are the
tree's (read through its lease). One request is one use of each node it uses
(`hit_count`): matches and the prompt's insert count nothing, `release` counts it once.

Threading: scheduler thread only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache.handles import Admitted, Hit, Lease, Requester
from hicache.memory.device import DeviceKVPool
from hicache.tree.base import PrefixCache, concat
from hicache.tree.node import TreeNode
from hicache.tree.sessions import SessionTable


class RequestCalls:
    """What the stack does for requests, over its tree, its L1 pool (where the slots the
    tree does not keep go back) and its sessions (None: session retention is off)."""

    def __init__(self, tree: PrefixCache, device_pool: DeviceKVPool,
                 sessions: SessionTable | None) -> None:
        self.tree = tree
        self.device_pool = device_pool
        self.sessions = sessions

    def peek(self, key: Sequence[int], extra_key: str | None = None) -> int:
        """Tokens of `key` cached in any tier, touching nothing (for ranking)."""
        return self.tree.peek_prefix(key, extra_key)

    def match(self, key: Sequence[int], who: Requester) -> Hit:
        """The longest cached prefix of `key` in L1 and L2 (touched, its priority raised to
        `who`'s; its use is counted once, at `release`)."""
        m = self.tree.match_prefix(key, who.extra_key, priority=who.priority, count_hit=False)
        return Hit(m.device_indices, m.host_hit_length, m.last_device_node, m.last_host_node)

    def room_beyond(self, hit: Hit) -> int:
        """L1 tokens eviction could free with `hit`'s path held: the evictable ones off its
        path, less the pinned ones that cannot leave L1."""
        end = hit._device_end
        return (self.tree.evictable_size() - self.tree.unlocked_on_path(end)
                - self.tree.retention.stuck_pinned_size(end))

    def evict(self, tokens: int) -> int:
        """Free at least `tokens` L1 tokens of unlocked pages if possible; the tokens freed."""
        return self.tree.evict(tokens)

    def evictable_size(self) -> int:
        return self.tree.evictable_size()

    def admit(self, hit: Hit, evict_tokens: int = 0) -> Admitted:
        """Lock `hit`'s L1 path, evict `evict_tokens` (keeping its L2 pages), and queue the
        load-back of its L2 part (skipped when too short to pay, or when L1 has no room)."""
        end = hit._device_end
        self.tree.inc_lock_ref(end)
        try:
            if evict_tokens:
                self._evict_keeping(hit, evict_tokens)
            slots, loaded = hit.device_slots, 0
            if hit.host_tokens:
                lb = self.tree.host.init_load_back(hit._host_end)
                if lb.device_indices.numel():
                    slots = torch.cat([slots, lb.device_indices])
                    loaded = lb.device_indices.numel()
                    self.tree.inc_lock_ref(lb.last_node)
                    self.tree.dec_lock_ref(end)
                    end = lb.last_node
        except BaseException:
            self.tree.dec_lock_ref(end)
            raise
        return Admitted(Lease(end), slots, loaded)

    def _evict_keeping(self, hit: Hit, tokens: int) -> None:
        """Evict L1 `tokens` while the hit's L2 pages are kept (an L1 eviction may make
        room in L2 for its write-back)."""
        if not hit.host_tokens:
            self.tree.evict(tokens)
            return
        self.tree.host.protect_host(hit._host_end)
        try:
            self.tree.evict(tokens)
        finally:
            self.tree.host.release_host(hit._host_end)

    def cache_prefix(self, lease: Lease, tokens: Sequence[int], slots: torch.Tensor,
                     who: Requester, shared: int) -> tuple[Lease, torch.Tensor]:
        """Give the tree `tokens` (whole pages: a prefilled prompt) with their `slots`, and
        move the lease to their end. The caller's copies of pages the tree had already
        are freed. Returns the new lease and the tree's slots for `tokens`, which the
        caller reads from now on. Counts no use (`release` does)."""
        self._insert(tokens, slots, who, shared, count_hit=False)
        path = self.tree.peek_path(tokens, who.extra_key)  # no second hit for the policies
        tree_slots = concat([node.value for node in path])
        assert tree_slots.numel() == len(tokens), "an inserted key is whole nodes on L1"
        self.tree.inc_lock_ref(path[-1])
        self._own(path[-1], who)
        self.tree.dec_lock_ref(lease._end)
        return Lease(path[-1]), tree_slots

    def release(self, lease: Lease, tokens: Sequence[int], slots: torch.Tensor,
                who: Requester, shared: int, admitted: int, *, count_use: bool = True) -> None:
        """End the lease: `tokens` (whole pages computed; empty to keep nothing) go to the
        tree where they pass the `admitted` tokens the admission held; the slots neither the
        tree nor its copies keep go back to the pool. Counts the request's one use of its
        path (`count_use`: not when it only steps aside, a retraction)."""
        end = lease._end
        if len(tokens) > admitted:  # pages new since admission, maybe cached at prefill
            self._insert(tokens, slots, who, shared, count_hit=count_use)  # (again): a
            path = self.tree.peek_path(tokens, who.extra_key)             # fresh access
            if path:
                self._own(path[-1], who)
        elif count_use:  # nothing computed to add (or failed): the prefix it held
            self.tree.count_use(end, who.priority)
        self._own(end, who)
        rest = slots[max(len(tokens), shared):]  # never the tree's
        if rest.numel():
            self.device_pool.free(rest)
        self.tree.dec_lock_ref(end)

    def _insert(self, tokens: Sequence[int], slots: torch.Tensor, who: Requester,
                shared: int, count_hit: bool) -> None:
        """Insert `tokens` with their slots; the caller's copies of pages the tree already
        held (beyond the `shared` ones it reads from the tree) are freed."""
        present = self.tree.insert(tokens, slots[:len(tokens)], who.extra_key,
                                   count_hit=count_hit, priority=who.priority)
        if present > shared:  # the tree had these pages: the caller's are duplicates
            self.device_pool.free(slots[shared:present])

    def _own(self, end: TreeNode, who: Requester) -> None:
        """`who`'s live session owns the path ending at `end`. A session closed meanwhile
        stays closed: its late requests own nothing."""
        if self.sessions is not None and who.session_id in self.sessions:
            self.tree.retention.own(end, who.session_id)
