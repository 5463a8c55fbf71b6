"""A request's updates, from the scheduler thread to the event loop that streams them.

Per token the scheduler hands on a `Delta` (what is new: ids, text, logprob entries); the
last update also carries the whole result, built once. A stream's `Mailbox` holds at most
one unread delta: one put while the last is unread is merged into it (`Delta.merge`), so a
reader slower than the scheduler gets several tokens in one update, none lost, and the
buffer never holds more than what that reader has not read.

Threading: `put` on the scheduler thread; `get` on the reader's event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any, NamedTuple

from hicache_server.output import Delta


class Update(NamedTuple):
    delta: Delta
    result: dict[str, Any] | None  # the whole result (`Request.result`), on the last only


class Mailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()  # the unread delta, between the two threads
        self._delta: Delta | None = None
        self._result: dict[str, Any] | None = None
        self._ready = asyncio.Event()

    def put(self, delta: Delta, result: dict[str, Any] | None) -> None:
        """Scheduler thread: add `delta` (and the final `result`); RuntimeError once the
        reader's loop has closed (the scheduler then aborts the request)."""
        if self._loop.is_closed():
            raise RuntimeError("the reader's event loop has closed")
        with self._lock:
            wake = self._delta is None
            if wake:
                self._delta = delta
            else:
                self._delta.merge(delta)
            if result is not None:
                self._result = result
        if wake:
            self._loop.call_soon_threadsafe(self._ready.set)

    async def get(self) -> Update:
        """The unread delta (all that came since the last `get`), once there is one."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            with self._lock:
                delta, result, self._delta = self._delta, self._result, None
            if delta is not None:  # None: a wake-up whose delta an earlier get took
                return Update(delta, result)


async def final_result(updates: AsyncIterator[Update]) -> dict[str, Any]:
    """The whole result a request's updates end with (read to their end, so that the
    stream finishes here rather than when the garbage collector closes it)."""
    result = None
    async for update in updates:
        if update.result is not None:
            result = update.result
    if result is None:
        raise RuntimeError("a request's updates ended without its result")
    return result


async def final_results(streams: Sequence[AsyncIterator[Update]]) -> list[dict[str, Any]]:
    """`final_result` of each stream, read together; the streams start in order (tasks run
    in creation order: choice 0 of an `n` is submitted first). When one fails (a full
    queue, say), the others are cancelled, so their requests aborted, before the error goes
    on: all the choices run, or none."""
    tasks = [asyncio.ensure_future(final_result(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
