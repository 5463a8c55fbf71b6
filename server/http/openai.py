"""OpenAI's completions route.

    POST /v1/completions    {"prompt", "max_tokens", "temperature", "logprobs", "echo", "n",
                             "best_of", "stream", "stream_options", "priority", ...}

docs/http.md has the table of every accepted field. What both OpenAI routes read alike
(the renamed sampling fields, `OPENAI_PARAMS`; stream_options; priority) is
`hicache_server.http.openai_fields`, and the engine's checks name the fields as the client
does (`openai_names`). The field policy (`hicache_server.http.fields`) covers the rest:
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

from hicache_server.http.auth import scope_of
from hicache_server.http.body import check_type, flag, read_object
from hicache_server.http.discovery import served_model_name
from hicache_server.http.errors import HttpError
from hicache_server.http.fields import Only, check_int
from hicache_server.http.generation import LogprobOptions, start_all, submit
from hicache_server.http.offload import off_loop
from hicache_server.http.openai_fields import (
    OPENAI_FIELDS,
    OPENAI_UNSUPPORTED,
    openai_names,
    read_openai,
)
from hicache_server.http.openai_shapes import (
    Completion,
    CompletionShape,
    completion_chunks,
    completion_response,
)
from hicache_server.http.prompts import any_prompts, check_batch_size
from hicache_server.http.state import live_engine
from hicache_server.http.streaming import json_events, last_results, send_sse
from hicache_server.request import MAX_CHOICES

ROUTE = "POST /v1/completions"
OPENAI_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
COMPLETION_UNSUPPORTED = {
    **OPENAI_UNSUPPORTED,
    "suffix": Only(None, "a suffix (text inserted after the completion)"),
    "prompt_logprobs": Only(None, "vLLM's prompt_logprobs (send echo with logprobs)"),
}
COMPLETION_FIELDS = OPENAI_FIELDS | {*COMPLETION_UNSUPPORTED, "prompt", "best_of", "echo",
                                     "return_tokens_as_token_ids"}


def parse_completion(body: dict[str, Any]) -> Completion:
    """Check the OpenAI fields' shapes and what this server supports; the engine checks the
    sampling values' ranges."""
    common = read_openai(body, COMPLETION_FIELDS, COMPLETION_UNSUPPORTED, ROUTE,
                         OPENAI_DEFAULT_MAX_TOKENS)
    body = common.body
    prompts = any_prompts("prompt", body.get("prompt"))
    n, best_of = _choices(body)
    check_batch_size(len(prompts.items), best_of)
    logprobs = check_type(body, "logprobs", (int,), "an integer")  # range: the engine's
    if common.stream and best_of > n:
        raise HttpError(400, f"`best_of` ({best_of}) > `n` ({n}) cannot be streamed: the best "
                        "choices are known only once all are done; drop `stream` or `best_of`")
    shape = CompletionShape(include_usage=common.include_usage,
                            continuous_usage=common.continuous_usage,
                            token_ids=flag(body, "return_token_ids"),
                            tokens_as_ids=flag(body, "return_tokens_as_token_ids"))
    return Completion(prompts, {**common.sampling_params, "n": best_of}, n, logprobs,
                      flag(body, "echo"), common.stream, shape, common.cache_salt,
                      common.limit_field, common.priority, common.session_id)


def _choices(body: dict[str, Any]) -> tuple[int, int]:
    """(n, best_of): best_of defaults to n and must not be below it."""
    n = check_int(body, "n", 1, MAX_CHOICES) or 1
    best_of = check_int(body, "best_of", 1, MAX_CHOICES)
    if best_of is None:
        return n, n
    if best_of < n:
        raise HttpError(400, f"`best_of` must be >= `n` ({n}), got {best_of}")
    return n, best_of


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
    submitted = await submit(engine, completion.prompts, [completion.sampling_params] * count,
                             [completion.cache_salt] * count,
                             [logprob_options(completion)] * count,
                             [completion.priority] * count, completion.session_id,
                             openai_names(completion.limit_field, "prompt", "logprobs"),
                             scope=scope_of(request))
    streams = await start_all(engine, submitted)
    model = served_model_name(engine)
    if not completion.stream:
        results = await last_results(streams)
        answer = await off_loop(completion_response, completion, submitted, results, model,
                                engine.tokenizer)  # echo decodes the prompts
        return web.json_response(answer)
    chunks = completion_chunks(completion, submitted, streams, model, engine.tokenizer)
    return await send_sse(request, json_events(chunks))
