"""From parsed prompts to engine requests, shared by /generate and /v1/completions.

`submit` validates and builds every request of one HTTP request before any runs (a bad
prompt in a batch refuses the whole batch, and nothing is left running), off the event loop
(tokenizing and checking a prompt is a loop over it); `start_all` then starts them all at
once. A prompt with `sampling_params.n > 1` is n requests, its choices
in order; the engine makes them share the prompt's prefill through the tree. Each request's
cache namespace is its salt within the caller's tenant (`hicache_server.tenancy.Scope`).

    Submitted.groups[i][j]   prompt i's j-th choice
    Submitted.choices()      (i, request) for every choice, prompt-major: the order of the
                             streams `start_all` returns and of the answers' lists
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, NamedTuple, TypeVar

from hicache_server.engine import Engine
from hicache_server.field_names import SGLANG_NAMES, FieldNames
from hicache_server.http.offload import off_loop
from hicache_server.http.prompts import Prompts, item_message
from hicache_server.http.streaming import start_streams
from hicache_server.request import InvalidRequest, Request
from hicache_server.tenancy import Scope
from hicache_server.tokenizer import Tokenizer

T = TypeVar("T")


class LogprobOptions(NamedTuple):
    """SGLang's logprob fields, outside `sampling_params` as there. `logprob_start_len` -1:
    output logprobs only; k >= 0: the prompt's too, from position k."""

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False

    @classmethod
    def of(cls, fields: dict[str, Any]) -> LogprobOptions:
        """From a body's fields (absent or null: the default); the engine checks them."""
        return cls(**{k: v for k, v in fields.items() if v is not None})


class Submitted(NamedTuple):
    prompts: Prompts
    groups: list[list[Request]]

    def choices(self) -> list[tuple[int, Request]]:
        return [(i, req) for i, group in enumerate(self.groups) for req in group]

    def prompt_ids(self, i: int) -> list[int]:
        return list(self.groups[i][0].input.ids)

    def prompt_text(self, i: int, tokenizer: Tokenizer) -> str:
        """Prompt i as text: as sent, or its ids decoded (what `echo` prepends)."""
        text = self.prompts.items[i].text
        return text if text is not None else tokenizer.decode(self.groups[i][0].input.ids)

    def regroup(self, flat: Sequence[T]) -> list[list[T]]:
        """Per-choice values (in `choices()` order) as one list per prompt."""
        out, k = [], 0
        for group in self.groups:
            out.append(list(flat[k:k + len(group)]))
            k += len(group)
        return out

    def regroup_seen(self, flat: Sequence[T | None]) -> list[list[T]]:
        """`regroup`, leaving out the choices with no value yet."""
        return [[v for v in group if v is not None] for group in self.regroup(flat)]


async def submit(engine: Engine, prompts: Prompts, params: Sequence[dict[str, Any]],
                 extra_keys: Sequence[str | None], logprobs: Sequence[LogprobOptions],
                 priorities: Sequence[int | None] | None = None,
                 session_id: str | None = None, names: FieldNames = SGLANG_NAMES, *,
                 scope: Scope) -> Submitted:
    """Every request of `prompts` (`params`, `extra_keys`, `logprobs`, `priorities`: one
    per prompt; `session_id` for all), built off the event loop; InvalidRequest naming the
    prompt of a batch that is wrong, and the field as the client calls it (`names`).
    `scope` (the caller's, `hicache_server.http.auth.scope_of`) salts each `extra_keys[i]`
    and the session by the caller's tenant: required, so no route forgets it."""
    return await off_loop(_make_all, engine, prompts, params, extra_keys, logprobs,
                          priorities, session_id, names, scope)


def _make_all(engine: Engine, prompts: Prompts, params: Sequence[dict[str, Any]],
              extra_keys: Sequence[str | None], logprobs: Sequence[LogprobOptions],
              priorities: Sequence[int | None] | None, session_id: str | None,
              names: FieldNames, scope: Scope) -> Submitted:
    groups = []
    session_id = scope.session_id(session_id)
    for i, prompt in enumerate(prompts.items):
        try:
            groups.append(engine.make_requests(
                prompt.text, prompt.input_ids, params[i],
                scope.extra_key(extra_keys[i], names.option("extra_key")),
                **logprobs[i]._asdict(),
                priority=None if priorities is None else priorities[i],
                session_id=session_id, field_names=names))
        except InvalidRequest as e:
            raise InvalidRequest(item_message(i, prompts.batch, str(e))) from None
    return Submitted(prompts, groups)


async def start_all(engine: Engine, submitted: Submitted) -> list[AsyncIterator[dict]]:
    """Each choice's results (see `streaming.start_stream`), in `choices()` order."""
    return await start_streams(engine, [req for _, req in submitted.choices()])
