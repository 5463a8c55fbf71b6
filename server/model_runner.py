"""Builds the forward batch, pulls misses upward, runs the model.

    ForwardBatch  <- the scheduled requests' new tokens and slot tables
    loads         <- every H->D copy queued at admission, launched as one transfer; the
                     model waits for layer i's pages just before layer i's attention
    logits        -> the last new token's of each request (`hicache_server.sampling` turns them into
                     tokens and logprobs), and, for a request that wants prompt logprobs,
                     those of every prompt position from its `logprob_start_len`; a plain
                     greedy request's row may be the head screen's (`argmax_only`: exact
                     wherever its argmax can be, models/head_screen.py)

Threading: scheduler thread only.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from hicache.door import CacheDoor
from hicache.memory import DeviceKVPool
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.request import Request

__all__ = ["ForwardOutput", "LogitRows", "ModelRunner", "build_batch"]

# The made-up tokens of a timed forward cycle through ids 1..WARMUP_TOKEN_IDS (any vocabulary
# has them; the forward's cost does not depend on which tokens).
WARMUP_TOKEN_IDS = 200


class LogitRows(NamedTuple):
    """One request's rows of a forward's logits: `count` rows from row `first`, the logits
    after its positions `[first_pos, first_pos + count)`; the last row is its newest token's
    (the one a token is sampled from once the prompt is in)."""

    first: int
    first_pos: int
    count: int

    @property
    def last(self) -> int:
        return self.first + self.count - 1


class ForwardOutput(NamedTuple):
    logits: torch.Tensor   # [sum of counts, vocab] float32
    rows: list[LogitRows]  # per request, in batch order


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: CacheDoor) -> None:
        self.model = model
        self.kv_pool: DeviceKVPool = cache.slots.device_kv()
        self.cache = cache  # launches the H->D loads admission queued (none without L2)
        self.device = self.kv_pool.device

    def forward(self, reqs: list[Request], extend_lens: list[int]) -> ForwardOutput:
        """Compute K/V for `extend_lens[i]` new tokens of each request; the logits of the
        last new token of each, and of the prompt positions a request wants logprobs of."""
        batch = build_batch(reqs, extend_lens)
        rows = logit_rows(reqs, extend_lens)
        if any(r.count > 1 for r in rows):  # else the model's own last-token path
            batch.output_rows = _output_rows(rows, reqs, batch.extend_starts)
        batch.argmax_only = argmax_only(reqs, rows)
        handle = self.cache.steps.launch_loads()
        if handle is not None:
            batch.layer_hook = handle.wait_layer
        return ForwardOutput(self.model.forward(batch, self.kv_pool), rows)


    def timed_prefill(self, tokens: int) -> float | None:
        """Seconds of one forward of `tokens` made-up tokens from scratch, into KV slots
        borrowed from the pool and given back (nothing is kept); None when the pool has no
        room for them."""
        slots = self.kv_pool.alloc(tokens)
        if slots is None:
            return None
        try:
            slots = slots[:tokens]
            ids = torch.arange(tokens, dtype=torch.int64) % WARMUP_TOKEN_IDS + 1
            batch = ForwardBatch(input_ids=ids, positions=torch.arange(tokens),
                                 out_slots=slots, seq_slots=[slots], prefix_lens=[0],
                                 extend_lens=[tokens])
            started = time.perf_counter()
            logits = self.model.forward(batch, self.kv_pool)
            logits[-1, 0].item()  # on CUDA, the sync
            return time.perf_counter() - started
        finally:
            self.kv_pool.free(slots)


def build_batch(reqs: list[Request], extend_lens: list[int]) -> ForwardBatch:
    ids, positions, out_slots, seq_slots, prefix_lens = [], [], [], [], []
    for req, n in zip(reqs, extend_lens):
        start = req.kv.num_computed
        tokens = req.ids_between(start, start + n)
        ids.extend(tokens)
        positions.append(torch.arange(start, start + n, dtype=torch.int64))
        slots = req.kv.slots[:start + n]  # [prefix + new]
        out_slots.append(slots[start:])
        seq_slots.append(slots)
        prefix_lens.append(start)
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.cat(positions),
        out_slots=torch.cat(out_slots),
        seq_slots=seq_slots,
        prefix_lens=prefix_lens,
        extend_lens=list(extend_lens),
    )


def logit_rows(reqs: list[Request], extend_lens: list[int]) -> list[LogitRows]:
    """Which positions each request needs logits of this pass: its last new one, and in a
    prefill chunk of a request that wants prompt logprobs, every one from `logprob_start_len`
    (admission never served those from the cache, so they are all computed here)."""
    out, row = [], 0
    for req, n in zip(reqs, extend_lens):
        start = req.kv.num_computed
        last = start + n - 1
        first = last
        if req.wants_prompt_logprobs and start < req.prompt_len:
            first = min(max(start, req.input.logprob_start_len), last)
        out.append(LogitRows(row, first, last - first + 1))
        row += last - first + 1
    return out


def argmax_only(reqs: list[Request], rows: list[LogitRows]) -> torch.Tensor | None:
    """`ForwardBatch.argmax_only` for `rows`: a request's last row where its token is a plain
    greedy one (greedy, no logit changes, no logprobs), so only that row's argmax is read
    (scheduler/tokens.py); None when no row is."""
    marks = []
    for req, r in zip(reqs, rows):
        p = req.input.params
        plain = p.greedy and not p.shapes_logits and not req.input.return_logprob
        marks += [False] * (r.count - 1) + [plain]
    return torch.tensor(marks, dtype=torch.bool) if any(marks) else None


def _output_rows(rows: list[LogitRows], reqs: list[Request],
                 extend_starts: list[int]) -> torch.Tensor:
    """`ForwardBatch.output_rows` for `rows`: offsets into the batch's `[T]` new tokens."""
    picks = [torch.arange(r.count) + (s + r.first_pos - req.kv.num_computed)
             for r, req, s in zip(rows, reqs, extend_starts)]
    return torch.cat(picks).to(torch.int64)
