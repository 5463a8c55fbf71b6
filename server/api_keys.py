"""Who may call the inference routes: the operator's key (`server.api_key`, `--api-key`,
HICACHE_API_KEY) and the tenants of `server.api_keys_file` (`--api-keys-file`), read once at
start-up.

    {"alice": "sk-alice-...", "bob": "sk-bob-..."}      the file: tenant name -> key

A key sent as `Authorization: Bearer KEY` names an `Identity`: a tenant, or the operator
(`tenant` None: served unsalted, exactly as a server without tenants serves everyone). What
must stay true: no key names two identities, so a request is never served in a namespace it
was not meant for; no key is ever put in an error message, a log line or a response.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

BEARER = "bearer"  # the auth scheme, compared case-insensitively (RFC 9110 section 11.1)

logger = logging.getLogger(__name__)

# A key travels in an HTTP header and the bearer token is read stripped: only visible ASCII
# (RFC 9110's VCHAR, 0x21-0x7E) arrives byte for byte from every client, so a key with a
# space, a control character or non-ASCII text could never match and is refused at start.
KEY_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F))
# Bytes of a key's SHA-256 digest that pick its lookup bucket: 64 bits, so a bucket holds one
# key unless two digests share a prefix, which for any real number of tenants never happens.
BUCKET_BYTES = 8


class ApiKeysError(ValueError):
    """The keys cannot be used: the message names the file (or flag) and what is wrong, never
    a key."""


class Identity(NamedTuple):
    """Whom a valid key names. `tenant` None: the operator's own key (`--api-key`)."""

    tenant: str | None


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


@dataclass(frozen=True, eq=False)
class ApiKeys:
    """The keys the inference routes take; none at all (`OPEN`): the routes are open.

    Lookup: a sent token's SHA-256 digest picks a bucket by its first bytes, and
    `hmac.compare_digest` compares it with the bucket's digests. The time a lookup takes
    depends on the digest of what was sent, which tells a caller nothing about any key's
    bytes, and stays O(1) however many tenants there are (the event loop runs it on every
    request)."""

    buckets: Mapping[bytes, tuple[tuple[bytes, Identity], ...]]  # digest[:BUCKET_BYTES] ->
    tenant_names: tuple[str, ...]  # sorted

    @property
    def required(self) -> bool:
        """Whether the inference routes need a key."""
        return bool(self.buckets)

    @property
    def has_tenants(self) -> bool:
        return bool(self.tenant_names)

    def identify(self, token: bytes) -> Identity | None:
        """The identity `token` (the bearer token's bytes as sent) names; None: no such key."""
        digest = _digest(token)
        for known, identity in self.buckets.get(digest[:BUCKET_BYTES], ()):
            if hmac.compare_digest(known, digest):
                return identity
        return None

    @classmethod
    def of(cls, api_key: str | None, tenants: Mapping[str, str],
           source: str = "--api-keys-file") -> ApiKeys:
        """From the operator's key and the tenants (name -> key), checked: ApiKeysError when
        a key has characters a bearer header cannot carry or two identities share one key
        (`source` names where the tenants came from, for the message)."""
        owners: dict[bytes, str] = {}
        buckets: dict[bytes, tuple[tuple[bytes, Identity], ...]] = {}
        entries = ([] if api_key is None else [(None, api_key)]) + sorted(tenants.items())
        for tenant, key in entries:
            name = "--api-key" if tenant is None else f"tenant {tenant!r}"
            who = name if tenant is None else f"{source}: {name}"
            _check_key(who, key)
            digest = _digest(key.encode("ascii"))
            if digest in owners:
                raise ApiKeysError(f"{who} has the same key as {owners[digest]}; every "
                                   "tenant needs a key of its own, different from --api-key")
            owners[digest] = name
            bucket = digest[:BUCKET_BYTES]
            buckets[bucket] = (*buckets.get(bucket, ()), (digest, Identity(tenant)))
        return cls(buckets, tuple(sorted(tenants)))


OPEN = ApiKeys({}, ())


def _check_key(who: str, key: str) -> None:
    if not key:
        raise ApiKeysError(f"{who}: the key is empty")
    if not set(key) <= KEY_CHARS:
        raise ApiKeysError(f"{who}: a key may hold only visible ASCII characters (no spaces, "
                           "control characters or non-ASCII text), as an Authorization "
                           "header carries it")


def load_api_keys(api_key: str | None, api_keys_file: str | None) -> ApiKeys:
    """The operator's key and the tenants of `api_keys_file` (read now, once); ApiKeysError
    naming the file and what is wrong with it."""
    tenants = read_tenants(api_keys_file) if api_keys_file is not None else {}
    source = f"--api-keys-file {api_keys_file}"
    return ApiKeys.of(api_key, tenants, source) if api_key or tenants else OPEN


def read_tenants(path: str) -> dict[str, str]:
    """The tenants of the keys file at `path`: a JSON object of tenant name to key."""
    where = f"--api-keys-file {path}"
    try:
        with open(os.path.expanduser(path), "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            raw = f.read()
    except OSError as e:
        raise ApiKeysError(f"{where}: cannot read it: {e.strerror or e}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("%s is readable by other users (mode %o); chmod 600 it, it holds "
                       "keys", where, stat.S_IMODE(mode))
    try:
        # the decoder's message names a line and column, never the text there (a key)
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_names(where))
    except UnicodeDecodeError:
        raise ApiKeysError(f"{where}: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ApiKeysError(f"{where}: not valid JSON ({e.msg} at line {e.lineno}, column "
                           f"{e.colno})") from None
    return _tenants(where, data)


def _unique_names(where: str) -> Any:
    """A JSON `object_pairs_hook` refusing an object that names one field twice (json keeps
    the last silently: a tenant would lose a key without a word)."""
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, value in items:
            if name in out:
                raise ApiKeysError(f"{where}: tenant {name!r} is named twice")
            out[name] = value
        return out
    return pairs


def _tenants(where: str, data: Any) -> dict[str, str]:
    if not isinstance(data, dict):
        raise ApiKeysError(f"{where}: must be a JSON object of tenant name to key, like "
                           f'{{"alice": "KEY"}}, got a JSON {_json_type(data)}')
    if not data:
        raise ApiKeysError(f"{where}: names no tenant; give at least one, like "
                           '{"alice": "KEY"}, or leave --api-keys-file out')
    for name, key in data.items():
        if not name.strip():
            raise ApiKeysError(f"{where}: a tenant name is empty; name every tenant")
        if not _is_text(name):
            raise ApiKeysError(f"{where}: tenant name {name!r} is not valid Unicode")
        if not isinstance(key, str):
            raise ApiKeysError(f"{where}: tenant {name!r}: the key must be a string, got a "
                               f"JSON {_json_type(key)}")
    return dict(data)


def _is_text(name: str) -> bool:
    try:
        name.encode("utf-8")  # JSON can carry a lone surrogate, which has no UTF-8 form
    except UnicodeEncodeError:
        return False
    return True


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
             float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def bearer_token(authorization: str | None) -> bytes | None:
    """The token of an `Authorization: Bearer TOKEN` header as the client sent its bytes;
    None without one."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if scheme.lower() != BEARER or not token:
        return None
    # aiohttp hands header bytes that are not UTF-8 over as lone surrogates (surrogateescape):
    # encoding them back the same way gives the bytes the client sent
    return token.encode("utf-8", "surrogateescape")
