"""The eviction order: each policy's heap key (lowest evicted first) behind a leading
retention class (unowned, then session-owned, then pinned). Both tiers' heaps (L1 leaves,
and HiRadixCache's L2 leaves) use the same key."""

from __future__ import annotations

from collections.abc import Callable

from hicache.tree.node import TreeNode


def lru_priority(node: TreeNode) -> tuple[float]:
    """Least recently used first (`time.monotonic()`: a clock step never reorders it)."""
    return (node.last_access_time,)


def lfu_priority(node: TreeNode) -> tuple[int, float]:
    """Least often hit first, least recently used among equals."""
    return (node.hit_count, node.last_access_time)


def request_priority(node: TreeNode) -> tuple[float, float]:
    """Lowest request priority first (the highest of the node's users), least recently used
    among equals (SGLang's `priority` eviction policy)."""
    return (node.priority, node.last_access_time)


# Eviction order per policy: the heap's key, lowest evicted first (one per EVICTION_POLICIES).
# Both tiers' heaps (L1 leaves, and HiRadixCache's L2 leaves) use the same one, behind
# `_owned_last`.
PRIORITIES: dict[str, Callable[[TreeNode], tuple]] = {"lru": lru_priority,
                                                       "lfu": lfu_priority,
                                                       "priority": request_priority}


# Retention classes, the eviction key's leading component: lowest evicted first.
UNOWNED, SESSION_OWNED, PINNED = 0, 1, 2


def _owned_last(policy: Callable[[TreeNode], tuple]) -> Callable[[TreeNode], tuple]:
    """`policy`'s key behind a leading retention class: nodes a live session owns
    (`owners`) go after every unowned one, pinned nodes (`pin_ref`) after those, in
    `policy`'s order within each class."""
    def key(node: TreeNode) -> tuple:
        retention = PINNED if node.pin_ref else SESSION_OWNED if node.owners else UNOWNED
        return (retention, *policy(node))
    return key


def eviction_key(policy: str) -> Callable[[TreeNode], tuple]:
    """The heap key of the eviction policy `policy` (one of EVICTION_POLICIES)."""
    return _owned_last(PRIORITIES[policy])
