"""What both OpenAI routes (/v1/completions, /v1/chat/completions) read from a body the
same way: the renamed sampling fields (`OPENAI_PARAMS`), the fields this server refuses on
both (`OPENAI_UNSUPPORTED`), `stream_options`, `priority`, and the names the engine's
errors use for them (`openai_names`). Neither route imports the other; both import this.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from hicache_server.field_names import FieldNames
from hicache_server.http.body import check_type, flag, session_of
from hicache_server.http.fields import Only, known_fields, refuse_unsupported

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
# How the engine's errors name a sampling field on these routes (its first OpenAI name).
_OPENAI_NAMES = {ours: theirs for theirs, ours in reversed(OPENAI_PARAMS.items())}
CONSTRAINED = "constrained decoding (a grammar, schema or regex)"
OPENAI_UNSUPPORTED = {
    "response_format": Only({"type": "text"}, "a response format other than text"),
    "lora_path": Only(None, "a LoRA adapter"),
    "use_beam_search": Only(False, "beam search"),
    "logits_processors": Only(None, "custom logits processors"),
    **{name: Only(None, CONSTRAINED) for name in (
        "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
        "regex", "json_schema", "ebnf")},
}
# The fields both routes know (each adds its own).
OPENAI_FIELDS = frozenset({
    *OPENAI_PARAMS, *OPENAI_UNSUPPORTED, "model", "max_completion_tokens", "stream",
    "stream_options", "n", "user", "logprobs", "return_token_ids",
    "return_cached_tokens_details", "cache_salt", "priority", "session_id"})
STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})


class OpenAIRequest(NamedTuple):
    """What both OpenAI routes read alike from a body (`read_openai`)."""

    body: dict[str, Any]  # the known fields: the route reads its own from here
    sampling_params: dict[str, Any]
    limit_field: str  # the field that set max_new_tokens
    stream: bool
    include_usage: bool  # a usage chunk ends the stream
    continuous_usage: bool  # usage on every chunk (vLLM's continuous_usage_stats)
    cache_salt: str | None
    priority: int | None  # vLLM's field; eviction under --radix-eviction-policy priority
    session_id: str | None  # the session whose prefixes stay cached longer


def read_openai(body: dict[str, Any], allowed: frozenset[str], unsupported: dict[str, Only],
                route: str, default_max_tokens: int | None) -> OpenAIRequest:
    """The field policy (`hicache_server.http.fields`), the string fields every OpenAI body
    may carry (any model name: one model is served), then what both routes read alike."""
    body = known_fields(body, allowed, route)
    refuse_unsupported(body, unsupported)
    for name in ("model", "user", "cache_salt"):
        check_type(body, name, (str,), "a string")
    stream = flag(body, "stream")
    usage, continuous = _usage_options(body, stream, route)
    params, limit_field = _sampling_params(body, default_max_tokens)
    priority = check_type(body, "priority", (int,), "an integer")
    return OpenAIRequest(body, params, limit_field, stream, usage, continuous,
                         body.get("cache_salt"), priority, session_of(body))


def openai_names(limit_field: str, prompt_field: str, top_field: str) -> FieldNames:
    """The engine's fields as a client of an OpenAI route names them: the sampling fields
    by their OpenAI names, the token limit as the field that set it, the prompt
    (`prompt` or `messages`), the logprobs' top-k (`logprobs` or `top_logprobs`)."""
    return FieldNames({**_OPENAI_NAMES, "max_new_tokens": limit_field,
                       "input_ids": prompt_field, "text": prompt_field,
                       "top_logprobs_num": top_field, "extra_key": "cache_salt"},
                      sampling_prefix="")


def _usage_options(body: dict[str, Any], stream: bool, route: str) -> tuple[bool, bool]:
    """`stream_options` as (a usage chunk ends the stream, usage on every chunk): both only
    when streaming, and continuous stats only with include_usage (as vLLM)."""
    options = check_type(body, "stream_options", (dict,), "an object") or {}
    options = known_fields(options, STREAM_OPTIONS, route, "stream_options.")
    usage = bool(check_type(options, "include_usage", (bool,), "a boolean"))
    continuous = bool(check_type(options, "continuous_usage_stats", (bool,), "a boolean"))
    return stream and usage, stream and usage and continuous


def _sampling_params(body: dict[str, Any], default_max_tokens: int | None
                           ) -> tuple[dict[str, Any], str]:
    """`sampling_params` of an OpenAI body, and the field that set the token limit:
    `max_completion_tokens` (OpenAI's newer name) wins over `max_tokens`, as in vLLM.
    `default_max_tokens` None leaves the engine's default (chat: SGLang's 128)."""
    params = {OPENAI_PARAMS[k]: v for k, v in body.items() if k in OPENAI_PARAMS and v is not None}
    if default_max_tokens is not None:
        params.setdefault("max_new_tokens", default_max_tokens)
    if body.get("max_completion_tokens") is None:
        return params, "max_tokens"
    return {**params, "max_new_tokens": body["max_completion_tokens"]}, "max_completion_tokens"
