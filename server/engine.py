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
import json
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import Any

from hicache.config import (
    STORAGE_BACKENDS,
    TIERED_BACKEND,
    TIERED_PARTS,
    Config,
    ConfigError,
    StorageConfig,
    apply_overrides,
    config_to_dict,
)
from hicache.policies import TIERS
from hicache.stack import CacheStack, ModelKV, build_stack
from hicache.stats import CacheStats, PinStats, SessionStats
from hicache.tree.pins import PinRefused, PinTable
from hicache.tree.sessions import SessionTable
from server.args import _extra_overrides, _parse_extra
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
from server.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

# Tokens computed per forward step (prefill chunks + decodes): bounds step latency, so decodes
# keep flowing while a long prompt is prefilled in chunks (SGLang's chunked_prefill_size).
MAX_BATCH_TOKENS = 2048
MAX_RUNNING_REQUESTS = 64
DRAIN_POLL_S = 0.02
# The longest TTL a pin may ask for: a week. A pin is a lease to renew, not a setting.
MAX_PIN_TTL_S = 7 * 24 * 3600.0
# Of the lowest tier's capacity (L2, or L1 without L2), what pins may hold by default
# (cache.max_pinned_tokens: null): the rest stays for running requests and ordinary reuse.
DEFAULT_PIN_SHARE = 4
# Without L2 pinned pages never leave L1: at most 1/this of it, whatever the config says.
MAX_PIN_SHARE_OF_L1_ONLY = 2


class EngineClosed(RuntimeError):
    """The engine is shutting down and takes no new requests (HTTP 503)."""


class StorageChangeRefused(InvalidRequest):
    """An L3 attach or detach that was refused (HTTP 400, as SGLang answers); the message
    says why. Nothing changed: the engine serves as before."""


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


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


def _extra_object(extra: object) -> dict[str, Any]:
    """An extra config as sent: an object, its JSON text (SGLang sends text), or nothing."""
    if extra is None or extra == "":
        return {}
    if isinstance(extra, str):
        return _parse_extra(extra)
    if not isinstance(extra, dict):
        raise ConfigError("storage.extra_config", f"expected a JSON object (or its JSON "
                          f"text), got {type(extra).__name__}")
    return extra


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
    # The storage section the engine was started with, kept at the first L3 attach or
    # detach: every attach merges over it, every detach returns to it (backend "none").
    _launch_storage: StorageConfig | None = None

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
        mc = self.loaded.config
        self.cache: CacheStack = build_stack(self.config, ModelKV(
            mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, self.loaded.dtype,
            self.loaded.device, self.loaded.path))
        runner = ModelRunner(self.loaded.model, self.cache.device_pool, self.cache.tree)
        c = self.config.cache
        self.sessions = (SessionTable(self.cache.tree, c.session_timeout_s)
                         if c.session_retention else None)
        self.pins = PinTable(self.cache.tree, self._pin_cap())
        self.scheduler = Scheduler(runner, self.cache, self.tokenizer,
                                   max_batch_tokens=MAX_BATCH_TOKENS,
                                   max_running=MAX_RUNNING_REQUESTS,
                                   schedule_policy=self.config.server.schedule_policy,
                                   sessions=self.sessions, pins=self.pins)

    def _pin_cap(self) -> int:
        """cache.max_pinned_tokens, or a quarter of L2 (of L1 without L2), whole pages."""
        cap = self.config.cache.max_pinned_tokens
        pool = self.cache.host_pool
        l1 = self.cache.device_pool.allocator.total_size()
        if cap is None:
            cap = (pool.total_size() if pool is not None else l1) // DEFAULT_PIN_SHARE
        if pool is None:  # pinned pages never leave L1: keep (over) half of it for requests,
            # so a request that fits beside a full cap of pins (`_check_params`) can be a
            # pin's own computation (its prompt: the pinned pages and less than a page more)
            cap = min(cap, (l1 - self.config.cache.page_size) // MAX_PIN_SHARE_OF_L1_ONLY)
        return cap // self.config.cache.page_size * self.config.cache.page_size

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
                self.pins.clear()
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
        ids, extra_key = self._pin_prefix(text, input_ids, extra_key)
        ttl = _pin_ttl(ttl_seconds)
        if len(ids) > self.pins.max_tokens:
            raise InvalidRequest(f"pinning {len(ids)} tokens exceeds the cap "
                                 f"(cache.max_pinned_tokens) of {self.pins.max_tokens}")
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
        tree = self.cache.tree
        node = tree.node_at(tree.root, ids, extra_key)
        if node is None:
            return None
        key = (tuple(ids), extra_key)
        try:
            self.pins.check(key, node)
        except PinRefused as e:
            raise InvalidRequest(str(e)) from None
        self.pins.pin(key, node, ttl, time.monotonic())
        tree.back_up_path(node)  # a pinned page must reach L2 to leave L1 (best effort)
        return {"success": True, "pinned_tokens": len(ids), "expires_in_s": ttl,
                "total_pinned_tokens": self.pins.pinned_tokens(),
                "max_pinned_tokens": self.pins.max_tokens}

    def unpin(self, text: str | None = None, input_ids: list[int] | None = None,
              extra_key: str | None = None) -> bool:
        """Release the pin of a prefix (as `pin` was given it); False when none."""
        ids, extra_key = self._pin_prefix(text, input_ids, extra_key)
        return self._call(lambda: self.pins.unpin((tuple(ids), extra_key)))

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
        if self.sessions is None:
            return False
        return self._call(lambda: self.sessions.close(session_id))

    def cache_stats(self) -> CacheStats:
        """One typed snapshot of the tiers, the request counters and the live sessions
        (`hicache.stats`)."""
        return self._call(self._stats_now)

    def _stats_now(self) -> CacheStats:
        stats = self.cache.stats(self.scheduler.counters)
        pins = PinStats(self.pins.pinned_tokens(), self.pins.max_tokens,
                        tuple(p._asdict() for p in self.pins.infos(time.monotonic())))
        sessions = (SessionStats(*self.sessions.sizes()) if self.sessions is not None
                    else None)
        return dataclasses.replace(stats, sessions=sessions, pins=pins)

    def stats(self) -> dict:
        """`cache_stats()` as plain data: `{"tiers": {tier: {...}}, "counters": {...}}`."""
        return self.cache_stats().as_dict()

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
        return self._call(lambda: self._attach_now(backend, extra_config, prefetch_policy,
                                                   write_policy))

    def detach_storage(self) -> dict:
        """Detach L3: in-flight backups land first, the store is closed (its pages stay in
        it), the tree forgets what it held; `config.storage` is the launch one again, with
        backend "none". With none attached, nothing changes (success, as SGLang answers).
        Returns what `attach_storage` does."""
        return self._call(self._detach_now)

    def storage_backend(self) -> dict:
        """SGLang's `GET /hicache/storage-backend` fields: `hicache_storage_backend` (None
        without L3), `hicache_storage_backend_extra_config` (the backend's section as JSON
        text; the Redis password redacted), `hicache_storage_prefetch_policy`,
        `hicache_write_policy` (None without L2); and `backend_config`, that section as an
        object."""
        return self._call(self._storage_view)

    def _attach_now(self, backend: str, extra_config: dict | str | None,
                    prefetch_policy: str | None, write_policy: str | None) -> dict:
        config = self._storage_config(backend, extra_config, prefetch_policy, write_policy)
        if self.cache.host_pool is None:
            raise StorageChangeRefused("L3 needs the host tier (L2), which this server was "
                                       "started without: restart it with "
                                       "--enable-hierarchical-cache")
        self._require_idle("attach")
        if self.cache.storage is not None:
            return self._reattach(config, prefetch_policy is not None)
        try:
            self.cache.attach_storage(config, self._model_kv())
        except (OSError, ValueError) as e:
            logger.error("attaching L3 (%s) failed; serving without L3: %s", backend, e)
            raise StorageChangeRefused(f"could not open L3 ({backend}: "
                                       f"{json.dumps(self._section(config))}): {e}; the "
                                       "server goes on without L3") from None
        self.config = config
        logger.info("L3 (%s) attached at runtime", backend)
        return {"success": True, "message": f"L3 ({backend}) attached",
                **self._storage_view()}

    def _reattach(self, config: Config, new_policy: bool) -> dict:
        """An attach while L3 is attached: the same backend and section update the
        prefetch policy (`new_policy`: one was given); anything else is refused."""
        now, new = self.config.storage, config.storage
        if not new_policy:
            new = dataclasses.replace(new, prefetch_policy=now.prefetch_policy)
            config = dataclasses.replace(config, storage=new)
        if dataclasses.replace(new, prefetch_policy=now.prefetch_policy) != now:
            raise StorageChangeRefused(f"L3 is attached already ({now.backend}: "
                                       f"{json.dumps(self._section(self.config))}); detach "
                                       f"it first, then attach {new.backend}")
        self.cache.set_prefetch_policy(new.prefetch_policy)
        self.config = config
        return {"success": True,
                "message": f"L3 ({now.backend}) was attached already with this "
                           f"configuration; prefetch policy {new.prefetch_policy}",
                **self._storage_view()}

    def _detach_now(self) -> dict:
        self._require_idle("detach")
        name, launch = self.config.storage.backend, self._launch()
        try:
            detached = self.cache.detach_storage()
        finally:  # the stack has dropped its tier even if closing it failed
            self.config = dataclasses.replace(
                self.config, storage=dataclasses.replace(launch, backend="none"))
        if detached:
            logger.info("L3 (%s) detached at runtime", name)
        message = (f"L3 ({name}) detached; its pages stay in the store" if detached
                   else "no L3 was attached; nothing changed")
        return {"success": True, "message": message, **self._storage_view()}

    def _storage_config(self, backend: str, extra_config: dict | str | None,
                        prefetch_policy: str | None, write_policy: str | None) -> Config:
        """The config with `backend` attached, validated; no side effects."""
        allowed = [b for b in STORAGE_BACKENDS if b != "none"]
        if not isinstance(backend, str) or backend not in allowed:
            hint = "; to detach, use detach_storage" if backend == "none" else ""
            raise StorageChangeRefused(f"storage.backend: {backend!r} is not one of "
                                       f"{', '.join(allowed)}{hint}")
        current = self.config.host.write_policy
        if write_policy is not None and write_policy != current:
            raise StorageChangeRefused(
                f"host.write_policy: {write_policy!r} asks for a change the running server "
                f"cannot make (the L2 write policy is fixed at start, now {current!r}); "
                f"restart with --hicache-write-policy {write_policy}, or leave it out")
        overrides: dict[str, object] = {"storage.backend": backend}
        if prefetch_policy is not None:
            overrides["storage.prefetch_policy"] = prefetch_policy
        base = dataclasses.replace(self.config, storage=self._launch())
        try:
            overrides.update(_extra_overrides(backend, _extra_object(extra_config)))
            return apply_overrides(base, overrides)
        except ConfigError as e:
            raise StorageChangeRefused(str(e)) from None

    def _launch(self) -> StorageConfig:
        """Scheduler thread: the launch storage section (kept before its first change)."""
        if self._launch_storage is None:
            self._launch_storage = self.config.storage
        return self._launch_storage

    def _require_idle(self, action: str) -> None:
        """Scheduler thread: refuse unless no request runs or waits."""
        running, waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        if running or waiting:
            raise StorageChangeRefused(
                f"cannot {action} L3: the server is not idle: "
                f"{_plural(running, 'request')} running, {waiting} waiting; retry once they "
                "have finished (drain the traffic first)")

    def _storage_view(self) -> dict:
        attached = self.cache.storage is not None
        section = self._section(self.config) if attached else None
        s = self.config.storage
        return {"hicache_storage_backend": s.backend if attached else None,
                "hicache_storage_backend_extra_config":
                    None if section is None else json.dumps(section),
                "hicache_storage_prefetch_policy": s.prefetch_policy if attached else None,
                "hicache_write_policy": self.config.host.write_policy
                if self.cache.host_pool is not None else None,
                "backend_config": section}

    @staticmethod
    def _section(config: Config) -> dict:
        """The chosen backend's section(s) as plain data, the Redis password redacted."""
        storage = config_to_dict(config, redact=True)["storage"]
        if config.storage.backend == TIERED_BACKEND:
            return {part: storage[part] for part in TIERED_PARTS}
        return storage[config.storage.backend]

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
