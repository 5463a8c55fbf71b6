"""A generation request: its sampling parameters, its place in the KV cache, its output."""

from __future__ import annotations

import itertools
import math
import reprlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
# Below this temperature sampling is greedy: dividing logits by a smaller one overflows float32
# (1e-40 and 1e-300 gave inf / NaN probabilities). vLLM's _SAMPLING_EPS is the same 1e-5.
SAMPLING_EPS = 1e-5
MAX_STOP_STRINGS = 16
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
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0      # 0 (or below SAMPLING_EPS) = greedy
    top_p: float = 1.0
    top_k: int = -1               # -1 = all tokens
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None       # per-request generator; None = derived from the request id

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Validate a user's `sampling_params`; raises InvalidRequest naming the field."""
        d = dict(d or {})
        unknown = sorted(set(d) - {f for f in cls.__dataclass_fields__})
        if unknown:
            raise InvalidRequest(f"sampling_params: unknown field(s) {', '.join(unknown)}; "
                                 f"allowed: {', '.join(cls.__dataclass_fields__)}")
        stop = d.pop("stop", None)
        params = {k: _check_field(k, v) for k, v in d.items() if v is not None}
        return cls(stop=_check_stop(stop), **params)


_RANGES: dict[str, tuple[type, float, float]] = {
    "max_new_tokens": (int, 1, 1 << 20),
    "temperature": (float, 0.0, 100.0),
    "top_p": (float, 0.0, 1.0),
    "top_k": (int, -1, 1 << 20),
    "seed": (int, 0, 2**63 - 1),
}


def _check_field(name: str, value: Any) -> Any:
    if name == "ignore_eos":
        if not isinstance(value, bool):
            raise InvalidRequest(f"sampling_params.ignore_eos: expected a boolean, got {_short(value)}")
        return value
    kind, low, high = _RANGES[name]
    ok_type = isinstance(value, (int, float)) if kind is float else isinstance(value, int)
    if isinstance(value, bool) or not ok_type:
        raise InvalidRequest(f"sampling_params.{name}: expected "
                             f"{'a number' if kind is float else 'an integer'}, got {_short(value)}")
    if not (low <= value <= high) or (kind is float and not math.isfinite(value)):
        raise InvalidRequest(f"sampling_params.{name}: must be in [{low}, {high}], got {value}")
    if name == "top_p" and value == 0:
        raise InvalidRequest("sampling_params.top_p: must be > 0, got 0")
    if name == "top_k" and value == 0:
        raise InvalidRequest("sampling_params.top_k: must be -1 (all) or >= 1, got 0")
    return kind(value)


def _check_stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stop)):
        raise InvalidRequest(f"sampling_params.stop: expected a non-empty string or a list of "
                             f"at most {MAX_STOP_STRINGS} non-empty strings, got {_short(stop)}")
    return tuple(stop)


@dataclass(eq=False)
class Request:
    """Owned by the scheduler thread once submitted (callbacks run on that thread).

    Its device slots, from admission to finish (`kv_slots`, token positions):

        [0, tree_len)              the tree's slots, locked through `last_node`; the tree
                                   frees them (on eviction), never the request
        [tree_len, num_computed)   KV this request computed; at its prefill's end
                                   (`cache_prompt`) and at finish they go to the tree, which
                                   hands back the duplicates of pages it already had
        [num_computed, len)        allocated for the step in flight; the request frees them
        + `reserved` tokens        promised by admission, not yet allocated

    `tree_len` grows when the prompt is cached; `cache_hit_tokens` (what `cached_details`
    adds up to) is fixed at admission: prompt tokens served from the cache, not computed.
    """

    input_ids: list[int]
    params: SamplingParams
    extra_key: str | None = None
    on_update: Callable[[Request, bool], None] | None = None  # (request, finished)
    rid: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None   # why it failed (finish_reason "error"), for its client
    arrival: float = 0.0
    first_token_at: float | None = None
    # KV cache state (scheduler thread)
    kv_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    num_computed: int = 0      # tokens whose K/V are in kv_slots
    tree_len: int = 0          # leading slots owned by the tree (locked), not by the request
    last_node: Any = None      # the locked tree node ending `[0, tree_len)`
    reserved: int = 0          # L1 tokens set aside for the rest of this request
    from_storage: int = 0      # tokens its prefetch brought from L3 into L2
    cached_details: dict[str, int] = field(
        default_factory=lambda: {"device": 0, "host": 0, "storage": 0})
    generator: torch.Generator | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def prefilled(self) -> bool:
        return self.num_computed >= self.prompt_len

    @property
    def cache_hit_tokens(self) -> int:
        return sum(self.cached_details.values())

    def meta_info(self) -> dict[str, Any]:
        meta = {
            "id": self.rid,
            "prompt_tokens": self.prompt_len,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cache_hit_tokens,
            "cached_tokens_details": dict(self.cached_details),
            "finish_reason": self.finish_reason,
        }
        if self.error is not None:
            meta["error"] = self.error
        return meta

    def result(self) -> dict[str, Any]:
        return {"text": self.text, "output_ids": list(self.output_ids),
                "meta_info": self.meta_info()}
