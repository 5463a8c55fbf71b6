"""The answers of /v1/completions: choices, `usage`, and the stream's chunks.

A choice is `{"index", "text", "logprobs", "finish_reason"}`, plus vLLM's
`prompt_token_ids` and `token_ids` with `return_token_ids`. With `echo` its text starts with
the prompt's, and its logprobs with the prompt's (`openai_logprobs`).

A stream sends one chunk per update of a choice (a token, or the tokens that came while the
client was reading; several choices interleave, each chunk naming its `index`): the text
that settled with them (often "" while a character or a possible stop string is
unfinished), their logprobs, and their ids with `return_token_ids` (the prompt's ids and, with `echo`, the prompt's text and
logprobs come in the choice's first chunk). Concatenated, a choice's chunks are its plain
answer. Then the usage chunk (`choices: []`) with `include_usage`; with
`continuous_usage_stats` every chunk carries the usage so far.

`usage` counts each prompt once and every sample's tokens (best_of's discarded ones too: they
were computed); its cached tokens are those of each prompt's first sample, the one whose
prefill the others share. SGLang's `sglext.cached_tokens_details` (the cached tokens by tier)
is beside `usage` wherever `usage` is, on this route and on chat (`usage_fields`):
`return_cached_tokens_details` is accepted and changes nothing.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, NamedTuple

from hicache_server.http.generation import Submitted
from hicache_server.http.offload import off_loop
from hicache_server.http.openai_logprobs import (
    Namer,
    cumulative_logprob,
    logprobs_object,
    output_positions,
    positions,
    prompt_positions,
    text_length,
    token_namer,
)
from hicache_server.http.prompts import Prompts
from hicache_server.http.streaming import merged
from hicache_server.output import Delta, Logprobs
from hicache_server.tokenizer import Tokenizer
from hicache_server.updates import Update

COMPLETION_OBJECT = "text_completion"
TIERS_ZERO = {"device": 0, "host": 0, "storage": 0}


class CompletionShape(NamedTuple):
    include_usage: bool = False  # a usage chunk ends the stream
    continuous_usage: bool = False  # usage on every chunk
    token_ids: bool = False  # vLLM's return_token_ids
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids


class Completion(NamedTuple):
    prompts: Prompts
    sampling_params: dict[str, Any]  # its `n` is best_of: the samples run per prompt
    n: int  # the choices returned per prompt
    logprobs: int | None  # top-k per position, None: no logprobs object
    echo: bool
    stream: bool
    shape: CompletionShape
    cache_salt: str | None
    limit_field: str  # the field that set max_new_tokens, for error messages
    priority: int | None  # None: the default
    session_id: str | None = None  # the session whose prefixes stay cached longer


def usage_body(groups: Sequence[Sequence[dict[str, Any]]]) -> dict[str, Any]:
    """OpenAI's `usage` over each prompt's samples' `meta_info`s (`groups[i]`: prompt i's)."""
    prompt = sum(g[0]["prompt_tokens"] for g in groups if g)
    completion = sum(m["completion_tokens"] for g in groups for m in g)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(g[0]["cached_tokens"]
                                                           for g in groups if g)}}


def sglext_body(groups: Sequence[Sequence[dict[str, Any]]]) -> dict[str, Any]:
    details = dict(TIERS_ZERO)
    for g in groups:
        for tier, tokens in (g[0]["cached_tokens_details"] if g else {}).items():
            details[tier] = details.get(tier, 0) + tokens
    return {"cached_tokens_details": details}


def finished_sglext(meta: dict[str, Any]) -> dict[str, Any]:
    """`sglext` for the chunk that ends one choice: SGLang's benchmark client
    (`bench_serving --cache-report`) reads the cached tokens off the stream's chunks, and a
    stream without `include_usage` has no usage chunk to carry them."""
    if meta["finish_reason"] is None:
        return {}
    return {"sglext": {"cached_tokens_details": dict(meta["cached_tokens_details"])}}


def usage_fields(groups: Sequence[Sequence[dict[str, Any]]]) -> dict[str, Any]:
    """`usage` and `sglext` beside it: one rule for /v1/completions and chat, so a client
    reading the cache tiers finds them on both without asking."""
    return {"usage": usage_body(groups), "sglext": sglext_body(groups)}


def completion_object(model: str, choices: list[dict[str, Any]], cid: str | None = None
                      ) -> dict[str, Any]:
    return {"id": cid or f"cmpl-{uuid.uuid4().hex}", "object": COMPLETION_OBJECT,
            "created": int(time.time()), "model": model, "choices": choices}


# --------------------------------------------------------------------------- plain answers


def completion_response(completion: Completion, submitted: Submitted, results: list[dict],
                        model: str, tokenizer: Tokenizer) -> dict[str, Any]:
    name = token_namer(tokenizer, completion.shape.tokens_as_ids)
    groups = submitted.regroup(results)
    choices = []
    for i, group in enumerate(groups):
        kept = _best(group, completion.n)
        echo = _echo_text(completion, submitted, i, tokenizer)
        choices += [_choice(completion, echo, submitted.prompt_ids(i), i * completion.n + j,
                            result, name)
                    for j, result in enumerate(kept)]
    metas = [[r["meta_info"] for r in group] for group in groups]
    return {**completion_object(model, choices), **usage_fields(metas)}


def _echo_text(completion: Completion, submitted: Submitted, i: int, tokenizer: Tokenizer
               ) -> str:
    """What prompt i's choices start with: its text with `echo`, else nothing."""
    return submitted.prompt_text(i, tokenizer) if completion.echo else ""


def _best(samples: list[dict], n: int) -> list[dict]:
    """The `n` samples of highest cumulative logprob, in their order (all when n are run)."""
    if len(samples) <= n:
        return samples
    ranked = sorted(range(len(samples)),
                    key=lambda k: -cumulative_logprob(samples[k]["meta_info"]))
    return [samples[k] for k in sorted(ranked[:n])]


def _choice(completion: Completion, echo_text: str, prompt_ids: list[int], index: int,
            result: dict, name: Namer) -> dict[str, Any]:
    meta = result["meta_info"]
    logprobs = None
    if completion.logprobs is not None:
        items = prompt_positions(meta, name) if completion.echo else []
        items += output_positions(meta, name)
        logprobs = logprobs_object(items)
    out = {"index": index, "text": echo_text + result["text"],
           "logprobs": logprobs, "finish_reason": meta["finish_reason"]}
    if completion.shape.token_ids:
        out |= {"prompt_token_ids": prompt_ids, "token_ids": list(result["output_ids"])}
    return out


# ---------------------------------------------------------------------------------- streams


class ChoiceStream:
    """What one choice of a stream has sent: whether its first chunk, where its logprobs'
    text offsets stand."""

    def __init__(self, completion: Completion, index: int, echo_text: str,
                 prompt_ids: list[int], name: Namer) -> None:
        self._completion, self.index, self._name = completion, index, name
        self._echo_text, self._prompt_ids = echo_text, prompt_ids
        self._offset = 0
        self._first = True

    def choice(self, delta: Delta) -> dict[str, Any]:
        """The chunk's choice for `delta` (the prompt's echo, ids and logprobs first)."""
        first, self._first = self._first, False
        out = {"index": self.index, "text": (self._echo_text if first else "") + delta.text,
               "logprobs": self._logprobs(delta.logprobs, self._completion.echo and first),
               "finish_reason": delta.finish_reason}
        if self._completion.shape.token_ids:
            if first:
                out["prompt_token_ids"] = self._prompt_ids
            out["token_ids"] = delta.ids
        return out

    def _logprobs(self, new: Logprobs, echo: bool) -> dict[str, Any] | None:
        if self._completion.logprobs is None:
            return None
        items = positions(new.input_token, new.input_top, self._name) if echo else []
        items += positions(new.output_token, new.output_top, self._name)
        out = logprobs_object(items, self._offset)
        self._offset += text_length(items)
        return out


def _echo_texts(submitted: Submitted, tokenizer: Tokenizer) -> list[str]:
    """Each prompt's text, once per prompt (its `n` choices all start with it)."""
    return [submitted.prompt_text(i, tokenizer) for i in range(len(submitted.groups))]


async def completion_chunks(completion: Completion, submitted: Submitted,
                            streams: list[AsyncIterator[Update]], model: str,
                            tokenizer: Tokenizer) -> AsyncIterator[dict[str, Any]]:
    """The chunks of every choice as their tokens come, then the usage chunk when asked
    for. Closing this closes the streams (so aborts their requests)."""
    cid, shape = f"cmpl-{uuid.uuid4().hex}", completion.shape
    name = token_namer(tokenizer, shape.tokens_as_ids)
    echoes = [""] * len(submitted.groups)
    if completion.echo:  # decoding the prompts: off the loop
        echoes = await off_loop(_echo_texts, submitted, tokenizer)
    choices = [ChoiceStream(completion, k, echoes[i], submitted.prompt_ids(i), name)
               for k, (i, _) in enumerate(submitted.choices())]
    latest: list[dict | None] = [None] * len(choices)
    events = merged(streams)
    try:
        async for k, update in events:
            latest[k] = update.delta.meta
            chunk = completion_object(model, [choices[k].choice(update.delta)], cid)
            chunk |= finished_sglext(update.delta.meta)
            if shape.continuous_usage:
                chunk |= usage_fields(submitted.regroup_seen(latest))
            yield chunk
    finally:
        await events.aclose()
    if shape.include_usage:
        yield {**completion_object(model, [], cid),
               **usage_fields(submitted.regroup_seen(latest))}
