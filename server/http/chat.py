"""OpenAI's chat route.

    POST /v1/chat/completions    {"messages", "max_tokens" | "max_completion_tokens", "n",
                                  "temperature", "top_p", "stop", "seed", "logprobs",
                                  "top_logprobs", "stream", "stream_options", ...}

docs/http.md has the table of every accepted field. The messages are rendered with the
model's chat template (`hicache_server.chat_template`, read once when the route is built by
`chat_route`) and tokenized without added specials, so BOS comes from the template alone.
The rest is what both OpenAI routes share (`hicache_server.http.openai_fields`), not a
copy of /v1/completions': the same field policy (`hicache_server.http.fields`: unknown
fields, also inside a message, ignored with one warning; the known ones this server cannot
honour, `CHAT_UNSUPPORTED`, a 400), the same sampling fields (`OPENAI_PARAMS`) and error
names (`openai_names`), `n` choices built by `Engine.make_requests` (one prefill, shared
through the tree) and started together, and the same `usage` / `sglext` (`usage_fields`).

A stream is `chat.completion.chunk`s: each choice's role chunk first, then one content delta
per update (a token, or the tokens that came while the client was reading: the text that
settled with them, often "" while a character or a possible stop string is unfinished),
with their `logprobs.content`; the finish reason on its last; then the usage chunk when
`stream_options.include_usage` asks for it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from aiohttp import web

from hicache_server.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    NoChatTemplate,
    load_chat_template,
)
from hicache_server.engine import Engine
from hicache_server.http.auth import scope_of
from hicache_server.http.body import brief, check_type, flag, json_type, read_object
from hicache_server.http.discovery import served_model_name
from hicache_server.http.errors import HttpError
from hicache_server.http.fields import Only, known_fields
from hicache_server.http.generation import LogprobOptions, start_all, submit
from hicache_server.http.offload import off_loop
from hicache_server.http.openai_fields import (
    OPENAI_FIELDS,
    OPENAI_UNSUPPORTED,
    openai_names,
    read_openai,
)
from hicache_server.http.openai_logprobs import Entry, Namer, token_namer
from hicache_server.http.openai_shapes import finished_sglext, usage_fields
from hicache_server.http.prompts import Prompt, Prompts
from hicache_server.http.state import Handler, live_engine
from hicache_server.http.streaming import json_events, last_results, merged, send_sse
from hicache_server.output import Logprobs
from hicache_server.request import check_unicode
from hicache_server.tokenizer import Tokenizer
from hicache_server.updates import Update

logger = logging.getLogger(__name__)

ROUTE = "POST /v1/chat/completions"
TOOLS = "tool (function) calling"
# What both OpenAI routes refuse, and chat's own.
CHAT_UNSUPPORTED = {
    **OPENAI_UNSUPPORTED,
    "prompt_logprobs": Only(None, "vLLM's prompt_logprobs"),
    "tools": Only(None, TOOLS), "tool_choice": Only("none", TOOLS),
    "functions": Only(None, TOOLS), "function_call": Only("none", TOOLS),
    "audio": Only(None, "audio output"),
    "modalities": Only(["text"], "an output modality other than text"),
    "prediction": Only(None, "predicted outputs"),
}
CHAT_FIELDS = OPENAI_FIELDS | {*CHAT_UNSUPPORTED, "messages", "top_logprobs",
                               "parallel_tool_calls"}
ROLES = ("system", "user", "assistant")
MESSAGE_FIELDS = frozenset({"role", "content", "name"})
PART_FIELDS = frozenset({"type", "text"})
TEXT_PART = "text"
# A message's text parts become one string, joined as vLLM joins them for string templates.
PART_SEPARATOR = "\n"
CHAT_OBJECT, CHUNK_OBJECT = "chat.completion", "chat.completion.chunk"


class Chat(NamedTuple):
    messages: list[dict[str, str]]  # role, content (a string), name when given
    sampling_params: dict[str, Any]  # its `n`: the choices
    logprobs: int | None  # top-k per token with `logprobs: true`; None: no logprobs
    stream: bool
    include_usage: bool
    continuous_usage: bool  # usage on every chunk (vLLM's continuous_usage_stats)
    token_ids: bool  # vLLM's return_token_ids: the prompt's and each choice's ids
    cache_salt: str | None
    limit_field: str  # the field that set max_new_tokens, for error messages
    priority: int | None  # vLLM's field; eviction under --radix-eviction-policy priority
    session_id: str | None = None  # the session whose prefixes stay cached longer


def parse_chat(body: dict[str, Any]) -> Chat:
    """Check the fields' shapes and what this server supports; the engine checks the
    sampling values' ranges."""
    common = read_openai(body, CHAT_FIELDS, CHAT_UNSUPPORTED, ROUTE, default_max_tokens=None)
    body, params = common.body, common.sampling_params
    messages = parse_messages(body.get("messages"))
    if body.get("n") is not None:  # its range: the engine's (`n` in [1, MAX_CHOICES])
        params = {**params, "n": body["n"]}
    return Chat(messages, params, _logprobs(body), common.stream, common.include_usage,
                common.continuous_usage, flag(body, "return_token_ids"), common.cache_salt,
                common.limit_field, common.priority, common.session_id)


def _logprobs(body: dict[str, Any]) -> int | None:
    """OpenAI's pair: `logprobs` (a boolean) turns them on, `top_logprobs` is k (its
    range: the engine's, 0..MAX_TOP_LOGPROBS)."""
    wanted = flag(body, "logprobs")
    top = check_type(body, "top_logprobs", (int,), "an integer")
    if top and not wanted:
        raise HttpError(400, f"`top_logprobs` ({top}) needs `logprobs: true`")
    return (top or 0) if wanted else None


def parse_messages(value: Any) -> list[dict[str, str]]:
    if value is None:
        raise HttpError(400, "`messages` is required: a non-empty array of messages "
                        '({"role": ..., "content": ...})')
    if not isinstance(value, list) or not value:
        got = "an empty array" if value == [] else json_type(value)
        raise HttpError(400, f"`messages` must be a non-empty array of messages, got {got}")
    return [_message(f"messages[{i}]", m) for i, m in enumerate(value)]


def _message(where: str, message: Any) -> dict[str, str]:
    if not isinstance(message, dict):
        raise HttpError(400, f"`{where}` must be an object with `role` and `content`, got "
                        f"{json_type(message)}")
    message = known_fields(message, MESSAGE_FIELDS, ROUTE, "messages[].")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise HttpError(400, f"`{where}.role` must be one of {', '.join(ROLES)}, got "
                        f"{brief(role)}")
    content = _content(where, message.get("content"))
    check_unicode(f"{where}.content", content)
    out = {"role": role, "content": content}
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise HttpError(400, f"`{where}.name` must be a string, got {json_type(name)}")
    return out if name is None else {**out, "name": name}


def _content(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = (_text_part(f"{where}.content[{j}]", p) for j, p in enumerate(content))
        return PART_SEPARATOR.join(parts)
    raise HttpError(400, f"`{where}.content` must be a string or an array of text parts "
                    f'({{"type": "text", "text": ...}}), got {json_type(content)}')


def _text_part(where: str, part: Any) -> str:
    if not isinstance(part, dict):
        raise HttpError(400, f'`{where}` must be a text part {{"type": "text", "text": ...}}, '
                        f"got {json_type(part)}")
    if part.get("type") != TEXT_PART:
        raise HttpError(400, f"`{where}.type`: content parts of type {brief(part.get('type'))} "
                        f'are not supported; only "{TEXT_PART}" parts are')
    part = known_fields(part, PART_FIELDS, ROUTE, "messages[].content[].")
    text = part.get("text")
    if not isinstance(text, str):
        raise HttpError(400, f"`{where}.text` must be a string, got {json_type(text)}")
    return text


def chat_prompt_ids(template: ChatTemplate, tokenizer: Tokenizer,
                    messages: list[dict[str, str]]) -> list[int]:
    """The prompt of `messages` as token ids: rendered with the generation prompt, then
    tokenized with no specials added (the template writes its own BOS, as HF's
    `apply_chat_template(tokenize=True)` assumes)."""
    try:
        text = template.render(messages, add_generation_prompt=True)
    except ChatTemplateError as e:
        raise HttpError(400, str(e)) from None
    return tokenizer.encode(text, add_special_tokens=False)


def logprob_options(chat: Chat) -> LogprobOptions:
    if chat.logprobs is None:
        return LogprobOptions()
    return LogprobOptions(return_logprob=True, top_logprobs_num=chat.logprobs,
                          return_text_in_logprobs=True)


def _token(entry: Entry, name: Namer) -> dict[str, Any]:
    token = name(entry)
    return {"token": token, "logprob": entry[0], "bytes": list(token.encode("utf-8"))}


def logprobs_content(logprobs: Logprobs, name: Namer) -> list[dict[str, Any]]:
    """OpenAI's chat `logprobs.content` of the output tokens in `logprobs` (a stream sends
    each token's once): the token, and the engine's k most likely there in order. A list,
    not completions' dict, so two tokens of one text (byte pieces both shown as U+FFFD)
    both appear."""
    tops = logprobs.output_top
    return [{**_token(entry, name),
             "top_logprobs": [_token(alt, name) for alt in (tops[i] if i < len(tops) else None)
                              or ()]}
            for i, entry in enumerate(logprobs.output_token)]


def _chat_object(kind: str, model: str, choices: list[dict[str, Any]], cid: str | None = None
                 ) -> dict[str, Any]:
    return {"id": cid or f"chatcmpl-{uuid.uuid4().hex}", "object": kind,
            "created": int(time.time()), "model": model, "choices": choices}


def chat_response(chat: Chat, results: list[dict], prompt_ids: list[int], model: str,
                  name: Namer) -> dict[str, Any]:
    """The plain answer: one choice per result; `usage` counts the prompt once (its cached
    tokens: choice 0's, whose prefill the others share), as /v1/completions does for `n`."""
    choices = []
    for index, result in enumerate(results):
        meta = result["meta_info"]
        logprobs = None
        if chat.logprobs is not None:
            logprobs = {"content": logprobs_content(_output_logprobs(meta), name)}
        choice = {"index": index, "message": {"role": "assistant", "content": result["text"]},
                  "logprobs": logprobs, "finish_reason": meta["finish_reason"]}
        if chat.token_ids:
            choice["token_ids"] = list(result["output_ids"])
        choices.append(choice)
    out = _chat_object(CHAT_OBJECT, model, choices)
    if chat.token_ids:
        out["prompt_token_ids"] = prompt_ids
    return {**out, **usage_fields([[r["meta_info"] for r in results]])}


def _output_logprobs(meta: dict[str, Any]) -> Logprobs:
    """The output logprobs of a result's meta_info."""
    return Logprobs(output_token=meta.get("output_token_logprobs") or [],
                    output_top=meta.get("output_top_logprobs") or [])


async def chat_chunks(chat: Chat, streams: list[AsyncIterator[Update]],
                      prompt_ids: list[int], model: str, name: Namer
                      ) -> AsyncIterator[dict[str, Any]]:
    """Each choice's role chunk when its first update comes, then one chunk per update of
    it (a token, or the tokens that came while the client was reading; choices interleave,
    each chunk naming its `index`), the finish reason on its last; then the usage chunk
    (`choices: []`) when asked for. With `continuous_usage`, every chunk carries the usage
    so far (a role chunk: none of its choice's tokens yet). Closing this closes the streams
    (so aborts their requests)."""
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    latest: list[dict[str, Any] | None] = [None] * len(streams)

    def chunk(k: int, delta: dict[str, str], logprobs: dict[str, Any] | None,
              finish: str | None, extra: dict[str, Any]) -> dict[str, Any]:
        choice = {"index": k, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                  **extra}
        out = _chat_object(CHUNK_OBJECT, model, [choice], cid)
        if chat.continuous_usage:
            out |= usage_fields([[m for m in latest if m is not None]])
        return out

    events = merged(streams)
    try:
        async for k, update in events:
            new = update.delta
            if latest[k] is None:
                latest[k] = {**new.meta, "completion_tokens": 0}
                role = chunk(k, {"role": "assistant", "content": ""}, None, None, {})
                yield role | ({"prompt_token_ids": prompt_ids} if chat.token_ids else {})
            latest[k] = new.meta
            logprobs = None
            if chat.logprobs is not None:
                logprobs = {"content": logprobs_content(new.logprobs, name)}
            extra = {"token_ids": new.ids} if chat.token_ids else {}
            yield chunk(k, {"content": new.text}, logprobs, new.finish_reason,
                        extra) | finished_sglext(new.meta)
    finally:
        await events.aclose()  # a client gone: its requests are aborted now
    if chat.include_usage:
        yield {**_chat_object(CHUNK_OBJECT, model, [], cid),
               **usage_fields([[m for m in latest if m is not None]])}


def chat_route(engine: Engine) -> Handler:
    """The POST /v1/chat/completions handler for `engine`'s model. Its chat template is read
    here, once; a model without one (or with one that does not compile) answers every chat
    request with a 400 saying so, and the other routes serve as usual."""
    try:
        template: ChatTemplate | None = load_chat_template(engine.loaded.path)
        missing = ""
    except NoChatTemplate as e:
        template, missing = None, str(e)
        logger.warning("POST /v1/chat/completions will answer 400: %s", missing)

    async def handle_chat_completions(request: web.Request) -> web.StreamResponse:
        chat = parse_chat(await read_object(request))
        if template is None:
            raise HttpError(400, missing)
        return await serve_chat(request, chat, template)

    return handle_chat_completions


async def serve_chat(request: web.Request, chat: Chat, template: ChatTemplate
                     ) -> web.StreamResponse:
    engine = live_engine(request)
    ids = await off_loop(chat_prompt_ids, template, engine.tokenizer, chat.messages)
    prompts = Prompts([Prompt(None, ids)], False)
    submitted = await submit(engine, prompts, [chat.sampling_params], [chat.cache_salt],
                             [logprob_options(chat)], [chat.priority], chat.session_id,
                             openai_names(chat.limit_field, "messages", "top_logprobs"),
                             scope=scope_of(request))
    streams = await start_all(engine, submitted)
    model, name = served_model_name(engine), token_namer(engine.tokenizer, False)
    if not chat.stream:
        results = await last_results(streams)
        return web.json_response(chat_response(chat, results, ids, model, name))
    chunks = chat_chunks(chat, streams, ids, model, name)
    return await send_sse(request, json_events(chunks))
