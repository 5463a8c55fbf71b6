"""The admin part of the one door (`cache.admin`, held by `hicache.stack.CacheStack`): which
tiers the stack has, L3 attached and detached at run time, the metrics hook, and the close
at shutdown. The L3 prefetch policy and cost estimates are the L3 part's (`cache.l3`).

Threading: scheduler thread only. `attach_storage` / `detach_storage` run with no request
running or waiting (the engine checks): no prefetch is then in flight, and no node is
locked by a request. `close` runs once the loop has stopped.
"""

from __future__ import annotations

from collections.abc import Callable

from hicache.config_storage import TierSections
from hicache.events import EventPublisher, EventRecorder
from hicache.memory.host import HostKVPool
from hicache.model_kv import ModelKV
from hicache.stack_steps import StepCalls, restate_events
from hicache.stack_storage import StorageLink
from hicache.storage.open import open_storage_tier
from hicache.transfer.controller import HiCacheController
from hicache.tree.base import PrefixCache


class AdminCalls:
    """Over the tree, L2 (`host_pool` and `controller` None without it), the L3 part, the
    step part (to quiesce) and the KV events (`events` None: off)."""

    def __init__(self, tree: PrefixCache, host_pool: HostKVPool | None,
                 controller: HiCacheController | None, l3: StorageLink, steps: StepCalls,
                 events: EventRecorder | None, publisher: EventPublisher) -> None:
        self._tree = tree
        self._host_pool = host_pool
        self._controller = controller
        self._l3 = l3
        self._steps = steps
        self._events = events
        self._publisher = publisher

    def tiers(self) -> tuple[str, ...]:
        """The tiers this stack has now, L1 first (L3 comes and goes: attach / detach)."""
        return (("device",) + ("host",) * (self._host_pool is not None)
                + ("storage",) * (self._l3.tier is not None))

    def attach_storage(self, config: TierSections, model: ModelKV) -> None:
        """Open L3 from `config.storage` under the running tree and back up to it what L2
        holds (in the background, parents first), as every page that reaches L2 from now
        on. Raises, the stack unchanged: ValueError without L2, with L3 attached already,
        or for a section the backend refuses; an OSError (StorageUnavailable among them)
        when the store cannot be opened, or opens and fails its first call (a Redis that
        is down)."""
        if self._controller is None or self._host_pool is None:
            raise ValueError("L3 needs the host tier (L2): cache.hierarchical is off")
        if self._l3.tier is not None:
            raise ValueError("L3 is attached already; detach it first")
        tier = open_storage_tier(config, model, self._tree, self._host_pool, must_answer=True)
        self._steps.quiesce()  # a node's host pages hold its KV only once its D->H copy is acked
        self._l3.attach(tier)

    def detach_storage(self) -> bool:
        """Let in-flight copies and their backups land, close L3 (its prefetches and backups
        finish first), forget which nodes it held. False when none was attached."""
        tier = self._l3.tier
        if tier is None:
            return False
        self._steps.quiesce()
        self._l3.detach(tier)
        if self._events is not None:  # routers forget this server's L3 pages
            restate_events(self._events, self._tree)
        return True

    def set_observer(self, observe: Callable[[str, float], None]) -> None:
        """Latency hook for metrics: the tree's load-backs, the storage tier's prefetches."""
        self._tree.observer = self._l3.observer = observe
        if self._l3.tier is not None:
            self._l3.tier.observer = observe

    def close(self) -> None:
        """Let every prefetch and backup finish, stop the I/O and copy threads; send the
        last KV events and stop the publisher (its thread joined, its sockets closed)."""
        try:
            self._l3.close()
            if self._controller is not None:
                self._controller.close()
            self._steps.publish_events()
        finally:
            self._publisher.shutdown()
