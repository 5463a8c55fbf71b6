"""The names users choose between: tiers and policies (one definition each; config validates
against these, the tree, the transfer engines and the storage tier act on them). A leaf
module: it imports nothing, so everything in `hicache` may import it."""

from __future__ import annotations

TIERS = ("device", "host", "storage")  # L1, L2, L3: flush names, stats keys, metric labels
# lru: least recently used first; lfu: least often used first (one request = one use), LRU
# among equals; priority: lowest request priority first (SGLang's --radix-eviction-policy
# priority), LRU among equals.
EVICTION_POLICIES = ("lru", "lfu", "priority")
# A request's priority when it names none (SGLang's and vLLM's `priority` default): higher
# values keep their prefixes longer under the `priority` eviction policy.
DEFAULT_PRIORITY = 0
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
IO_BACKENDS = ("kernel", "direct")  # L1<->L2 copies: CUDA kernels, or cudaMemcpyAsync runs
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    """Raise ValueError naming `name`, the offending `value` and what is allowed."""
    if value not in allowed:
        raise ValueError(f"{name} {value!r} is not one of {', '.join(allowed)}")
