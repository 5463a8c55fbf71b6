"""The scheduler's inbox: requests and calls from any thread, taken by the scheduler thread.

    put(kind, payload)   any thread; SchedulerStopped once the inbox is closed
    take(timeout)        scheduler thread: everything queued, waiting up to `timeout` s for
                         the first item (0: no wait)
    close(reason)        once the loop has died: refuse from now on, return what was queued

Threading: `put` and `close` hold one lock, so nothing is queued after the last `take` that
`close` performs; `take` needs no lock (queue.Queue is thread-safe).
"""

from __future__ import annotations

import queue
import threading
from typing import Any

Item = tuple[str, Any]  # ("req", Request) or ("cmd", (fn, future, when_idle))


class SchedulerStopped(RuntimeError):
    """The scheduler loop has died: work handed to it can never run (its message says why)."""


class Inbox:
    def __init__(self) -> None:
        self._queue: queue.Queue[Item] = queue.Queue()
        self._lock = threading.Lock()
        self._closed: str | None = None  # why, once closed

    def put(self, kind: str, payload: Any) -> None:
        with self._lock:
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
            return self.take()

    def empty(self) -> bool:
        return self._queue.empty()
