"""Gemma's norms and GeGLU on the CPU layer kernel against torch's ops, side by side in one run.

    torch ops   RoPE on the layer kernel, Gemma's RMSNorms (float32 `1 + w`, q/k per head)
                and GeGLU as torch ops: the engine before issue 54 put them on C
    C kernel    every layer op on CpuLayerKernel (`gemma_rms_norm`, `gemma_norm_add_norm`,
                `gelu_tanh_mul`, RoPE): the engine's CPU default

Same model (Gemma 3 270M, `gemma3-270m`, unless `--model-path`), same weights, the linear and
attention kernels on both sides, in each dtype asked for: a 2,048-token prefill and decode
steps at batch 1 and 8 (700 tokens of context each). The two run in turn, repeat after
repeat, so a busy machine slows both alike; prints the best milliseconds of each, the
speed-up and the largest logit difference between them; writes JSON.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.bench_forward import PAGE_SIZE, fill_prefixes, make_batch, write_results
from hicache.memory.device import DeviceKVPool
from hicache_server.models.gemma3 import gemma_kernel_modules
from hicache_server.models.loader import load_model
from hicache_server.models.rope import RotaryEmbedding

SHAPES = {"prefill 2048": [(0, 2048)], "decode batch 1": [(700, 1)],
          "decode batch 8": [(700, 1)] * 8}
DECODE_REPEATS_FACTOR = 10  # a decode step is ~50x shorter than the prefill: more tries
CONFIGS = ("torch ops", "C kernel")


def use(model: torch.nn.Module, config: str, kernel: object) -> None:
    """RoPE on `kernel` always; the norms and GeGLU too for "C kernel"."""
    for m in gemma_kernel_modules(model):
        m.kernel = kernel if config == "C kernel" or isinstance(m, RotaryEmbedding) else None


def run_dtype(args: argparse.Namespace, dtype: str) -> list[dict]:
    lm = load_model(args.model_path, dtype, "cpu")
    model, c = lm.model, lm.config
    kernel = model.model.norm.kernel
    if kernel is None:
        raise SystemExit("the CPU layer kernel is off or unsupported here: nothing to compare")
    tokens = max(sum(p + e for p, e in seqs) for seqs in SHAPES.values())
    pool = DeviceKVPool(-(-tokens // PAGE_SIZE) + 1, PAGE_SIZE, c.num_hidden_layers,
                        c.num_key_value_heads, c.head_dim, lm.dtype, lm.device)
    rows = []
    for name, seqs in SHAPES.items():
        batch = make_batch(seqs, c.vocab_size, args.seed)
        use(model, "C kernel", kernel)
        fill_prefixes(model, pool, batch, c.vocab_size, args.seed + 1)
        best = dict.fromkeys(CONFIGS, float("inf"))
        logits = {}
        repeats = args.repeats * (1 if name.startswith("prefill") else DECODE_REPEATS_FACTOR)
        for attempt in range(repeats + 1):  # attempt 0 warms up, kept out of the best
            for config in CONFIGS:
                use(model, config, kernel)
                t0 = time.perf_counter()
                logits[config] = model.forward(batch, pool)
                if attempt:
                    best[config] = min(best[config], time.perf_counter() - t0)
        rows.append(_row(dtype, name, best, logits))
        print(f"{dtype} {name}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in best.items()),
              flush=True)
    return rows


def _row(dtype: str, shape: str, best: dict[str, float], logits: dict[str, torch.Tensor]
         ) -> dict:
    before, after = (logits[k] for k in CONFIGS)
    return {"dtype": dtype, "shape": shape, "torch_ops_ms": best["torch ops"] * 1e3,
            "kernel_ms": best["C kernel"] * 1e3,
            "speedup": best["torch ops"] / best["C kernel"],
            "max_logit_diff": float((before - after).abs().max()),
            "same_argmax": bool(torch.equal(before.argmax(-1), after.argmax(-1)))}


def table(rows: list[dict]) -> str:
    out = ["| dtype | shape | torch ops ms | C kernel ms | speed-up | max logit diff |",
           "|---|---|---:|---:|---:|---:|"]
    out += [f"| {r['dtype']} | {r['shape']} | {r['torch_ops_ms']:,.1f} | {r['kernel_ms']:,.1f} "
            f"| {r['speedup']:.2f}x | {r['max_logit_diff']:.1e} |" for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default="gemma3-270m")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/gemma_ops.json"))
    args = p.parse_args(argv)
    with torch.inference_mode():
        rows = [row for dtype in args.dtypes for row in run_dtype(args, dtype)]
    print(table(rows))
    write_results(args, rows)

if __name__ == "__main__":
    main()
