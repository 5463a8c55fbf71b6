"""A request's output, the part of a `Request` the scheduler writes as tokens come: its ids,
logprobs, text and finish, and what its client has not read yet (`take_delta`).

Deltas, not snapshots: per token the scheduler appends the token, its logprob entries and
the text that settled with it (`hicache_server.scheduler.text`); a reader takes what is new
since its last read, never a copy of the whole output. The whole result (`result`) is built
once, when the request has finished.

Threading: written and read on the scheduler thread only; a `Delta` once taken belongs to
its reader.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprobs:
    """What a `return_logprob` request has collected, each entry SGLang's
    `[logprob, token_id, text or None]` (text only with `return_text_in_logprobs`).

    `input_token` covers the prompt from `logprob_start_len` on; its first entry has logprob
    None (SGLang pads the first position so), and so has `input_top`'s first position.
    """

    input_token: list[list[Any]] = field(default_factory=list)
    input_top: list[list[list[Any]] | None] = field(default_factory=list)
    output_token: list[list[Any]] = field(default_factory=list)
    output_top: list[list[list[Any]]] = field(default_factory=list)

    def meta(self, with_top: bool) -> dict[str, list]:
        """meta_info's logprob keys (copies: their owner keeps appending; a finished
        request's result, and each /generate stream snapshot, `http.native._SoFar`); the
        top lists only when asked, as SGLang."""
        meta = {"input_token_logprobs": list(self.input_token),
                "output_token_logprobs": list(self.output_token)}
        if with_top:
            meta["input_top_logprobs"] = list(self.input_top)
            meta["output_top_logprobs"] = list(self.output_top)
        return meta

    def extend(self, later: Logprobs) -> None:
        self.input_token += later.input_token
        self.input_top += later.input_top
        self.output_token += later.output_token
        self.output_top += later.output_top


@dataclass
class Sent:
    """How much of each output list a reader has taken (counts, never copies)."""

    ids: int = 0
    pieces: int = 0
    input_token: int = 0
    input_top: int = 0
    output_token: int = 0
    output_top: int = 0


@dataclass
class Delta:
    """What a request's output gained since its reader last took one: new token ids, new
    text (settled: never taken back), new logprob entries, and `meta` (meta_info's counts
    and finish reason as of now, no logprob lists). `merge` folds a later delta in: a
    reader slower than the scheduler gets one delta for several tokens, none lost."""

    ids: list[int]
    text_pieces: list[str]
    logprobs: Logprobs
    meta: dict[str, Any]

    @property
    def text(self) -> str:
        return "".join(self.text_pieces)

    @property
    def finish_reason(self) -> str | None:
        return self.meta["finish_reason"]

    def merge(self, later: Delta) -> None:
        self.ids += later.ids
        self.text_pieces += later.text_pieces
        self.logprobs.extend(later.logprobs)
        self.meta = later.meta


@dataclass(eq=False)
class RequestOutput:
    """The output so far. `pieces` joined is the text handed on (never taken back);
    `held` is decoded text kept back because it may be the start of a stop string, and
    `prefix_offset <= read_offset <= len(ids)` are the incremental decode's read offsets:
    `ids[prefix_offset:read_offset]` was decoded last, as context for the next window
    (see `hicache_server.scheduler.text`)."""

    ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None   # why it failed (finish_reason "error"), for its client
    logprobs: Logprobs = field(default_factory=Logprobs)
    pieces: list[str] = field(default_factory=list)
    held: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    text_done: bool = False    # the text is final: nothing more is decoded or held
    sent: Sent = field(default_factory=Sent)

    @property
    def text(self) -> str:
        """The text handed on so far (the whole text once the request has finished)."""
        return "".join(self.pieces)

    def take_delta(self, meta: dict[str, Any]) -> Delta:
        """What was added since the last call, and `meta` (the request's counts): the work
        is the size of what is new, never of the whole output."""
        s, lp = self.sent, self.logprobs
        delta = Delta(self.ids[s.ids:], self.pieces[s.pieces:],
                      Logprobs(lp.input_token[s.input_token:], lp.input_top[s.input_top:],
                               lp.output_token[s.output_token:],
                               lp.output_top[s.output_top:]), meta)
        self.sent = Sent(len(self.ids), len(self.pieces), len(lp.input_token),
                         len(lp.input_top), len(lp.output_token), len(lp.output_top))
        return delta
