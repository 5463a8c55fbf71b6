"""The model's forward pass, CPU/GPU configuration against configuration, in one run.

    reference   ReferenceAttention: per sequence, gather its K/V, repeat KV heads, SDPA with
                a materialised mask (the engine's path before batching); Linears on oneDNN
                (CUDA: cuBLAS), norms, RoPE and SiLU as torch ops
    batched     TorchAttention: one decode SDPA per layer over a padded slot table, one
                gather for all prefills, KV heads broadcast by stride, masks built per batch;
                the rest as reference
    kernel      CpuKernelAttention (CPU float32 or bfloat16 where the C kernel builds): every sequence in
                one call, K/V read through the slots; the rest as reference
    all-C       kernel, with the Linears on CpuLinearKernel and RMSNorm, RoPE and SiLU * up
                on CpuLayerKernel: the engine's CPU default (float32 and bfloat16)

Same model (the embedded one unless `--model-path`), same weights, same pool, the shapes the
engine runs: a 2,048-token prefill from scratch, a 512-token extend on a 1,536-token cached
prefix, decode steps at batch 1 and 8 (700 tokens of context each) and a mixed batch (7
decodes + a 256-token prefill). Prints milliseconds (best of `--repeats`), the speed-ups,
and the largest logit difference from the reference; writes JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from hicache.memory.device import DeviceKVPool
from hicache_server.models.attention import CpuKernelAttention, ReferenceAttention, TorchAttention
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.models.kernels import cpu_attention, cpu_layer, cpu_linear
from hicache_server.models.loader import EMBEDDED_TINY_LLAMA, KERNELS_DIR, hicache_home, load_model

# name -> (prefix, extend) per sequence
SHAPES = {
    "prefill 2048": [(0, 2048)],
    "extend 512 on 1536": [(1536, 512)],
    "decode batch 1": [(700, 1)],
    "decode batch 8": [(700, 1)] * 8,
    "mixed: 7 decodes + prefill 256": [(700, 1)] * 7 + [(0, 256)],
}
PAGE_SIZE = 16


def make_batch(seqs: list[tuple[int, int]], vocab: int, seed: int) -> ForwardBatch:
    """Sequences laid out one after another from slot PAGE_SIZE (past the padding page)."""
    gen = torch.Generator().manual_seed(seed)
    ids, positions, out_slots, seq_slots, offset = [], [], [], [], PAGE_SIZE
    for prefix, extend in seqs:
        slots = torch.arange(offset, offset + prefix + extend)
        offset += prefix + extend
        ids.append(torch.randint(0, vocab, (extend,), generator=gen))
        positions.append(torch.arange(prefix, prefix + extend))
        out_slots.append(slots[prefix:])
        seq_slots.append(slots)
    return ForwardBatch(torch.cat(ids), torch.cat(positions), torch.cat(out_slots), seq_slots,
                        [p for p, _ in seqs], [e for _, e in seqs])


def set_backend(model: torch.nn.Module, backend: object) -> None:
    for layer in model.model.layers:
        layer.self_attn.backend = backend


def set_config(model: torch.nn.Module, config: tuple[object, object, object]) -> None:
    """(attention backend, linear kernel or None, layer kernel or None) on every layer."""
    backend, linear_kernel, layer_kernel = config
    set_backend(model, backend)
    model.use_linear_kernel(linear_kernel)
    model.use_layer_kernel(layer_kernel)


def fill_prefixes(model: torch.nn.Module, pool: DeviceKVPool, batch: ForwardBatch,
                  vocab: int, seed: int) -> None:
    """Compute the K/V of every sequence's cached prefix into its slots."""
    seqs = [(s[:p], p) for s, p in zip(batch.seq_slots, batch.prefix_lens) if p]
    if not seqs:
        return
    gen = torch.Generator().manual_seed(seed)
    slots = [s for s, _ in seqs]
    model.forward(ForwardBatch(
        torch.randint(0, vocab, (sum(p for _, p in seqs),), generator=gen),
        torch.cat([torch.arange(p) for _, p in seqs]), torch.cat(slots), slots,
        [0] * len(seqs), [p for _, p in seqs]), pool)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def run(args: argparse.Namespace) -> list[dict]:
    lm = load_model(args.model_path, args.dtype, args.device)
    model, c = lm.model, lm.config
    tokens = max(sum(p + e for p, e in seqs) for seqs in SHAPES.values())
    pool = DeviceKVPool(-(-tokens // PAGE_SIZE) + 1, PAGE_SIZE, c.num_hidden_layers,
                        c.num_key_value_heads, c.head_dim, lm.dtype, lm.device)
    backends: dict[str, tuple[object, object, object]] = {
        "reference": (ReferenceAttention(), None, None),
        "batched": (TorchAttention(), None, None)}
    kernels = hicache_home() / KERNELS_DIR
    attention, linear, layer = (cpu_attention.load(kernels), cpu_linear.load(kernels),
                                cpu_layer.load(kernels))
    if lm.device.type == "cpu" and lm.dtype in cpu_attention.DTYPES and attention is not None:
        backends["kernel"] = (CpuKernelAttention(attention), None, None)
        if linear is not None and layer is not None:
            backends["all-C"] = (CpuKernelAttention(attention), linear, layer)
    rows = []
    for name, seqs in SHAPES.items():
        batch = make_batch(seqs, c.vocab_size, args.seed)
        set_config(model, backends["batched"])
        fill_prefixes(model, pool, batch, c.vocab_size, args.seed + 1)  # shared by all
        row, logits = {"shape": name}, {}
        for label, backend in backends.items():
            set_config(model, backend)
            logits[label] = model.forward(batch, pool)
            row[f"{label}_ms"] = timed(functools.partial(model.forward, batch, pool),
                                       args.repeats) * 1e3
        for label in backends:
            if label != "reference":
                row[f"{label}_speedup"] = row["reference_ms"] / row[f"{label}_ms"]
                row[f"{label}_max_logit_diff"] = float(
                    (logits["reference"] - logits[label]).abs().max())
        rows.append(row)
        print(f"{name}: " + ", ".join(f"{label} {row[f'{label}_ms']:.1f} ms"
                                      for label in backends), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    labels = [k[:-3] for k in rows[0] if k.endswith("_ms") and k != "reference_ms"]
    head = "| shape | reference ms | " + " | ".join(
        f"{lb} ms | {lb} speed-up | {lb} max logit diff" for lb in labels) + " |"
    out = [head, "|---|---:|" + "---:|---:|---:|" * len(labels)]
    for r in rows:
        cells = [f"{r[f'{lb}_ms']:,.1f} | {r[f'{lb}_speedup']:.2f}x | "
                 f"{r[f'{lb}_max_logit_diff']:.1e}" for lb in labels]
        out.append(f"| {r['shape']} | {r['reference_ms']:,.1f} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=EMBEDDED_TINY_LLAMA)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/forward.json"))
    args = p.parse_args(argv)
    with torch.inference_mode():
        rows = run(args)
    print(table(rows))
    write_results(args, rows)


def write_results(args: argparse.Namespace, rows: list[dict]) -> None:
    """`rows` as JSON at `args.out`, with the date, the machine, torch and the arguments."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
