"""OpenAI's completions route.

    POST /v1/completions    {"prompt", "max_tokens", "temperature", "logprobs", "echo", "n",
                             "best_of", "stream", "stream_options", "priority", ...}

docs/http.md has the table of every accepted field. The renamed sampling fields map onto
`sampling_params` (`OPENAI_PARAMS`); the engine's messages about them are answered in the
OpenAI names (`openai_message`). The field policy (`hicache_server.http.fields`) covers the rest:
unknown fields are ignored with one warning, the known ones this server cannot honour
(`COMPLETION_UNSUPPORTED`) are a 400.

A list of prompts answers `n` choices per prompt, indexed prompt-major (choice
`i * n + j` is prompt i's j-th), as OpenAI does. `best_of > n` samples `best_of` per prompt
(one prefill, shared through the tree) and keeps the `n` of highest cumulative logprob; it
cannot be streamed (the best are known only at the end), as in OpenAI. `priority` (vLLM's
extension: an integer, default 0) is every prompt's request priority.
The answers' shapes are built in `hicache_server.http.openai_shapes`.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from hicache_server.http.body import check_type, read_object
from hicache_server.http.discovery import served_model_name
from hicache_server.http.errors import HttpError
from hicache_server.http.fields import Only, check_int, known_fields, refuse_unsupported
from hicache_server.http.generation import LogprobOptions, start_all, submit
from hicache_server.http.native import session_of
from hicache_server.http.offload import off_loop
from hicache_server.http.openai_shapes import (
    Completion,
    CompletionShape,
    completion_chunks,
    completion_response,
)
from hicache_server.http.prompts import any_prompts, check_batch_size
from hicache_server.http.state import live_engine
from hicache_server.http.streaming import json_events, last_results, send_sse
from hicache_server.request import MAX_CHOICES, MAX_TOP_LOGPROBS, InvalidRequest

ROUTE = "POST /v1/completions"
OPENAI_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# OpenAI (or vLLM / SGLang extension) field -> sampling_params field, for fields that are
# passed on as they are (the engine checks their values).
OPENAI_PARAMS = {
    "max_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p",
    "top_k": "top_k", "min_p": "min_p", "stop": "stop", "stop_token_ids": "stop_token_ids",
    "seed": "seed", "ignore_eos": "ignore_eos", "min_tokens": "min_new_tokens",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty", "logit_bias": "logit_bias",
    "skip_special_tokens": "skip_special_tokens",
    "include_stop_str_in_output": "no_stop_trim",  # vLLM's name of SGLang's no_stop_trim
    "no_stop_trim": "no_stop_trim",
}
# How engine messages name a sampling field on this route (the first OpenAI name of each).
_OPENAI_NAMES = {ours: theirs for theirs, ours in reversed(OPENAI_PARAMS.items())}
CONSTRAINED = "constrained decoding (a grammar, schema or regex)"
COMPLETION_UNSUPPORTED = {
    "suffix": Only(None, "a suffix (text inserted after the completion)"),
    "response_format": Only({"type": "text"}, "a response format other than text"),
    "lora_path": Only(None, "a LoRA adapter"),
    "prompt_logprobs": Only(None, "vLLM's prompt_logprobs (send echo with logprobs)"),
    "use_beam_search": Only(False, "beam search"),
    "logits_processors": Only(None, "custom logits processors"),
    **{name: Only(None, CONSTRAINED) for name in (
        "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
        "regex", "json_schema", "ebnf")},
}
COMPLETION_FIELDS = frozenset({
    *OPENAI_PARAMS, *COMPLETION_UNSUPPORTED, "model", "prompt", "max_completion_tokens",
    "stream", "stream_options", "n", "best_of", "user", "logprobs", "echo", "return_token_ids",
    "return_tokens_as_token_ids", "return_cached_tokens_details", "cache_salt", "priority",
    "session_id"})
STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})


def openai_body(body: dict[str, Any], allowed: tuple[str, ...], unsupported: dict[str, Only],
                route: str) -> dict[str, Any]:
    """What both OpenAI routes check first: the field policy (`hicache_server.http.fields`), then
    the string fields every OpenAI body may carry (any model name: one model is served)."""
    body = known_fields(body, allowed, route)
    refuse_unsupported(body, unsupported)
    for name in ("model", "user", "cache_salt"):
        check_type(body, name, (str,), "a string")
    return body


def parse_completion(body: dict[str, Any]) -> Completion:
    """Check the OpenAI fields' shapes and what this server supports; the engine checks the
    sampling values' ranges."""
    body = openai_body(body, COMPLETION_FIELDS, COMPLETION_UNSUPPORTED, ROUTE)
    prompts = any_prompts("prompt", body.get("prompt"))
    n, best_of = _choices(body)
    check_batch_size(len(prompts.items), best_of)
    logprobs = check_int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    stream = flag(body, "stream")
    if stream and best_of > n:
        raise HttpError(400, f"`best_of` ({best_of}) > `n` ({n}) cannot be streamed: the best "
                        "choices are known only once all are done; drop `stream` or `best_of`")
    params, limit_field = openai_sampling_params(body)
    shape = _shape(body, stream)
    return Completion(prompts, {**params, "n": best_of}, n, logprobs, flag(body, "echo"),
                      stream, shape, body.get("cache_salt"), limit_field,
                      request_priority(body), session_of(body))


def request_priority(body: dict[str, Any]) -> int | None:
    """The body's `priority` (vLLM's field on both OpenAI routes); None when absent."""
    return check_type(body, "priority", (int,), "an integer")


def flag(body: dict[str, Any], name: str) -> bool:
    return bool(check_type(body, name, (bool,), "a boolean"))


def _choices(body: dict[str, Any]) -> tuple[int, int]:
    """(n, best_of): best_of defaults to n and must not be below it."""
    n = check_int(body, "n", 1, MAX_CHOICES) or 1
    best_of = check_int(body, "best_of", 1, MAX_CHOICES)
    if best_of is None:
        return n, n
    if best_of < n:
        raise HttpError(400, f"`best_of` must be >= `n` ({n}), got {best_of}")
    return n, best_of


def usage_options(body: dict[str, Any], stream: bool, route: str) -> tuple[bool, bool]:
    """`stream_options` as (a usage chunk ends the stream, usage on every chunk): both only
    when streaming, and continuous stats only with include_usage (as vLLM). Shared with chat
    so that both routes read the options, and warn about unknown ones, the same way."""
    options = check_type(body, "stream_options", (dict,), "an object") or {}
    options = known_fields(options, STREAM_OPTIONS, route, "stream_options.")
    usage = bool(check_type(options, "include_usage", (bool,), "a boolean"))
    continuous = bool(check_type(options, "continuous_usage_stats", (bool,), "a boolean"))
    return stream and usage, stream and usage and continuous


def _shape(body: dict[str, Any], stream: bool) -> CompletionShape:
    usage, continuous = usage_options(body, stream, ROUTE)
    return CompletionShape(
        include_usage=usage, continuous_usage=continuous,
        token_ids=flag(body, "return_token_ids"),
        tokens_as_ids=flag(body, "return_tokens_as_token_ids"))


def openai_sampling_params(body: dict[str, Any],
                           default_max_tokens: int | None = OPENAI_DEFAULT_MAX_TOKENS
                           ) -> tuple[dict[str, Any], str]:
    """`sampling_params` of an OpenAI body (completions' or chat's), and the field that set
    the token limit: `max_completion_tokens` (OpenAI's newer name) wins over `max_tokens`, as
    in vLLM. `default_max_tokens` None leaves the engine's default (chat: SGLang's 128)."""
    params = {OPENAI_PARAMS[k]: v for k, v in body.items() if k in OPENAI_PARAMS and v is not None}
    if default_max_tokens is not None:
        params.setdefault("max_new_tokens", default_max_tokens)
    if body.get("max_completion_tokens") is None:
        return params, "max_tokens"
    return {**params, "max_new_tokens": body["max_completion_tokens"]}, "max_completion_tokens"


def openai_message(message: str, limit_field: str = "max_tokens") -> str:
    """An engine message about `sampling_params.X`, in the OpenAI field's name."""
    message = message.replace("sampling_params.max_new_tokens", limit_field)
    for ours, theirs in _OPENAI_NAMES.items():
        message = message.replace(f"sampling_params.{ours}", theirs)
    return message.replace("sampling_params.", "").replace("`input_ids`", "`prompt`")


def logprob_options(completion: Completion) -> LogprobOptions:
    """What the engine must collect: output logprobs (and the prompt's, from its first token,
    for `echo`) when asked for, or to rank `best_of`'s samples."""
    wanted = completion.logprobs is not None
    if not wanted and completion.sampling_params["n"] == completion.n:
        return LogprobOptions()
    return LogprobOptions(return_logprob=True,
                          logprob_start_len=0 if completion.echo and wanted else -1,
                          top_logprobs_num=completion.logprobs or 0,
                          return_text_in_logprobs=True)


async def handle_completions(request: web.Request) -> web.StreamResponse:
    completion = parse_completion(await read_object(request))
    engine = live_engine(request)
    count = len(completion.prompts.items)  # every prompt is asked the same
    try:
        submitted = await submit(engine, completion.prompts, [completion.sampling_params] * count,
                           [completion.cache_salt] * count, [logprob_options(completion)] * count,
                           [completion.priority] * count, completion.session_id)
    except InvalidRequest as e:
        raise HttpError(400, openai_message(str(e), completion.limit_field)) from None
    streams = await start_all(engine, submitted)
    model = served_model_name(engine)
    if not completion.stream:
        results = await last_results(streams)
        answer = await off_loop(completion_response, completion, submitted, results, model,
                                engine.tokenizer)  # echo decodes the prompts
        return web.json_response(answer)
    chunks = completion_chunks(completion, submitted, streams, model, engine.tokenizer)
    return await send_sse(request, json_events(chunks))
