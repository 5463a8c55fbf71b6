"""The scheduler side of `HiCacheConnector`: which of a request's blocks hicache's tiers hold
(its own index of the worker's L2 slots, then L3's `batch_exists`), and what each step loads
and saves. It reads vLLM's `Request` and `SchedulerOutput` by their fields and imports no
vLLM, so it runs in a test on plain objects.

What must stay true: only `step` assigns L2 slots, and a slot a step loads from is not
reassigned in that step (`keep`); the worker copies a step's L2 loads before that step's
saves, so the worker's host pool holds what `index` says at every load.

A hit that reaches into L3 loads within its step when its L3 pages are few
(`l3_step_load_mb`): vLLM runs the request's forward in the step that allocated its blocks,
and the worker reads and checks the pages before that forward reads them. A larger one loads
asynchronously (vLLM's WAITING_FOR_REMOTE_KVS): its L2 pages are copied in the step that
allocated its blocks, its L3 pages by the worker's loader thread while vLLM goes on with
other requests, and the worker reports it done through `get_finished`. The blocks a step
computes over an in-step L3 load are saved to L3 only, and only if that load arrived whole
(`PageSave.over`): L2's index names no page the worker may drop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hicache.integrations.vllm_groups import NULL_BLOCK_ID, KVGroups
from hicache.integrations.vllm_settings import ConnectorSpace, HostIndex, store_key, unit_id

# Window units `ConnectorScheduler` remembers sending to L3 (~10 MB of ids in a dict)
WINDOW_UNITS_REMEMBERED = 1 << 16
# Page hashes of a hybrid model's requests it remembers, to find where a prompt leaves an
# earlier one (~10 MB)
PAGES_SEEN_REMEMBERED = 1 << 16


@dataclass
class PageLoad:
    block_id: int
    page_hash: bytes
    slot: int | None  # its L2 slot; None: from L3
    group: int = 0  # the KV cache group whose block it is (`vllm_groups`)
    block: int = -1  # its block's index in the request's blocks


@dataclass
class PageSave:
    block_id: int
    page_hash: bytes
    slot: int | None  # the L2 slot it is copied to; None: L3 only (L2 full or none)
    # the requests whose in-step L3 loads this block's KV was computed over (its own, or
    # another's whose blocks vLLM's prefix cache shared with it in the same step): dropped
    # if a page of one of them failed (vLLM computes the block again, and it is saved then)
    over: tuple[str, ...] = ()
    group: int = 0  # the KV cache group whose block it is (`vllm_groups`)
    l3: bool = True  # written to L3 too (a window unit outside every boundary's window: L2)


@dataclass
class StepPlan:
    """One step's work for the workers (inside vLLM's connector metadata)."""

    loads: list[PageLoad] = field(default_factory=list)  # copied before this step's saves
    # L3 pages by request, read and placed before this step's forward reads them
    l3_loads: dict[str, list[PageLoad]] = field(default_factory=dict)
    idle: bool = False  # the step runs no forward: the workers may read L3 on their thread
    saves: list[PageSave] = field(default_factory=list)
    # L3 pages of requests loaded asynchronously, by request: read beside the steps that follow
    async_loads: dict[str, list[PageLoad]] = field(default_factory=dict)


@dataclass
class _Tracked:
    """A request the scheduler side follows: its blocks, page hashes and what is saved."""

    request: Any  # vLLM's Request: request_id, all_token_ids, num_prompt_tokens
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    hashes: list[bytes] = field(default_factory=list)
    saved: int = 0  # blocks [0, saved) are in hicache's tiers, queued for them, or vLLM's
    # an L3 load was planned: a later match (after a load that failed, vLLM asks again)
    # reads L2 alone, so pages the workers cannot read are not planned over and over
    l3_planned: bool = False
    # the blocks its prompt shares with a request seen before it (a hybrid model's): where
    # the two diverge is a boundary a later request may hit at, as a split in hicache's tree
    split: int = 0
    # the window units its last match loads from L3 (a hybrid model's): L3 holds them, so
    # its boundary does not send them back (`_save_boundary`). A load that fails is its
    # request's: vLLM starts it over from token 0 and matches it again, which clears them
    l3_window_units: set[bytes] = field(default_factory=set)


class _Hit(NamedTuple):
    """What `matched` found of a request, for `allocated` to plan."""

    first: int  # the first block it covers
    plan: list[PageLoad]  # from L2 (a slot) then from L3 (none), block ids still to come
    load_async: bool  # what `matched` told vLLM: too many L3 pages to load within a step


class ConnectorScheduler:
    """The scheduler side: which blocks hicache holds, what each step loads and saves."""

    def __init__(self, c: ConnectorSpace) -> None:
        self.c = c
        self.index = HostIndex(c.slots)
        self.tracked: dict[str, _Tracked] = {}
        self.planned: dict[str, _Hit] = {}  # matched, not yet allocated
        self.loads: list[PageLoad] = []               # allocated, for this step's meta
        self.l3_loads: dict[str, list[PageLoad]] = {}  # the same, L3 pages in the step
        self.async_loads: dict[str, list[PageLoad]] = {}  # the same, L3 pages loaded async
        self.step_load_pages = c.settings.step_load_pages(c.geometry.page_bytes)
        self.counters = {"queries": 0, "l2_hit_tokens": 0, "l3_hit_tokens": 0,
                         "saved_pages": 0}
        # window units sent to L3 lately (a hybrid model's), so a boundary's are sent once
        self.window_units_sent: OrderedDict[bytes, None] = OrderedDict()
        # page hash -> the request that had it first, lately (a hybrid model's requests)
        self.pages_seen: OrderedDict[bytes, str] = OrderedDict()

    def _hashes(self, t: _Tracked, blocks: int) -> list[bytes]:
        """The page hashes of `t`'s first `blocks` blocks (its tokens so far)."""
        have = len(t.hashes)
        if blocks > have:
            tokens = t.request.all_token_ids[have * self.c.block_size:blocks * self.c.block_size]
            new = self.c.hasher.hash_pages(tokens, prev=t.hashes[-1] if have else None)
            t.hashes += new
            if self.c.groups is not None:
                if not have:  # its first pages (its prompt's, from `matched`)
                    t.split = self._split(t, new)
                self._seen(new, t.request.request_id)
        return t.hashes[:blocks]

    def _seen(self, hashes: list[bytes], req_id: str) -> None:
        """Remember that `req_id` has these pages (the first request to have one keeps it).
        First in, first out, never refreshed: a prompt's pages go in chain order, so its
        earlier pages are forgotten first and the last one remembered still says how far
        a later prompt shares it (`_split`)."""
        for h in hashes:
            _remember(self.pages_seen, h, req_id, PAGES_SEEN_REMEMBERED)

    def _split(self, t: _Tracked, hashes: list[bytes]) -> int:
        """The blocks `t` shares with a request seen before it: past the last of its pages
        that another request had (the hashes chain, so that request had every page before)."""
        rid = t.request.request_id
        return max((i + 1 for i, h in enumerate(hashes) if self.pages_seen.get(h, rid) != rid),
                   default=0)

    def matched(self, request: Any, num_computed: int) -> tuple[int, bool]:
        """Tokens beyond `num_computed` (block-aligned) found in L2 or L3: whole blocks, and
        never the prompt's last token (vLLM computes at least one); and whether they load
        asynchronously (more L3 pages than a step loads)."""
        t = self.tracked.setdefault(request.request_id, _Tracked(request))
        t.l3_window_units.clear()
        self.counters["queries"] += 1
        blocks = (request.num_prompt_tokens - 1) // self.c.block_size
        first = num_computed // self.c.block_size
        t.saved = max(t.saved, first)  # vLLM's own hits: saved when vLLM computed them
        hashes = self._hashes(t, blocks)
        store = None if t.l3_planned else self.c.open_store(prefault=False)
        if self.c.groups is not None:
            plan = by_groups(self.c.groups, self.index, store, hashes, first)
        else:
            plan = self._by_pages(store, hashes, first)
        l3_pages = sum(x.slot is None for x in plan)
        # a hybrid model's L3 loads are asynchronous: vLLM takes a failed load of several
        # groups only as its request's (failed_recving, of a request it holds back)
        hit = _Hit(first, plan, l3_pages > (0 if self.c.groups else self.step_load_pages))
        if plan:
            self.planned[request.request_id] = hit
        else:
            self.planned.pop(request.request_id, None)
        end = max((x.block + 1 for x in plan), default=first)
        return (end - first) * self.c.block_size, hit.load_async

    def _by_pages(self, store: Any, hashes: list[bytes], first: int) -> list[PageLoad]:
        """One group: the leading pages from `first` in L2, then those after in L3."""
        plan: list[PageLoad] = []
        i, blocks = first, len(hashes)
        while i < blocks:
            slot = self.index.find(hashes[i])
            if slot is None:
                break
            plan.append(PageLoad(-1, hashes[i], slot, block=i))
            i += 1
        if i < blocks and store is not None:
            found = store.batch_exists([store_key(h, 0) for h in hashes[i:blocks]])
            plan += [PageLoad(-1, h, None, block=i + k) for k, h in enumerate(hashes[i:i + found])]
        return plan

    def allocated(self, request: Any, blocks: Any, num_external: int) -> None:
        planned = self.planned.pop(request.request_id, None)
        t = self.tracked.setdefault(request.request_id, _Tracked(request))
        if not num_external or planned is None:
            return
        first, plan = planned.first, planned.plan
        ids = blocks.get_block_ids()
        end = first + num_external // self.c.block_size
        l3 = self.async_loads if planned.load_async else self.l3_loads
        for load in plan:
            if load.block >= end:
                continue  # past the hit vLLM took
            load.block_id = ids[load.group][load.block]
            if self.c.groups is not None and load.block_id == NULL_BLOCK_ID:
                continue  # a window block vLLM skipped (before the window)
            tokens = self.c.block_size if load.group == 0 else 0  # a block's, counted once
            if load.slot is not None:
                self.loads.append(load)
                self.counters["l2_hit_tokens"] += tokens
            else:
                l3.setdefault(request.request_id, []).append(load)
                self.counters["l3_hit_tokens"] += tokens
                t.l3_planned = True
                if self.c.groups is not None and load.group in self.c.groups.windowed:
                    t.l3_window_units.add(unit_id(load.page_hash, load.group))
        if planned.load_async:  # vLLM holds the request until the worker says it is done,
            l3.setdefault(request.request_id, [])  # even with no L3 unit left to load
        t.saved = max(t.saved, end)

    def step(self, so: Any) -> StepPlan:
        """This step's loads (allocated since the last step) and saves (the blocks it
        fills), from vLLM's `SchedulerOutput`."""
        meta = StepPlan(loads=self.loads, l3_loads=self.l3_loads,
                        async_loads=self.async_loads, idle=so.total_num_scheduled_tokens == 0)
        self.loads, self.l3_loads, self.async_loads = [], {}, {}
        keep = {load.slot for load in meta.loads if load.slot is not None}
        # (group, block id) -> the request loading it from L3 in this step: a request that
        # reads such a block (vLLM's prefix cache shares it at once) computes over that load
        loading = {(load.group, load.block_id): req_id
                   for req_id, loads in meta.l3_loads.items() for load in loads}
        for new in so.scheduled_new_reqs:
            t = self.tracked.get(new.req_id)
            if t is None:
                continue
            t.block_ids = [list(ids) for ids in new.block_ids]
            over = _over(new.req_id, t, meta, loading)
            self._save_boundary(t, new.num_computed_tokens // self.c.block_size, meta, over)
            self._save(t, new.num_computed_tokens, so.num_scheduled_tokens[new.req_id],
                       keep, meta, over)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self.tracked.get(req_id)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                t.block_ids = [list(ids) for ids in new_ids] if new_ids is not None else []
            elif new_ids is not None:
                t.block_ids = [old + list(ids) for old, ids in
                               zip(t.block_ids or [[] for _ in new_ids], new_ids)]
            self._save(t, cached.num_computed_tokens[i], so.num_scheduled_tokens[req_id],
                       keep, meta, _over(req_id, t, meta, loading))
        return meta

    def _save(self, t: _Tracked, computed: int, scheduled: int, keep: set[int],
              meta: StepPlan, over: tuple[str, ...]) -> None:
        """Plan the saves of `t`'s blocks that this step fills: its tokens from `computed`
        (what vLLM has) to `computed + scheduled`. Where vLLM has less than was saved or
        loaded (blocks that failed to load, a preempted request), it computes them again
        and they are saved again: a page that failed its checksum is stored anew (a window
        unit where this request's rule sends it, `_window_l3`). `over`:
        the in-step L3 loads its KV is computed over, so its blocks go to L3 only, if those
        loads hold."""
        bs = self.c.block_size
        t.saved = min(t.saved, computed // bs)
        full = min((computed + scheduled) // bs, len(t.block_ids[0]) if t.block_ids else 0,
                   len(t.request.all_token_ids) // bs)
        if full <= t.saved:
            return
        hashes = self._hashes(t, full)
        window_l3 = self._window_l3(t)
        for group, ids in enumerate(t.block_ids):
            windowed = self.c.groups is not None and group in self.c.groups.windowed
            for i in range(t.saved, min(full, len(ids))):
                if windowed and ids[i] == NULL_BLOCK_ID:
                    continue  # outside the window
                unit = unit_id(hashes[i], group)
                in_l2 = self.index.find(unit) is not None
                to_l3 = self.c.settings.has_storage and (
                    not windowed or (window_l3(i) and self._window_to_l3(unit)))
                if in_l2 and not (windowed and to_l3):
                    continue  # L2 has it (another request's save sent it on to L3, a window
                    # unit if that request's rule took it; else this one's sends it now)
                slot = None if over or in_l2 else self.index.assign(unit, keep)
                if slot is None and not to_l3:
                    continue
                meta.saves.append(PageSave(ids[i], hashes[i], slot, over, group, to_l3))
                self.counters["saved_pages"] += 1
        t.saved = full

    def _window_l3(self, t: _Tracked) -> Callable[[int], bool]:
        """Whether a save sends block i's window units to L3: those a query reads at a
        boundary a later request can hit at (hicache's rule: docs/architecture.md, "L3 by
        kind"): the prompt's end (the same prompt asked again hits a block short of it when
        its tokens fill whole blocks: `matched` never takes the last token) and every block
        after it, and where the prompt leaves one seen before it (`_Tracked.split`)."""
        groups = self.c.groups
        if groups is None:
            return lambda i: True
        end_from = groups.needed_from((t.request.num_prompt_tokens - 1) // self.c.block_size)
        split_from = groups.needed_from(t.split)
        return lambda i: i >= end_from or split_from <= i < t.split

    def _save_boundary(self, t: _Tracked, end: int, meta: StepPlan,
                       over: tuple[str, ...]) -> None:
        """A hybrid request's first step starts at `end` blocks vLLM or hicache had: a
        boundary another request may hit at again (a shared system prompt). Its window units
        ([needed_from(end), end): vLLM keeps them for this request) go to L3 from its blocks
        (loaded before the step's saves), but for those known to be there."""
        groups = self.c.groups
        if groups is None or not end or not self.c.settings.has_storage:
            return
        hashes = self._hashes(t, end)
        for group in groups.windowed:
            ids = t.block_ids[group]
            for i in range(groups.needed_from(end), min(end, len(ids))):
                unit = unit_id(hashes[i], group)
                if ids[i] == NULL_BLOCK_ID:
                    continue  # outside the window
                if not self._window_to_l3(unit) or unit in t.l3_window_units:
                    continue  # in L3: sent lately, or loaded from there by this request
                    # (now remembered as sent, for the requests after it)
                meta.saves.append(PageSave(ids[i], hashes[i], None, over, group))
                self.counters["saved_pages"] += 1

    def _window_to_l3(self, unit: bytes) -> bool:
        """Whether a window unit still has to go to L3: False when this scheduler sent it
        lately. The memory is first in, first out, never refreshed: a send the worker lost
        (its write ring full, a store fault) or a value L3 dropped since is sent again once
        it ages out, and L3 skips what it holds."""
        return _remember(self.window_units_sent, unit, None, WINDOW_UNITS_REMEMBERED)

    def finished(self, req_id: str) -> None:
        self.tracked.pop(req_id, None)
        self.planned.pop(req_id, None)


def _remember(memory: OrderedDict, key: bytes, value: Any, most: int) -> bool:
    """Put `key` in a first-in, first-out memory of at most `most` keys (one already there
    keeps its value and its place); whether it was new."""
    if key in memory:
        return False
    memory[key] = value
    if len(memory) > most:
        memory.popitem(last=False)
    return True


def _over(req_id: str, t: _Tracked, meta: StepPlan, loading: dict[tuple[int, int], str]
          ) -> tuple[str, ...]:
    """The in-step L3 loads `t`'s KV is computed over: its own, and those of the blocks it
    shares with another request loading them in this step."""
    own = (req_id,) if req_id in meta.l3_loads else ()
    if not loading:
        return own
    others = {loading[(g, b)] for g, ids in enumerate(t.block_ids or ())
              for b in ids if (g, b) in loading} - {req_id}
    return own + tuple(sorted(others))


def by_groups(groups: KVGroups, index: HostIndex, store: Any, hashes: list[bytes],
              first: int) -> list[PageLoad]:
    """A hybrid model's hit from block `first` (`KVGroups.hit_end`): each unit from L2 (its
    slot) or L3 (`batch_present`); block ids still to come."""
    where: dict[tuple[int, int], int | None] = {}  # (group, block) -> slot; None: L3
    for group in range(len(groups.groups)):
        missing = []
        for i in range(first, len(hashes)):
            slot = index.find(unit_id(hashes[i], group))
            if slot is not None:
                where[group, i] = slot
            else:
                missing.append(i)
        if missing and store is not None:
            present = store.batch_present([store_key(hashes[i], 0, group) for i in missing])
            where.update({(group, i): None for i, ok in zip(missing, present) if ok})
    held = [[all((g, i) in where for g in kind) for i in range(first, len(hashes))]
            for kind in (groups.full, groups.windowed)]
    end = groups.hit_end(first, *held)
    window_from = max(first, groups.needed_from(end))
    return [PageLoad(-1, hashes[i], where[g, i], g, i) for g in range(len(groups.groups))
            for i in range(first if g in groups.full else window_from, end)]
