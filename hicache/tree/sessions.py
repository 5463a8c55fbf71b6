"""Live sessions (SGLang's `--enable-session-radix-cache`): which session ids are open, and
when each last sent a request. The tree records what each one owns (`RadixCache.own`):
nodes a live session used are evicted from L1 and L2 only after every unowned node.

A session opens with its first request, closes on `close` (POST /close_session) or after
`timeout_s` without a request (`expire`, called once per scheduler step: it looks at the
oldest session only, O(1) when none is due). Closing disowns its nodes in the tree.

Threading: scheduler thread only (it owns the tree); times are `time.monotonic()`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from hicache.tree.base import PrefixCache


class SessionSizes(NamedTuple):
    live: int               # open sessions
    owned_device_tokens: int
    owned_host_tokens: int  # owned nodes evicted from L1, on L2 only


class SessionTable:
    """Open sessions, oldest request first; `tree` records their ownership."""

    def __init__(self, tree: PrefixCache, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"session timeout must be > 0 seconds, got {timeout_s}")
        self.tree = tree
        self.timeout_s = timeout_s
        self._last_seen: OrderedDict[str, float] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._last_seen)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._last_seen

    def touch(self, session_id: str, now: float) -> None:
        """A request of `session_id` arrived at `now` (opens the session if new)."""
        self._last_seen[session_id] = now
        self._last_seen.move_to_end(session_id)

    def close(self, session_id: str) -> bool:
        """Close the session, releasing its nodes; False when it was not open."""
        if self._last_seen.pop(session_id, None) is None:
            return False
        self.tree.retention.disown(session_id)
        return True

    def expire(self, now: float) -> list[str]:
        """Close the sessions with no request for `timeout_s`; their ids."""
        expired = []
        while self._last_seen:
            session_id, seen = next(iter(self._last_seen.items()))
            if now - seen < self.timeout_s:
                break
            self.close(session_id)
            expired.append(session_id)
        return expired

    def sizes(self) -> SessionSizes:
        owned = self.tree.retention.owned_tokens()
        return SessionSizes(len(self), owned.device, owned.host_only)
