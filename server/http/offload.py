"""Blocking work of a handler, run off the event loop.

The event loop only waits: chat templates, tokenization and any loop over a prompt run on
the loop's default executor (`off_loop`), never on the loop itself, where they would hold
every other request, /health included, for as long as they take (a 1 M-character chat
message: 0.4-0.7 s).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

T = TypeVar("T")


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the default executor; its exception is raised here."""
    return await asyncio.get_running_loop().run_in_executor(None, partial(fn, *args))
