"""From a request's logits to its next token and the logprobs it asked for.

    raw logits -> logprobs     log-softmax of the model's own logits in float32, before any
                               penalty or temperature: what the model says, whatever the
                               sampling (vLLM's default; SGLang's RETURN_ORIGINAL_LOGPROB)
               -> LogitsShaper logit_bias, the min_new_tokens mask, repetition, frequency and
                               presence penalties (vLLM's order), only for requests that ask
               -> a token      argmax when greedy; else `sample_row`: temperature, top-k,
                               top-p, min-p, a draw from the request's own generator

Synchronisation: the scheduler reads the greedy tokens of a whole batch in one copy;
`sample_row` copies its one row; `token_logprobs` copies once per pass of rows.

Threading: scheduler thread.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from hicache_server.request import Request, SamplingParams

if TYPE_CHECKING:
    from hicache_server.model_runner import LogitRows

# Rows log-softmaxed at once when reading logprobs: bounds the float32 temporary to
# rows x vocab (512 x 152k, Qwen2's vocabulary, is 300 MiB) for long prompt-logprob prefills.
LOGPROB_ROWS_PER_PASS = 512


def _on(device: torch.device, values: Sequence[int] | Sequence[float],
        dtype: torch.dtype) -> torch.Tensor:
    """A host list on `device`, copied without waiting for the device (as ForwardBatch does)."""
    return torch.tensor(list(values), dtype=dtype).to(device, non_blocking=True)


class LogitsShaper:
    """One request's logit changes before sampling. The token counts they read live on the
    logits' device and grow by each step's new tokens, so no step rebuilds them."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int], stop_ids: Iterable[int],
                 vocab_size: int, device: torch.device) -> None:
        self.params = params
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)  # in output
        self.counted = 0  # output tokens already in `counts`
        self.seen: torch.Tensor | None = None  # [vocab] bool: in prompt or output
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.seen[_on(device, prompt, torch.int64)] = True
        self.bias_ids = _on(device, [t for t, _ in params.logit_bias], torch.int64)
        self.bias = _on(device, [b for _, b in params.logit_bias], torch.float32)
        # the tokens that would end the request, masked until min_new_tokens are out
        self.stop_ids = _on(device, sorted(stop_ids), torch.int64)

    def apply(self, row: torch.Tensor, output_ids: Sequence[int]) -> None:
        """Shape `row` `[vocab]` float32 in place for the token after `output_ids`."""
        self._count(output_ids)
        p = self.params
        if self.bias_ids.numel():
            row.index_add_(0, self.bias_ids, self.bias)
        if len(output_ids) < p.min_new_tokens and self.stop_ids.numel():
            row.index_fill_(0, self.stop_ids, -math.inf)
        if self.seen is not None:  # HF / vLLM: > 1 lowers every seen logit, < 1 raises it
            shaped = torch.where(row > 0, row / p.repetition_penalty,
                                 row * p.repetition_penalty)
            row.copy_(torch.where(self.seen, shaped, row))
        if p.frequency_penalty:
            row.sub_(p.frequency_penalty * self.counts)
        if p.presence_penalty:
            row.sub_(p.presence_penalty * (self.counts > 0).to(row.dtype))

    def _count(self, output_ids: Sequence[int]) -> None:
        new = list(output_ids[self.counted:])
        if not new:
            return
        idx = _on(self.counts.device, new, torch.int64)
        self.counts.index_add_(0, idx, torch.ones(len(new), device=self.counts.device))
        if self.seen is not None:
            self.seen[idx] = True
        self.counted = len(output_ids)


def sample_row(row: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    """One token of `row` `[vocab]` by temperature, top-k, top-p and min-p. Never fails on
    a finite row: the most likely token is always kept, and a distribution that still comes
    out unusable (non-finite logits) falls back to the argmax instead of raising."""
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
    if p.min_p > 0:  # relative to the top token, which it therefore always keeps
        probs = torch.where(probs >= p.min_p * probs.max(), probs, torch.zeros_like(probs))
    probs = probs.cpu()  # the one copy (and sync) per sampled row; checked on the host
    total = float(probs.sum())
    if not (total > 0 and math.isfinite(total)) or not bool(torch.isfinite(probs).all()):
        return int(row.argmax())
    token = torch.multinomial(probs, 1, generator=generator)
    return int(token.item())


class TokenLogprob(NamedTuple):
    logprob: float
    top: list[tuple[float, int]]  # (logprob, token id), most likely first


def token_logprobs(logits: torch.Tensor, rows: Sequence[int], targets: Sequence[int],
                   tops: Sequence[int]) -> list[TokenLogprob]:
    """For each i: the float32 log-softmax of `logits[rows[i]]` at `targets[i]`, and its
    `tops[i]` most likely tokens. Batched: one log-softmax, gather and top-k per
    LOGPROB_ROWS_PER_PASS rows, and two copies to the host."""
    out: list[TokenLogprob] = []
    k = min(max(tops, default=0), logits.shape[-1])
    for start in range(0, len(rows), LOGPROB_ROWS_PER_PASS):
        end = start + LOGPROB_ROWS_PER_PASS
        idx = _on(logits.device, rows[start:end], torch.int64)
        tgt = _on(logits.device, targets[start:end], torch.int64)
        lp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)  # [r, vocab]
        chosen = lp.gather(1, tgt[:, None])  # [r, 1]
        top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], tgt[:, None][:, :0])
        values = torch.cat([chosen, top_v], dim=1).tolist()
        ids = top_i.tolist()
        for v, i, want in zip(values, ids, tops[start:end]):
            out.append(TokenLogprob(v[0], list(zip(v[1:1 + want], i[:want]))))
    return out


class LogprobRead(NamedTuple):
    req: Request
    row: int       # of the forward's logits
    target: int    # the token whose logprob is read there
    output: bool   # a generated token's (else the prompt token after that position)


def logprob_reads(reqs: Sequence[Request], rows: Sequence[LogitRows],
                  tokens: dict[int, int]) -> list[LogprobRead]:
    """What this pass's logits give the requests that asked for logprobs: per request, in
    order, each prompt position from `logprob_start_len` (read for the next prompt token;
    the last prompt position's logits are the first output token's), then its new token
    (`tokens`: request index -> token)."""
    reads = []
    for i, (req, r) in enumerate(zip(reqs, rows)):
        if not req.input.return_logprob or req.output.finish_reason is not None:
            continue
        if req.wants_prompt_logprobs:
            for j in range(r.count):
                pos = r.first_pos + j
                if req.input.logprob_start_len <= pos < req.prompt_len - 1:
                    reads.append(LogprobRead(req, r.first + j, req.input.ids[pos + 1], False))
        if i in tokens:
            reads.append(LogprobRead(req, r.last, tokens[i], True))
    return reads


def record_logprob(read: LogprobRead, found: TokenLogprob,
                   text_of: Callable[[int], str | None]) -> None:
    """Add one read to its request's `Logprobs` as SGLang's `[logprob, id, text]` entries.
    The prompt's list opens with the token at `logprob_start_len`, logprob None."""
    req, rec = read.req, read.req.output.logprobs
    if req.wants_prompt_logprobs and not rec.input_token:
        first = req.input.ids[req.input.logprob_start_len]
        rec.input_token.append([None, first, text_of(first)])
        rec.input_top.append(None)
    entry = [found.logprob, read.target, text_of(read.target)]
    top = [[v, t, text_of(t)] for v, t in found.top]
    if read.output:
        rec.output_token.append(entry)
        rec.output_top.append(top)
    else:
        rec.input_token.append(entry)
        rec.input_top.append(top)
