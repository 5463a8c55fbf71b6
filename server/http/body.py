"""Reading a request body as JSON and checking its fields' shapes; errors are 4xx HttpErrors
whose messages name the field, what was sent (cut short) and what is allowed.

The engine checks the values' ranges (`hicache_server.request`); these check only JSON shapes.
"""

from __future__ import annotations

import asyncio
import json
import reprlib
from typing import Any

from aiohttp import web

from hicache_server.http.errors import HttpError
from hicache_server.http.state import STATE
from hicache_server.request import InvalidRequest, check_session_id


async def read_json(request: web.Request, *, empty: Any = None) -> Any:
    """The body as JSON (`empty` when there is none); 400 when it is not valid JSON, 408 when
    it does not arrive within the body timeout (a client sending a byte a minute must not
    hold a handler forever)."""
    timeout = request.app[STATE].body_timeout_s
    try:
        raw = await asyncio.wait_for(request.read(), timeout)  # 413 past client_max_size
    except asyncio.TimeoutError:  # not yet the builtin TimeoutError on Python 3.10
        raise HttpError(408, f"the request body did not arrive within {timeout:g} s") from None
    if not raw.strip():
        if empty is None:
            raise HttpError(400, "the request body is empty; expected a JSON object")
        return empty
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise HttpError(400, f"the request body is not valid JSON: {e}") from None


async def read_object(request: web.Request, *, empty: Any = None) -> dict[str, Any]:
    body = await read_json(request, empty=empty)
    if not isinstance(body, dict):
        raise HttpError(400, f"the request body must be a JSON object, got "
                        f"{json_type(body)}")
    return body


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string",
             list: "an array", dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def brief(value: Any) -> str:
    """`repr(value)` cut short: error messages echo what was sent, never megabytes of it."""
    return reprlib.repr(value)


def check_fields(body: dict[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise HttpError(400, f"unknown field(s) {brief(unknown)[1:-1]}; allowed: "
                        f"{', '.join(allowed)}")


def check_type(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    """`body[name]`, None when absent or null; 400 unless it is one of `kinds` (no bools
    passing for numbers)."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise HttpError(400, f"`{name}` must be {what}, got {json_type(value)}")
    return value


def session_of(body: dict[str, Any]) -> str | None:
    """The body's `session_id` (this server's field on every generation route), checked:
    a non-empty string, or absent."""
    try:
        return check_session_id(body.get("session_id"))
    except InvalidRequest as e:
        raise HttpError(400, str(e)) from None


def flag(body: dict[str, Any], name: str) -> bool:
    """`body[name]` as a boolean (absent or null: False); 400 unless a boolean."""
    return bool(check_type(body, name, (bool,), "a boolean"))
