"""The names users choose between: tiers and policies (one definition each; config validates
against these, the tree, the transfer engines and the storage tier act on them). A leaf
module: it imports nothing, so everything in `hicache` may import it."""

from __future__ import annotations

TIERS = ("device", "host", "storage")  # L1, L2, L3: flush names, stats keys, metric labels
EVICTION_POLICIES = ("lru", "lfu")
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
IO_BACKENDS = ("kernel", "direct")  # L1<->L2 copies: CUDA kernels, or cudaMemcpyAsync runs
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    """Raise ValueError naming `name`, the offending `value` and what is allowed."""
    if value not in allowed:
        raise ValueError(f"{name} {value!r} is not one of {', '.join(allowed)}")
