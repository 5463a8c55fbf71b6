"""OpenAI-compatible routes.

    POST /v1/completions    {"prompt", "max_tokens", "temperature", "top_p", "stop", ...}
    GET  /v1/models         the one model served

A completion's OpenAI fields map onto `sampling_params` (`OPENAI_PARAMS`); the engine's
messages about them are answered in the OpenAI names (`openai_message`). Streams are
`text_completion` chunks carrying text deltas, with a usage chunk last when asked for.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from aiohttp import web

from server.http.body import check_fields, check_type, json_type, read_object
from server.http.errors import HttpError
from server.http.state import STATE, live_engine
from server.http.streaming import json_events, last_result, send_sse, start_stream
from server.request import InvalidRequest

OPENAI_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
COMPLETION_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stop",
                     "seed", "ignore_eos", "stream", "stream_options", "n", "user")
# OpenAI field -> sampling_params field (top_k and ignore_eos: the vLLM/SGLang extensions)
OPENAI_PARAMS = {"max_tokens": "max_new_tokens", "temperature": "temperature",
                 "top_p": "top_p", "top_k": "top_k", "stop": "stop", "seed": "seed",
                 "ignore_eos": "ignore_eos"}
REPLACEMENT_CHAR = "\ufffd"  # what decoding an unfinished UTF-8 sequence ends with


class Completion(NamedTuple):
    text: str | None
    input_ids: list[int] | None
    sampling_params: dict[str, Any]
    stream: bool
    include_usage: bool


def parse_completion(body: dict[str, Any]) -> Completion:
    """Check the OpenAI fields' shapes; the engine checks the values' ranges."""
    check_fields(body, COMPLETION_FIELDS)
    check_type(body, "model", (str,), "a string")  # any name: one model is served (SGLang)
    check_type(body, "user", (str,), "a string")
    if check_type(body, "n", (int,), "an integer") not in (None, 1):
        raise HttpError(400, f"`n` must be 1 (one choice per request), got {body['n']}")
    stream = bool(check_type(body, "stream", (bool,), "a boolean"))
    options = check_type(body, "stream_options", (dict,), "an object") or {}
    check_fields(options, ("include_usage",))
    usage = check_type(options, "include_usage", (bool,), "a boolean")
    text, ids = _prompt(body.get("prompt"))
    params = {OPENAI_PARAMS[k]: v for k, v in body.items() if k in OPENAI_PARAMS and v is not None}
    params.setdefault("max_new_tokens", OPENAI_DEFAULT_MAX_TOKENS)
    return Completion(text, ids, params, stream, bool(usage))


def _prompt(prompt: Any) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise HttpError(400, "`prompt`: a batch of prompts is not supported; send one "
                        "request per prompt")
    raise HttpError(400, f"`prompt` must be a string or an array of token ids (integers), "
                    f"got {json_type(prompt)}")


def openai_message(message: str) -> str:
    """An engine message about `sampling_params.X`, in the OpenAI field's name."""
    for openai, ours in OPENAI_PARAMS.items():
        message = message.replace(f"sampling_params.{ours}", openai)
    return message.replace("`input_ids`", "`prompt`")


def _usage(meta: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": meta["cached_tokens"]}}


def _completion(model: str, choices: list[dict[str, Any]], cid: str | None = None
                ) -> dict[str, Any]:
    return {"id": cid or f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": model, "choices": choices}


def _choice(text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}


def completion_response(result: dict[str, Any], model: str) -> dict[str, Any]:
    meta = result["meta_info"]
    out = _completion(model, [_choice(result["text"], meta["finish_reason"])])
    return {**out, "usage": _usage(meta)}


async def completion_chunks(results: AsyncIterator[dict], model: str, stop: tuple[str, ...],
                            include_usage: bool) -> AsyncIterator[dict[str, Any]]:
    """OpenAI chunks carrying text deltas. Until the end, the tail that could still become a
    stop string (cut from the final text) or an unfinished UTF-8 character is held back, so a
    delta is never taken back."""
    cid, hold, sent = f"cmpl-{uuid.uuid4().hex}", max(map(len, stop), default=1) - 1, ""
    meta: dict[str, Any] = {}
    try:
        async for result in results:
            meta = result["meta_info"]
            final = meta["finish_reason"] is not None
            text = result["text"]
            visible = text if final else text[:len(text) - hold].rstrip(REPLACEMENT_CHAR)
            delta = visible[len(sent):] if visible.startswith(sent) else ""
            sent = visible if visible.startswith(sent) else sent
            if delta or final:
                yield _completion(model, [_choice(delta, meta["finish_reason"])], cid)
    finally:
        await results.aclose()  # a client gone: its request is aborted now
    if include_usage and meta:
        yield {**_completion(model, [], cid), "usage": _usage(meta)}


async def handle_completions(request: web.Request) -> web.StreamResponse:
    parsed = parse_completion(await read_object(request))
    engine = live_engine(request)
    model = engine.config.model.path
    try:
        req = engine.make_request(parsed.text, parsed.input_ids, parsed.sampling_params)
    except InvalidRequest as e:
        raise HttpError(400, openai_message(str(e))) from None
    results = await start_stream(engine, req)
    if not parsed.stream:
        return web.json_response(completion_response(await last_result(results), model))
    chunks = completion_chunks(results, model, req.params.stop, parsed.include_usage)
    return await send_sse(request, json_events(chunks))


async def handle_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    card = {"id": state.engine.config.model.path, "object": "model", "created": state.started,
            "owned_by": "hicache", "max_model_len": state.engine.context_len}
    return web.json_response({"object": "list", "data": [card]})
