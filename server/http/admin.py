"""Admin routes: empty cache tiers, read their occupancy; bearer-key or loopback-only access.

    POST /admin/flush                     {"tiers": [...], "unpin": false} (default all three)
                                          -> {"freed": {...}}; pinned pages stay unless
                                          `unpin` (which releases every pin first)
    POST /admin/pin                       {text | input_ids, extra_key, ttl_seconds}: compute
                                          the prefix if needed, keep its whole pages cached
                                          (400 over cache.max_pinned_tokens)
    POST /admin/unpin                     {text | input_ids, extra_key} (404: not pinned)
    GET  /admin/tiers                     capacity / used / evictable / protected / hits, tokens
                                          (storage also: errors, errors_by_op: faults;
                                          cost_model: estimates and decisions)
    POST /flush_cache                     SGLang's alias: flush device and host
    POST /hicache/storage-backend/clear   SGLang's alias: flush storage
    PUT  /hicache/storage-backend         attach L3 at runtime (SGLang's body fields, below)
    DELETE /hicache/storage-backend       detach L3
    GET  /hicache/storage-backend         the attached L3: backend, section, policies

/admin/tiers also has `pinned_tokens`, `max_pinned_tokens`, `pins: [{tokens, extra_key,
expires_in_s}]`, and with `cache.session_retention` `sessions`: `{live_sessions,
owned_device_tokens, owned_host_tokens}`.

Attach and detach (`Engine.attach_storage` / `detach_storage`) answer 200
`{"success": true, "message", ...GET's fields}`, or 400 with the reason (no L2, a bad
backend name or extra config naming its key, L3 attached already, a store that cannot be
opened, or a server that is not idle: SGLang's rule, refused at once rather than waited for).

Access (`admin_guard`): with `server.admin_api_key` set, every admin route needs
`Authorization: Bearer <key>` (401 without a bearer header, 403 with a wrong key); without a
key they answer loopback clients only, and refuse a browser's foreign `Origin` or `Host`
(403). A body must be JSON (`Content-Type: application/json`, 415 otherwise).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any

from aiohttp import web

from hicache.policies import TIERS
from hicache.stats import StorageStats
from hicache_server.engine import Engine
from hicache_server.http.admin_guard import guarded
from hicache_server.http.body import brief, check_fields, check_type, read_object
from hicache_server.http.errors import HttpError
from hicache_server.http.metrics import tier_summaries
from hicache_server.http.offload import off_loop
from hicache_server.http.state import STATE

SGLANG_FLUSH_TIERS = ("device", "host")  # SGLang's /flush_cache empties GPU and host memory
# SGLang's PUT /hicache/storage-backend body (`AttachHiCacheStorageReqInput`)
BACKEND_FIELD = "hicache_storage_backend"
EXTRA_FIELD = "hicache_storage_backend_extra_config_json"
PREFETCH_FIELD = "hicache_storage_prefetch_policy"
WRITE_FIELD = "hicache_write_policy"
ATTACH_FIELDS = (BACKEND_FIELD, EXTRA_FIELD, PREFETCH_FIELD, WRITE_FIELD)


def parse_tiers(body: dict[str, Any]) -> tuple[str, ...]:
    """The `tiers` of a flush body: absent or null means all three."""
    check_fields(body, ("tiers", "unpin"))
    tiers = body.get("tiers")
    if tiers is None:
        return TIERS
    if not isinstance(tiers, list) or not all(isinstance(t, str) for t in tiers):
        raise HttpError(400, f"`tiers` must be an array of tier names ({', '.join(TIERS)}), "
                        f"got {brief(tiers)}")
    if not tiers:
        raise HttpError(400, f"`tiers` is empty; name at least one of {', '.join(TIERS)}, "
                        "or leave it out to flush all three")
    return tuple(dict.fromkeys(tiers))  # duplicates once, order kept


async def _flush(engine: Engine, tiers: Sequence[str], unpin: bool = False) -> web.Response:
    """Waits (off the loop) for running requests and copies, then empties the tiers
    (pinned pages stay unless `unpin`)."""
    freed = await off_loop(partial(engine.flush_cache, tiers, unpin=unpin))
    return web.json_response({"freed": freed, **({"unpinned": True} if unpin else {})})


async def handle_flush(request: web.Request) -> web.Response:
    body = await read_object(request, empty={})
    tiers = parse_tiers(body)
    unpin = check_type(body, "unpin", (bool,), "a boolean") or False
    return await _flush(request.app[STATE].engine, tiers, unpin)


PIN_FIELDS = ("text", "input_ids", "extra_key", "ttl_seconds")


async def handle_pin(request: web.Request) -> web.Response:
    """`{text | input_ids, extra_key, ttl_seconds}` -> `Engine.pin`'s answer."""
    body = await read_object(request)
    check_fields(body, PIN_FIELDS)
    if body.get("ttl_seconds") is None:
        raise HttpError(400, "`ttl_seconds` is required: how long the prefix stays pinned")
    engine = request.app[STATE].engine
    return web.json_response(await off_loop(partial(
        engine.pin, body.get("text"), body.get("input_ids"), body.get("extra_key"),
        ttl_seconds=body["ttl_seconds"])))


async def handle_unpin(request: web.Request) -> web.Response:
    """`{text | input_ids, extra_key}` as pinned -> 200 `{"success": true}`; 404 when that
    prefix is not pinned."""
    body = await read_object(request)
    check_fields(body, PIN_FIELDS[:3])
    engine = request.app[STATE].engine
    done = await off_loop(engine.unpin, body.get("text"), body.get("input_ids"),
                          body.get("extra_key"))
    if not done:
        raise HttpError(404, "that prefix is not pinned (under this extra_key): nothing to "
                        "unpin; GET /admin/tiers lists the pins")
    return web.json_response({"success": True})


async def handle_sglang_flush(request: web.Request) -> web.Response:
    return await _flush(request.app[STATE].engine, SGLANG_FLUSH_TIERS)


async def handle_storage_clear(request: web.Request) -> web.Response:
    return await _flush(request.app[STATE].engine, ("storage",))


async def handle_storage_attach(request: web.Request) -> web.Response:
    body = await read_object(request)
    check_fields(body, ATTACH_FIELDS)
    backend = check_type(body, BACKEND_FIELD, (str,), "a backend name")
    if backend is None:
        raise HttpError(400, f"`{BACKEND_FIELD}` is required: the L3 backend to attach")
    extra = check_type(body, EXTRA_FIELD, (str, dict),
                       "a JSON object, or a string of one")
    prefetch = check_type(body, PREFETCH_FIELD, (str,), "a prefetch policy name")
    write = check_type(body, WRITE_FIELD, (str,), "a write policy name")
    engine = request.app[STATE].engine
    return web.json_response(await off_loop(partial(
        engine.attach_storage, backend, extra, prefetch_policy=prefetch, write_policy=write)))


async def handle_storage_detach(request: web.Request) -> web.Response:
    engine = request.app[STATE].engine
    return web.json_response(await off_loop(engine.detach_storage))


async def handle_storage_backend(request: web.Request) -> web.Response:
    engine = request.app[STATE].engine
    return web.json_response(await off_loop(engine.storage_backend))


def cost_model(storage: StorageStats) -> dict[str, Any]:
    """What the storage tier's cost model estimates (None until it has enough observations)
    and what it decided: hits split into a computed head and a fetched tail, hits recomputed."""
    c = storage.counters
    estimates = storage.estimates._asdict() if storage.estimates is not None else {}
    return {**estimates, "split_prefetches": c.split_prefetches, "head_tokens": c.head_tokens,
            "recomputed_hits": c.recomputed_hits,
            "recomputed_hit_tokens": c.recomputed_hit_tokens}


async def handle_tiers(request: web.Request) -> web.Response:
    engine = request.app[STATE].engine
    stats = await off_loop(engine.cache_stats)
    summaries = tier_summaries(stats)
    tiers = {t: s._asdict() for t, s in summaries.items()}
    if stats.device.windows is not None:  # a hybrid model: L1's window layers
        tiers["device"]["window_layers"] = dataclasses.asdict(stats.device.windows)
    if stats.storage is not None:  # faults turned into misses / skipped writes, per operation
        tiers["storage"]["errors"] = stats.storage.errors
        tiers["storage"]["errors_by_op"] = dict(stats.storage.errors_by_op)
        tiers["storage"]["cost_model"] = cost_model(stats.storage)
    out = {"unit": "tokens", "page_size": engine.config.cache.page_size, "tiers": tiers}
    if stats.sessions is not None:
        out["sessions"] = dataclasses.asdict(stats.sessions)
    if stats.pins is not None:
        out["pinned_tokens"] = stats.pins.pinned_tokens
        out["max_pinned_tokens"] = stats.pins.max_pinned_tokens
        out["pins"] = list(stats.pins.pins)
    return web.json_response(out)


# (path, method, handler); every path is in loopback_guard.ADMIN_PATHS, which the router guards
ADMIN_ROUTES = (("/admin/flush", "POST", handle_flush), ("/admin/tiers", "GET", handle_tiers),
                ("/admin/pin", "POST", handle_pin), ("/admin/unpin", "POST", handle_unpin),
                ("/flush_cache", "POST", handle_sglang_flush),
                ("/hicache/storage-backend/clear", "POST", handle_storage_clear),
                ("/hicache/storage-backend", "PUT", handle_storage_attach),
                ("/hicache/storage-backend", "DELETE", handle_storage_detach),
                ("/hicache/storage-backend", "GET", handle_storage_backend))


def add_admin_routes(app: web.Application, engine: Engine, api_key: str | None) -> None:
    """Add the admin routes to an app from `hicache_server.http.app.create_app(engine)`."""
    if STATE not in app or app[STATE].engine is not engine:
        raise ValueError("add_admin_routes needs the app that create_app built for this engine")
    for path, method, handler in ADMIN_ROUTES:
        app.router.add_route(method, path, guarded(handler, api_key))
