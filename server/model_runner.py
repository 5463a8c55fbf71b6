"""Builds the forward batch, pulls misses upward, runs the model, samples.

    ForwardBatch  <- the scheduled requests' new tokens and slot tables
    loads         <- every H->D copy queued at admission, launched as one transfer; the
                     model waits for layer i's pages just before layer i's attention
    logits        -> one token per request (greedy, or temperature / top-k / top-p with the
                     request's own seeded generator)

Threading: scheduler thread only.
"""

from __future__ import annotations

import math

import torch

from hicache.memory import DeviceKVPool
from hicache.tree import PrefixCache
from server.models.forward_batch import ForwardBatch
from server.request import Request


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_pool: DeviceKVPool, tree: PrefixCache) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.tree = tree  # launches the H->D loads admission queued (none without L2)
        self.device = kv_pool.device

    def forward(self, reqs: list[Request], extend_lens: list[int]) -> torch.Tensor:
        """Compute K/V for `extend_lens[i]` new tokens of each request; logits of the last
        new token of each, `[len(reqs), vocab]` float32."""
        batch = build_batch(reqs, extend_lens)
        handle = self.tree.start_loading()
        if handle is not None:
            batch.layer_hook = handle.wait_layer
        return self.model.forward(batch, self.kv_pool)


def build_batch(reqs: list[Request], extend_lens: list[int]) -> ForwardBatch:
    ids, positions, out_slots, seq_slots, prefix_lens = [], [], [], [], []
    for req, n in zip(reqs, extend_lens):
        start = req.num_computed
        tokens = req.all_ids[start:start + n]
        ids.extend(tokens)
        positions.append(torch.arange(start, start + n, dtype=torch.int64))
        slots = req.kv_slots[:start + n]  # [prefix + new]
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


def sample(logits: torch.Tensor, reqs: list[Request]) -> list[int]:
    """One token per row of `logits` `[n, vocab]`, by each request's sampling parameters."""
    greedy = logits.argmax(dim=-1).tolist()  # one sync for the whole batch
    return [greedy[i] if req.params.greedy else sample_row(logits[i], req.params, req.generator)
            for i, req in enumerate(reqs)]


def sample_row(row: torch.Tensor, p, generator: torch.Generator) -> int:
    """One token of `row` `[vocab]` by temperature, top-k and top-p. Never fails on a finite
    row: the most likely token is always kept, and a distribution that still comes out
    unusable (non-finite logits) falls back to the argmax instead of raising."""
    probs = torch.softmax(row.float() / p.temperature, dim=-1)  # [vocab]
    if p.top_k > 0:
        k = min(p.top_k, probs.numel())
        top, idx = probs.topk(k)
        probs = torch.zeros_like(probs).scatter_(0, idx, top)
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < p.top_p * sorted_p.sum()
        keep[0] = True  # a top_p so small that `top_p * sum` underflows still keeps one
        probs = torch.zeros_like(probs).scatter_(0, idx[keep], sorted_p[keep])
    probs = probs.cpu()  # the one copy (and sync) per sampled row; checked on the host
    total = float(probs.sum())
    if not (total > 0 and math.isfinite(total)) or not bool(torch.isfinite(probs).all()):
        return int(row.argmax())
    token = torch.multinomial(probs, 1, generator=generator)
    return int(token.item())
