"""Engine: the model, the cache tiers and the scheduler thread behind one object.

    engine = Engine.from_cli(["--enable-hierarchical-cache"])
    out = engine.generate("Hello", sampling_params={"temperature": 0, "max_new_tokens": 8})
    outs = engine.generate("Hello", sampling_params={"n": 4, "seed": 1}, return_logprob=True)
    engine.flush_cache(["device", "host"]); engine.stats(); engine.shutdown()

Threading: any thread may call the public methods; they hand work to the scheduler thread
(which alone touches the tree and the pools) and wait for its answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import Any

from hicache.build import build_stack
from hicache.config import (
    Config,
)
from hicache.model_kv import ModelKV
from hicache.policies import TIERS
from hicache.stack import CacheStack, PinRefused
from hicache.stats import CacheStats
from server.inbox import SchedulerStopped
from server.model_runner import ModelRunner
from server.models.loader import load_model
from server.request import (
    MAX_TOP_LOGPROBS,
    InvalidRequest,
    Request,
    SamplingParams,
    check_priority,
    check_session_id,
    check_unicode,
)
from server.scheduler import Scheduler
from server.storage_attach import StorageAttachment
from server.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

# Tokens computed per forward step (prefill chunks + decodes): bounds step latency, so decodes
# keep flowing while a long prompt is prefilled in chunks (SGLang's chunked_prefill_size).
MAX_BATCH_TOKENS = 2048
MAX_RUNNING_REQUESTS = 64
DRAIN_POLL_S = 0.02
# The longest TTL a pin may ask for: a week. A pin is a lease to renew, not a setting.
MAX_PIN_TTL_S = 7 * 24 * 3600.0


class EngineClosed(RuntimeError):
    """The engine is shutting down and takes no new requests (HTTP 503)."""


def _choice(first: Request, index: int) -> Request:
    """Choice `index` >= 1 of `first`'s request: the same prompt and options, seed
    `seed + index` when seeded, waiting for `first`'s prompt (`Scheduler._held`)."""
    p = first.params
    params = p if p.seed is None else dataclasses.replace(p, seed=p.seed + index)
    return Request(list(first.input_ids), params, first.extra_key, prompt_leader=first,
                   priority=first.priority, session_id=first.session_id,
                   return_logprob=first.return_logprob,
                   logprob_start_len=first.logprob_start_len,
                   top_logprobs_num=first.top_logprobs_num,
                   return_text_in_logprobs=first.return_text_in_logprobs)


def _flag(name: str, value: object) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(f"`{name}` must be a boolean, got {value!r:.40}")
    return value


def _integer(name: str, value: object, default: int) -> int:
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequest(f"`{name}` must be an integer, got {value!r:.40}")
    return value


def _logprob_options(return_logprob: object, logprob_start_len: object,
                     top_logprobs_num: object, return_text_in_logprobs: object
                     ) -> dict[str, Any]:
    """The logprob options checked (None = the default, as a JSON null means);
    `logprob_start_len` against the prompt by `_check_logprob_start`."""
    start = _integer("logprob_start_len", logprob_start_len, -1)
    top = _integer("top_logprobs_num", top_logprobs_num, 0)
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"`top_logprobs_num` must be in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {top}")
    return {"return_logprob": _flag("return_logprob", return_logprob),
            "logprob_start_len": start, "top_logprobs_num": top,
            "return_text_in_logprobs": _flag("return_text_in_logprobs",
                                             return_text_in_logprobs)}


def _check_logprob_start(start: int, prompt_len: int) -> None:
    if not (start == -1 or 0 <= start < prompt_len):
        raise InvalidRequest(f"`logprob_start_len` must be -1 (no prompt logprobs) or a "
                             f"position of the {prompt_len}-token prompt, in "
                             f"[0, {prompt_len - 1}]; got {start}")


def _pin_ttl(ttl: object) -> float:
    if isinstance(ttl, int) and not isinstance(ttl, bool) and ttl > MAX_PIN_TTL_S:
        ttl = float("inf")  # a huge integer: out of range below, never an OverflowError
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or math.isnan(ttl):
        raise InvalidRequest(f"`ttl_seconds` must be a number of seconds, got {ttl!r:.40}")
    if not 0 < ttl <= MAX_PIN_TTL_S:
        raise InvalidRequest(f"`ttl_seconds` must be in (0, {MAX_PIN_TTL_S:g}] (a week at "
                             f"most: renew a pin by pinning again), got {ttl}")
    return float(ttl)


def in_passing_thread(fn: Callable[[], None]) -> None:
    """Run `fn` on a thread that exits when it returns (its exception re-raised here).

    The engine's heavy torch work at start (loading weights, zeroing the pools) runs there,
    not on the caller's thread: an OpenMP thread pool lives as long as the thread that
    started it, and with one more pool alive than the scheduler thread's, libgomp counts
    more threads than cores and stops spinning between parallel regions (its throttled
    spin count), so every op of a forward pass waits for its workers to wake: a decode
    step at batch 8 took 25 ms instead of 18.6 ms on 2 cores."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=run, name="hicache-init")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


class Engine:
    def __init__(self, config: Config) -> None:
        self.config = config
        in_passing_thread(self._start_up)
        self._accepting = True
        self._cache_closed = False
        self._stop = threading.Event()
        # Called (on the dying thread) with the exception if the scheduler loop ever dies:
        # `hicache-server` exits non-zero then, so that a supervisor restarts it.
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.fatal_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run_scheduler, name="hicache-scheduler",
                                        daemon=True)
        self._thread.start()

    def _run_scheduler(self) -> None:
        """The scheduler loop. Per-request faults never reach here (the scheduler fails that
        request alone); an exception that does is a broken invariant: it is logged with its
        traceback, every pending request and call fails with it, and `on_fatal` runs."""
        try:
            self.scheduler.run(self._stop)
        except BaseException as exc:
            self.fatal_error = exc
            logger.critical("the scheduler thread died; the engine serves nothing more",
                            exc_info=exc)
            self.scheduler.fail_all(f"the server's scheduler stopped "
                                    f"({type(exc).__name__}: {exc}); retry on a restarted "
                                    "server")
            if self.on_fatal is not None:
                self.on_fatal(exc)

    def _start_up(self) -> None:
        """The model, the cache's tiers and the scheduler (on the passing thread)."""
        self._init_model()
        self.cache: CacheStack = build_stack(self.config, self._model_kv())
        runner = ModelRunner(self.loaded.model, self.cache)
        self._storage = StorageAttachment(self)
        self.scheduler = Scheduler(runner, self.cache, self.tokenizer,
                                   max_batch_tokens=MAX_BATCH_TOKENS,
                                   max_running=MAX_RUNNING_REQUESTS,
                                   schedule_policy=self.config.server.schedule_policy)

    def _init_model(self) -> None:
        m = self.config.model
        self.loaded = load_model(m.path, m.dtype, m.device)
        self.tokenizer = load_tokenizer(self.loaded.path)
        self.context_len = self.loaded.config.max_position_embeddings
        self.vocab_size = self.loaded.config.vocab_size

    @classmethod
    def from_cli(cls, argv: list[str]) -> Engine:
        """Build from the same flags as `hicache-server` (a bad one raises SystemExit(2))."""
        from server.args import parse_config

        config, _ = parse_config(argv)
        return cls(config)

    # -------------------------------------------------------------------------- generate

    def make_request(self, text: str | None = None, input_ids: list[int] | None = None,
                     sampling_params: dict | None = None, extra_key: str | None = None, *,
                     return_logprob: bool = False, logprob_start_len: int = -1,
                     top_logprobs_num: int = 0, return_text_in_logprobs: bool = False,
                     priority: int | None = None, session_id: str | None = None) -> Request:
        """Validate a one-choice generation request; raises InvalidRequest with what was
        wrong (for `sampling_params.n` > 1, `make_requests` gives the n choices). The logprob
        options are SGLang's (`Request`); the results land in `meta_info`. `priority`
        (SGLang's; None = 0): higher keeps its prefix cached longer under the `priority`
        eviction policy. `session_id` (SGLang's): with `cache.session_retention`, the
        session owns the nodes the request uses (evicted after unowned ones)."""
        req = self._build(text, input_ids, sampling_params, extra_key, _logprob_options(
            return_logprob, logprob_start_len, top_logprobs_num, return_text_in_logprobs),
            priority, session_id)
        if req.params.n > 1:
            raise InvalidRequest(f"sampling_params.n = {req.params.n}: several choices are "
                                 "made by make_requests (or generate), not make_request")
        return req

    def _build(self, text: str | None, input_ids: list[int] | None,
               sampling_params: dict | None, extra_key: str | None,
               options: dict[str, Any], priority: int | None = None,
               session_id: str | None = None) -> Request:
        if (text is None) == (input_ids is None):
            raise InvalidRequest("give exactly one of `text` or `input_ids`")
        if text is not None:
            if not isinstance(text, str):
                raise InvalidRequest(f"`text` must be a string, got {type(text).__name__}")
            check_unicode("text", text)
            input_ids = self.tokenizer.encode(text)
        ids = self._check_ids(input_ids)
        params = self._check_params(SamplingParams.from_dict(sampling_params), len(ids))
        if extra_key is not None and not isinstance(extra_key, str):
            raise InvalidRequest("`extra_key` must be a string")
        if extra_key is not None:
            check_unicode("extra_key", extra_key)
        _check_logprob_start(options["logprob_start_len"], len(ids))
        return Request(ids, params, extra_key, priority=check_priority(priority),
                       session_id=check_session_id(session_id), **options)

    def make_requests(self, text: str | None = None, input_ids: list[int] | None = None,
                      sampling_params: dict | None = None, extra_key: str | None = None, *,
                      return_logprob: bool = False, logprob_start_len: int = -1,
                      top_logprobs_num: int = 0, return_text_in_logprobs: bool = False,
                      priority: int | None = None, session_id: str | None = None
                      ) -> list[Request]:
        """`make_request`, as its `sampling_params.n` choices (one for n = 1). Choice i has
        seed `seed + i` when seeded; choices 1.. wait in the scheduler until choice 0 has
        prefilled the prompt, then read it from the tree (one prefill for all). Submit
        choice 0 first (`generate` and `async_generate` do); the others never wait for a
        choice 0 that was not submitted, they only share nothing then."""
        first = self._build(text, input_ids, sampling_params, extra_key, _logprob_options(
            return_logprob, logprob_start_len, top_logprobs_num, return_text_in_logprobs),
            priority, session_id)
        return [first, *(_choice(first, i) for i in range(1, first.params.n))]

    def _check_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """`params` checked against this model (vocabulary, context, L1 size, tokenizer)."""
        params.check_vocab(self.vocab_size)
        for stop in params.stop:
            check_unicode("sampling_params.stop", stop)
        room = self.context_len - prompt_len
        if params.max_new_tokens > room:  # as OpenAI servers do: cut to the context
            params = dataclasses.replace(params, max_new_tokens=room,
                                         min_new_tokens=min(params.min_new_tokens, room))
        need = prompt_len + params.max_new_tokens
        total = self.cache.device_pool.allocator.total_size()
        if need > total:
            raise InvalidRequest(f"prompt + max_new_tokens = {need} tokens exceed the L1 KV "
                                 f"cache ({total} tokens); lower max_new_tokens or raise "
                                 "--max-total-tokens")
        return params

    def _check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequest("`input_ids` must be a list of integers")
        if not ids:
            raise InvalidRequest("the prompt is empty")
        if len(ids) >= self.context_len:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens; the model's context is "
                                 f"{self.context_len} (one token must be left to generate)")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        return ids

    def generate(self, text: str | None = None, input_ids: list[int] | None = None,
                 sampling_params: dict | None = None, extra_key: str | None = None, *,
                 return_logprob: bool = False, logprob_start_len: int = -1,
                 top_logprobs_num: int = 0, return_text_in_logprobs: bool = False,
                 priority: int | None = None, session_id: str | None = None
                 ) -> dict | list[dict]:
        """The result; a list of n results for `sampling_params.n` > 1 (`make_requests`)."""
        reqs = self.make_requests(text, input_ids, sampling_params, extra_key,
                                  return_logprob=return_logprob,
                                  logprob_start_len=logprob_start_len,
                                  top_logprobs_num=top_logprobs_num,
                                  return_text_in_logprobs=return_text_in_logprobs,
                                  priority=priority, session_id=session_id)
        futures = [self._submit_for_result(req) for req in reqs]  # choice 0 first
        results = [fut.result() for fut in futures]
        return results if len(reqs) > 1 else results[0]

    def _submit_for_result(self, req: Request) -> Future:
        fut: Future = Future()
        req.on_update = lambda r, done: done and fut.set_result(r.result())
        self._submit(req)
        return fut

    async def async_generate(self, text: str | None = None,
                             input_ids: list[int] | None = None,
                             sampling_params: dict | None = None,
                             extra_key: str | None = None, *,
                             return_logprob: bool = False, logprob_start_len: int = -1,
                             top_logprobs_num: int = 0, return_text_in_logprobs: bool = False,
                             priority: int | None = None, session_id: str | None = None
                             ) -> dict | list[dict]:
        """`generate` on an event loop: the same arguments and results."""
        reqs = self.make_requests(text, input_ids, sampling_params, extra_key,
                                  return_logprob=return_logprob,
                                  logprob_start_len=logprob_start_len,
                                  top_logprobs_num=top_logprobs_num,
                                  return_text_in_logprobs=return_text_in_logprobs,
                                  priority=priority, session_id=session_id)
        # gather starts the streams in order: choice 0 is submitted first
        results = await asyncio.gather(*(self._final(self.stream(req)) for req in reqs))
        return results if len(reqs) > 1 else results[0]

    @staticmethod
    async def _final(results: AsyncIterator[dict]) -> dict:
        result: dict = {}
        async for chunk in results:
            result = chunk
        return result

    async def stream(self, req: Request) -> AsyncIterator[dict]:
        """Yield the request's result after every new token; the last one is final."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[tuple[dict, bool]] = asyncio.Queue()
        req.on_update = lambda r, done: loop.call_soon_threadsafe(
            updates.put_nowait, (r.result(), done))  # raises once the loop has closed
        self._submit(req)
        done = False
        try:
            while not done:
                result, done = await updates.get()
                yield result
        finally:
            if not done:  # the consumer stopped listening: stop generating for it
                self.abort(req.rid)

    def abort(self, rid: str) -> None:
        """Stop a request whose client went away (no wait; unknown ids are ignored)."""
        if self._thread.is_alive():
            self.scheduler.call(lambda: self.scheduler.abort(rid))

    def alive(self) -> bool:
        """Whether the scheduler thread is running (health checks watch this)."""
        return self._thread.is_alive() and not self._stop.is_set() and self.fatal_error is None

    def _submit(self, req: Request) -> None:
        if not self._accepting:
            raise EngineClosed("the server is shutting down")
        try:
            self.scheduler.submit(req)
        except SchedulerStopped as e:
            raise EngineClosed(str(e)) from None

    # ----------------------------------------------------------------------------- admin

    def flush_cache(self, tiers: Sequence[str] = TIERS, *, unpin: bool = False) -> dict:
        """Empty the named tiers once in-flight requests and copies finish; tokens freed.
        Pinned pages stay (on L1 without L2; with L2 a device flush moves them to L2, and
        a host flush keeps them) unless `unpin`, which releases every pin first."""
        tiers = tuple(tiers)
        bad = [t for t in tiers if t not in TIERS]
        if bad:
            raise InvalidRequest(f"unknown tier(s) {', '.join(map(str, bad))}; "
                                 f"allowed: {', '.join(TIERS)}")

        def flush() -> dict:
            if unpin:
                self.cache.unpin_all()
            return self.cache.flush(tiers)

        return self._call(flush, when_idle=True)

    # ------------------------------------------------------------------------------ pins

    def pin(self, text: str | None = None, input_ids: list[int] | None = None,
            extra_key: str | None = None, *, ttl_seconds: float) -> dict:
        """Keep a prefix cached for `ttl_seconds` (POST /admin/pin): its whole pages are
        computed first if not cached (a one-token generate), then pinned: evicted from L1
        after everything else (demoted to L2, never deleted), kept in L2. Pinning the same
        prefix again renews its TTL. InvalidRequest when the pins would pass
        `cache.max_pinned_tokens` (saying how much is pinned and the cap). Returns
        `{"success", "pinned_tokens", "expires_in_s", "total_pinned_tokens",
        "max_pinned_tokens"}`."""
        if not self.cache.enabled:
            raise InvalidRequest("pins need the radix cache, which this server was started "
                                 "without: restart it without --disable-radix-cache")
        ids, extra_key = self._pin_prefix(text, input_ids, extra_key)
        ttl = _pin_ttl(ttl_seconds)
        if len(ids) > self.cache.max_pinned_tokens:
            raise InvalidRequest(f"pinning {len(ids)} tokens exceeds the cap "
                                 f"(cache.max_pinned_tokens) of {self.cache.max_pinned_tokens}")
        for _ in range(2):  # once more if a busy L1 evicted it before it was pinned
            self.generate(input_ids=ids, extra_key=extra_key,
                          sampling_params={"max_new_tokens": 1, "temperature": 0})
            done = self._call(lambda: self._pin_now(ids, extra_key, ttl))
            if done is not None:
                return done
        raise InvalidRequest("the prefix was evicted before it could be pinned twice in a "
                             "row (the cache is under heavy pressure); retry later")

    def _pin_now(self, ids: list[int], extra_key: str | None, ttl: float) -> dict | None:
        """Scheduler thread: pin the cached path spelling `ids` (None: not cached)."""
        try:
            if not self.cache.pin(ids, extra_key, ttl, time.monotonic()):
                return None
        except PinRefused as e:
            raise InvalidRequest(str(e)) from None
        return {"success": True, "pinned_tokens": len(ids), "expires_in_s": ttl,
                "total_pinned_tokens": self.cache.pinned_tokens(),
                "max_pinned_tokens": self.cache.max_pinned_tokens}

    def unpin(self, text: str | None = None, input_ids: list[int] | None = None,
              extra_key: str | None = None) -> bool:
        """Release the pin of a prefix (as `pin` was given it); False when none."""
        ids, extra_key = self._pin_prefix(text, input_ids, extra_key)
        return self._call(lambda: self.cache.unpin(ids, extra_key))

    def _pin_prefix(self, text: str | None, input_ids: list[int] | None,
                    extra_key: str | None) -> tuple[list[int], str | None]:
        """The prefix's whole pages and its namespace, checked like a prompt's."""
        req = self._build(text, input_ids, {"max_new_tokens": 1}, extra_key,
                          _logprob_options(None, None, None, None))
        page = self.config.cache.page_size
        ids = req.input_ids[:len(req.input_ids) // page * page]
        if not ids:
            raise InvalidRequest(f"the prefix has {len(req.input_ids)} tokens; a pin holds "
                                 f"whole pages of {page} tokens")
        return ids, req.extra_key

    def close_session(self, session_id: str) -> bool:
        """Close a session (SGLang's POST /close_session): the nodes it owned go back to
        their policy's place among the unowned ones. False when no such session is open
        (never opened, closed, timed out, or `cache.session_retention` is off)."""
        session_id = check_session_id(session_id)
        if session_id is None:
            raise InvalidRequest("`session_id` is required: the session to close")
        return self._call(lambda: self.cache.close_session(session_id))

    def cache_stats(self) -> CacheStats:
        """One typed snapshot of the tiers, the request counters and the live sessions
        (`hicache.stats`)."""
        return self._call(lambda: self.cache.stats(self.scheduler.counters))

    def stats(self) -> dict:
        """`cache_stats()` as plain data: `{"tiers": {tier: {...}}, "counters": {...}}`."""
        return self.cache_stats().as_dict()

    def load(self) -> dict[str, int]:
        """SGLang's load report (`GET /get_load`), read between scheduler steps: requests
        running and waiting, and `num_tokens`, every token of the running ones (prompt and
        output so far) plus the waiting prompts: the KV the server holds or will, which
        sglang-router's load-based policies compare between workers."""
        def now() -> dict[str, int]:
            sched = self.scheduler
            return {"dp_rank": 0, "num_reqs": len(sched.running),
                    "num_waiting_reqs": len(sched.waiting),
                    "num_tokens": sum(r.seq_len for r in sched.running)
                    + sum(r.prompt_len for r in sched.waiting)}
        return self._call(now)

    # ------------------------------------------------------------ L3 attach / detach
    # Each runs on the scheduler thread between steps and only when no request runs or
    # waits: a busy engine refuses at once (StorageChangeRefused) rather than holding the
    # caller until traffic stops, as SGLang does. `self.config` is then replaced (never
    # mutated), there alone; other threads read whichever whole Config they find.

    def attach_storage(self, backend: str, extra_config: dict | str | None = None, *,
                       prefetch_policy: str | None = None, write_policy: str | None = None
                       ) -> dict:
        """Attach L3 (`backend`: lmdb, redis or lmdb+redis) to a running engine with L2.
        `extra_config` (an object, or its JSON text) is merged into the backend's section
        of the launch config (YAML and flags) exactly as
        `--hicache-storage-backend-extra-config` is; `prefetch_policy` sets
        `storage.prefetch_policy`; `write_policy` may only repeat `host.write_policy`
        (fixed at start). Attaching the backend already attached with the same section
        only updates the prefetch policy when one is given (SGLang's answer); any other
        attach while one is attached is refused. A store that cannot be opened, or does
        not answer, is refused too and the engine goes on without L3. Returns
        `{"success", "message"}` and `storage_backend()`'s fields, after the change."""
        return self._call(lambda: self._storage.attach(backend, extra_config,
                                                       prefetch_policy, write_policy))

    def detach_storage(self) -> dict:
        """Detach L3: in-flight backups land first, the store is closed (its pages stay in
        it), the tree forgets what it held; `config.storage` is the launch one again, with
        backend "none". With none attached, nothing changes (success, as SGLang answers).
        Returns what `attach_storage` does."""
        return self._call(self._storage.detach)

    def storage_backend(self) -> dict:
        """SGLang's `GET /hicache/storage-backend` fields: `hicache_storage_backend` (None
        without L3), `hicache_storage_backend_extra_config` (the backend's section as JSON
        text; the Redis password redacted), `hicache_storage_prefetch_policy`,
        `hicache_write_policy` (None without L2); and `backend_config`, that section as an
        object."""
        return self._call(self._storage.view)

    def _model_kv(self) -> ModelKV:
        mc = self.loaded.config
        return ModelKV(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                       self.loaded.dtype, self.loaded.device, self.loaded.path)

    def _call(self, fn, when_idle: bool = False):
        """Run `fn` on the scheduler thread and wait for its result (EngineClosed once the
        engine has shut down or its scheduler died, even while this call waited)."""
        if self._stop.is_set() or not self._thread.is_alive() or self.fatal_error is not None:
            raise EngineClosed("the engine has shut down")
        try:
            return self.scheduler.call(fn, when_idle=when_idle).result()
        except SchedulerStopped as e:
            raise EngineClosed(str(e)) from None

    # -------------------------------------------------------------------------- shutdown

    def shutdown(self, drain: bool = True) -> None:
        """Stop taking requests, let running ones finish (`drain`), write pending backups,
        close the storage tier. Idempotent."""
        if self.fatal_error is not None or not self._thread.is_alive():
            self._close_after_death()
            return
        self._accepting = False
        try:
            while drain and self._call(self.scheduler.num_unfinished):
                self._stop.wait(DRAIN_POLL_S)
            self._call(self.cache.quiesce)  # pending backups reach L3
        except EngineClosed:  # the scheduler died while draining
            self._close_after_death()
            return
        self._stop.set()
        self._thread.join()
        self._close_cache_once()

    def _close_after_death(self) -> None:
        """After the scheduler died: let the tiers go (their I/O threads, the backends), but
        a failure there, on a tree in an unknown state, is only logged."""
        if self.fatal_error is None:
            return
        try:
            self._close_cache_once()
        except Exception:
            logger.exception("closing the cache tiers after the scheduler died failed")

    def _close_cache_once(self) -> None:
        if not self._cache_closed:
            self._cache_closed = True
            self.cache.close()

    def __enter__(self) -> Engine:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
