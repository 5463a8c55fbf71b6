"""A forward pass's tokens: each finished row's next token (shaped logits, then one argmax
for the batch, or a sample) and the logprobs its request asked for, read in one batch.

A failure while serving one request fails it alone (`alone`, `fail`: the scheduler's); the
others' tokens come back.

Threading: scheduler thread.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from weakref import WeakKeyDictionary

import torch

from hicache_server.model_runner import ForwardOutput
from hicache_server.request import Request
from hicache_server.sampling import (
    LogitsShaper,
    logprob_reads,
    record_logprob,
    sample_row,
    token_logprobs,
)
from hicache_server.scheduler.text import OutputText


class TokenChoice:
    def __init__(self, text: OutputText,
                 alone: Callable[[Request, str], AbstractContextManager[None]],
                 fail: Callable[[Request, str, Exception], None]) -> None:
        self.text = text
        self.alone = alone  # a block whose exception fails that request only
        self.fail = fail    # fail a request after an exception while serving it
        # each request's shaper, made at its first shaped token; gone with the request
        self._shapers: WeakKeyDictionary[Request, LogitsShaper] = WeakKeyDictionary()

    def choose(self, reqs: list[Request], done: list[int],
                       out: ForwardOutput) -> dict[int, int]:
        """The next token of each `reqs[i]`, i in `done`: logits shaped for the requests
        that ask, then one argmax over all rows (the one sync of a greedy batch; a plain
        greedy row is exactly today's argmax) or `sample_row`. A failure fails its request
        alone; the others' tokens come back (request index -> token)."""
        if not done:
            return {}
        logits = out.logits[[out.rows[i].last for i in done]]  # [len(done), vocab], a copy
        for j, i in enumerate(done):
            if reqs[i].input.params.shapes_logits:
                with self.alone(reqs[i], "shaping its logits"):
                    self._shaper(reqs[i], logits[j]).apply(logits[j], reqs[i].output.ids)
        greedy = logits.argmax(dim=-1).tolist()  # one sync for all
        tokens = {}
        for j, i in enumerate(done):
            req = reqs[i]
            if req.output.finish_reason is None:
                with self.alone(req, "sampling its token"):
                    tokens[i] = greedy[j] if req.input.params.greedy else sample_row(
                        logits[j], req.input.params, req.generator)
        return tokens

    def _shaper(self, req: Request, row: torch.Tensor) -> LogitsShaper:
        shaper = self._shapers.get(req)
        if shaper is None:
            shaper = self._shapers[req] = LogitsShaper(
                req.input.params, req.input.ids, self.text.stop_ids(req), row.shape[-1], row.device)
        return shaper

    def record_logprobs(self, reqs: list[Request], out: ForwardOutput,
                         tokens: dict[int, int]) -> None:
        """The logprobs this pass gives the requests that asked (prompt positions, new
        tokens), read in one batch; a failure fails the requests that asked."""
        reads = logprob_reads(reqs, out.rows, tokens)
        if not reads:
            return
        try:
            found = token_logprobs(out.logits, [r.row for r in reads],
                                   [r.target for r in reads],
                                   [r.req.input.top_logprobs_num for r in reads])
        except Exception as exc:  # noqa: BLE001 - fails the requests that asked only
            for req in dict.fromkeys(r.req for r in reads):
                self.fail(req, "reading its logprobs", exc)
            return
        for read, lp in zip(reads, found):
            req = read.req
            if req.output.finish_reason is None:
                with self.alone(req, "recording its logprobs"):
                    record_logprob(read, lp, lambda t, r=req: self.text.token_text(r, t))
