"""A generation request's input, checked against the model and the cache before anything is
queued: the prompt (text or token ids), the sampling parameters, the options beside them
(`GenerateOptions`), and a pin's prefix and TTL. Every failure is an InvalidRequest that
says what was wrong (HTTP 400); nothing is changed by a check.

Threading: any thread (the checks read only what is fixed at start).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from hicache.pages import pages_down
from hicache_server.field_names import SGLANG_NAMES, FieldNames
from hicache_server.request import (
    MAX_TOP_LOGPROBS,
    InvalidRequest,
    Request,
    RequestInput,
    SamplingParams,
    check_priority,
    check_session_id,
    check_unicode,
)
from hicache_server.tokenizer import Tokenizer

# The longest TTL a pin may ask for: a week. A pin is a lease to renew, not a setting.
MAX_PIN_TTL_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class GenerateOptions:
    """A generation request's options beside its prompt, sampling parameters and
    `extra_key`: SGLang's names, and None meaning the default (as a JSON null does).

    The logprob options (SGLang's; the results land in `meta_info`): `return_logprob`,
    `logprob_start_len` (-1: no prompt logprobs; k: from prompt position k),
    `top_logprobs_num` (0 to MAX_TOP_LOGPROBS alternatives per position),
    `return_text_in_logprobs` (each entry's token text too). `priority` (None = 0): higher
    keeps its prefix cached longer under the `priority` eviction policy. `session_id`: with
    `cache.session_retention`, the session owns the nodes the request uses (evicted after
    unowned ones)."""

    return_logprob: bool | None = False
    logprob_start_len: int | None = -1
    top_logprobs_num: int | None = 0
    return_text_in_logprobs: bool | None = False
    priority: int | None = None
    session_id: str | None = None

    @classmethod
    def from_kwargs(cls, caller: str, kwargs: dict[str, Any]) -> GenerateOptions:
        """The options given by keyword to `caller`; a TypeError for an unknown name, as
        Python raises for a keyword a function does not take."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r} "
                            f"(its options: {', '.join(sorted(names))})")
        return cls(**kwargs)

    def checked(self, prompt_len: int, names: FieldNames = SGLANG_NAMES) -> dict[str, Any]:
        """The options as `RequestInput`'s keywords, each checked (`logprob_start_len` against
        the prompt's length); errors name the fields as the client does (`names`)."""
        start = _integer(names.option("logprob_start_len"), self.logprob_start_len, -1)
        top_name = names.option("top_logprobs_num")
        top = _integer(top_name, self.top_logprobs_num, 0)
        if not 0 <= top <= MAX_TOP_LOGPROBS:  # the one check of this limit
            raise InvalidRequest(f"`{top_name}` must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        if not (start == -1 or 0 <= start < prompt_len):
            raise InvalidRequest(f"`logprob_start_len` must be -1 (no prompt logprobs) or a "
                                 f"position of the {prompt_len}-token prompt, in "
                                 f"[0, {prompt_len - 1}]; got {start}")
        return {"return_logprob": _flag(names.option("return_logprob"), self.return_logprob),
                "logprob_start_len": start, "top_logprobs_num": top,
                "return_text_in_logprobs": _flag(names.option("return_text_in_logprobs"),
                                                 self.return_text_in_logprobs),
                "priority": check_priority(self.priority),
                "session_id": check_session_id(self.session_id)}


def _flag(name: str, value: object) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(f"`{name}` must be a boolean, got {value!r:.40}")
    return value


def _integer(name: str, value: object, default: int) -> int:
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequest(f"`{name}` must be an integer, got {value!r:.40}")
    return value


def pin_ttl(ttl: object) -> float:
    """A pin's `ttl_seconds`, checked: a number in (0, a week]."""
    if isinstance(ttl, int) and not isinstance(ttl, bool) and ttl > MAX_PIN_TTL_S:
        ttl = float("inf")  # a huge integer: out of range below, never an OverflowError
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or math.isnan(ttl):
        raise InvalidRequest(f"`ttl_seconds` must be a number of seconds, got {ttl!r:.40}")
    if not 0 < ttl <= MAX_PIN_TTL_S:
        raise InvalidRequest(f"`ttl_seconds` must be in (0, {MAX_PIN_TTL_S:g}] (a week at "
                             f"most: renew a pin by pinning again), got {ttl}")
    return float(ttl)


def _choice(first: Request, index: int) -> Request:
    """Choice `index` >= 1 of `first`'s request: the same prompt and options, seed
    `seed + index` when seeded, waiting for `first`'s prompt (`Scheduler._held`)."""
    p = first.input.params
    params = p if p.seed is None else dataclasses.replace(p, seed=p.seed + index)
    asked = dataclasses.replace(first.input, ids=list(first.input.ids), params=params)
    return Request(asked, prompt_leader=first)


@dataclass(frozen=True)
class InputChecker:
    """Checks inputs against one model and cache: its tokenizer, vocabulary and context,
    the L1 size (a request must fit in L1 whole), the page size (a pin holds pages) and the
    server's cap on prompt-logprob work."""

    tokenizer: Tokenizer
    vocab_size: int
    context_len: int
    l1_tokens: int
    page_size: int
    max_prompt_logprobs: int  # positions x (top entries + 1) x n a request may ask for

    def request(self, text: str | None, input_ids: list[int] | None,
                sampling_params: dict | None, extra_key: str | None,
                options: GenerateOptions, names: FieldNames = SGLANG_NAMES) -> Request:
        """One request, checked (its `sampling_params.n` may ask for several choices:
        `choices` makes them); errors name the fields as the client does (`names`)."""
        if (text is None) == (input_ids is None):
            raise InvalidRequest("give exactly one of `text` or `input_ids`")
        if text is not None:
            if not isinstance(text, str):
                raise InvalidRequest(f"`text` must be a string, got {type(text).__name__}")
            check_unicode(names.option("text"), text)
            input_ids = self.tokenizer.encode(text)
        ids = self._ids(input_ids, names.option("input_ids"))
        params = self._params(SamplingParams.from_dict(sampling_params, names), len(ids),
                              names)
        if extra_key is not None and not isinstance(extra_key, str):
            raise InvalidRequest(f"`{names.option('extra_key')}` must be a string")
        if extra_key is not None:
            check_unicode(names.option("extra_key"), extra_key)
        checked = options.checked(len(ids), names)
        self._prompt_logprobs(checked, len(ids), params.n, names)
        return Request(RequestInput(ids, params, extra_key, **checked))

    def choices(self, text: str | None, input_ids: list[int] | None,
                sampling_params: dict | None, extra_key: str | None,
                options: GenerateOptions, names: FieldNames = SGLANG_NAMES) -> list[Request]:
        """The request's `sampling_params.n` choices (one for n = 1); see
        `Engine.make_requests`."""
        first = self.request(text, input_ids, sampling_params, extra_key, options, names)
        return [first, *(_choice(first, i) for i in range(1, first.input.params.n))]

    def pin_prefix(self, text: str | None, input_ids: list[int] | None,
                   extra_key: str | None) -> tuple[list[int], str | None]:
        """A pin's prefix: its whole pages and its namespace, checked like a prompt's."""
        req = self.request(text, input_ids, {"max_new_tokens": 1}, extra_key,
                           GenerateOptions())
        ids = req.input.ids[:pages_down(len(req.input.ids), self.page_size)]
        if not ids:
            raise InvalidRequest(f"the prefix has {len(req.input.ids)} tokens; a pin holds "
                                 f"whole pages of {self.page_size} tokens")
        return ids, req.input.extra_key

    def _params(self, params: SamplingParams, prompt_len: int, names: FieldNames
                ) -> SamplingParams:
        """`params` checked against this model (vocabulary, context, L1 size, tokenizer)."""
        params.check_vocab(self.vocab_size, names)
        for stop in params.stop:
            check_unicode(names.sampling("stop"), stop)
        room = self.context_len - prompt_len
        if params.max_new_tokens > room:  # as OpenAI servers do: cut to the context
            params = dataclasses.replace(params, max_new_tokens=room,
                                         min_new_tokens=min(params.min_new_tokens, room))
        need = prompt_len + params.max_new_tokens
        if need > self.l1_tokens:
            limit = names.sampling("max_new_tokens")
            raise InvalidRequest(f"prompt + {limit} = {need} tokens exceed the L1 KV cache "
                                 f"({self.l1_tokens} tokens); lower {limit} or raise "
                                 "--max-total-tokens")
        return params

    def _prompt_logprobs(self, checked: dict[str, Any], prompt_len: int, n: int,
                         names: FieldNames) -> None:
        """InvalidRequest when the prompt logprobs asked for (positions x (top entries + 1)
        x n choices) pass `max_prompt_logprobs`: each entry is a list built on the scheduler
        thread and sent as JSON (~200 bytes with its text)."""
        start = checked["logprob_start_len"]
        if not checked["return_logprob"] or start < 0:
            return
        positions, top = prompt_len - start, checked["top_logprobs_num"]
        entries = positions * (top + 1) * n
        if entries > self.max_prompt_logprobs:
            top_name, n_name = names.option("top_logprobs_num"), names.sampling("n")
            raise InvalidRequest(
                f"prompt logprobs: {positions} prompt positions x ({top} `{top_name}` + 1) x "
                f"{n} `{n_name}` = {entries} entries, more than this server's limit of "
                f"{self.max_prompt_logprobs} a request (server.max_prompt_logprobs, "
                f"--max-prompt-logprobs); ask for "
                "fewer prompt positions, top logprobs or choices")

    def _ids(self, ids: Any, public: str) -> list[int]:
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequest(f"`{public}` must be a list of integers")
        if not ids:
            raise InvalidRequest("the prompt is empty")
        if len(ids) >= self.context_len:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens; the model's context is "
                                 f"{self.context_len} (one token must be left to generate)")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        return ids
