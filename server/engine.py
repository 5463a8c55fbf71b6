"""Engine: the model, the cache tiers and the scheduler thread behind one object.

    engine = Engine.from_cli(["--enable-hierarchical-cache"])
    out = engine.generate("Hello", sampling_params={"temperature": 0, "max_new_tokens": 8})
    outs = engine.generate("Hello", sampling_params={"n": 4, "seed": 1}, return_logprob=True)
    engine.flush_cache(["device", "host"]); engine.stats(); engine.shutdown()

The Engine owns the lifecycle (start, the scheduler thread, shutdown) and generation; it
hands input checks to `hicache_server.input_checks`, the admin operations to
`hicache_server.cache_admin.CacheAdmin` and L3 attach / detach to
`hicache_server.storage_attach.StorageAttachment`, each given only what it needs.

Threading: any thread may call the public methods; they hand work to the scheduler thread
(which alone touches the cache) and wait for its answer.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import Any

from hicache.build import build_stack
from hicache.door import CacheDoor
from hicache.memory.malloc import keep_freed_memory
from hicache.memory.windowed import STEP_TOKENS
from hicache.model_kv import ModelKV
from hicache.policies import TIERS
from hicache.stats import CacheStats
from hicache_server.cache_admin import CacheAdmin
from hicache_server.config import Config
from hicache_server.field_names import SGLANG_NAMES, FieldNames
from hicache_server.inbox import QueueFull, SchedulerStopped
from hicache_server.input_checks import GenerateOptions, InputChecker
from hicache_server.model_runner import ModelRunner
from hicache_server.models.loader import load_model
from hicache_server.request import InvalidRequest, Request
from hicache_server.scheduler import Scheduler
from hicache_server.storage_attach import StorageAttachment
from hicache_server.tokenizer import load_tokenizer
from hicache_server.updates import Mailbox, Update, final_results

logger = logging.getLogger(__name__)

# Tokens computed per forward step (prefill chunks + decodes): bounds step latency, so decodes
# keep flowing while a long prompt is prefilled in chunks (SGLang's chunked_prefill_size);
# a hybrid model's pool is sized for it (hicache.memory.windowed.STEP_TOKENS).
MAX_BATCH_TOKENS = STEP_TOKENS
MAX_RUNNING_REQUESTS = 64
DRAIN_POLL_S = 0.02
GREEDY_ONE_TOKEN = {"max_new_tokens": 1, "temperature": 0}


class EngineClosed(RuntimeError):
    """The engine is shutting down and takes no new requests (HTTP 503)."""


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
        keep_freed_memory()  # each forward pass reuses the last one's freed activations
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
        # ready once the scheduler's timed warm-up forwards are done (storage.prefill_warmup_s):
        # a request is never timed behind them
        self.scheduler.warmed_up.wait()

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
        model = self._model_kv()
        self.cache: CacheDoor = build_stack(self.config, model)
        self.scheduler = Scheduler(ModelRunner(self.loaded.model, self.cache), self.cache,
                                   self.tokenizer, max_batch_tokens=MAX_BATCH_TOKENS,
                                   max_running=MAX_RUNNING_REQUESTS,
                                   max_queued=self.config.server.max_queued_requests,
                                   schedule_policy=self.config.server.schedule_policy,
                                   prefill_warmup_s=self.config.storage.prefill_warmup_s)
        self.checker = InputChecker(self.tokenizer, self.vocab_size, self.context_len,
                                    self.cache.slots.device_capacity(),
                                    self.config.cache.page_size,
                                    self.config.server.max_prompt_logprobs)
        self.admin = CacheAdmin(self.cache, self.scheduler, self.checker, self._call,
                                self._compute_prefix)
        self._storage = StorageAttachment(self.config, self.cache, model, self._pending)

    def _init_model(self) -> None:
        m = self.config.model
        self.loaded = load_model(m.path, m.dtype, m.device)
        self.tokenizer = load_tokenizer(self.loaded.path)
        self.context_len = self.loaded.config.max_position_embeddings
        self.vocab_size = self.loaded.config.vocab_size

    @classmethod
    def from_cli(cls, argv: list[str]) -> Engine:
        """Build from the same flags as `hicache-server` (a bad one raises SystemExit(2))."""
        from hicache_server.args import parse_config

        config, _ = parse_config(argv)
        return cls(config)

    # -------------------------------------------------------------------------- generate
    # `options` are `hicache_server.input_checks.GenerateOptions`' fields by name: return_logprob,
    # logprob_start_len, top_logprobs_num, return_text_in_logprobs, priority, session_id.

    def make_request(self, text: str | None = None, input_ids: list[int] | None = None,
                     sampling_params: dict | None = None, extra_key: str | None = None,
                     **options: Any) -> Request:
        """Validate a one-choice generation request; raises InvalidRequest with what was
        wrong (for `sampling_params.n` > 1, `make_requests` gives the n choices)."""
        req = self.checker.request(text, input_ids, sampling_params, extra_key,
                                   GenerateOptions.from_kwargs("make_request", options))
        if req.input.params.n > 1:
            raise InvalidRequest(f"sampling_params.n = {req.input.params.n}: several choices are "
                                 "made by make_requests (or generate), not make_request")
        return req

    def make_requests(self, text: str | None = None, input_ids: list[int] | None = None,
                      sampling_params: dict | None = None, extra_key: str | None = None,
                      *, field_names: FieldNames = SGLANG_NAMES, **options: Any
                      ) -> list[Request]:
        """`make_request`, as its `sampling_params.n` choices (one for n = 1). Choice i has
        seed `seed + i` when seeded; choices 1.. wait in the scheduler until choice 0 has
        prefilled the prompt, then read it from the tree (one prefill for all). Submit
        choice 0 first (`generate` and `async_generate` do); the others never wait for a
        choice 0 that was not submitted, they only share nothing then. Errors name the
        fields as `field_names` says the client calls them (an OpenAI route's names)."""
        return self.checker.choices(text, input_ids, sampling_params, extra_key,
                                    GenerateOptions.from_kwargs("make_requests", options),
                                    field_names)

    def generate(self, text: str | None = None, input_ids: list[int] | None = None,
                 sampling_params: dict | None = None, extra_key: str | None = None,
                 **options: Any) -> dict | list[dict]:
        """The result; a list of n results for `sampling_params.n` > 1 (`make_requests`)."""
        reqs = self.checker.choices(text, input_ids, sampling_params, extra_key,
                                    GenerateOptions.from_kwargs("generate", options))
        futures: list[Future] = []
        try:
            for req in reqs:  # choice 0 first
                futures.append(self._submit_for_result(req))
        except (QueueFull, EngineClosed):  # all n or none: the ones queued stop
            for req in reqs[:len(futures)]:
                self.abort(req.rid)
            raise
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
                             extra_key: str | None = None, **options: Any
                             ) -> dict | list[dict]:
        """`generate` on an event loop: the same arguments and results."""
        reqs = self.checker.choices(text, input_ids, sampling_params, extra_key,
                                    GenerateOptions.from_kwargs("async_generate", options))
        results = await final_results([self.stream(req) for req in reqs])  # all or none
        return results if len(reqs) > 1 else results[0]

    async def stream(self, req: Request) -> AsyncIterator[Update]:
        """The request's updates: each what is new since the last (`Update.delta`); the
        last one carries the whole result too. A reader slower than the scheduler gets
        several tokens in one update, none lost (`hicache_server.updates.Mailbox`)."""
        box = Mailbox(asyncio.get_running_loop())
        req.on_update = lambda r, done: box.put(r.take_delta(), r.result() if done else None)
        self._submit(req)
        done = False
        try:
            while not done:
                update = await box.get()
                done = update.result is not None
                yield update
        finally:
            if not done:  # the consumer stopped listening: stop generating for it
                self.abort(req.rid)

    def abort(self, rid: str) -> None:
        """Stop a request whose client went away (no wait; unknown ids are ignored)."""
        if self._thread.is_alive():
            self.scheduler.call(lambda: self.scheduler.endings.abort(rid))

    def alive(self) -> bool:
        """Whether the scheduler thread is running (health checks watch this)."""
        return self._thread.is_alive() and not self._stop.is_set() and self.fatal_error is None

    def _submit(self, req: Request) -> None:
        """Hand `req` to the scheduler: EngineClosed when shutting down, QueueFull when
        `server.max_queued_requests` wait already (`hicache_server.inbox`)."""
        if not self._accepting:
            raise EngineClosed("the server is shutting down")
        try:
            self.scheduler.submit(req)
        except SchedulerStopped as e:
            raise EngineClosed(str(e)) from None

    def set_observer(self, observe: Callable[[str, float], None]) -> None:
        """Latency hook for metrics: the scheduler's steps and the tiers' copies and
        fetches call `observe(name, seconds)`."""
        self.scheduler.set_observer(observe)
        self.cache.admin.set_observer(observe)

    def _compute_prefix(self, ids: list[int], extra_key: str | None) -> None:
        """Compute `ids` if not cached (a pin's prefix: a one-token greedy generate)."""
        self.generate(input_ids=ids, extra_key=extra_key, sampling_params=GREEDY_ONE_TOKEN)

    # ----------------------------------------------------------------------------- admin

    def flush_cache(self, tiers: Sequence[str] = TIERS, *, unpin: bool = False) -> dict:
        """Empty the named tiers once in-flight requests and copies finish; tokens freed.
        Pinned pages stay (on L1 without L2; with L2 a device flush moves them to L2, and
        a host flush keeps them) unless `unpin`, which releases every pin first."""
        return self.admin.flush(tiers, unpin=unpin)

    def pin(self, text: str | None = None, input_ids: list[int] | None = None,
            extra_key: str | None = None, *, ttl_seconds: float) -> dict:
        """Keep a prefix cached for `ttl_seconds` (POST /admin/pin): its whole pages are
        computed first if not cached (a one-token generate), then pinned: evicted from L1
        after everything else (demoted to L2, never deleted), kept in L2. Pinning the same
        prefix again renews its TTL. InvalidRequest when the pins would pass
        `cache.max_pinned_tokens` (saying how much is pinned and the cap). Returns
        `{"success", "pinned_tokens", "expires_in_s", "total_pinned_tokens",
        "max_pinned_tokens"}`."""
        return self.admin.pin(text, input_ids, extra_key, ttl_seconds)

    def unpin(self, text: str | None = None, input_ids: list[int] | None = None,
              extra_key: str | None = None) -> bool:
        """Release the pin of a prefix (as `pin` was given it); False when none."""
        return self.admin.unpin(text, input_ids, extra_key)

    def close_session(self, session_id: str) -> bool:
        """Close a session (SGLang's POST /close_session): the nodes it owned go back to
        their policy's place among the unowned ones. False when no such session is open
        (never opened, closed, timed out, or `cache.session_retention` is off)."""
        return self.admin.close_session(session_id)

    def cache_stats(self) -> CacheStats:
        """One typed snapshot of the tiers, the request counters, the pins and the live
        sessions (`hicache.stats`)."""
        return self.admin.stats()

    def stats(self) -> dict:
        """`cache_stats()` as plain data: `{"tiers": {tier: {...}}, "counters": {...}}`."""
        return self.cache_stats().as_dict()

    def load(self) -> dict[str, int]:
        """SGLang's load report (`GET /get_load`), read between scheduler steps: requests
        running and waiting, and `num_tokens`, every token of the running ones (prompt and
        output so far) plus the waiting prompts: the KV the server holds or will, which
        sglang-router's load-based policies compare between workers."""
        return self.admin.load()

    # ------------------------------------------------------------ L3 attach / detach
    # Each runs on the scheduler thread between steps and only when no request runs or
    # waits: a busy engine refuses at once (StorageChangeRefused) rather than holding the
    # caller until traffic stops, as SGLang does. The attachment replaces its config (never
    # mutates it) and `self.config` is read back from it, there alone; other threads read
    # whichever whole Config they find.

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
        return self._change_storage(lambda: self._storage.attach(
            backend, extra_config, prefetch_policy, write_policy))

    def detach_storage(self) -> dict:
        """Detach L3: in-flight backups land first, the store is closed (its pages stay in
        it), the tree forgets what it held; `config.storage` is the launch one again, with
        backend "none". With none attached, nothing changes (success, as SGLang answers).
        Returns what `attach_storage` does."""
        return self._change_storage(self._storage.detach)

    def storage_backend(self) -> dict:
        """SGLang's `GET /hicache/storage-backend` fields: `hicache_storage_backend` (None
        without L3), `hicache_storage_backend_extra_config` (the backend's section as JSON
        text; the Redis password redacted), `hicache_storage_prefetch_policy`,
        `hicache_write_policy` (None without L2); and `backend_config`, that section as an
        object."""
        return self._call(self._storage.view)

    def _change_storage(self, change: Callable[[], dict]) -> dict:
        def run() -> dict:
            try:
                return change()
            finally:  # a detach that failed has still dropped L3 (and changed the config)
                self.config = self._storage.config
        return self._call(run)

    def _pending(self) -> tuple[int, int]:
        """Scheduler thread: the requests running and waiting."""
        return len(self.scheduler.running), len(self.scheduler.waiting)

    def _model_kv(self) -> ModelKV:
        mc = self.loaded.config
        return ModelKV(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                       self.loaded.dtype, self.loaded.device, self.loaded.fingerprint,
                       tuple(mc.window_of(i) for i in range(mc.num_hidden_layers)))

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
            self._call(self.cache.steps.quiesce)  # pending backups reach L3
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
            self.cache.admin.close()

    def __enter__(self) -> Engine:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
