"""The tree's side of L3: page hashes on nodes, backups after L2 writes, prefetches on arrival.

    arrival    prefetch(req, last_host_node, tokens)   anchor protected, hashes queried
    each step  check()                                 hits -> host pages allocated, fetched;
                                                       backup acks release host pages
    admission  ready(req) per policy, then terminate(req): fetched pages become L2-only
               nodes under the anchor; the anchor is released

Each prefetch moves through the named states of `PrefetchState` (QUERYING, WAITING,
FETCHING, RESTART, DONE). Requests that arrive together with a common prefix (a burst after a
restart, one system prompt) fetch it once: a prefetch whose first pages another one is
already fetching is WAITING for it; once those pages are in the tree (the other request was
admitted), or whenever at least `threshold` of its tokens turn up in L2 under its anchor, it
is RESTART: handed back to the scheduler (`take_restarts`), which matches the request again
and prefetches only what is still missing. A wait ends too when the other fetch finished a
step ago but its request is still not admitted (no L1 room): then the waiting one fetches
the pages itself.

What to fetch (`_head_pages`): once the cost model (`planner.py`) has estimates of this
engine's prefill and of the backend's fetches, it decides for each hit: fetch it all,
recompute it all (fetching would be slower), or race: compute the head from the front while
the tail is fetched from the back (`race.py`; the fetched pages are valid on their own: the
hash chain fixes their prefix), the line between them moved as both go (`tier_race.py`).
Before the model has its estimates a hit is raced from a fixed first target (so that none
costs more than about its recompute), or fetched whole without `overlap`. With `cost_model`
off hits of at least `threshold` tokens are fetched whole.

Threading: scheduler thread only (it owns the tree and the host allocator); the I/O runs on
the `StorageController`'s threads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hicache.events.schema import MEDIUM_DISK
from hicache.pages import page_count
from hicache.policies import PREFETCH_POLICIES, check_choice
from hicache.storage.fetch_queue import PrefetchOp, PrefetchState
from hicache.storage.hashing import PageHasher
from hicache.storage.io import StorageController
from hicache.storage.planner import CostEstimates, FetchPlanner
from hicache.storage.race import first_target
from hicache.storage.tier_backup import Backups
from hicache.storage.tier_race import HeadRace
from hicache.storage.tier_state import KnownStored, Resume, StorageCounters
from hicache.tree.node import node_hashes

if TYPE_CHECKING:
    from hicache.tree.hiradix import HiRadixCache, HiTreeNode

# In-flight prefetches may hold at most this share of the host pool, so L2 keeps room for
# write-through and load-back (SGLang caps prefetch the same way).
MAX_PREFETCH_HOST_FRACTION = 0.5


class StorageTier:
    """The tree's side of L3 (see the module docstring); its races between a computed head
    and a fetched tail are its `race` part's (`HeadRace`)."""

    def __init__(self, tree: HiRadixCache, io: StorageController, hasher: PageHasher,
                 prefetch_policy: str = "timeout", prefetch_threshold: int = 256,
                 timeout_base: float = 2.0, timeout_per_ki_token: float = 0.1,
                 timeout_max: float = 30.0, cost_model: bool = True,
                 overlap: bool = True) -> None:
        check_choice("prefetch_policy", prefetch_policy, PREFETCH_POLICIES)
        self.tree = tree
        self.io = io
        self.hasher = hasher
        self.page_size = tree.page_size
        self.policy = prefetch_policy
        self.threshold = prefetch_threshold
        self.timeout = (timeout_base, timeout_per_ki_token, timeout_max)
        self.host_pool = io.host_pool
        self.ops: dict[str, PrefetchOp] = {}   # by request: every prefetch not yet ended
        self._draining: list[PrefetchOp] = []  # ended while FETCHING: pages freed once DONE
        self._fresh: list[PrefetchOp] = []  # submitted since the last `settle`
        self._step = 0  # `check` calls, to tell a fetch that just finished from a stale one
        self.counters = StorageCounters()
        self._stored = KnownStored()  # pages L3 holds that a request recomputes instead
        self.planner = FetchPlanner(self.page_size, self.host_pool.page_bytes, cost_model,
                                    overlap)
        self.race = HeadRace(io, self.planner, tree, self.counters, self._stored)
        self.backups = Backups(io, tree, hasher, self.counters, self._stored)
        # observer(name, seconds): latency hook for metrics ("prefetch_seconds")
        self.observer: Callable[[str, float], None] | None = None

    def _last_hash(self, node: HiTreeNode) -> bytes | None:
        """The hash of `node`'s last page (None for the root): a chain's next link."""
        return None if node is self.tree.root else node_hashes(node, self.tree.root,
                                                               self.hasher)[-1]

    # -------------------------------------------------------------------------- prefetch

    def set_policy(self, prefetch_policy: str) -> None:
        """The prefetch policy from now on (admissions read it at each check)."""
        check_choice("prefetch_policy", prefetch_policy, PREFETCH_POLICIES)
        self.policy = prefetch_policy

    def prefetch(self, req_id: str, last_host_node: HiTreeNode, tokens: Any,
                 extra_key: str | None = None, resume: Resume | None = None,
                 prefix_tokens: int = 0) -> bool:
        """Start fetching the pages of `tokens` (the request's key beyond its L1+L2 hit of
        `prefix_tokens`, under namespace `extra_key`) from storage. False when shorter than
        the threshold, already running, or when the hit's last node has no L2 copy to hang
        pages under. `resume` (a restart) keeps the policy's clock and budget of the first
        attempt."""
        tokens = self.tree.page_aligned(tokens)
        if len(tokens) < max(self.threshold, self.page_size) or req_id in self.ops:
            return False
        if not last_host_node.backuped:  # L2-only pages need a parent in L2 (no holes)
            return False
        hashes = self.hasher.hash_pages(tokens, self._last_hash(last_host_node), extra_key)
        op = PrefetchOp(req_id, hashes, last_host_node, tokens, extra_key,
                        timeout_tokens=len(tokens), prefix_tokens=prefix_tokens)
        if resume is not None:
            op.started_at, op.timeout_tokens = resume
            op.is_restart = True
        self.tree.protect_host(last_host_node)
        self.ops[req_id] = op
        self._fresh.append(op)
        self.io.submit(op)
        return True

    def settle(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the queries submitted since the last call to
        answer, so that `check` can start their fetches, or admit at once a request whose
        query found nothing, in this scheduler step rather than after the next forward pass."""
        fresh, self._fresh = self._fresh, []
        deadline = time.monotonic() + timeout
        for op in fresh:
            left = deadline - time.monotonic()
            if left <= 0 or not op.queried.wait(left):
                return

    def check(self) -> None:
        """Top of each scheduler step, in this order: fetches the I/O thread finished become
        DONE (stamped with this step); WAITING ops whose fetch went stale decide again; ops
        whose query answered decide; ended ops' pages are freed once DONE; backup acks
        release host pages. (A fetch DONE in this very step still counts as "about to be in
        the tree" for the decisions that follow.)"""
        self._step += 1
        for op in self.ops.values():
            if op.state is PrefetchState.FETCHING:
                if op.finished.is_set():
                    self._done(op)
                elif not self.planner.fetch_fitted:
                    self._observe_progress(op)
        for op in list(self.ops.values()):
            if op.state is PrefetchState.WAITING and self._wait_is_stale(op):
                self._decide(op)
        for op in list(self.ops.values()):
            if op.state is PrefetchState.QUERYING and op.queried.is_set():
                self._decide(op)
        self._draining = [op for op in self._draining if not self._free_if_finished(op)]
        self.backups.check()

    def _observe_progress(self, op: PrefetchOp) -> None:
        """Before the fetch model has its estimate, each batch that arrives in a fetch is an
        observation (the pages so far and the time they took): a cold server's first fetch
        seeds it."""
        with op.lock:
            pages, seconds = op.completed_pages, op.fetch_seconds
        if pages > op.observed_pages and seconds > 0:
            self.planner.observe_fetch(pages, seconds)
            op.observed_pages = pages

    def _done(self, op: PrefetchOp) -> None:
        if op.state is PrefetchState.FETCHING:
            self._observe_progress(op)
        op.state, op.done_step, op.waiting_for = PrefetchState.DONE, self._step, None
        op.finished.set()  # the threads never started, or have let go of its pages

    def _decide(self, op: PrefetchOp) -> None:
        """A QUERYING op whose query answered, or a WAITING op whose wait ended: fetch, wait
        for another fetch, hand back for a fresh match, or finish with nothing to fetch."""
        hit = op.hit_pages or 0
        if op.state is PrefetchState.QUERYING:
            self._record_found(op, hit)
        if op.cancelled or hit == 0 or hit * self.page_size < self.threshold:
            return self._done(op)
        head = self._head_pages(op, hit)
        if head is None or head >= hit:  # all of it recomputed
            self.race.recomputed(op, hit)
            return self._done(op)
        if not op.is_restart and self._covered_in_l2(op) >= max(self.threshold, self.page_size):
            op.state = PrefetchState.RESTART  # inserted since the match: match again
            return None
        other = self._fetching_our_first_pages(op)
        if other is not None:
            op.state, op.waiting_for = PrefetchState.WAITING, other.req_id
            return None
        op.waiting_for = None
        pages = min(hit, self._prefetch_budget_pages())
        if head:  # a race: the fetch takes the last pages the host budget holds
            head = max(head, hit - pages)
            if head >= hit:
                self.race.recomputed(op, hit)
                return self._done(op)
        elif pages * self.page_size < max(1, self.threshold):
            return self._done(op)
        host = self._alloc_host(pages)
        if host is None:
            return self._done(op)
        op.host_indices, op.state = host, PrefetchState.FETCHING
        if head:
            self.race.start(op, hit, head, pages)
        else:
            self.io.fetch(op)
        return None

    def _record_found(self, op: PrefetchOp, hit: int) -> None:
        """KV events: the `hit` pages the query found are on DISK (whether or not fetched)."""
        events = self.tree.events
        if events is not None and hit:
            events.stored(op.hashes[:hit], self._last_hash(op.anchor),
                          op.tokens[:hit * self.page_size], MEDIUM_DISK)

    def _head_pages(self, op: PrefetchOp, hit: int) -> int | None:
        """For an L3 hit of `hit` pages: 0, fetch it all; k > 0, race it with a first target
        of k pages; None, recompute it all (`FetchPlanner`). A restarted prefetch fetches
        what another request's did not bring: never raced."""
        if op.is_restart:
            return 0
        plan = self.planner.plan(hit, op.prefix_tokens)
        op.planned_race_s = plan.split.seconds if plan.race and plan.split else None
        return first_target(hit, plan.head_pages) if plan.race else plan.head_pages

    def _alloc_host(self, pages: int) -> Any:
        """Host slots for `pages` pages, evicting L2 once if needed; None when there is no
        room even then."""
        tokens = pages * self.page_size
        host = self.host_pool.alloc(tokens)
        if host is None:
            self.tree.evict_host(tokens)
            host = self.host_pool.alloc(tokens)
        return host

    def _covered_in_l2(self, op: PrefetchOp) -> int:
        """Tokens of `op.tokens` the tree has gained below the anchor since the request
        matched (there were none, or the match would have gone further), counted only when
        the path ends in L2, so that a fresh match anchors a prefetch there."""
        node, pos = self.tree.reach_below(op.anchor, op.tokens, op.extra_key)
        return pos if node is not op.anchor and node.backuped else 0

    def _fetching_our_first_pages(self, op: PrefetchOp) -> PrefetchOp | None:
        """A fetch below the same anchor whose pages begin with at least `threshold` tokens
        of `op`'s (same anchor and hash: the same pages), FETCHING or DONE in this step (its
        request is likely admitted in this step, inserting them)."""
        need = max(1, page_count(self.threshold, self.page_size))
        for other in self.ops.values():
            if (other is not op and other.host_indices is not None and other.race is None
                    and (other.state is PrefetchState.FETCHING or other.done_step == self._step)
                    and other.anchor is op.anchor
                    and other.hashes[:need] == op.hashes[:need]):
                return other
        return None

    def _wait_is_stale(self, op: PrefetchOp) -> bool:
        """The fetch `op` waits for finished before this step and its request is still not
        admitted (no L1 room): stop waiting, fetch the pages ourselves."""
        other = self.ops.get(op.waiting_for)
        return other is not None and other.state is PrefetchState.DONE and \
            other.done_step != self._step

    def take_restarts(self) -> list[str]:
        """Requests whose prefetch is RESTART: the scheduler matches them again (`restart`,
        then `prefetch(..., resume=)`)."""
        return [rid for rid, op in self.ops.items() if op.state is PrefetchState.RESTART]

    def restart(self, req_id: str) -> Resume | None:
        """Drop the request's prefetch before it fetched anything (it holds no host pages);
        returns its clock and budget for `prefetch(..., resume=)`, or None if it is gone."""
        op = self.ops.pop(req_id, None)
        if op is None:
            return None
        assert op.host_indices is None, f"a restarted prefetch ({op.state}) holds host pages"
        op.cancelled = True
        self.tree.release_host(op.anchor)
        self.counters.prefetch_restarts += 1
        return Resume(op.started_at, op.timeout_tokens)

    def _prefetch_budget_pages(self) -> int:
        cap = int(self.host_pool.total_size() * MAX_PREFETCH_HOST_FRACTION) - \
            self.held_host_tokens()
        return max(0, cap) // self.page_size

    # ------------------------------------------------------------------ the race (`race`)

    def head_stop(self, req_id: str) -> int:
        op = self.ops.get(req_id)
        return 0 if op is None else self.race.head_stop(op)

    def continue_head(self, req_id: str, computed: int) -> int:
        """See `HeadRace.continue_head`; a lost race ends the prefetch here (0)."""
        op = self.ops.get(req_id)
        stop = 0 if op is None else self.race.continue_head(op, computed)
        if stop is None:
            self.terminate(req_id)
        return stop or 0

    def head_computed(self, req_id: str, node: HiTreeNode) -> None:
        op = self.ops.get(req_id)
        if op is not None:
            self.race.head_computed(op, node)

    def ready(self, req_id: str) -> bool:
        """Whether the request may be admitted now under the prefetch policy."""
        op = self.ops.get(req_id)
        if op is None or self.policy == "best_effort":
            return True
        if op.race is not None and not op.race.final:  # it computes its head meanwhile
            return True
        if op.finished.is_set() or self.race.tail_arrived(op):  # fetched, failed, or nothing
            return True                                      # worth fetching
        base, per_ki, cap = self.timeout
        limit = cap if self.policy == "wait_complete" else min(
            cap, base + per_ki * op.timeout_tokens / 1024)
        return time.monotonic() - op.started_at >= limit

    def terminate(self, req_id: str) -> int:
        """End the request's prefetch: insert the pages fetched so far as L2-only nodes and
        release the anchor. Returns the tokens inserted."""
        op = self.ops.pop(req_id, None)
        if op is None:
            return 0
        done = self.io.cancel(op)
        inserted = self.race.insert_tail(op, done) if op.race is not None else 0
        if op.race is None and op.host_indices is not None and done:
            n = done * self.page_size
            window = op.window_run(0, done, self.page_size)
            inserted = self.tree.insert_host_pages(op.anchor, op.tokens[:n],
                                                   op.host_indices[:n], op.hashes[:done],
                                                   op.extra_key, window)
            op.host_indices = op.host_indices[n:]
            self.counters.prefetched_tokens += n
            self.counters.window_prefetched_tokens += 0 if window is None else n - window
        for waiting in self.ops.values():  # its pages are in the tree now (or never will be)
            if waiting.state is PrefetchState.WAITING and waiting.waiting_for == req_id:
                waiting.state, waiting.waiting_for = PrefetchState.RESTART, None
        self.tree.release_host(op.anchor)
        if op.head_node is not None:
            self.tree.release_host(op.head_node)
        if self.observer is not None:
            self.observer("prefetch_seconds", time.monotonic() - op.started_at)
        if op.state is not PrefetchState.FETCHING:
            op.finished.set()  # no thread will write its pages (none were handed out)
        if not self._free_if_finished(op):
            self._draining.append(op)
        return inserted

    # --------------------------------------------------------------------- cost model

    def observe_forward(self, rows: list[tuple[int, int]], seconds: float) -> None:
        """A forward pass of `rows` (prefix tokens, tokens computed) took `seconds`."""
        self.planner.observe_forward(rows, seconds)

    def probe_fetch(self) -> list[tuple[int, float]]:
        """Seed the fetch model with a few timed reads of what the store holds (at attach,
        before the threads have work); (pages, seconds) per read, none for an empty store."""
        reads = self.io.probe()
        for pages, seconds in reads:
            self.planner.observe_fetch(pages, seconds)
        return reads

    def estimates(self) -> CostEstimates:
        return self.planner.estimates()

    def _free_if_finished(self, op: PrefetchOp) -> bool:
        if not op.finished.is_set():
            return False
        if op.host_indices is not None and len(op.host_indices):
            self.host_pool.free(op.host_indices)
        op.host_indices = None
        return True

    # ------------------------------------------------------------------------------ misc

    def busy(self) -> bool:
        """Whether a prefetch or a backup is in flight."""
        return bool(self.ops) or self.backups.busy()

    def held_host_tokens(self) -> int:
        """Host slots held by prefetches (not yet in the tree)."""
        ops = list(self.ops.values()) + self._draining
        return sum(len(op.host_indices) for op in ops if op.host_indices is not None)

    def wait_idle(self) -> None:
        """Finish every backup and let go of every prefetch (flush, shutdown)."""
        for req_id in list(self.ops):
            self.terminate(req_id)
        for op in self._draining:
            op.finished.wait()
        self.io.wait_backups()
        self.check()

    def clear(self) -> int:
        """Empty L3 (after in-flight backups land); returns the pages removed."""
        self.wait_idle()
        self._stored.clear()
        removed = self.io.backend.clear()
        self.tree.forget_stored()
        return removed

    def close(self) -> None:
        self.wait_idle()
        self.io.close()
