"""The one error shape every route answers with, and the exceptions that map onto it.

    {"error": {"message": ..., "type": ERROR_TYPES[status], "code": status}}

`HttpError` is a client error with its status; `RequestFailed` is the engine failing one
request (a 500). `hicache_server.http.app.error_middleware` turns both, and the engine's own
exceptions, into this shape.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               408: "timeout_error", 413: "invalid_request_error",
               415: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
               503: "unavailable_error"}


class RequestFailed(Exception):
    """The engine failed this request (logged there with its traceback): an HTTP 500."""


class HttpError(Exception):
    """A client error with its status, turned into the JSON error shape by the middleware."""

    def __init__(self, status: int, message: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers  # e.g. a 429's Retry-After


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"),
                      "code": status}}


def error_response(status: int, message: str,
                   headers: dict[str, str] | None = None) -> web.Response:
    """The one error shape every route answers with."""
    return web.json_response(error_body(status, message), status=status, headers=headers)


def request_failure(meta: dict[str, Any]) -> str | None:
    """Why the engine failed this request (its meta_info's finish_reason "error"), None
    when it did not."""
    if meta.get("finish_reason") != "error":
        return None
    return meta.get("error") or "the server failed while serving this request"
