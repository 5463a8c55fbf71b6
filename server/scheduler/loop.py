"""Continuous batching over the KV cache hierarchy, on one thread that owns the cache.

Each step (`step`): drain the inbox, apply the cache's acks (`cache.steps.poll`), then

    schedule   every running request gets this step's slots (1 token each for a decode, the
               next chunk of a prefill): a fill from its reservation, a decode from the free
               slots (evicting the tree's unlocked pages); when L1 cannot give a decode its
               slot even after the L1->L2 copies in flight land (their pages are locked
               until then), running requests are retracted, least progressed first
               (`retraction.py`).
               Then, unless a request was retracted, waiting requests are admitted in
               the schedule policy's order (`policy.py`: longest cached prefix first by
               default), each asked then committed (`admission.py`:
               prefetch policy -> match -> room for the fill and the estimated new tokens?
               -> lock -> evict -> load-back from L2 -> reserve L1 for the fill)
    run        the model runner starts the loads and runs the batch
    finish     a request whose fill just ended has its tokens inserted into the tree (it
               keeps the path locked); choose tokens (`hicache_server.sampling`: shaped logits for
               the requests that ask, one argmax for all greedy rows, `sample_row` for the
               rest) and read the logprobs asked for; finished requests are inserted whole
               (duplicate slots freed, write-through queued) and unlocked

A request that does not fit waits in the queue; a retracted one waits again at its head, its
output kept, and resumes from the tree. Nothing exits for lack of memory, except a request
that cannot get a slot even when it runs alone (it fails with an error).
Every other thread talks to the scheduler through `submit` / `call` (the inbox).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from hicache.door import CacheDoor
from hicache.stats import RequestCounters
from hicache_server.inbox import Inbox, SchedulerStopped
from hicache_server.model_runner import ModelRunner
from hicache_server.request import Request
from hicache_server.scheduler.admission import Admission
from hicache_server.scheduler.endings import RequestEndings
from hicache_server.scheduler.kv import RequestKV
from hicache_server.scheduler.retraction import Retraction, progress
from hicache_server.scheduler.text import OutputText
from hicache_server.scheduler.tokens import TokenChoice
from hicache_server.scheduler.warmup import warm_up_prefill
from hicache_server.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05     # inbox wait when there is nothing to do
BUSY_POLL_S = 0.002    # inbox wait while prefetches or copies are in flight
# After new requests arrive, the step waits up to this long for their L3 queries (a local
# LMDB answers in microseconds, a Redis on the LAN in a round trip), so a request whose prefix
# storage does not hold is admitted in this step instead of after the next forward pass.
QUERY_SETTLE_S = 0.005


def fill_end(req: Request) -> int:
    """Where the request's computing stops before its next token can be chosen: its whole
    sequence, or the end of the head of an L3 hit whose tail is still on its way."""
    return req.kv.head_stop or req.seq_len


class Scheduler:
    def __init__(self, runner: ModelRunner, cache: CacheDoor, tokenizer: Tokenizer, *,
                 max_batch_tokens: int, max_running: int, max_queued: int,
                 schedule_policy: str = "lpm", prefill_warmup_s: float = 0.0) -> None:
        self.runner = runner
        self.prefill_warmup_s = prefill_warmup_s  # timed forwards before the first step
        self.warmed_up = threading.Event()  # set once they are done (the engine waits)
        self.cache = cache
        self.tokenizer = tokenizer
        self.text = OutputText(tokenizer)
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.inbox = Inbox(max_queued)  # past `max_queued` unadmitted requests: QueueFull
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.kv = RequestKV(cache, self.running)
        self.admission = Admission(cache, self.kv, schedule_policy)
        self._commands: list[tuple[Callable[[], Any], Future, bool]] = []
        self.observer: Callable[[str, float], None] | None = None  # latency hook (metrics)
        self.counters = RequestCounters()
        self.retraction = Retraction(self.kv, self.waiting, self.counters)
        self.endings = RequestEndings(cache, self.kv, self.text, self.counters, self.waiting,
                                      self.running, self.inbox.admitted)
        self.tokens = TokenChoice(self.text, self.endings.alone, self.endings.fail)

    def set_observer(self, observe: Callable[[str, float], None]) -> None:
        """Latency hook for metrics (`ttft_seconds`, ...)."""
        self.observer = observe

    # ------------------------------------------------------------------------- inbox

    def submit(self, req: Request) -> None:
        """Queue a request (any thread); its `on_update` runs on the scheduler thread.
        Raises QueueFull when `max_queued` requests wait to be admitted already (nothing is
        queued), SchedulerStopped once the loop has died (`fail_all`)."""
        self.inbox.put_request(req)

    def call(self, fn: Callable[[], Any], when_idle: bool = False) -> Future:
        """Run `fn` on the scheduler thread between steps (after the running requests
        finish when `when_idle`); admissions pause while an idle call waits. Once the loop
        has died the future holds SchedulerStopped at once: nothing waits forever."""
        fut: Future = Future()
        try:
            self.inbox.put("cmd", (fn, fut, when_idle))
        except SchedulerStopped as e:
            fut.set_exception(e)
        return fut

    def _drain_inbox(self) -> bool:
        """Accept what arrived (waiting for it when there is nothing else to do); whether
        anything did."""
        timeout = 0.0
        if not (self.running or self._commands):
            timeout = BUSY_POLL_S if (self.waiting or self.cache.steps.busy()) else IDLE_WAIT_S
        items = self.inbox.take(timeout)
        for item in items:
            self._accept(*item)
        return bool(items)

    def _accept(self, kind: str, payload: Any) -> None:
        if kind == "cmd":
            self._commands.append(payload)
            return
        req: Request = payload
        req.arrival = time.monotonic()
        if req.input.session_id is not None:
            self.cache.retention.touch_session(req.input.session_id, req.arrival)
        req.generator = torch.Generator()
        if req.input.params.seed is None:
            req.generator.seed()  # fresh entropy, as SGLang and vLLM do without a seed
        else:
            req.generator.manual_seed(req.input.params.seed)
        self.waiting.append(req)
        self.counters.requests += 1
        self.counters.prompt_tokens += req.prompt_len
        with self.endings.alone(req, "starting its storage prefetch"):
            self.admission.start_prefetch(req)

    def fail_all(self, message: str) -> None:
        """After the loop died: finish every request and command with `message`, touching
        neither the tree nor the pools (their state is unknown). Any thread, once `run` has
        returned; never raises. From here on submit / call fail at once."""
        queued = self.inbox.close(message)
        self.endings.fail_all_requests(message, [p for kind, p in queued if kind == "req"])
        pending = [payload for kind, payload in queued if kind == "cmd"]
        for _, fut, _ in (*self._commands, *pending):
            if not fut.done():
                fut.set_exception(SchedulerStopped(message))
        self._commands = []

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---------------------------------------------------------------------------- loop

    def run(self, stop: threading.Event) -> None:
        try:
            warm_up_prefill(self.runner, self.cache, self.prefill_warmup_s,
                            min(self.max_batch_tokens, self.cache.slots.free_slots()))
        finally:
            self.warmed_up.set()
        while not stop.is_set():
            self.step()

    def step(self) -> None:
        self.cache.steps.poll(QUERY_SETTLE_S if self._drain_inbox() else 0.0)
        if self._restart_prefetches():  # their queries may answer in this step too
            self.cache.steps.poll(QUERY_SETTLE_S)
        self._run_commands()
        self.cache.retention.expire(time.monotonic())
        plan = self._schedule()
        if plan:
            self._run_batch(*plan)
        else:
            self.cache.steps.launch_loads()  # loads never wait for a forward pass
        self.cache.steps.publish_events()  # this step's KV events, one batch (never blocks)

    def _run_commands(self) -> None:
        keep = []
        for fn, fut, when_idle in self._commands:
            if when_idle and self.running:
                keep.append((fn, fut, when_idle))
                continue
            try:
                fut.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - reported to the caller; the loop goes on
                fut.set_exception(exc)
        self._commands = keep

    # ------------------------------------------------------------------------ schedule

    def _schedule(self) -> tuple[list[Request], list[int]] | None:
        if not self.running:
            self.admission.ratio.reset()
        step, complete = self._continue_running()
        budget = self.max_batch_tokens - sum(step.values())
        admitted = []
        if complete and not any(when_idle for _, _, when_idle in self._commands):
            sharing = self.admission.sharing(self.waiting)  # delay scheduling
            for req in self.admission.order(self.waiting):
                if budget <= 0 or len(self.running) >= self.max_running:
                    break
                if self._held(req):
                    continue
                if sharing.defers(req):
                    self.counters.delayed_admissions += 1
                    continue
                if self._try_admit(req):
                    step[req] = min(fill_end(req) - req.kv.num_computed, budget)
                    budget -= step[req]
                    admitted.append(req)
                    sharing.admitted(req)
        for req in admitted:  # a fill, from the reservation just made
            if not self.kv.ensure_slots(req, req.kv.num_computed + step[req]):
                # only a hybrid model's window slots can be short: it fills a step later
                assert self.cache.slots.has_windows, (
                    f"request {req.rid}: its fill was reserved at admission")
                del step[req]
        return (list(step), list(step.values())) if step else None

    def _continue_running(self) -> tuple[dict[Request, int], bool]:
        """This step's tokens of the running requests (request -> tokens), each with its
        slots. The most progressed are served first; when L1 cannot give one its slots,
        the least progressed decoding request is retracted (`retraction.py`), until it can.
        Whether every running request got its slots without a retraction."""
        step, budget = {}, self.max_batch_tokens
        for req in self.running:
            n = min(fill_end(req) - req.kv.num_computed, budget)
            if n > 0 and budget > 0:
                step[req] = n
                budget -= n
        retracted: list[Request] = []
        for req in sorted(step, key=progress, reverse=True):
            while req in step and not self.kv.ensure_slots(req, req.kv.num_computed + step[req]):
                if self._settle_copies():
                    continue
                victim = self.retraction.victim()
                if victim is None and self.cache.slots.has_windows:
                    victim = self.retraction.any_victim(req)
                if victim is None:
                    self.endings.fail(req, "getting L1 slots",
                                       self.retraction.no_room(req, step.pop(req)))
                    break
                with self.endings.alone(victim, "retracting it"):
                    self.retraction.retract(victim)
                    retracted.append(victim)
                step.pop(victim, None)
        if retracted:
            old = self.admission.ratio.value
            self.admission.ratio.retracted(self.running)
            logger.info("L1 is out of slots for decoding: retracted %d request(s) (%s) to the "
                        "queue, %d still running; new_token_ratio %.3f -> %.3f",
                        len(retracted), ", ".join(r.rid for r in retracted),
                        len(self.running), old, self.admission.ratio.value)
        elif any(r.output.ids for r in step):  # a decode step
            self.admission.ratio.decayed()
        return step, not retracted

    def _settle_copies(self) -> bool:
        """Wait for the L1<->L2 copies in flight and apply their acks: a page on its way to
        L2 stays locked until its ack and is evictable once it lands, which beats
        retracting a request. Whether that made room (an ack may start the next write of a
        path, so the caller asks again)."""
        room = self.kv.free_tokens() + self.cache.slots.evictable_size()
        if not self.cache.steps.wait_copies():
            return False
        return self.kv.free_tokens() + self.cache.slots.evictable_size() > room

    def _held(self, req: Request) -> bool:
        """A later choice of an `n > 1` request waits while the first one prefills, then
        finds the prompt in the tree (`cache_prompt` runs at the end of that prefill): the
        prompt is computed once. Never held without a tree, nor behind a first choice that
        has not arrived (it would go unshared, never stuck) or has finished."""
        lead = req.prompt_leader
        return (lead is not None and self.cache.enabled and lead.arrival > 0
                and lead.output.finish_reason is None and not lead.prefilled)

    def _restart_prefetches(self) -> bool:
        """Prefetches whose prefix reached the tree meanwhile (another prefetch brought it):
        match again and fetch only the rest. Whether any was restarted."""
        restarts = self.cache.l3.take_restarts()
        if not restarts:
            return False
        waiting = {req.rid: req for req in self.waiting}
        for rid, resume in restarts:
            if rid in waiting:
                with self.endings.alone(waiting[rid], "restarting its storage prefetch"):
                    self.admission.start_prefetch(waiting[rid], resume)
        return True

    def _try_admit(self, req: Request) -> bool:
        """Ask, then commit; a failure fails `req` alone (see `admission.py`)."""
        admitted = False
        with self.endings.alone(req, "admission"):
            plan = self.admission.plan(req)
            if plan is not None:
                counted = self.admission.commit(req, plan)
                if counted is not None:
                    self.counters.add_cached(counted)
                self.waiting.remove(req)
                self.running.append(req)
                self.inbox.admitted(req)  # a place in the queue for the next request
                admitted = True
        return admitted

    # ----------------------------------------------------------------------------- run

    def _run_batch(self, reqs: list[Request], lens: list[int]) -> None:
        rows = [(req.kv.num_computed, n) for req, n in zip(reqs, lens)]
        started = time.perf_counter()
        try:
            out = self.runner.forward(reqs, lens)
        except Exception as exc:  # noqa: BLE001 - a failed forward fails its requests only
            for req in reqs:
                self.endings.fail(req, "the forward pass", exc)
            return
        done, heads = [], []
        for i, (req, n) in enumerate(zip(reqs, lens)):
            filling = n > 1 or not req.prefilled  # not one decode
            req.kv.num_computed += n
            self.kv.leave_window(req, n)
            if req.kv.num_computed == req.seq_len:  # its next token can be chosen
                done.append(i)
                if filling:
                    with self.endings.alone(req, "caching its prompt"):
                        self.kv.cache_prompt(req)
            elif req.kv.num_computed == req.kv.head_stop:
                heads.append(req)
        done = [i for i in done if reqs[i].output.finish_reason is None]
        tokens = self.tokens.choose(reqs, done, out)
        if done or not out.logits.is_cuda:  # on CUDA the token choice is the sync
            self.cache.l3.observe_forward(rows, time.perf_counter() - started)
        for req in heads:
            with self.endings.alone(req, "moving its L3 head stop"):
                self._head_reached(req)
        self.tokens.record_logprobs(reqs, out, tokens)
        for i, token in tokens.items():
            if reqs[i].output.finish_reason is None:  # reading its logprobs may have failed it
                with self.endings.alone(reqs[i], "detokenising its token"):
                    self._append_token(reqs[i], token)

    def _head_reached(self, req: Request) -> None:
        """The request reached its head stop: it computes on to the next one, waits for its
        tail (`_wait_for_tail`), or, its race over, computes the rest of its prompt."""
        stop = self.cache.l3.continue_head(req.rid, req.kv.num_computed)
        if stop == req.kv.num_computed:
            self._wait_for_tail(req)
        else:
            req.kv.head_stop = stop

    def _wait_for_tail(self, req: Request) -> None:
        """The request computed the head of its L3 hit: its pages go to the tree, and it
        waits at the head of the queue, holding nothing on L1, until the tail its prefetch
        fetches meanwhile has arrived; admitted again, it matches both (`admission.py`)."""
        self.kv.cache_prompt(req)
        self.cache.l3.head_computed(req.rid, req.kv.lease)
        self.kv.retract(req)
        req.kv.head_stop, req.kv.tail_pending = 0, True
        self.running.remove(req)
        self.waiting.insert(0, req)

    def _append_token(self, req: Request, token: int) -> None:
        req.output.ids.append(token)
        self.counters.generated_tokens += 1
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
            if self.observer is not None:
                self.observer("ttft_seconds", req.first_token_at - req.arrival)
        reason = self.text.stop_reason(req, token)
        if reason is not None:
            self.endings.finish(req, reason)
        else:
            self.endings.notify(req, False)
