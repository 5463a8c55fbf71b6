"""Linear layers (`Linear`: q|k|v, o, gate|up, down, the LM head) and how their matmuls run.

On CUDA, cuBLAS through `F.linear`. On the CPU each Linear keeps its weight packed once
after loading: for float32, panels for the C kernel (kernels/src/cpu_linear.c: one FMA chain per
output, a row's bits independent of its batch, decode batches at memory bandwidth), plus a
oneDNN copy for chunks of ONEDNN_MIN_ROWS rows or more where oneDNN gives the very same bits
(`onednn_matches_kernel`); for bfloat16, the kernel's VNNI pairs alone (AMX, vdpbf16ps or
AVX-512F; oneDNN's bfloat16 bits depend on the batch size); otherwise oneDNN's blocked
layout. `hicache_server.models.cpu_kernels` chooses the kernel.

Threading: `forward` runs on the scheduler thread.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hicache_server.models.kernels.cpu_linear import CpuLinearKernel


def make_param(shape: Sequence[int], dtype: torch.dtype, device: torch.device,
           fill: float | None = None) -> nn.Parameter:
    t = torch.empty(tuple(shape), dtype=dtype, device=device)
    if fill is not None:
        t.fill_(fill)
    return nn.Parameter(t, requires_grad=False)


# Rows up to which a plain CPU weight goes through oneDNN rather than MKL's sgemm: decode-
# sized batches, where MKL spends its time packing the weight (vLLM's CPU backend switches at
# the same size). Only the tied LM head (it is the embedding table too) and a weight that
# cannot be packed take this path; the other CPU Linears have a packed copy (`Linear.pack`).
ONEDNN_MAX_ROWS = 32
# The batch size oneDNN is told to expect when it reorders a weight: any hint from 2 up gives
# the same layout and speed from 1 to 256 rows here (a hint of 1 keeps it unblocked).
PACK_ROWS_HINT = 16
# A packed matmul of one row may take another oneDNN kernel whose bits differ from the same
# row in a batch of 2 or more (seen for in_features 1,536, the embedded model's down_proj,
# not for 512), so a lone decode token would not match its prefilled self. `Linear.pack`
# checks each weight once; where one row differs, a lone row runs as 2 copies of itself.
SINGLE_ROW_PAD = 2
SINGLE_ROW_PROBE_SEED = 0  # any: the probe's input only has to be random-looking


@functools.cache
def onednn_linear_works(dtype: torch.dtype) -> bool:
    """Whether torch's oneDNN linear (`mkldnn._linear_pointwise`, what inductor calls on the
    CPU) runs here in `dtype` and agrees with `F.linear`; checked once per dtype."""
    if not torch.backends.mkldnn.is_available():
        return False
    return _onednn_agrees(dtype, lambda w: w)


@functools.cache
def onednn_packing_works(dtype: torch.dtype) -> bool:
    """Whether a weight reordered once into oneDNN's blocked layout
    (`mkldnn._reorder_linear_weight`, what inductor's weight freezing does on the CPU) runs
    here in `dtype`, gives `F.linear`'s result, and unpacks to the same weight."""
    if not onednn_linear_works(dtype):
        return False

    def pack(w: torch.Tensor) -> torch.Tensor:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
        if not torch.equal(packed.to_dense(), w):
            raise RuntimeError("the packed weight does not unpack to itself")
        return packed
    return _onednn_agrees(dtype, pack)


def _onednn_agrees(dtype: torch.dtype,
                   prepare: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """oneDNN's linear on `prepare(w)` runs and gives `F.linear(x, w)` in `dtype`."""
    x, w = torch.randn(5, 16).to(dtype), torch.randn(8, 16).to(dtype)
    try:
        y = torch.ops.mkldnn._linear_pointwise(x, prepare(w), None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.allclose(y.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2))


# On the kernel, a batch of this many rows or more (a prefill chunk) runs on oneDNN's packed
# copy instead where oneDNN gives the kernel's very bits for that weight's shape
# (`onednn_matches_kernel`): oneDNN's blocking was 2-5% faster on 1,024-2,048 rows here, the
# kernel as fast up to ~300 rows and 1.4-2x faster on decode batches.
ONEDNN_MIN_ROWS = 512
ONEDNN_PROBE_ROWS = (ONEDNN_MIN_ROWS, 2048)  # 2,048: the engine's largest chunk
ONEDNN_PROBE_SEED = 1


@functools.cache
def onednn_matches_kernel(kernel: CpuLinearKernel, out_features: int, in_features: int,
                          bias: bool) -> bool:
    """Whether oneDNN's packed matmul gives the kernel's bits (one FMA chain per output in
    input order, then the bias) for a float32 weight of this shape, at ONEDNN_PROBE_ROWS
    rows: so on oneDNN 3.x with 512 inputs, not with 1,536 (it sums blocks of 1,024).
    Checked once per shape with random values, which any other order would not match; the
    probe costs two matmuls of 2,048 rows per shape at load (~0.3 s for the embedded model)."""
    if not onednn_packing_works(torch.float32):
        return False
    gen = torch.Generator().manual_seed(ONEDNN_PROBE_SEED)
    w = torch.randn((out_features, in_features), generator=gen)
    b = torch.randn((out_features,), generator=gen) if bias else None
    packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
    panels = kernel.pack(w)
    for rows in ONEDNN_PROBE_ROWS:
        x = torch.randn((rows, in_features), generator=gen)
        with torch.inference_mode():
            got = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
            if not torch.equal(got, kernel(x, panels, out_features, b)):
                return False
    return True


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           onednn: bool = False) -> torch.Tensor:
    """`F.linear`, through oneDNN for a CPU batch of at most ONEDNN_MAX_ROWS rows when
    `onednn` (the model checked `onednn_linear_works`)."""
    if onednn and x.shape[0] <= ONEDNN_MAX_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """`y = x @ W.T (+ b)`; W stacks `len(out_sizes)` matrices row-wise (q|k|v, gate|up).

    On the CPU, once the weights are loaded, `pack` keeps a second copy of W laid out for the
    matmul, and every call runs on it:

    - float32 where the C kernel builds (`kernel`, set by `LlamaForCausalLM.use_linear_kernel`;
      kernels/src/cpu_linear.c): every output one FMA chain over the inputs in order, whatever
      the batch size, so a row's bits do not depend on the rows beside it; a decode batch
      streams the weight at memory bandwidth (the embedded model's 97 MB of weights in a
      one-row step: 2.7 ms against oneDNN's 4.6 on 2 cores). Chunks of ONEDNN_MIN_ROWS
      rows or more take a oneDNN copy too, where its bits are the kernel's.
    - bfloat16 on the same kernel: float32 sums over the input pairs, one rounding; on AMX
      (2 x 2 tiles) 0.75x the speed of oneDNN's bfloat16 matmul at 2,048 rows of Gemma 3's
      shapes, 0.8x at 300 and 1.7-2.1x faster for decode batches of 1-8 rows (2-core Xeon,
      kernels/cpu_linear.py), every call on the kernel.
    - otherwise oneDNN's blocked layout (vLLM's CPU backend does the same): no per-call
      reorder of the weight (measured on 2 cores, the embedded model's gate|up at 8 rows:
      505 -> 272 us), and a row's result does not depend on how many rows share the call
      (but see SINGLE_ROW_PAD). MKL's sgemm on the plain W is not used for large batches
      either: on the AMD EPYCs here it was 8% faster for a 2,048-token prefill on one
      machine and 10-20% slower on another.

    Either way a token's K/V are the same bits whether it was prefilled or extended. Each
    copy adds the memory of the Linear weights once (not of the embedding table nor of a
    tied LM head): one copy on oneDNN, one or two on the kernel.
    """

    # Packings and unpackings of any Linear so far: what binds a packed copy's address
    # (server/models/cpu_forward.py) rebinds when it moves.
    packings = 0

    def __init__(self, in_features: int, out_sizes: Sequence[int], bias: bool,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.out_sizes = list(out_sizes)
        self.weight = make_param((sum(out_sizes), in_features), dtype, device)
        self.bias = make_param((sum(out_sizes),), dtype, device) if bias else None
        self.onednn = device.type == "cpu" and onednn_linear_works(dtype)
        self.packable = device.type == "cpu" and onednn_packing_works(dtype)
        self.packed: torch.Tensor | None = None  # not a parameter: derived from W
        self.pad_single_row = False  # set by `pack`
        self.kernel: CpuLinearKernel | None = None  # the C kernel, for float32 on the CPU
        self.panels: torch.Tensor | None = None  # W packed for `kernel`, by `pack`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            if self.packed is not None and x.shape[0] >= ONEDNN_MIN_ROWS:
                return self._packed(x)  # the same bits (`onednn_matches_kernel`)
            x = x if x.stride(-1) == 1 else x.contiguous()
            return self.kernel(x, self.panels, self.weight.shape[0], self.bias)
        if self.packed is None:
            return linear(x, self.weight, self.bias, self.onednn)
        if x.shape[0] == 1 and self.pad_single_row:  # see SINGLE_ROW_PAD
            return self._packed(x.expand(SINGLE_ROW_PAD, -1).contiguous())[:1]
        return self._packed(x)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @torch.no_grad()
    def pack(self) -> None:
        """(Re)build the packed copy of W: the kernel's panels where it takes this weight,
        else oneDNN's layout where packing works (CPU); else nothing."""
        Linear.packings += 1
        if self.kernel is not None and self.weight.dtype in (torch.float32, torch.bfloat16):
            self.panels = self.kernel.pack(self.weight)
            if self.weight.dtype == torch.float32 and self.packable and onednn_matches_kernel(self.kernel, *self.weight.shape,
                                                       self.bias is not None):
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(),
                                                                      PACK_ROWS_HINT)
        elif self.packable:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(),
                                                                  PACK_ROWS_HINT)
            gen = torch.Generator().manual_seed(SINGLE_ROW_PROBE_SEED)
            x = torch.randn((SINGLE_ROW_PAD, self.weight.shape[1]), generator=gen).to(
                self.weight.dtype)
            self.pad_single_row = not torch.equal(self._packed(x[:1]), self._packed(x)[:1])

    def unpack(self) -> None:
        Linear.packings += 1
        self.packed = self.panels = None

    def shard(self, param: torch.Tensor, index: int) -> torch.Tensor:
        """Rows of stacked matrix `index` in `param` (the weight or the bias), a view."""
        start = sum(self.out_sizes[:index])
        return param[start:start + self.out_sizes[index]]
