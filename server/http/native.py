"""SGLang's native routes.

    POST /close_session {"session_id"} -> {"success", "message"}
    POST /generate    {"text" | "input_ids", "sampling_params", "stream", "rid",
                       "return_logprob", "logprob_start_len", "top_logprobs_num",
                       "return_text_in_logprobs", "extra_key" | "cache_salt", "priority",
                       "session_id" | "session_params",
                       ...}

The answer is the engine's result (`text`, `output_ids`, `meta_info`); with
`"stream": true`, one such result per update (a token, or the tokens that came while the
client was reading), each carrying the text so far. A batch
(`text` as a list of strings, `input_ids` as a list of id lists) or `sampling_params.n > 1`
answers a list of results, prompt-major (prompt i's j-th sample at `i * n + j`); streamed,
each event is one of them with its place in that list as `index`, as SGLang streams a batch.

`rid` names the request in `meta_info.id` (a list: one per prompt; a string for a batch:
`{rid}_{i}` for prompt i, as SGLang expands it; n > 1: `{id}_{j}` for sample j). Inside the
engine each request keeps a unique id of its own, so two clients sending the same `rid`
never abort or mix up each other's requests. `priority` (SGLang's: an integer, default 0; a
list for a batch) keeps the prompt's cache entries longer under the `priority` eviction
policy. `session_id` (a string; or SGLang's `session_params: {"id": ...}`, its `id` only)
names the session whose prefixes the cache keeps longer (`--enable-session-radix-cache`;
POST /close_session ends it). docs/http.md has the table of every field. On a server with
tenants (`--api-keys-file`) both `extra_key` and `session_id` are the caller's tenant's own
(`hicache_server.tenancy`): another tenant's same salt or session id names something else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from aiohttp import web

from hicache_server.field_names import FieldNames
from hicache_server.http.auth import scope_of
from hicache_server.http.body import brief, check_fields, check_type, read_object, session_of
from hicache_server.http.errors import HttpError
from hicache_server.http.fields import Only, known_fields, refuse_unsupported
from hicache_server.http.generation import LogprobOptions, Submitted, start_all, submit
from hicache_server.http.offload import off_loop
from hicache_server.http.prompts import (
    Prompts,
    check_batch_size,
    id_prompts,
    per_prompt,
    text_prompts,
)
from hicache_server.http.state import live_engine
from hicache_server.http.streaming import json_events, last_results, merged, send_sse
from hicache_server.output import Delta, Logprobs
from hicache_server.request import Request, SamplingParams
from hicache_server.updates import Update

ROUTE = "POST /generate"
GENERATE_UNSUPPORTED = {
    "lora_path": Only(None, "a LoRA adapter"), "lora_id": Only(None, "a LoRA adapter"),
    "input_embeds": Only(None, "a prompt given as embeddings"),
    "image_data": Only(None, "image input"), "video_data": Only(None, "video input"),
    "audio_data": Only(None, "audio input"),
    "return_hidden_states": Only(False, "returning hidden states"),
    "return_routed_experts": Only(False, "returning routed experts (a mixture of experts')"),
    "custom_logit_processor": Only(None, "a custom logit processor"),
    "token_ids_logprob": Only(None, "logprobs of chosen token ids"),
    "return_entropy": Only(False, "returning the entropy"),
}
SAMPLING_UNSUPPORTED = {name: Only(None, "constrained decoding (a grammar, schema or regex)")
                        for name in ("regex", "json_schema", "ebnf", "structural_tag",
                                     "stop_regex")}
LOGPROB_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num",
                  "return_text_in_logprobs")
GENERATE_FIELDS = frozenset({
    "text", "input_ids", "sampling_params", "stream", "stream_options", "rid", "extra_key",
    "cache_salt", "return_cached_tokens_details", "priority", "session_id", "session_params",
    *LOGPROB_FIELDS,
    *GENERATE_UNSUPPORTED})
# Accepted and without effect: every event's meta_info already carries the token counts.
STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})


def sampling_fields() -> frozenset[str]:
    """The engine's `sampling_params` fields (read from it: a field it adds is known here)."""
    return frozenset(f.name for f in dataclasses.fields(SamplingParams))


class Generate(NamedTuple):
    prompts: Prompts
    sampling_params: list[dict[str, Any]]  # one per prompt
    rids: list[str | None]  # the client's id of each prompt
    extra_keys: list[str | None]
    logprobs: list[LogprobOptions]
    stream: bool
    priorities: list[int | None]  # one per prompt; None: the default
    session_id: str | None = None  # every prompt's; None: no session
    salt_field: str = "extra_key"  # the name the client gave the salt (or `cache_salt`)


def parse_generate(body: dict[str, Any]) -> Generate:
    body = known_fields(body, GENERATE_FIELDS, ROUTE)
    refuse_unsupported(body, GENERATE_UNSUPPORTED)
    stream = bool(check_type(body, "stream", (bool,), "a boolean"))
    options = check_type(body, "stream_options", (dict,), "an object") or {}
    known_fields(options, STREAM_OPTIONS, ROUTE, "stream_options.")
    prompts = _prompts(body)
    count, batch = len(prompts.items), prompts.batch
    params = [_sampling_params(p) for p in per_prompt("sampling_params",
                                                      body.get("sampling_params"), count, batch)]
    check_batch_size(count, max(_choices(p) for p in params))
    salt_field, extra_keys = _extra_keys(body, count, batch)
    return Generate(prompts, params, _rids(body.get("rid"), count, batch), extra_keys,
                    _logprobs(body, count, batch), stream,
                    _priorities(body.get("priority"), count, batch),
                    _session_params(body), salt_field)


def _session_params(body: dict[str, Any]) -> str | None:
    """`session_id`, or SGLang's `session_params: {"id": ...}` (its `id` only: this server
    keeps a session's prefixes cached, it does not branch or replace a session's turns)."""
    session_id = session_of(body)
    params = body.get("session_params")
    if params is None:
        return session_id
    if not isinstance(params, dict):
        raise HttpError(400, f"`session_params` must be an object like {{\"id\": "
                        f"\"<session id>\"}}, got {brief(params)}")
    other = sorted(k for k, v in params.items() if k != "id" and v not in (None, False))
    if other:
        raise HttpError(400, f"session_params: {', '.join(other)} not supported; this server "
                        "takes `session_params.id` only (the session whose prefixes it keeps "
                        "cached), not SGLang's branching of a session's turns")
    sid = session_of({"session_id": params.get("id")})
    if session_id is not None and sid is not None and sid != session_id:
        raise HttpError(400, f"`session_id` ({session_id!r}) and `session_params.id` "
                        f"({sid!r}) name different sessions; give one")
    return session_id if sid is None else sid


def _prompts(body: dict[str, Any]) -> Prompts:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise HttpError(400, "give exactly one of `text` or `input_ids`")
    return text_prompts("text", text) if text is not None else id_prompts("input_ids", ids)


def _sampling_params(params: Any) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise HttpError(400, "`sampling_params` must be an object (or, for a batch, an array "
                        "of one object per prompt)")
    refuse_unsupported(params, SAMPLING_UNSUPPORTED, "sampling_params.")
    return known_fields(params, sampling_fields(), ROUTE, "sampling_params.")


def _choices(params: dict[str, Any]) -> int:
    n = params.get("n")
    return n if isinstance(n, int) and n > 0 else 1  # the engine checks n itself


def _rids(rid: Any, count: int, batch: bool) -> list[str | None]:
    if batch and isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(count)]
    rids = per_prompt("rid", rid, count, batch)
    if not all(r is None or isinstance(r, str) for r in rids):
        raise HttpError(400, "`rid` must be a string (or, for a batch, an array of one string "
                        "per prompt)")
    return rids


def _extra_keys(body: dict[str, Any], count: int, batch: bool
                ) -> tuple[str, list[str | None]]:
    """The name the client gave the cache namespace, and each prompt's."""
    if body.get("extra_key") is not None and body.get("cache_salt") is not None:
        raise HttpError(400, "give at most one of `extra_key` or `cache_salt` (both name "
                        "the cache namespace)")
    name = "cache_salt" if body.get("cache_salt") is not None else "extra_key"
    return name, per_prompt(name, body.get(name), count, batch)


def _priorities(priority: Any, count: int, batch: bool) -> list[int | None]:
    priorities = per_prompt("priority", priority, count, batch)
    if not all(p is None or (isinstance(p, int) and not isinstance(p, bool))
               for p in priorities):
        raise HttpError(400, f"`priority` must be an integer (or, for a batch, an array of "
                        f"one integer per prompt), got {brief(priority)}")
    return priorities


def _logprobs(body: dict[str, Any], count: int, batch: bool) -> list[LogprobOptions]:
    """Each prompt's logprob options (the engine checks their values)."""
    columns = {name: per_prompt(name, body.get(name), count, batch) for name in LOGPROB_FIELDS}
    return [LogprobOptions.of({name: columns[name][i] for name in LOGPROB_FIELDS})
            for i in range(count)]


async def handle_close_session(request: web.Request) -> web.Response:
    """SGLang's POST /close_session `{"session_id"}`: the session's prefixes lose their
    retention. An id that is not open (unknown, closed, timed out, or retention off) is
    200 `{"success": false}`, as SGLang answers 200 and only logs it."""
    body = await read_object(request)
    check_fields(body, ("session_id",))
    session_id = session_of(body)
    if session_id is None:
        raise HttpError(400, "`session_id` is required: the session to close")
    engine = live_engine(request)
    closed = await off_loop(engine.close_session, scope_of(request).session_id(session_id))
    message = (f"session {session_id!r} closed" if closed else
               f"session {session_id!r} is not open (never used, closed or timed out"
               + ("" if engine.config.cache.session_retention else
                  "; session retention is off: start with --enable-session-radix-cache")
               + "); nothing changed")
    return web.json_response({"success": closed, "message": message})


async def handle_generate(request: web.Request) -> web.StreamResponse:
    generate = parse_generate(await read_object(request))
    engine = live_engine(request)
    submitted = await submit(engine, generate.prompts, generate.sampling_params,
                             generate.extra_keys, generate.logprobs, generate.priorities,
                             generate.session_id,
                             FieldNames({"extra_key": generate.salt_field}),
                             scope=scope_of(request))
    streams = await start_all(engine, submitted)
    rids = _choice_ids(generate, submitted)
    one = not generate.prompts.batch and len(streams) == 1
    if not generate.stream:
        results = [_named(r, rid) for r, rid in zip(await last_results(streams), rids)]
        return web.json_response(results[0] if one else results)
    events = [_snapshots(s, req, rid)
              for s, (_, req), rid in zip(streams, submitted.choices(), rids)]
    return await send_sse(request, json_events(events[0] if one else _indexed(events)))


def _choice_ids(generate: Generate, submitted: Submitted) -> list[str | None]:
    """The client's id of each choice, in `submitted.choices()` order."""
    out = []
    for i, group in enumerate(submitted.groups):
        rid = generate.rids[i]
        out += [rid if rid is None or len(group) == 1 else f"{rid}_{j}"
                for j in range(len(group))]
    return out


def _named(result: dict, rid: str | None) -> dict:
    """`result` with the client's `rid` as meta_info.id (when it sent one)."""
    if rid is None:
        return result
    return {**result, "meta_info": {**result["meta_info"], "id": rid}}


class _SoFar:
    """A request's output so far, from its deltas: SGLang's /generate streams each event
    as the whole result so far (its text and ids, not what is new), so this route, alone,
    builds a snapshot per event."""

    def __init__(self, req: Request) -> None:
        self.text, self.ids, self.logprobs = "", [], Logprobs()
        self.with_logprobs, self.with_top = req.input.return_logprob, req.input.top_logprobs_num > 0

    def add(self, delta: Delta) -> dict[str, Any]:
        self.text += delta.text
        self.ids += delta.ids
        self.logprobs.extend(delta.logprobs)
        meta = delta.meta
        if self.with_logprobs:
            meta = {**meta, **self.logprobs.meta(self.with_top)}
        return {"text": self.text, "output_ids": list(self.ids), "meta_info": meta}


async def _snapshots(updates: AsyncIterator[Update], req: Request, rid: str | None
                     ) -> AsyncIterator[dict]:
    """SGLang's stream events of one request, with the client's `rid`."""
    so_far = _SoFar(req)
    try:
        async for update in updates:
            snapshot = so_far.add(update.delta)
            yield _named(update.result or snapshot, rid)
    finally:
        await updates.aclose()  # type: ignore[attr-defined]


async def _indexed(streams: list[AsyncIterator[dict]]) -> AsyncIterator[dict]:
    """A batch's events as they come, each with its place in the batch's answer."""
    events = merged(streams)
    try:
        async for i, result in events:
            yield {**result, "index": i}
    finally:
        await events.aclose()
