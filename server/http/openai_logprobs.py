"""OpenAI's completion `logprobs` object, built from the engine's SGLang-shaped logprobs.

The engine's `meta_info` holds, per position, `[logprob, token_id, text]` entries
(`input_token_logprobs`, `output_token_logprobs`) and lists of such entries for the top-k
(`input_top_logprobs`, `output_top_logprobs`); the first prompt token has no logprob (None:
nothing comes before it). OpenAI's object holds four parallel lists:

    tokens          each position's token text
    token_logprobs  its logprob (null for the first prompt token, as OpenAI's `echo` has)
    top_logprobs    {token text: logprob} of the k most likely tokens there, plus the chosen
                    one (as vLLM: a client checking "was this token the argmax" finds it)
    text_offset     where the token's text starts in the choice's `text` (vLLM's rule:
                    the token texts' lengths added up, from the start of the choice)

Two tokens can share a text (byte-level pieces of one character both decode to U+FFFD): in a
top dict the more likely keeps the key, except that the chosen token's own logprob always
wins its key, so `top_logprobs[i][tokens[i]] == token_logprobs[i]` holds everywhere.
`return_tokens_as_token_ids` (vLLM's) names tokens `token_id:<id>`, which never collide.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from hicache_server.tokenizer import Tokenizer

TOKEN_ID_PREFIX = "token_id:"  # vLLM's name of a token under return_tokens_as_token_ids

Entry = Sequence[Any]  # [logprob | None, token_id, text | None]
Namer = Callable[[Entry], str]


class Position(NamedTuple):
    token: str
    logprob: float | None
    top: dict[str, float] | None


def token_namer(tokenizer: Tokenizer, as_token_ids: bool) -> Namer:
    """How a `[logprob, token_id, text]` entry is named in OpenAI's lists."""
    if as_token_ids:
        return lambda entry: f"{TOKEN_ID_PREFIX}{entry[1]}"
    return lambda entry: entry[2] if entry[2] is not None else tokenizer.decode([entry[1]])


def positions(token_logprobs: Sequence[Entry], top_logprobs: Sequence[Any] | None,
              name: Namer) -> list[Position]:
    """One `Position` per entry of the engine's lists (top lists may be missing or shorter:
    no top dict then beyond the chosen token)."""
    tops = top_logprobs or ()
    out = []
    for i, entry in enumerate(token_logprobs):
        token, logprob = name(entry), entry[0]
        if logprob is None:  # the first prompt token: nothing predicts it
            out.append(Position(token, None, None))
            continue
        top: dict[str, float] = {}
        for alt in (tops[i] if i < len(tops) and tops[i] else ()):
            top.setdefault(name(alt), alt[0])
        top[token] = logprob
        out.append(Position(token, logprob, top))
    return out


def prompt_positions(meta: dict[str, Any], name: Namer) -> list[Position]:
    return positions(meta.get("input_token_logprobs") or (), meta.get("input_top_logprobs"),
                     name)


def output_positions(meta: dict[str, Any], name: Namer) -> list[Position]:
    """The output positions of a whole result (a stream reads its deltas' `positions`)."""
    return positions(meta.get("output_token_logprobs") or (), meta.get("output_top_logprobs"),
                     name)


def logprobs_object(items: Sequence[Position], offset: int = 0) -> dict[str, Any]:
    """OpenAI's object over `items`, whose first token starts at `offset` in the choice's
    text."""
    offsets = []
    for p in items:
        offsets.append(offset)
        offset += len(p.token)
    return {"tokens": [p.token for p in items],
            "token_logprobs": [p.logprob for p in items],
            "top_logprobs": [p.top for p in items],
            "text_offset": offsets}


def text_length(items: Sequence[Position]) -> int:
    """How far `text_offset` moves past these positions."""
    return sum(len(p.token) for p in items)


def cumulative_logprob(meta: dict[str, Any]) -> float:
    """The sum of the output tokens' logprobs: how `best_of` ranks its samples."""
    return sum(entry[0] for entry in meta.get("output_token_logprobs") or ())
