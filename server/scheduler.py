"""Continuous batching over the KV cache hierarchy, on one thread that owns the cache.

Each step (`step`): drain the inbox, apply the cache's acks, then

    schedule   decode every running request (1 token each), continue chunked prefills,
               admit waiting requests longest-cached-prefix first: storage prefetch
               policy -> match -> load-back from L2 -> lock -> reserve L1 for the rest
    run        the model runner starts the loads and runs the batch
    finish     sample; a request whose prefill just ended has its prompt inserted into the
               tree (it keeps the path locked); finished requests are inserted whole
               (duplicate slots freed, write-through queued) and unlocked

A request that does not fit waits in the queue; nothing ever exits for lack of memory.
Every other thread talks to the scheduler through `submit` / `call` (the inbox).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch

from hicache.hiradix_cache import HiRadixCache
from hicache.radix_cache import RadixCache
from hicache.storage_tier import Resume
from server.inbox import Inbox, SchedulerStopped
from server.model_runner import ModelRunner, sample_row
from server.request import Request
from server.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Waiting requests ranked by cached prefix each step; past this many, first come first served
# (matching every request every step would cost more than it saves; SGLang does the same).
MAX_LPM_SCAN = 128
IDLE_WAIT_S = 0.05     # inbox wait when there is nothing to do
BUSY_POLL_S = 0.002    # inbox wait while prefetches or copies are in flight
# After new requests arrive, the step waits up to this long for their L3 queries (a local
# LMDB answers in microseconds, a Redis on the LAN in a round trip), so a request whose prefix
# storage does not hold is admitted in this step instead of after the next forward pass.
QUERY_SETTLE_S = 0.005
TIERS = ("device", "host", "storage")


class Scheduler:
    def __init__(self, runner: ModelRunner, tree: RadixCache, tokenizer: Tokenizer, *,
                 max_batch_tokens: int, max_running: int) -> None:
        self.runner = runner
        self.tree = tree
        self.pool = runner.kv_pool
        self.tokenizer = tokenizer
        self.page_size = tree.page_size
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.hi = isinstance(tree, HiRadixCache)
        self.storage = tree.storage if self.hi else None
        self.inbox = Inbox()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._commands: list[tuple[Callable[[], Any], Future, bool]] = []
        self.observer: Callable[[str, float], None] | None = None  # latency hook (metrics)
        self.counters = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0,
                         "cached_device": 0, "cached_host": 0, "cached_storage": 0,
                         "request_errors": 0}

    # ------------------------------------------------------------------------- inbox

    def submit(self, req: Request) -> None:
        """Queue a request (any thread); its `on_update` runs on the scheduler thread.
        Raises SchedulerStopped once the loop has died (`fail_all`)."""
        self.inbox.put("req", req)

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
            timeout = BUSY_POLL_S if (self.waiting or self._transfers_pending()) else IDLE_WAIT_S
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
        req.generator = torch.Generator().manual_seed(req.params.seed or 0)
        self.waiting.append(req)
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += req.prompt_len
        with self._alone(req, "starting its storage prefetch"):
            self._start_prefetch(req)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _transfers_pending(self) -> bool:
        return self.hi and (self.tree.controller.has_pending() or bool(self.storage and (
            self.storage.ops or self.storage._backups)))

    # ---------------------------------------------------------------------------- loop

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.step()

    def step(self) -> None:
        if self._drain_inbox() and self.storage is not None:
            self.storage.settle(QUERY_SETTLE_S)
        self._cache_checks()
        self._run_commands()
        plan = self._schedule()
        if plan:
            self._run_batch(*plan)
        elif self.hi and self.tree.controller.has_pending():
            self.tree.controller.start_loading()  # loads never wait for a forward pass

    def _cache_checks(self) -> None:
        if self.hi:
            self.tree.writing_check()
            self.tree.loading_check()
            if self.storage is not None:
                self.storage.check()
                if self._restart_prefetches():  # their queries may answer in this step too
                    self.storage.settle(QUERY_SETTLE_S)
                    self.storage.check()

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
        reqs, lens, budget = [], [], self.max_batch_tokens
        for req in self.running:
            n = 1 if req.prefilled else min(req.prompt_len - req.num_computed, budget)
            if n > 0 and budget > 0:
                reqs.append(req)
                lens.append(n)
                budget -= n
        if not any(when_idle for _, _, when_idle in self._commands):
            for req in self._admission_order():
                if budget <= 0 or len(self.running) >= self.max_running:
                    break
                if self._try_admit(req):
                    n = min(req.prompt_len - req.num_computed, budget)
                    reqs.append(req)
                    lens.append(n)
                    budget -= n
        for req, n in zip(reqs, lens):
            self._ensure_slots(req, req.num_computed + n)
        return (reqs, lens) if reqs else None

    def _admission_order(self) -> list[Request]:
        if len(self.waiting) > MAX_LPM_SCAN:
            return list(self.waiting)
        def hit(req: Request) -> int:
            return self.tree.peek_prefix(self._cache_key(req), req.extra_key)
        return sorted(self.waiting, key=hit, reverse=True)  # stable: FCFS among equals

    def _cache_key(self, req: Request) -> list[int]:
        return req.input_ids[:-1]  # at least one prompt token is computed, for its logits

    def _start_prefetch(self, req: Request, resume: Resume | None = None) -> None:
        if self.storage is None:
            return
        key = self._cache_key(req)
        m = self.tree.match_prefix(key, req.extra_key)
        hit = m.device_indices.numel() + m.host_hit_length
        req.prefetch_started = self.storage.prefetch(req.rid, m.last_host_node, key[hit:],
                                                     req.extra_key, resume)

    def _restart_prefetches(self) -> bool:
        """Prefetches whose prefix reached the tree meanwhile (another prefetch brought it):
        match again and fetch only the rest. Whether any was restarted."""
        restarts = self.storage.take_restarts()
        if not restarts:
            return False
        waiting = {req.rid: req for req in self.waiting}
        for rid in restarts:
            resume = self.storage.restart(rid)
            if resume is not None and rid in waiting:
                with self._alone(waiting[rid], "restarting its storage prefetch"):
                    self._start_prefetch(waiting[rid], resume)
        return True

    def _try_admit(self, req: Request) -> bool:
        """`_admit`, with a failure failing `req` alone (its lock released by `_admit`)."""
        admitted = False
        with self._alone(req, "admission"):
            admitted = self._admit(req)
        return admitted

    def _admit(self, req: Request) -> bool:
        """Match, load back, lock and reserve L1 for `req`; False leaves it waiting."""
        if self.storage is not None and not self.storage.ready(req.rid):
            return False
        if self.storage is not None:  # kept on the request: this admission may still fail
            req.from_storage += self.storage.terminate(req.rid)
        m = self.tree.match_prefix(self._cache_key(req), req.extra_key)
        host_hit = m.host_hit_length if self.hi else 0
        last = m.last_device_node
        # Room first, loads second: a load queued for a request that then cannot be admitted
        # would hold its slots locked with no forward pass to launch it.
        self.tree.inc_lock_ref(last)
        try:
            need = self._pages_up(req.prompt_len - m.device_indices.numel() - host_hit
                                  + req.params.max_new_tokens)
            if not self._reserve_keeping(m, need + host_hit):
                self.tree.dec_lock_ref(last)
                return False
            prefix, loaded = m.device_indices, 0
            if host_hit:
                lb = self.tree.init_load_back(m.last_host_node)
                if lb.device_indices.numel():
                    prefix = torch.cat([prefix, lb.device_indices])
                    loaded = lb.device_indices.numel()
                    self.tree.inc_lock_ref(lb.last_node)
                    self.tree.dec_lock_ref(last)
                    last = lb.last_node
            need = self._pages_up(req.prompt_len - len(prefix) + req.params.max_new_tokens)
            if not self._reserve(need):  # cannot happen: the room was checked above
                self.tree.dec_lock_ref(last)
                return False
        except BaseException:
            self.tree.dec_lock_ref(last)  # the request never ran: nothing else to undo
            raise
        req.kv_slots, req.last_node, req.reserved = prefix, last, need
        req.num_computed = req.cached_len = len(prefix)
        storage = min(req.from_storage, loaded)
        req.cached_details = {"device": m.device_indices.numel(), "host": loaded - storage,
                              "storage": storage}
        for tier, n in req.cached_details.items():
            self.counters[f"cached_{tier}"] += n
        self.waiting.remove(req)
        self.running.append(req)
        return True

    def _reserve_keeping(self, m: Any, need: int) -> bool:
        """`_reserve(need)` while the match's L2 pages are kept from eviction."""
        if not m.host_hit_length:
            return self._reserve(need)
        self.tree.protect_host(m.last_host_node)
        try:
            return self._reserve(need)
        finally:
            self.tree.release_host(m.last_host_node)

    def _pages_up(self, tokens: int) -> int:
        return -(-tokens // self.page_size) * self.page_size

    def _reserve(self, need: int) -> bool:
        """Whether L1 can promise `need` more tokens, evicting unlocked pages if needed."""
        outstanding = sum(r.reserved for r in self.running)
        short = need - (self.pool.available_size() - outstanding)
        if short > 0:
            self.tree.evict(short)
            short = need - (self.pool.available_size() - outstanding)
        return short <= 0

    def _ensure_slots(self, req: Request, upto: int) -> None:
        missing = self._pages_up(upto - len(req.kv_slots))
        if missing <= 0:
            return
        slots = self.pool.alloc(missing)  # reserved at admission, so this cannot fail
        assert slots is not None, "L1 reservation broken"
        req.reserved -= missing
        req.kv_slots = torch.cat([req.kv_slots, slots])

    # ----------------------------------------------------------------------------- run

    def _run_batch(self, reqs: list[Request], lens: list[int]) -> None:
        try:
            logits = self.runner.forward(reqs, lens)
        except Exception as exc:  # noqa: BLE001 - a failed forward fails its requests only
            for req in reqs:
                self._fail_request(req, "the forward pass", exc)
            return
        done = []
        for i, (req, n) in enumerate(zip(reqs, lens)):
            was_prefilled = req.prefilled
            req.num_computed += n
            if req.prefilled:
                done.append(i)
                if not was_prefilled:
                    with self._alone(req, "caching its prompt"):
                        self._cache_prompt(req)
        done = [i for i in done if reqs[i].finish_reason is None]
        greedy = logits[done].argmax(dim=-1).tolist() if done else []  # one sync for all
        for i, token in zip(done, greedy):
            req = reqs[i]
            with self._alone(req, "sampling or detokenising its token"):
                if not req.params.greedy:
                    token = sample_row(logits[i], req.params, req.generator)
                self._append_token(req, token)

    def _append_token(self, req: Request, token: int) -> None:
        req.output_ids.append(token)
        self.counters["generated_tokens"] += 1
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
            if self.observer is not None:
                self.observer("ttft_seconds", req.first_token_at - req.arrival)
        reason = self._stop_reason(req, token)
        if reason is not None:
            self._finish(req, reason)
        elif req.on_update is not None:
            req.text = self.tokenizer.decode(req.output_ids)
            self._notify(req, False)

    def _stop_reason(self, req: Request, token: int) -> str | None:
        """"stop" (EOS or a stop string, `req.text` cut before it), "length", or None."""
        p = req.params
        if not p.ignore_eos and token in self.tokenizer.eos_token_ids:
            req.text = self.tokenizer.decode(req.output_ids[:-1])  # EOS is not text
            return "stop"
        if p.stop:
            req.text = self.tokenizer.decode(req.output_ids)
            cuts = [i for i in (req.text.find(s) for s in p.stop) if i >= 0]
            if cuts:
                req.text = req.text[:min(cuts)]
                return "stop"
        if len(req.output_ids) >= p.max_new_tokens:
            req.text = self.tokenizer.decode(req.output_ids)
            return "length"
        return None

    @contextmanager
    def _alone(self, req: Request, stage: str) -> Iterator[None]:
        """Serve `req` in the block; an exception there fails `req` alone (`_fail_request`)
        and the scheduler goes on with the others."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - fails this request only
            self._fail_request(req, stage, exc)

    def _fail_request(self, req: Request, stage: str, exc: Exception) -> None:
        """Fail `req` alone after an exception while serving it (logged with its traceback,
        counted in `request_errors`); its KV goes back to the pool, never into the tree."""
        logger.error("request %s failed in %s; the others go on", req.rid, stage,
                     exc_info=exc)
        self.counters["request_errors"] += 1
        req.error = f"the server failed in {stage}: {type(exc).__name__}: {exc}"
        if self.storage is not None and req in self.waiting:
            try:
                self.storage.terminate(req.rid)  # idempotent: a prefetch ends once
            except Exception:
                logger.exception("request %s: ending its storage prefetch failed", req.rid)
        if req in self.running or req in self.waiting:  # not finished (or half) already
            self._finish(req, "error", keep_cache=False)

    def _finish(self, req: Request, reason: str, keep_cache: bool = True) -> None:
        """Release the request's KV and lock, take it off the queues, tell its client. The
        last two happen even when the release raises (the request then reports an error and
        the exception goes on to the caller): a request is never left half finished."""
        req.finish_reason = reason
        try:
            self._release(req, keep_cache)
        except BaseException as exc:
            req.finish_reason = "error"
            req.error = req.error or f"the server failed releasing its cache: {exc!r}"
            raise
        finally:
            if req.finish_reason == "error":
                try:
                    req.text = self.tokenizer.decode(req.output_ids)
                except Exception:
                    logger.warning("request %s: its output cannot be decoded", req.rid,
                                   exc_info=True)
                    req.text = ""
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            self._notify(req, True)

    def _notify(self, req: Request, done: bool) -> None:
        """Run the request's callback; a callback that raises (its client went away) aborts
        that request, never the scheduler."""
        if req.on_update is None:
            return
        try:
            req.on_update(req, done)
        except Exception:
            logger.warning("dropping request %s: its result callback failed", req.rid,
                           exc_info=True)
            req.on_update = None
            if not done:
                self._finish(req, "abort")

    def abort(self, rid: str) -> bool:
        """Finish a waiting or running request now (its client left); False if unknown."""
        for req in (*self.waiting, *self.running):
            if req.rid == rid:
                if self.storage is not None:
                    self.storage.terminate(rid)
                self._finish(req, "abort")
                return True
        return False

    def fail_all(self, message: str) -> None:
        """After the loop died: finish every request and command with `message`, touching
        neither the tree nor the pools (their state is unknown). Any thread, once `run` has
        returned; never raises. From here on submit / call fail at once."""
        queued = self.inbox.close(message)
        arrived = [payload for kind, payload in queued if kind == "req"]
        for req in (*self.waiting, *self.running, *arrived):
            req.error, req.finish_reason = message, "error"
            try:
                if req.on_update is not None:
                    req.on_update(req, True)
            except Exception:  # noqa: BLE001 - its client is gone; tell the others
                logger.debug("request %s: callback failed after the scheduler died", req.rid)
        self.waiting, self.running = [], []
        pending = [payload for kind, payload in queued if kind == "cmd"]
        for _, fut, _ in (*self._commands, *pending):
            if not fut.done():
                fut.set_exception(SchedulerStopped(message))
        self._commands = []

    def quiesce(self) -> None:
        """Wait for every copy and backup in flight and apply their acks (flush, shutdown)."""
        if self.hi:  # copies first: their acks queue backups, which protect host pages
            self.tree.controller.wait_all()
            self.tree.writing_check()
            self.tree.loading_check()
            if self.storage is not None:
                self.storage.wait_idle()

    def _cache_prompt(self, req: Request) -> None:
        """Give the prompt's KV to the tree as soon as its prefill is done, not when the
        request finishes: requests sharing the prompt hit it in L1 while this one decodes,
        and its pages start down to L2 and L3 (where another server may look for them)
        before the answer is out. The request keeps the path locked and reads the tree's
        slots from here on (where the tree already had some, its own copies are freed)."""
        aligned = req.num_computed // self.page_size * self.page_size
        if self.tree.disable or aligned <= req.cached_len:
            return
        tokens = self._insert_into_tree(req, aligned, count_hit=False)  # `_release` counts
        path = self.tree.peek_path(tokens, req.extra_key)  # no second hit for the policies
        slots = torch.cat([node.value for node in path])
        assert slots.numel() == aligned, "an inserted key is whole nodes on the device"
        self.tree.inc_lock_ref(path[-1])
        self.tree.dec_lock_ref(req.last_node)
        req.kv_slots = torch.cat([slots, req.kv_slots[aligned:]])
        req.last_node, req.cached_len = path[-1], aligned

    def _insert_into_tree(self, req: Request, aligned: int, count_hit: bool = True
                          ) -> list[int]:
        """Insert the request's first `aligned` tokens with its slots; the request's copies
        of pages the tree already held (beyond those it shares, `cached_len`) are freed.
        Returns the tokens inserted."""
        tokens = req.all_ids[:aligned]
        present = self.tree.insert(tokens, req.kv_slots[:aligned], req.extra_key,
                                   count_hit=count_hit)
        if present > req.cached_len:  # the tree had these pages: ours are duplicates
            self.pool.free(req.kv_slots[req.cached_len:present])
        return tokens

    def _release(self, req: Request, keep_cache: bool) -> None:
        """Give the request's KV to the tree (keep_cache) or back to the pool; unlock."""
        if req.last_node is None:
            return
        aligned = req.num_computed // self.page_size * self.page_size if keep_cache else 0
        if aligned > req.cached_tokens:  # pages new since admission, maybe cached at prefill:
            self._insert_into_tree(req, aligned)  # (again): one use, and a fresh access time
        rest = req.kv_slots[max(aligned, req.cached_len):]  # never the tree's
        if rest.numel():
            self.pool.free(rest)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node, req.reserved = None, 0
        req.kv_slots = req.kv_slots[:0]

    # --------------------------------------------------------------------------- admin

    def flush(self, tiers: tuple[str, ...]) -> dict[str, int]:
        """Empty the named tiers (scheduler thread, no request running). Tokens freed."""
        out = dict.fromkeys(tiers, 0)
        self.quiesce()
        if "device" in tiers:
            out["device"] = self.tree.evict(self.tree.total_size())
        if "host" in tiers and self.hi:
            out["host"] = self.tree.flush_host()
        if "storage" in tiers and self.storage is not None:
            out["storage"] = self.storage.clear() * self.page_size
        return out
