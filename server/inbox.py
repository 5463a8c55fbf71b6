"""The scheduler's inbox: requests and calls from any thread, taken by the scheduler thread.

    put(kind, payload)   any thread; SchedulerStopped once the inbox is closed
    put_request(req)     any thread: a request, counted as queued; QueueFull when
                         `max_queued` requests are queued already (nothing is put then)
    admitted(req)        scheduler thread: `req` is no longer queued (first admitted, or
                         ended before that); idempotent
    take(timeout)        scheduler thread: everything queued, waiting up to `timeout` s for
                         the first item (0: no wait)
    close(reason)        once the loop has died: refuse from now on, return what was queued

A queued request is one handed in and never yet admitted to run, in the inbox or in the
scheduler's waiting list: the count is asked and committed under the lock that `put` holds,
so two threads never both take the last place. A request retracted to the waiting list, or
waiting for its L3 tail, was admitted once and is not counted again (it cannot be refused).

Threading: `put`, `put_request`, `admitted` and `close` hold one lock, so nothing is queued
after the last `take` that `close` performs; `take` needs no lock (queue.Queue is
thread-safe).
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from hicache_server.request import Request

Item = tuple[str, Any]  # ("req", Request) or ("cmd", (fn, future, when_idle))
# What a 429 asks a client to wait (seconds, `Retry-After`): the queue moves as requests
# finish, at decode speed; a second is a few decode steps' worth of room, and a client's
# own backoff grows from there (vLLM and SGLang send no Retry-After; TGI's 429 neither).
RETRY_AFTER_S = 1


class SchedulerStopped(RuntimeError):
    """The scheduler loop has died: work handed to it can never run (its message says why)."""


class QueueFull(RuntimeError):
    """`limit` requests are queued already (an HTTP 429 with `Retry-After: retry_after_s`)."""

    def __init__(self, limit: int, retry_after_s: int = RETRY_AFTER_S) -> None:
        waiting = f"{limit} request{'' if limit == 1 else 's'}"
        super().__init__(f"the server's queue is full ({waiting} waiting to run: "
                         f"server.max_queued_requests, --max-queued-requests); retry after "
                         f"{retry_after_s} s")
        self.limit = limit
        self.retry_after_s = retry_after_s


class Inbox:
    def __init__(self, max_queued: int) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self._queue: queue.Queue[Item] = queue.Queue()
        self._lock = threading.Lock()
        self._closed: str | None = None  # why, once closed
        self.max_queued = max_queued
        self._queued: set[Request] = set()  # requests handed in, never yet admitted (by identity)

    def put(self, kind: str, payload: Any) -> None:
        with self._lock:
            self._put(kind, payload)

    def put_request(self, req: Request) -> None:
        """Queue a request unless `max_queued` are queued (QueueFull: nothing changed)."""
        with self._lock:
            if self._closed is None and len(self._queued) >= self.max_queued:
                raise QueueFull(self.max_queued)
            self._put("req", req)
            self._queued.add(req)

    def admitted(self, req: Request) -> None:
        """`req` leaves the queued count (first admitted, or ended while queued)."""
        with self._lock:
            self._queued.discard(req)

    def queued(self) -> int:
        """Requests handed in and never yet admitted (a snapshot)."""
        with self._lock:
            return len(self._queued)

    def _put(self, kind: str, payload: Any) -> None:
        if self._closed is not None:
            raise SchedulerStopped(self._closed)
        self._queue.put((kind, payload))

    def take(self, timeout: float = 0.0) -> list[Item]:
        try:
            first = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return []
        items = [first]
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items

    def close(self, reason: str) -> list[Item]:
        with self._lock:
            self._closed = reason
            self._queued.clear()
            return self.take()

    def empty(self) -> bool:
        return self._queue.empty()
