"""How a request leaves the scheduler: finished (`finish`: its text flushed, its KV
released, off the queues, its client told), failed alone after an exception while serving
it (`alone`, `fail`), aborted by its client (`abort`), or failed with every other request
once the loop has died (`fail_all_requests`). A part the `Scheduler` holds, over the
scheduler's own queues (the same list objects, changed in place, never rebound).

Threading: the scheduler thread, except `fail_all_requests` (any thread, once the loop
returned).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from hicache.door import CacheDoor
from hicache.stats import RequestCounters
from hicache_server.request import Request
from hicache_server.scheduler.kv import RequestKV
from hicache_server.scheduler.text import OutputText

logger = logging.getLogger("hicache_server.scheduler.loop")  # the scheduler's own logger


class RequestEndings:
    def __init__(self, cache: CacheDoor, kv: RequestKV, text: OutputText,
                 counters: RequestCounters, waiting: list[Request],
                 running: list[Request], unqueue: Callable[[Request], None]) -> None:
        self.cache, self.kv, self.text, self.counters = cache, kv, text, counters
        self.waiting, self.running = waiting, running  # the scheduler's queues
        self.unqueue = unqueue  # the inbox's count of unadmitted requests (`Inbox.admitted`)

    @contextmanager
    def alone(self, req: Request, stage: str) -> Iterator[None]:
        """Serve `req` in the block; an exception there fails `req` alone (`fail`) and the
        scheduler goes on with the others."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - fails this request only
            self.fail(req, stage, exc)

    def fail(self, req: Request, stage: str, exc: Exception) -> None:
        """Fail `req` alone after an exception while serving it (logged with its traceback,
        counted in `request_errors`); its KV goes back to the pool, never into the tree."""
        logger.error("request %s failed in %s; the others go on", req.rid, stage,
                     exc_info=exc)
        self.counters.request_errors += 1
        req.output.error = f"the server failed in {stage}: {type(exc).__name__}: {exc}"
        if req in self.waiting:
            try:
                self.cache.l3.end(req.rid)  # idempotent: a prefetch ends once
            except Exception:
                logger.exception("request %s: ending its storage prefetch failed", req.rid)
        if req in self.running or req in self.waiting:  # not finished (or half) already
            self.finish(req, "error", keep_cache=False)

    def finish(self, req: Request, reason: str, keep_cache: bool = True) -> None:
        """Release the request's KV and lock, take it off the queues, tell its client. The
        last two happen even when the release raises (the request then reports an error and
        the exception goes on to the caller): a request is never left half finished."""
        out = req.output
        out.finish_reason = reason
        try:
            self.kv.release(req, keep_cache)
        except BaseException as exc:
            out.finish_reason = "error"
            out.error = out.error or f"the server failed releasing its cache: {exc!r}"
            raise
        finally:
            self._flush_text(req)
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            self.unqueue(req)  # one that ends before it was admitted frees its place
            self.notify(req, True)

    def _flush_text(self, req: Request) -> None:
        """The text still held (an error or an abort ends a request mid-text)."""
        try:
            self.text.flush(req)
        except Exception:
            logger.warning("request %s: the rest of its output cannot be decoded", req.rid,
                           exc_info=True)
            req.output.held, req.output.text_done = "", True

    def notify(self, req: Request, done: bool) -> None:
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
                self.finish(req, "abort")

    def abort(self, rid: str) -> bool:
        """Finish a waiting or running request now (its client left); False if unknown."""
        for req in (*self.waiting, *self.running):
            if req.rid == rid:
                self.cache.l3.end(rid)
                self.finish(req, "abort")
                return True
        return False

    def fail_all_requests(self, message: str, arrived: list[Request]) -> None:
        """After the loop died: finish every request (queued or `arrived` in the inbox)
        with `message`, touching neither the tree nor the pools (their state is unknown).
        Never raises."""
        for req in (*self.waiting, *self.running, *arrived):
            req.output.error, req.output.finish_reason = message, "error"
            try:
                if req.on_update is not None:
                    req.on_update(req, True)
            except Exception:  # noqa: BLE001 - its client is gone; tell the others
                logger.debug("request %s: callback failed after the scheduler died", req.rid)
        self.waiting.clear()
        self.running.clear()
