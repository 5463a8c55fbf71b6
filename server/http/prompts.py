"""Prompts as the routes receive them: one, or a batch (a list of strings, of id lists).

    "abc"              one text prompt          [1, 2, 3]          one prompt of token ids
    ["abc", "de"]      a batch of two texts     [[1, 2], [3]]      a batch of two id lists

Only the JSON shapes are checked here; the engine checks the ids (vocabulary, context) and
the text (valid Unicode). A per-prompt field (`rid`, `sampling_params`, `return_logprob` on
/generate) is one value for all, or a list with one value per prompt (`per_prompt`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from hicache_server.http.body import json_type
from hicache_server.http.errors import HttpError

# Most prompts x choices one request may ask for: each is a request in the scheduler, so one
# HTTP request must not queue an unbounded number (lm-eval batches tens, bench_serving one).
MAX_BATCH_CHOICES = 1024


class Prompt(NamedTuple):
    text: str | None
    input_ids: list[int] | None


class Prompts(NamedTuple):
    items: list[Prompt]
    batch: bool  # sent as a list: the answer is a list too


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _is_batch_of(value: Any, kind: type) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(v, kind) for v in value))


def text_prompts(name: str, value: Any) -> Prompts:
    """`value` as a string or a non-empty list of strings."""
    if isinstance(value, str):
        return Prompts([Prompt(value, None)], False)
    if _is_batch_of(value, str):
        return Prompts([Prompt(v, None) for v in value], True)
    raise HttpError(400, f"`{name}` must be a string or a non-empty array of strings, got "
                    f"{_described(value)}")


def id_prompts(name: str, value: Any) -> Prompts:
    """`value` as a list of token ids or a non-empty list of such lists."""
    if _is_ids(value):
        return Prompts([Prompt(None, value)], False)
    if _is_batch_of(value, list) and all(_is_ids(v) for v in value):
        return Prompts([Prompt(None, v) for v in value], True)
    raise HttpError(400, f"`{name}` must be an array of token ids (integers) or a non-empty "
                    f"array of such arrays, got {_described(value)}")


def any_prompts(name: str, value: Any) -> Prompts:
    """OpenAI's `prompt`: a string, token ids, or a non-empty list of either."""
    if isinstance(value, str) or _is_batch_of(value, str):
        return text_prompts(name, value)
    if _is_ids(value) or _is_batch_of(value, list):
        return id_prompts(name, value)
    raise HttpError(400, f"`{name}` must be a string, an array of token ids (integers), or a "
                    f"non-empty array of strings or of token id arrays, got "
                    f"{_described(value)}")


def _described(value: Any) -> str:
    return "an empty array" if value == [] else json_type(value)


def per_prompt(name: str, value: Any, count: int, batch: bool) -> list[Any]:
    """One value per prompt: a list of `count` values in a batch, else `value` for all."""
    if batch and isinstance(value, list):
        if len(value) != count:
            raise HttpError(400, f"`{name}`: a list must have one value per prompt ({count}), "
                            f"got {len(value)}")
        return list(value)
    return [value] * count


def check_batch_size(prompts: int, choices: int) -> None:
    if prompts * choices > MAX_BATCH_CHOICES:
        raise HttpError(400, f"{prompts} prompt(s) x {choices} choice(s) = "
                        f"{prompts * choices} sequences in one request; at most "
                        f"{MAX_BATCH_CHOICES} (send several requests)")


def item_message(index: int, batch: bool, message: str) -> str:
    """An engine message about one prompt, saying which when there are several."""
    return f"prompt {index} of the batch: {message}" if batch else message
