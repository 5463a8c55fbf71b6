"""The inference routes' bearer key (OpenAI's `Authorization: Bearer KEY`, vLLM's and
SGLang's --api-key) and the tenant a key names.

    protected(handler)    the handler behind the key check: 401 with `WWW-Authenticate: Bearer`
                          when the server has keys and the request's is missing or wrong;
                          else the request's `Scope` is stored for `scope_of`
    scope_of(request)     the namespace a route hands the engine (UNSCOPED on an open server
                          or for the operator's key)

`create_app` wraps every generation, tokenize, session and model/info route; /health and
/metrics stay open (as in vLLM), and the admin routes keep their own key
(`hicache_server.http.admin`). No message here names what was sent: a key is never echoed.
"""

from __future__ import annotations

from aiohttp import web

from hicache_server.api_keys import ApiKeys, bearer_token
from hicache_server.http.errors import HttpError
from hicache_server.http.state import STATE, Handler
from hicache_server.tenancy import UNSCOPED, Scope

# RFC 6750 section 3: the challenge of a 401; `invalid_token` when a key was sent and is wrong
CHALLENGE = {"WWW-Authenticate": "Bearer"}
WRONG_KEY_CHALLENGE = {"WWW-Authenticate": 'Bearer error="invalid_token"'}
SCOPE = web.RequestKey("hicache_scope", Scope)


def caller_scope(keys: ApiKeys, authorization: str | None) -> Scope:
    """The namespace of a request with this Authorization header; HttpError 401 when the
    server has keys and the header carries none of them."""
    if not keys.required:
        return UNSCOPED
    token = bearer_token(authorization)
    if token is None:
        raise HttpError(401, "this route needs an API key: send the header "
                        "`Authorization: Bearer <API key>`", headers=CHALLENGE)
    identity = keys.identify(token)
    if identity is None:
        raise HttpError(401, "the API key in the Authorization header is not valid",
                        headers=WRONG_KEY_CHALLENGE)
    return Scope(identity.tenant, keys.has_tenants)


def protected(handler: Handler) -> Handler:
    """`handler`, run only for a request with a valid key (when the server has keys)."""
    async def with_key(request: web.Request) -> web.StreamResponse:
        keys = request.app[STATE].api_keys
        request[SCOPE] = caller_scope(keys, request.headers.get("Authorization"))
        return await handler(request)

    return with_key


def scope_of(request: web.Request) -> Scope:
    """The namespace `protected` found for this request. A KeyError (a 500) for a route
    `create_app` left unwrapped: a bug to fix, never a request served in the wrong namespace."""
    return request[SCOPE]
