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
So |L[j] - t[j]| <= ||x|| reach[j], with ||x|| rounded up. On the VNNI path (AVX512-VNNI
CPUs) x is quantized too, per row, in two int8 levels: x' = xs0 q0 + xs1 q1 (q1 quantizing
what q0 leaves), and t[j] = (S0 xs0 + S1 xs1) s[j] with S_l = q_l . q[j] exact in int32 and
four float32 roundings after the sums. Then |x.(s[j] q[j]) - t[j]| <= ||x - x'|| ||s[j]
q[j]|| + 2^-21 (||xs0 q0|| + ||xs1 q1||) ||s[j] q[j]|| (Cauchy-Schwarz, and the roundings),
so the bound grows by err ||s[j] q[j]||, err = (||x - x'|| + 2^-21 (||xs0 q0|| + ||xs1
q1||)) (1 + 2^-20) per row and ||s[j] q[j]|| (`qnorm`) per output, rounded up. In what
follows a bound is ||x|| reach[j] plus that term. The largest logit is then at or
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

Costs: the int8 copy (V x K bytes: 168 MB for Gemma 3, 28 MB for SmolLM2) and three float32
per output, made at load (`HeadScreen.build`, about a second for Gemma 3). The VNNI path
does 64 products an instruction where the fma path does 8 (after converting the int8s),
so a batch's screen is bound by streaming the copy rather than by its arithmetic.

Which batches take it: at load (`calibrate`) the screen and the whole head are timed side by
side at 1, 2, 4 ... 32 rows aimed at outputs (as a trained model's are); batches up to the
largest size from which down the screen was faster every time take it, larger ones the
whole head (`max_rows`). Where the whole head is cheap at a batch (bfloat16 heads on CPUs
with bfloat16 dot products, at 8 rows) it keeps it; the tokens are the same either way.

Threading: the scheduler thread (the model's forward).
"""

from __future__ import annotations

import math
import os
import time

import torch

from hicache_server.models.kernels.cpu_head import (
    MAX_ROWS,
    PANEL,
    VNNI_MAX_INPUTS,
    CpuHeadKernel,
)
from hicache_server.models.kernels.cpu_linear import CpuLinearKernel

# `off` keeps every row on the whole head, `fma` keeps the screen off the VNNI path
# (side-by-side runs); `on` (the best path this CPU runs) by default.
HEAD_SCREEN_ENV = "HICACHE_HEAD_SCREEN"
HEAD_SCREEN_CHOICES = ("on", "off", "fma")
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
# Batch sizes `calibrate` times the screen against the whole head at (none: no timing, every
# batch up to MAX_ROWS takes the screen), the best of PROBE_REPEATS in turn after a warm-up.
PROBE_ROWS = (1, 2, 4, 8, 16, 32)
PROBE_REPEATS = 5
# Hidden states aimed at an output: that output's weights times this (a clear winner).
PROBE_AIM = 30.0


def screen_choice() -> str:
    """`HICACHE_HEAD_SCREEN` (`on` by default); ValueError names a value not in
    HEAD_SCREEN_CHOICES."""
    choice = os.environ.get(HEAD_SCREEN_ENV, HEAD_SCREEN_CHOICES[0])
    if choice not in HEAD_SCREEN_CHOICES:
        raise ValueError(f"{HEAD_SCREEN_ENV}={choice!r}: expected one of "
                         f"{', '.join(HEAD_SCREEN_CHOICES)}")
    return choice


def screen_wanted() -> bool:
    """Whether `HICACHE_HEAD_SCREEN` leaves the screen on (`on` or `fma`)."""
    return screen_choice() != "off"


def screen_path(kernel: CpuHeadKernel) -> str:
    """The path the screen takes: the best `kernel` runs, or `fma` when the setting says."""
    return "fma" if screen_choice() == "fma" else kernel.best_path


class HeadScreen:
    """An LM head's int8 screen (the module docstring) beside its packed panels."""

    def __init__(self, kernel: CpuHeadKernel, linear_kernel: CpuLinearKernel,
                 panels: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                 reach: torch.Tensor, qnorm: torch.Tensor, vocab: int, dtype: torch.dtype,
                 inputs: int, path: str) -> None:
        self.kernel, self.linear_kernel = kernel, linear_kernel
        self.panels, self.packed, self.path = panels, packed, path
        self.scale, self.reach, self.qnorm = scale, reach, qnorm
        self.vocab, self.dtype = vocab, dtype
        self.num_panels = -(-vocab // PANEL)
        self.slack = BF16_SLACK if dtype == torch.bfloat16 else 0.0
        # a bound on every output's ||W[j]|| and ||q[j]|| (127 s[j] and 127 a weight, of
        # `inputs` weights), for the overflow check
        self.max_row_norm = 127.0 * max(float(scale.max()), 1.0) * math.sqrt(inputs)
        self.flags = torch.empty(self.num_panels, dtype=torch.uint8)
        self.screened = torch.empty(0, dtype=torch.float32)  # [B * V] scratch, grown
        self.err = torch.zeros(MAX_ROWS, dtype=torch.float64)  # each row's err (VNNI path)
        self.screened_rows = self.exact_rows = 0  # rows screened; of those, taken whole
        self.max_rows = MAX_ROWS  # the most rows a batch may have to take the screen
        self.probed: dict[int, tuple[float, float]] = {}  # rows -> (screen s, whole head s)

    @classmethod
    @torch.no_grad()
    def build(cls, weight: torch.Tensor, kernel: CpuHeadKernel,
              linear_kernel: CpuLinearKernel, panels: torch.Tensor,
              path: str | None = None) -> HeadScreen:
        """The screen of head `weight` `[V, K]` (float32 or bfloat16, on the CPU) whose
        linear-kernel panels are `panels`, on `path` (by default `screen_path`'s)."""
        vocab, k = weight.shape
        if path is None:  # past VNNI_MAX_INPUTS an int32 sum could overflow: the fma path
            path = screen_path(kernel) if k <= VNNI_MAX_INPUTS else "fma"
        g = 4.0 * (k + 2) * 2.0 ** -24  # twice a chain's bound, for any rounding mode
        q = torch.empty((vocab, k), dtype=torch.int8)
        scale, reach, qnorm = (torch.empty(vocab, dtype=torch.float32) for _ in range(3))
        for lo in range(0, vocab, BUILD_ROWS):  # bfloat16 rows to float32, exactly
            rows = slice(lo, min(lo + BUILD_ROWS, vocab))
            kernel.quantize(weight[rows].float().contiguous(), g, q[rows], scale[rows],
                            reach[rows], qnorm[rows])
        return cls(kernel, linear_kernel, panels, kernel.pack(q, path), scale, reach, qnorm,
                   vocab, weight.dtype, k, path)

    @torch.inference_mode()
    def calibrate(self, weight: torch.Tensor) -> int:
        """Time the screen against the whole head (the module docstring) on rows of head
        `weight` times PROBE_AIM, and set `max_rows`: the largest PROBE_ROWS size up to
        which the screen was faster at every size (MAX_ROWS when it was at all of them, 0
        when not even at one row). Returns it."""
        def timed(screened: bool, h: torch.Tensor) -> float:
            started = time.perf_counter()
            self._argmax(self.logits(h) if screened else None, h)
            return time.perf_counter() - started

        self.max_rows, self.probed = MAX_ROWS, {}
        gen = torch.Generator().manual_seed(0)
        faster = 0
        for rows in PROBE_ROWS:
            aim = torch.randint(0, self.vocab, (rows,), generator=gen)
            h = (weight[aim].float() * PROBE_AIM).to(weight.dtype).contiguous()
            # in turn, a warm-up first, the best of each: what a busy VM adds is left out
            runs = [(timed(True, h), timed(False, h)) for _ in range(1 + PROBE_REPEATS)][1:]
            screen, whole = min(t[0] for t in runs), min(t[1] for t in runs)
            self.probed[rows] = (screen, whole)
            if screen >= whole:
                break
            faster = rows
        else:
            faster = MAX_ROWS
        self.max_rows = faster
        self.screened_rows = self.exact_rows = 0
        return faster

    def describe(self) -> str:
        """What the start-up log says of the screen: its path, the batches that take it and
        the times `calibrate` measured."""
        probed = ", ".join(f"{rows} rows {screen * 1e3:.1f} ms against {whole * 1e3:.1f}"
                           for rows, (screen, whole) in self.probed.items())
        return (f"{self.path} path, batches of up to {self.max_rows} rows"
                + (f" ({probed})" if probed else ""))

    def _argmax(self, screened: torch.Tensor | None, h: torch.Tensor) -> torch.Tensor:
        """The rows' argmax from the screen's logits, or the whole head's when None."""
        if screened is None:
            screened = self.linear_kernel(h, self.panels, self.vocab).float()
        return screened.argmax(dim=1)

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor | None:
        """`[B, V]` float32 rows for the hidden states h `[B, K]` (the head's dtype) whose
        argmax is the whole head's: the candidates' panels' exact logits, -inf elsewhere
        (the module docstring); None when the batch has more than `max_rows` rows, a row
        is not finite or the screen leaves too many panels (the caller runs the whole
        head)."""
        rows = h.shape[0]
        if rows > min(self.max_rows, MAX_ROWS):
            return None
        norm = h.double().norm(dim=1)
        if (not bool(torch.isfinite(norm).all())
                or float(norm.max()) * self.max_row_norm >= MAX_PRODUCT):
            return None
        norm *= 1 + 2.0 ** -20  # rounded up
        x = h.float().contiguous()
        if self.screened.numel() < rows * self.vocab:
            self.screened = torch.empty(rows * self.vocab, dtype=torch.float32)
        self.screened_rows += rows
        flagged = self.kernel.screen(x, self.packed, self.scale, self.reach, self.qnorm, norm,
                                     self.slack, self.screened, self.flags, self.err[:rows],
                                     self.path)
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
