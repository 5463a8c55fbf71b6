"""Paged decode attention: the per-sequence torch reference, the batched torch path the
engine runs without the kernel, and the CuPy kernel.

All read K/V through a slot table of scattered pages (as the engine's pool holds them):

    torch      gather K/V per sequence (index_select), repeat KV heads, SDPA: the
               per-sequence loop (`ReferenceAttention`, what the engine ran before batching)
    batched    `TorchAttention`: one gather and one SDPA for the whole batch, KV heads never
               repeated (the engine's path on the CPU, and on CUDA without CuPy)
    kernel     kernels/src/paged_attention.cu, one launch for the batch (CUDA only)
    flashinfer `FlashInferAttention`: FlashInfer's paged decode over the pool's pages, planned
               once per batch (CUDA with flashinfer-python; the engine's CUDA default);
               timed twice: a fresh batch per call (page table and plan included), and
               one layer on a batch already planned (what each further layer costs)

Prints a markdown table (microseconds per layer call and speed-ups over the per-sequence
loop) and writes JSON. Without a GPU the kernel column stays empty and the table says so.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import torch

from hicache_server.models.attention import TorchAttention
from hicache_server.models.flashinfer_attention import FlashInferAttention, flashinfer_available
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.models.kernels.paged_attention import paged_decode_attention

# (name, query heads, kv heads, head dim, dtype): the embedded model and Llama-3-8B
GEOMETRIES = {
    "tiny": (8, 2, 64, torch.float32),
    "llama3-8b": (32, 8, 128, torch.bfloat16),
}


def make_case(batch: int, seq_len: int, geom: str, page_size: int, device: str, seed: int):
    heads, kv_heads, dim, dtype = GEOMETRIES[geom]
    g = torch.Generator().manual_seed(seed)
    pages_per_seq = -(-seq_len // page_size)
    num_pages = batch * pages_per_seq + 1
    perm = torch.randperm(num_pages - 1, generator=g)[: batch * pages_per_seq] + 1
    pages = perm.view(batch, pages_per_seq)  # scattered pages, page 0 unused
    offsets = torch.arange(page_size)
    table = (pages[:, :, None] * page_size + offsets).reshape(batch, -1)[:, :seq_len]
    slots = num_pages * page_size
    k = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    q = torch.randn(batch, heads, dim, generator=g).to(dtype)
    lens = torch.full((batch,), seq_len, dtype=torch.int64)
    return [t.to(device) for t in (q, k, v, table.contiguous(), lens)]


def torch_decode(q, k, v, table, lens, scale):
    """What TorchAttention does for a decode batch: gather, expand GQA, SDPA per sequence."""
    group = q.shape[1] // k.shape[1]
    outs = []
    for s in range(q.shape[0]):
        ks = k.index_select(0, table[s]).repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v.index_select(0, table[s]).repeat_interleave(group, dim=1).transpose(0, 1)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q[s][:, None], ks, vs, scale=scale)[:, 0])
    return torch.stack(outs)


def decode_batch(table, lens, q) -> ForwardBatch:
    """The decode batch of `table`'s sequences (one new token each, its slot the last)."""
    seq_slots = [row[:n] for row, n in zip(table, lens.tolist())]
    return ForwardBatch(
        input_ids=torch.zeros(len(seq_slots), dtype=torch.int64, device=q.device),
        positions=lens - 1, out_slots=torch.stack([s[-1] for s in seq_slots]),
        seq_slots=seq_slots, prefix_lens=[len(s) - 1 for s in seq_slots],
        extend_lens=[1] * len(seq_slots))


def batched_decode(q, k, v, table, lens, scale, backend=None, page_size: int = 0, batch=None):
    """What TorchAttention (or `backend`) does for a decode batch (its own scale:
    1/sqrt(head_dim)): a fresh batch, so a fresh plan, per call unless `batch` is given (the
    engine plans once per batch and runs every layer on that plan)."""
    del scale
    pool = SimpleNamespace(get_kv=lambda layer: (k, v), page_size=page_size)
    return (backend or TorchAttention()).forward(q, None, None, 0,
                                                 batch or decode_batch(table, lens, q), pool)


def timed(fn, repeats: int, cuda: bool) -> float:
    fn()  # warm-up (and compile)
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def run(args: argparse.Namespace) -> list[dict]:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    flashinfer = FlashInferAttention() if cuda and flashinfer_available() else None
    rows = []
    for geom in args.geometries:
        for seq_len in args.seq_lens:
            q, k, v, table, lens = make_case(args.batch, seq_len, geom, args.page_size, device,
                                             args.seed)
            scale = q.shape[-1] ** -0.5
            case = (q, k, v, table, lens, scale)
            ref = timed(functools.partial(torch_decode, *case), args.repeats, cuda)
            batched = timed(functools.partial(batched_decode, *case), args.repeats, cuda)
            row = {"geometry": geom, "batch": args.batch, "seq_len": seq_len,
                   "device": device, "torch_s": ref, "batched_s": batched, "kernel_s": None,
                   "max_abs_err": None, "flashinfer_s": None, "flashinfer_layer_s": None,
                   "flashinfer_max_abs_err": None}
            if cuda:
                row["kernel_s"] = timed(functools.partial(paged_decode_attention, *case),
                                        args.repeats, cuda)
                err = (paged_decode_attention(*case).float()
                       - torch_decode(*case).float()).abs().max()
                row["max_abs_err"] = float(err)
            if flashinfer is not None:
                fn = functools.partial(batched_decode, *case, flashinfer, args.page_size)
                row["flashinfer_s"] = timed(fn, args.repeats, cuda)
                planned = decode_batch(table, lens, q)
                row["flashinfer_layer_s"] = timed(
                    functools.partial(fn, batch=planned), args.repeats, cuda)
                row["flashinfer_max_abs_err"] = float(
                    (fn().float() - torch_decode(*case).float()).abs().max())
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    out = [("| geometry | batch | seq len | device | per-sequence µs | batched µs | batched "
           "speed-up | kernel µs | kernel speed-up | kernel max err | flashinfer µs | "
           "flashinfer vs batched | flashinfer max err | flashinfer layer µs (planned) | "
           "kernel / flashinfer layer |"),
           "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = []
        for key, err, base in (("kernel_s", "max_abs_err", "torch_s"),
                               ("flashinfer_s", "flashinfer_max_abs_err", "batched_s")):
            t = r.get(key)
            cells += (["", "", ""] if t is None else
                      [f"{t * 1e6:,.0f}", f"{r[base] / t:.1f}x", f"{r[err]:.1e}"])
        layer, kernel = r.get("flashinfer_layer_s"), r.get("kernel_s")
        cells += (["", ""] if layer is None else
                  [f"{layer * 1e6:,.0f}", "" if kernel is None else f"{kernel / layer:.2f}x"])
        out.append(f"| {r['geometry']} | {r['batch']} | {r['seq_len']} | {r['device']} | "
                   f"{r['torch_s'] * 1e6:,.0f} | {r['batched_s'] * 1e6:,.0f} | "
                   f"{r['torch_s'] / r['batched_s']:.1f}x | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=GEOMETRIES)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[256, 2048])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/attention.json"))
    args = p.parse_args(argv)
    rows = run(args)
    print(table(rows))
    if not torch.cuda.is_available():
        print("\nno CUDA device: only the torch paths ran (on the CPU)")
    write_results(args, rows)


def write_results(args: argparse.Namespace, rows: list[dict]) -> None:
    """`args.out`: the date, the machine, the GPU, torch's version, the arguments and rows."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
