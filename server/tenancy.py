"""Whose namespace a request's prefixes live in: a tenant's requests are salted by the tenant.

The one namespace every tier keys by is a request's `extra_key` (the L1 and L2 tree's
`match_prefix(key, extra_key)`, the L3 chain's root `PageHasher.root(extra_key)`, and so the
KV events' block hashes). A tenant's request gets

    extra_key = TENANT_PREFIX + JSON [tenant, salt]      salt: its cache_salt / extra_key,
                                                          JSON null when it sent none
    session   = TENANT_PREFIX + hex SHA-256 of JSON [tenant, session_id]

What must stay true: the map from (tenant, salt) to extra_key is one to one, and never meets
what a request without a tenant is keyed by. JSON of a two-item array decodes back to its
pair, so two pairs never share a key; a request without a tenant keeps its salt as it sent it
(today's keys, so a server without tenants, and its stored L3 pages, are exactly as before),
and while tenants are configured such a salt may not start with TENANT_PREFIX. A session id
is a handle nobody types, so a fixed-length digest keeps it within the engine's length limit.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, NamedTuple

from hicache_server.request import InvalidRequest, check_session_id, check_unicode

TENANT_PREFIX = "hicache-tenant:"
# JSON without spaces: the key an operator types to pin a tenant's prefix is exactly this
# text (`TENANT_PREFIX` + `["alice","salt"]`)
_COMPACT = (",", ":")


class Scope(NamedTuple):
    """A request's namespace. `tenant` None: unsalted by a tenant (the operator's key, or no
    tenants configured); `tenants` whether any tenant is configured (then the tenants'
    prefix is reserved)."""

    tenant: str | None = None
    tenants: bool = False

    def extra_key(self, salt: Any, field: str) -> str | None:
        """The engine's `extra_key` for the client's `salt` (`field`: its name as sent);
        InvalidRequest unless a string (or None), or when it takes the tenants' prefix."""
        if salt is not None:
            if not isinstance(salt, str):
                raise InvalidRequest(f"`{field}` must be a string, got {type(salt).__name__}")
            check_unicode(field, salt)
        if self.tenant is None:
            return self._unreserved(field, salt)
        return TENANT_PREFIX + json.dumps([self.tenant, salt], ensure_ascii=False,
                                          separators=_COMPACT)

    def session_id(self, session_id: Any) -> str | None:
        """The engine's session id for the client's (checked as the engine checks it)."""
        session_id = check_session_id(session_id)
        if self.tenant is None or session_id is None:
            return self._unreserved("session_id", session_id)
        pair = json.dumps([self.tenant, session_id], separators=_COMPACT).encode("utf-8")
        return TENANT_PREFIX + hashlib.sha256(pair).hexdigest()

    def _unreserved(self, field: str, value: str | None) -> str | None:
        if self.tenants and value is not None and value.startswith(TENANT_PREFIX):
            raise InvalidRequest(f"`{field}` may not start with {TENANT_PREFIX!r} on a server "
                                 "with tenants (--api-keys-file): that prefix names the "
                                 "tenants' namespaces")
        return value


UNSCOPED = Scope()
