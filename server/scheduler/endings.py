"""How a request leaves the scheduler: finished (`_finish`: its KV released, off the
queues, its client told), failed alone after an exception while serving it (`_alone`,
`_fail_request`), aborted by its client (`abort`), or failed with every other request once
the loop has died (`fail_all`). `Scheduler` is made of this; see `loop.py`.

Threading: the scheduler thread, except `fail_all` (any thread, once the loop returned).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

from hicache.stack import CacheStack
from hicache.stats import RequestCounters
from hicache_server.inbox import Inbox, SchedulerStopped
from hicache_server.request import Request
from hicache_server.scheduler.kv import RequestKV
from hicache_server.scheduler.text import OutputText

logger = logging.getLogger("hicache_server.scheduler.loop")  # the scheduler's own logger, as before


class RequestEndings:
    """Request endings over the scheduler's queues, cache and counters (given by
    `Scheduler`)."""

    cache: CacheStack
    counters: RequestCounters
    inbox: Inbox
    kv: RequestKV
    text: OutputText
    waiting: list[Request]
    running: list[Request]
    _commands: list[tuple[Any, Future, bool]]

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
        self.counters.request_errors += 1
        req.error = f"the server failed in {stage}: {type(exc).__name__}: {exc}"
        if req in self.waiting:
            try:
                self.cache.end_prefetch(req.rid)  # idempotent: a prefetch ends once
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
            self.kv.release(req, keep_cache)
        except BaseException as exc:
            req.finish_reason = "error"
            req.error = req.error or f"the server failed releasing its cache: {exc!r}"
            raise
        finally:
            if req.finish_reason == "error":
                try:
                    req.text = self.text.decode(req, req.output_ids)
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
                self.cache.end_prefetch(rid)
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
