"""The scheduler side of `HiCacheConnector`: which of a request's blocks hicache's tiers hold
(its own index of the worker's L2 slots, then L3's `batch_exists`), and what each step loads
and saves. It reads vLLM's `Request` and `SchedulerOutput` by their fields and imports no
vLLM, so it runs in a test on plain objects.

What must stay true: only `step` assigns L2 slots, and a slot a step loads from is not
reassigned in that step (`keep`); the worker copies a step's L2 loads before that step's
saves, so the worker's host pool holds what `index` says at every load.

A request whose hit reaches into L3 is loaded asynchronously (vLLM's WAITING_FOR_REMOTE_KVS):
its L2 pages are copied in the step that allocated its blocks, as a synchronous load's are,
and its L3 pages by the worker's loader thread while vLLM goes on with other requests; the
worker reports it done through `get_finished`. A hit from L2 alone is a memory copy and
stays synchronous.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hicache.integrations.vllm_settings import ConnectorSpace, HostIndex, store_key


@dataclass
class PageLoad:
    block_id: int
    page_hash: bytes
    slot: int | None  # its L2 slot; None: from L3


@dataclass
class PageSave:
    block_id: int
    page_hash: bytes
    slot: int | None  # the L2 slot it is copied to; None: L3 only (L2 full or none)


@dataclass
class StepPlan:
    """One step's work for the workers (inside vLLM's connector metadata)."""

    loads: list[PageLoad] = field(default_factory=list)  # copied before this step's saves
    idle: bool = False  # the step runs no forward: the workers may read L3 on their thread
    saves: list[PageSave] = field(default_factory=list)
    # L3 pages of requests loaded asynchronously, by request: read beside the steps that follow
    async_loads: dict[str, list[PageLoad]] = field(default_factory=dict)


@dataclass
class _Tracked:
    """A request the scheduler side follows: its blocks, page hashes and what is saved."""

    request: Any  # vLLM's Request: request_id, all_token_ids, num_prompt_tokens
    block_ids: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    saved: int = 0  # blocks [0, saved) are in hicache's tiers, queued for them, or vLLM's
    # an L3 load was planned: a later match (after a load that failed, vLLM asks again)
    # reads L2 alone, so pages the workers cannot read are not planned over and over
    l3_planned: bool = False


class ConnectorScheduler:
    """The scheduler side: which blocks hicache holds, what each step loads and saves."""

    def __init__(self, c: ConnectorSpace) -> None:
        self.c = c
        self.index = HostIndex(c.slots)
        self.tracked: dict[str, _Tracked] = {}
        self.planned: dict[str, tuple[int, list[PageLoad]]] = {}  # req_id -> (first block, hit)
        self.loads: list[PageLoad] = []               # allocated, for this step's meta
        self.async_loads: dict[str, list[PageLoad]] = {}  # the same, L3 pages loaded async
        self.counters = {"queries": 0, "l2_hit_tokens": 0, "l3_hit_tokens": 0,
                         "saved_pages": 0}

    def _hashes(self, t: _Tracked, blocks: int) -> list[bytes]:
        """The page hashes of `t`'s first `blocks` blocks (its tokens so far)."""
        have = len(t.hashes)
        if blocks > have:
            tokens = t.request.all_token_ids[have * self.c.block_size:blocks * self.c.block_size]
            t.hashes += self.c.hasher.hash_pages(tokens, prev=t.hashes[-1] if have else None)
        return t.hashes[:blocks]

    def matched(self, request: Any, num_computed: int) -> tuple[int, bool]:
        """Tokens beyond `num_computed` (block-aligned) found in L2 or L3: whole blocks, and
        never the prompt's last token (vLLM computes at least one); and whether they load
        asynchronously (some are in L3 only)."""
        t = self.tracked.setdefault(request.request_id, _Tracked(request))
        self.counters["queries"] += 1
        blocks = (request.num_prompt_tokens - 1) // self.c.block_size
        first = num_computed // self.c.block_size
        t.saved = max(t.saved, first)  # vLLM's own hits: saved when vLLM computed them
        hashes = self._hashes(t, blocks)
        plan: list[PageLoad] = []
        i = first
        while i < blocks:
            slot = self.index.find(hashes[i])
            if slot is None:
                break
            plan.append(PageLoad(-1, hashes[i], slot))
            i += 1
        store = None if t.l3_planned else self.c.open_store(prefault=False)
        if i < blocks and store is not None:
            found = store.batch_exists([store_key(h, 0) for h in hashes[i:blocks]])
            plan += [PageLoad(-1, h, None) for h in hashes[i:i + found]]
        if plan:
            self.planned[request.request_id] = (first, plan)
        else:
            self.planned.pop(request.request_id, None)
        return len(plan) * self.c.block_size, any(x.slot is None for x in plan)

    def allocated(self, request: Any, blocks: Any, num_external: int) -> None:
        planned = self.planned.pop(request.request_id, None)
        t = self.tracked.setdefault(request.request_id, _Tracked(request))
        if not num_external or planned is None:
            return
        first, plan = planned
        ids = blocks.get_block_ids()[0]
        n = num_external // self.c.block_size
        for k, load in enumerate(plan[:n]):
            load.block_id = ids[first + k]
            if load.slot is not None:
                self.loads.append(load)
                self.counters["l2_hit_tokens"] += self.c.block_size
            else:
                self.async_loads.setdefault(request.request_id, []).append(load)
                self.counters["l3_hit_tokens"] += self.c.block_size
                t.l3_planned = True
        t.saved = max(t.saved, first + n)

    def step(self, so: Any) -> StepPlan:
        """This step's loads (allocated since the last step) and saves (the blocks it
        fills), from vLLM's `SchedulerOutput`."""
        meta = StepPlan(loads=self.loads, async_loads=self.async_loads,
                        idle=so.total_num_scheduled_tokens == 0)
        self.loads, self.async_loads = [], {}
        keep = {load.slot for load in meta.loads if load.slot is not None}
        for new in so.scheduled_new_reqs:
            t = self.tracked.get(new.req_id)
            if t is None:
                continue
            t.block_ids = list(new.block_ids[0])
            self._save(t, new.num_computed_tokens, so.num_scheduled_tokens[new.req_id],
                       keep, meta)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self.tracked.get(req_id)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                t.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                t.block_ids += new_ids[0]
            self._save(t, cached.num_computed_tokens[i], so.num_scheduled_tokens[req_id],
                       keep, meta)
        return meta

    def _save(self, t: _Tracked, computed: int, scheduled: int, keep: set[int],
              meta: StepPlan) -> None:
        """Plan the saves of `t`'s blocks that this step fills: its tokens from `computed`
        (what vLLM has) to `computed + scheduled`. Where vLLM has less than was saved or
        loaded (blocks that failed to load, a preempted request), it computes them again
        and they are saved again: a page that failed its checksum is stored anew."""
        bs = self.c.block_size
        t.saved = min(t.saved, computed // bs)
        full = min((computed + scheduled) // bs, len(t.block_ids),
                   len(t.request.all_token_ids) // bs)
        if full <= t.saved:
            return
        hashes = self._hashes(t, full)
        for i in range(t.saved, full):
            if self.index.find(hashes[i]) is not None:
                continue  # L2 has it (another request's save)
            slot = self.index.assign(hashes[i], keep)
            if slot is None and not self.c.settings.has_storage:
                continue
            meta.saves.append(PageSave(t.block_ids[i], hashes[i], slot))
            self.counters["saved_pages"] += 1
        t.saved = full

    def finished(self, req_id: str) -> None:
        self.tracked.pop(req_id, None)
        self.planned.pop(req_id, None)
