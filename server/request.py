"""A generation request: its sampling parameters, its place in the KV cache, its output."""

from __future__ import annotations

import itertools
import math
import reprlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache.policies import DEFAULT_PRIORITY
from hicache_server.field_names import SGLANG_NAMES, FieldNames
from hicache_server.kv_state import KVState
from hicache_server.output import Delta, RequestOutput

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
# Below this temperature sampling is greedy: dividing logits by a smaller one overflows float32
# (1e-40 and 1e-300 gave inf / NaN probabilities). vLLM's _SAMPLING_EPS is the same 1e-5.
SAMPLING_EPS = 1e-5
MAX_STOP_STRINGS = 16
# SGLang's SamplingParams.verify bounds: repetition_penalty in (0, 2], the OpenAI penalties in
# [-2, 2]; logit_bias values in [-100, 100] are OpenAI's.
MAX_REPETITION_PENALTY = 2.0
MAX_ABS_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0
MAX_CHOICES = 128  # `n`: OpenAI's documented maximum
MAX_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs; OpenAI's chat top_logprobs limit
_ids = itertools.count()


def _short(value: Any) -> str:
    """A user's value for an error message, cut to a readable length."""
    return reprlib.repr(value)


class InvalidRequest(ValueError):
    """A request the server will not run; the message says what and why (an HTTP 400)."""


def check_unicode(name: str, text: str) -> None:
    """InvalidRequest unless `text` is valid Unicode. JSON can carry a lone surrogate
    (`"\\ud800"`), which is no character and has no UTF-8 form, so no tokenizer can take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"`{name}` is not valid Unicode: {e.reason} "
                             f"(U+{ord(text[e.start]):04X} at character {e.start}); a "
                             "\\uD800-\\uDBFF escape must be followed by its low "
                             "surrogate") from None


@dataclass(frozen=True)
class SamplingParams:
    """One choice's sampling, as SGLang's `sampling_params` spells it (defaults = off).

    Logits are shaped in vLLM's order before any sampling: `logit_bias` and the
    `min_new_tokens` mask, then `repetition_penalty` (prompt and output tokens), then
    `frequency_penalty` and `presence_penalty` (output tokens); then greedy argmax, or
    temperature, top-k, top-p, min-p and a draw.
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0      # 0 (or below SAMPLING_EPS) = greedy
    top_p: float = 1.0
    top_k: int = -1               # -1 = all tokens
    min_p: float = 0.0            # drop tokens below min_p * the top token's probability
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # stop on these too (unless ignore_eos, as SGLang)
    ignore_eos: bool = False
    min_new_tokens: int = 0       # no stop (EOS, stop ids, stop strings) before this many
    repetition_penalty: float = 1.0   # HF/vLLM: seen logits > 0 divided, < 0 multiplied
    frequency_penalty: float = 0.0    # OpenAI: minus penalty * count in the output
    presence_penalty: float = 0.0     # OpenAI: minus penalty once a token is in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    n: int = 1                    # choices; the engine runs each as its own request
    seed: int | None = None       # per-request generator; None = a fresh random seed
    skip_special_tokens: bool = True  # special ids are not in the text
    no_stop_trim: bool = False    # keep the stop string / stop token's text in the text

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def shapes_logits(self) -> bool:
        """Whether any logit is changed before sampling (False: the plain fast path)."""
        return bool(self.logit_bias or self.min_new_tokens or self.repetition_penalty != 1.0
                    or self.frequency_penalty or self.presence_penalty)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, names: FieldNames = SGLANG_NAMES
                  ) -> SamplingParams:
        """Validate a user's `sampling_params`; raises InvalidRequest naming the field as
        the client does (`names`). Token ids are checked against a vocabulary by
        `check_vocab`."""
        d = dict(d or {})
        unknown = sorted(set(d) - {f for f in cls.__dataclass_fields__})
        if unknown:
            raise InvalidRequest(f"sampling_params: unknown field(s) {', '.join(unknown)}; "
                                 f"allowed: {', '.join(cls.__dataclass_fields__)}")
        special = {"stop": _check_stop(d.pop("stop", None), names.sampling("stop")),
                   "stop_token_ids": _check_token_ids(d.pop("stop_token_ids", None),
                                                      names.sampling("stop_token_ids")),
                   "logit_bias": _check_logit_bias(d.pop("logit_bias", None),
                                                   names.sampling("logit_bias"))}
        params = cls(**special, **{k: _check_field(k, v, names.sampling(k))
                                   for k, v in d.items() if v is not None})
        if params.min_new_tokens > params.max_new_tokens:
            limit = names.sampling("max_new_tokens").removeprefix(names.sampling_prefix)
            raise InvalidRequest(f"{names.sampling('min_new_tokens')}: must be <= {limit} "
                                 f"({params.max_new_tokens}), got {params.min_new_tokens}")
        return params

    def check_vocab(self, vocab_size: int, names: FieldNames = SGLANG_NAMES) -> None:
        """InvalidRequest for a token id (stop_token_ids, logit_bias) outside the vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("logit_bias", [t for t, _ in self.logit_bias])):
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise InvalidRequest(f"{names.sampling(name)}: token id {bad} is outside the "
                                     f"vocabulary [0, {vocab_size})")


_BOOLEANS = frozenset({"ignore_eos", "skip_special_tokens", "no_stop_trim"})
_RANGES: dict[str, tuple[type, float, float]] = {
    "max_new_tokens": (int, 1, 1 << 20),
    "min_new_tokens": (int, 0, 1 << 20),
    "temperature": (float, 0.0, 100.0),
    "top_p": (float, 0.0, 1.0),
    "top_k": (int, -1, 1 << 20),
    "min_p": (float, 0.0, 1.0),
    "repetition_penalty": (float, 0.0, MAX_REPETITION_PENALTY),
    "frequency_penalty": (float, -MAX_ABS_PENALTY, MAX_ABS_PENALTY),
    "presence_penalty": (float, -MAX_ABS_PENALTY, MAX_ABS_PENALTY),
    "n": (int, 1, MAX_CHOICES),
    "seed": (int, 0, 2**63 - 1),
}
# Fields whose range excludes its lower end: (the value refused, why)
_OPEN_BELOW = {"top_p": (0, "> 0"), "top_k": (0, "-1 (all) or >= 1"),
               "repetition_penalty": (0, "> 0 (1 = no penalty)")}


def _check_field(name: str, value: Any, public: str) -> Any:
    """Sampling field `name`'s value, checked; errors name it `public`."""
    if name in _BOOLEANS:
        if not isinstance(value, bool):
            raise InvalidRequest(f"{public}: expected a boolean, got {_short(value)}")
        return value
    kind, low, high = _RANGES[name]
    _check_number(public, value, kind, low, high)
    if name in _OPEN_BELOW and value == _OPEN_BELOW[name][0]:
        raise InvalidRequest(f"{public}: must be {_OPEN_BELOW[name][1]}, got {value}")
    return kind(value)


def _check_number(name: str, value: Any, kind: type, low: float, high: float) -> None:
    """InvalidRequest unless `value` is a finite number of `kind` (int, or float = any
    number) in [low, high]."""
    ok_type = isinstance(value, (int, float)) if kind is float else isinstance(value, int)
    if isinstance(value, bool) or not ok_type:
        raise InvalidRequest(f"{name}: expected "
                             f"{'a number' if kind is float else 'an integer'}, got {_short(value)}")
    if not (low <= value <= high) or (kind is float and not math.isfinite(value)):
        raise InvalidRequest(f"{name}: must be in [{low}, {high}], got {value}")


def _check_stop(stop: Any, public: str) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stop)):
        raise InvalidRequest(f"{public}: expected a non-empty string or a list of "
                             f"at most {MAX_STOP_STRINGS} non-empty strings, got {_short(stop)}")
    return tuple(stop)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_priority(value: Any) -> int:
    """A request's `priority` (None: DEFAULT_PRIORITY); InvalidRequest unless an integer."""
    if value is None:
        return DEFAULT_PRIORITY
    if not _is_int(value):
        raise InvalidRequest(f"`priority` must be an integer (higher keeps the request's "
                             f"prefix cached longer under the priority eviction policy), "
                             f"got {_short(value)}")
    return value


MAX_SESSION_ID_LEN = 256  # a session id is a handle, not a payload


def check_session_id(value: Any) -> str | None:
    """A request's `session_id` (None: no session); InvalidRequest unless a non-empty
    string of at most MAX_SESSION_ID_LEN characters."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_SESSION_ID_LEN:
        raise InvalidRequest(f"`session_id` must be a non-empty string of at most "
                             f"{MAX_SESSION_ID_LEN} characters (the session whose prefixes "
                             f"the cache keeps longer), got {_short(value)}")
    check_unicode("session_id", value)
    return value


def _check_token_ids(ids: Any, public: str) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        raise InvalidRequest(f"{public}: expected a list of token ids "
                             f"(integers), got {_short(ids)}")
    return tuple(sorted(set(ids)))


def _check_logit_bias(bias: Any, public: str) -> tuple[tuple[int, float], ...]:
    """`{token id: bias}`; ids may be strings of digits, as JSON object keys always are."""
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise InvalidRequest(f"{public}: expected an object of token id -> "
                             f"bias, got {_short(bias)}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = _token_key(key)
        if token is None:
            raise InvalidRequest(f"{public}: key {_short(key)} is not a "
                                 "token id (an integer)")
        _check_number(f"{public}[{token}]", value, float,
                      -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS)
        out[token] = float(value)
    return tuple(sorted(out.items()))


def _token_key(key: Any) -> int | None:
    """A logit_bias key as a token id: an integer, or a string of one ("50256")."""
    if _is_int(key):
        return key
    if not isinstance(key, str):
        return None
    try:
        return int(key)
    except ValueError:
        return None


@dataclass(frozen=True, eq=False)
class RequestInput:
    """What the client asked, fixed once the request is made: the prompt's ids, the
    sampling parameters and the options beside them. The cache reads its namespace,
    priority and session off it (`hicache.handles.Requester`).

    The logprob options are SGLang's `GenerateReqInput` fields, outside `sampling_params`
    as there: `return_logprob`, `logprob_start_len` (-1: no prompt logprobs; k >= 0: those
    of the prompt from position k on), `top_logprobs_num`, `return_text_in_logprobs`.
    `priority` is SGLang's too: the tree keeps the prefixes of higher priorities longer
    (under the `priority` eviction policy, a node's is the highest of its users').
    `session_id` (SGLang's sessions): with `cache.session_retention`, the nodes it uses are
    owned by that session and evicted after unowned ones while the session lives.
    """

    ids: list[int]  # the prompt
    params: SamplingParams
    extra_key: str | None = None
    priority: int = DEFAULT_PRIORITY
    session_id: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False


@dataclass(eq=False)
class Request:
    """Owned by the scheduler thread once submitted (callbacks run on that thread). Its
    parts: `input` (prompt, sampling parameters, options: `RequestInput`, fixed), `kv`
    (its place in the KV cache, `hicache_server.kv_state`) and `output` (ids, logprobs,
    text, finish: `hicache_server.output`).

    Positions run over `all_ids` (prompt, then output): before its next token can be chosen
    a request computes up to `seq_len` (its fill: the prompt's rest at first, then one token
    a step). A retracted request's sampling goes on where it stopped: nothing it already
    generated is chosen or sent again. A request that wants prompt logprobs from position
    k is served at most its first k tokens from the cache (`cacheable_len`): the logits of
    every later position are computed.
    """

    input: RequestInput
    on_update: Callable[[Request, bool], None] | None = None  # (request, finished)
    rid: str = field(default_factory=lambda: f"req-{next(_ids)}")
    kv: KVState = field(default_factory=KVState)
    output: RequestOutput = field(default_factory=RequestOutput)
    arrival: float = 0.0
    first_token_at: float | None = None
    generator: torch.Generator | None = None
    # n > 1: the first choice, whose prompt this one waits for (then reads from the tree)
    prompt_leader: Request | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.input.ids)

    @property
    def seq_len(self) -> int:
        """Prompt and output tokens so far (`len(all_ids)`, without building the list)."""
        return len(self.input.ids) + len(self.output.ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs are asked and still to be read: once the first token is
        out they all are (a retracted request computes its prompt again, not its logprobs)."""
        asked = self.input.return_logprob and self.input.logprob_start_len >= 0
        return asked and not self.output.ids

    @property
    def cacheable_len(self) -> int:
        """Tokens of `all_ids` the cache may serve: all but the last (whose logits pick the
        next token), and none from `logprob_start_len` on while prompt logprobs are to be
        read (their logits must be computed; the tree cuts this to whole pages)."""
        if self.wants_prompt_logprobs:
            return min(self.prompt_len - 1, self.input.logprob_start_len)
        return self.seq_len - 1

    @property
    def all_ids(self) -> list[int]:
        """Prompt and output, one new list (the cache's key; not per token: `ids_between`)."""
        return self.input.ids + self.output.ids

    def ids_between(self, start: int, end: int) -> list[int]:
        """`all_ids[start:end]` without building `all_ids`: a decode step reads one token,
        whatever the output's length."""
        cut = len(self.input.ids)
        if start >= cut:
            return self.output.ids[start - cut:end - cut]
        return self.input.ids[start:end] + self.output.ids[:max(0, end - cut)]

    @property
    def prefilled(self) -> bool:
        return self.kv.num_computed >= self.prompt_len

    def meta_info(self, with_logprobs: bool = True) -> dict[str, Any]:
        """SGLang's meta_info: counts, cached tokens, finish; the logprob lists (whole: at
        the end only) unless `with_logprobs` is False."""
        meta = {
            "id": self.rid,
            "prompt_tokens": self.prompt_len,
            "completion_tokens": len(self.output.ids),
            "cached_tokens": self.kv.cache_hit_tokens,
            "cached_tokens_details": dict(self.kv.cached_details),
            "finish_reason": self.output.finish_reason,
        }
        if self.output.error is not None:
            meta["error"] = self.output.error
        if self.input.return_logprob and with_logprobs:
            meta.update(self.output.logprobs.meta(with_top=self.input.top_logprobs_num > 0))
        return meta

    def take_delta(self) -> Delta:
        """What the output gained since the last call (`RequestOutput.take_delta`)."""
        return self.output.take_delta(self.meta_info(with_logprobs=False))

    def result(self) -> dict[str, Any]:
        """The whole result, built once the request has finished: `text`, `output_ids`,
        `meta_info` (`Engine.generate`'s shape)."""
        return {"text": self.output.text, "output_ids": list(self.output.ids),
                "meta_info": self.meta_info()}
