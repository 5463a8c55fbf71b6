"""Prefill attention through the paged pool against SDPA on contiguous K/V of the same shape.

One sequence per case, `(cached prefix, new tokens)`, its K/V on scattered pages of a pool
as the engine holds them:

    engine       `TorchAttention` as the engine runs it: one gather of the sequence's K/V
                 from the pool, KV heads broadcast to their query heads, and on CUDA the
                 lower-right causal bias (the flash kernel, no mask tensor); on the CPU the
                 causal path from scratch and an additive mask built once per batch
    masked       `TorchAttention(lower_right=False)`: a materialised `[new, prefix + new]`
                 mask on every device (CUDA's prefill path before the flash one)
    kernel       on the CPU, float32, where it builds: `CpuKernelAttention`, the engine's
                 CPU default (kernels/src/cpu_attention.c: K/V read through the slots, no gather)
    flashinfer   on CUDA with flashinfer-python: `FlashInferAttention`, FlashInfer's paged
                 prefill over the pool's pages (the engine's CUDA default), planned each
                 call; `flashinfer_layer` the same on a batch already planned
    contiguous   SDPA on K/V already contiguous, KV heads repeated, the same causal rule
                 (`is_causal`, or the lower-right bias past a prefix): the flash path's
                 speed with nothing to gather, the bound the engine is measured against

Prints milliseconds per layer call (best of `--repeats`), the engine's time over the
contiguous one (issue 14's goal on an H200: at most 1.5x for a 16k-token prefill), and the
largest difference from the contiguous result; writes JSON. Without a GPU it runs smaller
cases on the CPU.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from benchmarks.bench_attention import timed, write_results
from hicache_server.models.attention import AttentionBackend, CpuKernelAttention, TorchAttention
from hicache_server.models.flashinfer_attention import FlashInferAttention, flashinfer_available
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.models.kernels import cpu_attention
from hicache_server.models.loader import KERNELS_DIR, hicache_home

# name -> (query heads, kv heads, head dim, dtype on CUDA); the CPU runs float32
GEOMETRIES = {
    "tiny": (8, 2, 64, torch.float32),
    "llama3.2-1b": (32, 8, 64, torch.bfloat16),
    "llama3-8b": (32, 8, 128, torch.bfloat16),
}
CUDA_CASES = ["0+16384", "14336+2048"]
CPU_CASES = ["0+2048", "1536+512"]


def make_case(prefix: int, extend: int, geom: str, page_size: int, device: str, seed: int):
    """Queries `[extend, heads, d]`, a pool `(k, v)` `[slots, kv_heads, d]` and the
    sequence's slots (scattered whole pages, page 0 unused)."""
    heads, kv_heads, dim, dtype = GEOMETRIES[geom]
    if device == "cpu":
        dtype = torch.float32
    g = torch.Generator().manual_seed(seed)
    n = prefix + extend
    pages = -(-n // page_size)
    order = torch.randperm(pages, generator=g) + 1
    slots = (order[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:n]
    size = (pages + 1) * page_size
    k = torch.randn(size, kv_heads, dim, generator=g).to(device, dtype)
    v = torch.randn(size, kv_heads, dim, generator=g).to(device, dtype)
    q = torch.randn(extend, heads, dim, generator=g).to(device, dtype)
    return q, k, v, slots.to(device)


def prefill_batch(q, slots, prefix: int) -> ForwardBatch:
    extend = q.shape[0]
    return ForwardBatch(
        input_ids=torch.zeros(extend, dtype=torch.int64, device=q.device),
        positions=torch.arange(prefix, prefix + extend, device=q.device),
        out_slots=slots[prefix:], seq_slots=[slots], prefix_lens=[prefix],
        extend_lens=[extend])


def engine(q, k, v, slots, prefix: int, backend: AttentionBackend, page_size: int,
           batch: ForwardBatch | None = None):
    """A fresh batch each call, as each forward pass builds its own plan, unless `batch`
    (already planned: what each further layer of a forward costs)."""
    pool = SimpleNamespace(get_kv=lambda layer: (k, v), page_size=page_size)
    return backend.forward(q, None, None, 0, batch or prefill_batch(q, slots, prefix), pool)


def contiguous(q, keys, values, prefix: int):
    """SDPA on `[1, heads, len, d]` tensors made contiguous beforehand."""
    extend = q.shape[0]
    mask = None if prefix == 0 else causal_lower_right(extend, prefix + extend)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values,
                                       attn_mask=mask, is_causal=prefix == 0)
    return o[0].transpose(0, 1)


def run(args: argparse.Namespace) -> list[dict]:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    backends: dict[str, AttentionBackend] = {"engine": TorchAttention(),
                                             "masked": TorchAttention(lower_right=False)}
    kernel = None if cuda else cpu_attention.load(hicache_home() / KERNELS_DIR)
    if kernel is not None:
        backends["kernel"] = CpuKernelAttention(kernel)
    if cuda and flashinfer_available():
        backends["flashinfer"] = FlashInferAttention()
    rows = []
    for geom in args.geometries:
        for case in args.cases or (CUDA_CASES if cuda else CPU_CASES):
            prefix, extend = (int(x) for x in case.split("+"))
            q, k, v, slots = make_case(prefix, extend, geom, args.page_size, device, args.seed)
            group = q.shape[1] // k.shape[1]
            keys, values = ([t.index_select(0, slots).repeat_interleave(group, dim=1)
                             .transpose(0, 1)[None].contiguous() for t in (k, v)])
            want = contiguous(q, keys, values, prefix)
            row = {"geometry": geom, "dtype": str(q.dtype).removeprefix("torch."),
                   "prefix": prefix, "extend": extend, "device": device}
            row["contiguous_s"] = timed(
                functools.partial(contiguous, q, keys, values, prefix), args.repeats, cuda)
            for label, backend in backends.items():
                fn = functools.partial(engine, q, k, v, slots, prefix, backend, args.page_size)
                row[f"{label}_s"] = timed(fn, args.repeats, cuda)
                row[f"{label}_max_err"] = float((fn().float() - want.float()).abs().max())
            if "flashinfer" in backends:  # a layer on a batch already planned
                planned = functools.partial(engine, q, k, v, slots, prefix,
                                            backends["flashinfer"], args.page_size,
                                            prefill_batch(q, slots, prefix))
                row["flashinfer_layer_s"] = timed(planned, args.repeats, cuda)
                row["flashinfer_layer_max_err"] = float(
                    (planned().float() - want.float()).abs().max())
            rows.append(row)
            print(f"{geom} {case}: " + ", ".join(
                f"{label} {row[f'{label}_s'] * 1e3:.2f} ms" for label in (*backends, "contiguous")),
                flush=True)
    return rows


def table(rows: list[dict]) -> str:
    labels = [k[:-2] for k in rows[0] if k.endswith("_s") and k != "contiguous_s"]
    out = ["| geometry | dtype | prefix + new | device | contiguous ms | "
           + " | ".join(f"{lb} ms | {lb} / contiguous | {lb} max err" for lb in labels) + " |",
           "|---|---|---|---|---:|" + "---:|---:|---:|" * len(labels)]
    for r in rows:
        cells = [f"{r[f'{lb}_s'] * 1e3:,.2f} | {r[f'{lb}_s'] / r['contiguous_s']:.2f}x | "
                 f"{r[f'{lb}_max_err']:.1e}" for lb in labels]
        out.append(f"| {r['geometry']} | {r['dtype']} | {r['prefix']:,} + {r['extend']:,} | "
                   f"{r['device']} | {r['contiguous_s'] * 1e3:,.2f} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--geometries", nargs="+", choices=GEOMETRIES, default=None,
                   help="default: llama3.2-1b and llama3-8b on CUDA, tiny on the CPU")
    p.add_argument("--cases", nargs="+", default=None, metavar="PREFIX+NEW",
                   help=f"default: {' '.join(CUDA_CASES)} on CUDA, {' '.join(CPU_CASES)} "
                        "on the CPU")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/prefill_attention.json"))
    args = p.parse_args(argv)
    if args.geometries is None:
        args.geometries = ["llama3.2-1b", "llama3-8b"] if torch.cuda.is_available() else ["tiny"]
    rows = run(args)
    print(table(rows))
    if not torch.cuda.is_available():
        print("\nno CUDA device: CPU cases, float32 (the flash kernel is CUDA's)")
    write_results(args, rows)


if __name__ == "__main__":
    main()
