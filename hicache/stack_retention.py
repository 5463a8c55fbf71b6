"""The retention part of the one door (`cache.retention`, held by `hicache.stack.CacheStack`):
what keeps cached pages past LRU eviction, pins (a path kept on L1 until its TTL, up to
`max_pinned_tokens`) and sessions (a session's nodes kept while it is open, with
`cache.session_retention`). A stack without sessions answers harmlessly: nothing to touch,
nothing to close.

    a request's arrival   touch_session(session_id, now)
    each step             expire(now): the sessions idle past their timeout, the pins past
                          their TTL
    admin                 pin / unpin / unpin_all, close_session

Threading: scheduler thread only, like the tree whose nodes these own.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.tree.base import PrefixCache
from hicache.tree.pins import PinTable
from hicache.tree.sessions import SessionTable


class RetentionCalls:
    """Pins and sessions over the tree: `pins` caps at `max_pinned_tokens` (0: pinning
    refused), `sessions` None without session retention."""

    def __init__(self, tree: PrefixCache, pins: PinTable,
                 sessions: SessionTable | None) -> None:
        self._tree = tree
        self._pins = pins
        self._sessions = sessions

    @property
    def max_pinned_tokens(self) -> int:
        return self._pins.max_tokens

    def pin(self, ids: Sequence[int], extra_key: str | None, ttl_s: float, now: float
            ) -> int | None:
        """Pin the cached path spelling `ids` (whole pages) until `now + ttl_s`, renewing
        its pin; the tokens pinned in all then, None when it is not cached (all of it, on
        L1). PinRefused past the cap."""
        end = self._tree.node_at(self._tree.root, ids, extra_key)
        if end is None:
            return None
        key = (tuple(ids), extra_key)
        self._pins.check(key, end)
        self._pins.pin(key, end, ttl_s, now)
        self._tree.host.back_up_path(end)  # a pinned page must reach L2 to leave L1 (best effort)
        return self._pins.pinned_tokens()

    def unpin(self, ids: Sequence[int], extra_key: str | None) -> bool:
        """Release the pin of `ids`; False when none."""
        return self._pins.unpin((tuple(ids), extra_key))

    def unpin_all(self) -> int:
        """Release every pin; how many there were."""
        return self._pins.clear()

    def touch_session(self, session_id: str, now: float) -> None:
        """A request of `session_id` arrived (opens it); nothing without session retention."""
        if self._sessions is not None:
            self._sessions.touch(session_id, now)

    def close_session(self, session_id: str) -> bool:
        """Close a session, disowning its nodes; False when it was not open (or sessions are
        off)."""
        return self._sessions is not None and self._sessions.close(session_id)

    def expire(self, now: float) -> None:
        """End the sessions idle for their timeout and the pins past their TTL (once per
        step: O(1) unless the oldest session is due, O(pins) and there are few)."""
        if self._sessions is not None:
            self._sessions.expire(now)
        if self._pins:
            self._pins.expire(now)
