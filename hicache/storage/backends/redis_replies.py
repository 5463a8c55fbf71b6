"""Redis replies checked where they are consumed: a peer that is not Redis (a misconfigured
proxy, another service on the port) answers `+OK` or `:1` to every command, and such a reply
must be a fault (`BadReply`), never a hit, a page or a crash.

    asking(call)                 a call into redis-py; its parse errors on junk -> BadReply
    checked(command, replies, n) n replies of `command`, each of the type it must have

Threading: pure functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from redis.exceptions import RedisError

T = TypeVar("T")
REPLY_SHOWN_CHARS = 80  # a wrong reply is shown in the log line cut to this length


class BadReply(RedisError):
    """What answered is not Redis, or not in step: a reply of the wrong type or number, or
    one redis-py could not parse. A fault of the whole server (reads and writes back off),
    after which its connections are closed."""


# What redis-py raises parsing a reply of the wrong type: its callbacks unpack, index,
# split and convert replies (`'bytes' object has no attribute 'get'` from a HELLO answered
# +OK; `cannot unpack non-iterable int object` from a SCAN answered :1). Caught only inside
# calls into redis-py (`asking`).
PARSE_ERRORS = (ValueError, TypeError, AttributeError, LookupError)


def asking(call: Callable[[], T]) -> T:
    """`call()`, a call into redis-py; what redis-py raises while parsing a reply of the
    wrong type (`PARSE_ERRORS`) becomes a `BadReply`. Wrap nothing but redis-py calls:
    the same exceptions from this module's own code are bugs, and must still raise."""
    try:
        return call()
    except PARSE_ERRORS as err:
        raise BadReply(f"redis-py could not parse the reply: {type(err).__name__}: "
                       f"{err}") from err


def _is_count(reply: Any) -> bool:
    return type(reply) is int and reply >= 0  # not a bool: RESP3 booleans are no counts


def _is_exists(reply: Any) -> bool:
    return type(reply) is int and reply in (0, 1)  # one key per EXISTS


def _is_value(reply: Any) -> bool:
    return reply is None or type(reply) is bytes  # nil: absent


def _is_set_nx(reply: Any) -> bool:
    """True: stored (redis-py maps +OK to True); None: already present (NX); with
    raise_on_error=False a refused SET (OOM, READONLY) is its exception, in its place."""
    return reply is True or reply is None or isinstance(reply, Exception)


def _is_info(reply: Any) -> bool:
    """A dict of the INFO fields, with `used_memory` (in every Redis's INFO; junk parsed as
    INFO has none) and the others, when present, integers. maxmemory and evicted_keys may
    be absent on a Redis-compatible server: they count as 0."""
    return (isinstance(reply, dict) and type(reply.get("used_memory")) is int
            and all(type(reply.get(key, 0)) is int for key in ("maxmemory", "evicted_keys")))


def _is_scan_step(reply: Any) -> bool:
    """(next cursor, [key names]), as redis-py's SCAN returns it; cursor 0: the last step."""
    return (isinstance(reply, tuple) and len(reply) == 2 and _is_count(reply[0])
            and isinstance(reply[1], list) and all(type(name) is bytes for name in reply[1]))


# What each command may answer, as redis-py hands it over (RESP2 or RESP3), and what a log
# line says was expected instead.
_REPLIES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "EXISTS": (_is_exists, "0 or 1"),
    "GET": (_is_value, "bytes or nil"),
    "SET": (_is_set_nx, "OK, nil or an error"),
    "UNLINK": (_is_count, "an integer >= 0"),
    "DBSIZE": (_is_count, "an integer >= 0"),
    "INFO": (_is_info, "INFO fields with an integer used_memory"),
    "SCAN": (_is_scan_step, "(cursor, [key, ...])"),
}


def checked(command: str, replies: Sequence[Any], sent: int) -> list[Any]:
    """`replies` to `sent` `command`s, after checking their number and each one's type;
    `BadReply` naming the first wrong one."""
    valid, expected = _REPLIES[command]
    if len(replies) != sent:
        raise BadReply(f"{sent} {command} commands got {len(replies)} replies")
    for reply in replies:
        if not valid(reply):
            shown = repr(reply)
            if len(shown) > REPLY_SHOWN_CHARS:
                shown = shown[:REPLY_SHOWN_CHARS] + "..."
            raise BadReply(f"{command} answered {shown}; expected {expected}")
    return list(replies)


def checked_one(command: str, reply: Any) -> Any:
    return checked(command, [reply], 1)[0]
