"""Greedy tokens without streaming the whole LM head: an int8 screen of the head, then the
exact logits of the few outputs that can still be the largest.

A plain greedy row (temperature 0 or top-k 1, no logprobs, no logit changes: the runner
picks them, `ModelRunner.forward`) needs one thing of its logits: the first index of the
largest. In a decode step of a small model most of the bytes streamed are the head's
(Gemma 3 270M: 168M of its 268M weights, 671 MB a step in float32, 336 in bfloat16;
SmolLM2: 28M of 135M). The screen streams an int8 copy instead (168 MB and 28 MB), then
computes exactly the panels of 64 outputs that hold a candidate:

    q[j]   = round(W[j] / s[j]) in [-127, 127], s[j] = max |W[j]| / 127   (once, at load)
    screened logit   t[j] = s[j] * sum_k x[k] q[j][k]                     (float32)
    reach[j] = (||W[j] - s[j] q[j]|| + g (||W[j]|| + s[j] ||q[j]||) + 2^-110) (1 + 2^-20)

Why it is exact. The linear kernel's logit L[j] is one float32 chain over k (products
exact in bfloat16; on AMX the tile unit's order, each add still one rounding), so it is
within g ||x|| ||W[j]|| of the real x.W[j], with g = 4 (K + 2) 2^-24, twice float32's bound
for K adds even if an add truncated; t[j] is within g ||x|| s[j] ||q[j]|| of the real
x.(s[j] q[j]); and by Cauchy-Schwarz |x.W[j] - x.(s[j] q[j])| <= ||x|| ||W[j] - s[j] q[j]||.
So |L[j] - t[j]| <= ||x|| reach[j], with ||x|| rounded up. The largest logit is then at or
above lo_max = max_j (t[j] - ||x|| reach[j]), and every output that may equal it after the
logits are rounded to the model's dtype (bfloat16's 8 bits: within 2^-7 of its magnitude,
`slack`) has t[j] + ||x|| reach[j] >= lo_max - slack * max(|lo_max|, |hi_max|): a
candidate. (Near float32's denormals, where flushes and rounding are absolute, the 2^-110
in reach and a 2^-99 below the floor cover them: cpu_head.c.) The candidates' panels go through the very linear kernel call of the whole head
(`CpuLinearKernel`, whose every output is its own chain, whatever panels it is given), so
their logits have the whole head's bits; every other output is set to -inf. The argmax of
that row, first index on ties, is the whole head's: every output whose logit (as the
head returns it, in the model's dtype) ties the largest is a candidate, and no other is
larger. A row with a non-finite value, one whose ||x|| max ||W[j]|| reaches MAX_PRODUCT
(a chain could overflow), or a batch whose candidates cover more than MAX_PANEL_SHARE of
the panels, takes the whole head; so does a batch of more than 64 rows.

On Gemma 3 270M's real hidden states a row has a median of 13 candidates in 6 panels of
4,096 (int8 screen, float32 and bfloat16); a 4-bit screen's bound took every panel.

Costs: the int8 copy (V x K bytes: 168 MB for Gemma 3, 28 MB for SmolLM2) and two float32
per output, made at load (`HeadScreen.build`, about a second for Gemma 3).

Threading: the scheduler thread (the model's forward).
"""

from __future__ import annotations

import math
import os

import torch

from hicache_server.models.kernels.cpu_head import MAX_ROWS, PANEL, CpuHeadKernel
from hicache_server.models.kernels.cpu_linear import CpuLinearKernel

# `off` keeps every row on the whole head (side-by-side runs); `on` by default.
HEAD_SCREEN_ENV = "HICACHE_HEAD_SCREEN"
HEAD_SCREEN_CHOICES = ("on", "off")
# Rows of the head quantized at a time at load (bounds the float32 copy of a bfloat16 head).
BUILD_ROWS = 8192
# A screen that leaves more than this share of the panels takes the whole head instead.
MAX_PANEL_SHARE = 0.125
# ||x|| ||W[j]|| at or past which a row takes the whole head: no chain can then overflow
# float32 (the screen's bound assumes none does).
MAX_PRODUCT = 2.0 ** 100
# What rounding float32 logits to bfloat16 may merge: within 2^-7 of their magnitude (8
# significant bits), with room to spare.
BF16_SLACK = 2.0 ** -6


def screen_wanted() -> bool:
    """Whether `HICACHE_HEAD_SCREEN` leaves the screen on (its default); ValueError names a
    value that is neither."""
    choice = os.environ.get(HEAD_SCREEN_ENV, HEAD_SCREEN_CHOICES[0])
    if choice not in HEAD_SCREEN_CHOICES:
        raise ValueError(f"{HEAD_SCREEN_ENV}={choice!r}: expected one of "
                         f"{', '.join(HEAD_SCREEN_CHOICES)}")
    return choice == "on"


class HeadScreen:
    """An LM head's int8 screen (the module docstring) beside its packed panels."""

    def __init__(self, kernel: CpuHeadKernel, linear_kernel: CpuLinearKernel,
                 panels: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                 reach: torch.Tensor, vocab: int, dtype: torch.dtype, inputs: int) -> None:
        self.kernel, self.linear_kernel = kernel, linear_kernel
        self.panels, self.packed = panels, packed
        self.scale, self.reach = scale, reach
        self.vocab, self.dtype = vocab, dtype
        self.num_panels = -(-vocab // PANEL)
        self.slack = BF16_SLACK if dtype == torch.bfloat16 else 0.0
        # a bound on every output's ||W[j]|| and ||q[j]|| (127 s[j] and 127 a weight, of
        # `inputs` weights), for the overflow check
        self.max_row_norm = 127.0 * max(float(scale.max()), 1.0) * math.sqrt(inputs)
        self.flags = torch.empty(self.num_panels, dtype=torch.uint8)
        self.screened = torch.empty(0, dtype=torch.float32)  # [B * V] scratch, grown
        self.screened_rows = self.exact_rows = 0  # rows screened; of those, taken whole

    @classmethod
    @torch.no_grad()
    def build(cls, weight: torch.Tensor, kernel: CpuHeadKernel,
              linear_kernel: CpuLinearKernel, panels: torch.Tensor) -> HeadScreen:
        """The screen of head `weight` `[V, K]` (float32 or bfloat16, on the CPU) whose
        linear-kernel panels are `panels`."""
        vocab, k = weight.shape
        g = 4.0 * (k + 2) * 2.0 ** -24  # twice a chain's bound, for any rounding mode
        q = torch.empty((vocab, k), dtype=torch.int8)
        scale = torch.empty(vocab, dtype=torch.float32)
        reach = torch.empty(vocab, dtype=torch.float32)
        for lo in range(0, vocab, BUILD_ROWS):  # bfloat16 rows to float32, exactly
            rows = slice(lo, min(lo + BUILD_ROWS, vocab))
            kernel.quantize(weight[rows].float().contiguous(), g, q[rows], scale[rows],
                            reach[rows])
        return cls(kernel, linear_kernel, panels, kernel.pack(q), scale, reach, vocab,
                   weight.dtype, k)

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor | None:
        """`[B, V]` float32 rows for the hidden states h `[B, K]` (the head's dtype) whose
        argmax is the whole head's: the candidates' panels' exact logits, -inf elsewhere
        (the module docstring); None when a row is not finite or the screen leaves too
        many panels (the caller runs the whole head)."""
        rows = h.shape[0]
        norm = h.double().norm(dim=1)
        if (rows > MAX_ROWS or not bool(torch.isfinite(norm).all())
                or float(norm.max()) * self.max_row_norm >= MAX_PRODUCT):
            return None
        norm *= 1 + 2.0 ** -20  # rounded up
        x = h.float().contiguous()
        if self.screened.numel() < rows * self.vocab:
            self.screened = torch.empty(rows * self.vocab, dtype=torch.float32)
        self.screened_rows += rows
        flagged = self.kernel.screen(x, self.packed, self.scale, self.reach, norm, self.slack,
                                     self.screened, self.flags)
        if flagged > MAX_PANEL_SHARE * self.num_panels:
            self.exact_rows += rows
            return None
        picked = self.flags.nonzero().flatten()
        size = self.panels.numel() // self.num_panels
        some = self.panels.view(self.num_panels, size).index_select(0, picked).view(-1)
        exact = self.linear_kernel(h.contiguous(), some, picked.numel() * PANEL)
        cols = (picked[:, None] * PANEL + torch.arange(PANEL)).flatten()
        keep = cols < self.vocab  # the last panel's padding outputs
        out = torch.full((rows, self.vocab), -math.inf, dtype=torch.float32)
        out[:, cols[keep]] = exact[:, keep].float()
        return out
