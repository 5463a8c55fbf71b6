"""The float32 linear kernel against oneDNN's packed matmul, side by side in one run.

    kernel   CpuLinearKernel on its packed panels (the engine's CPU default: one FMA chain per
             output in input order, whatever the batch)
    oneDNN   torch's mkldnn packed linear on its own packed copy (what vLLM's CPU build runs,
             and what the engine runs for chunks of 512 rows or more where oneDNN gives the
             kernel's very bits, `onednn_matches_kernel`)

A model's Linears per layer (its fused q|k|v and gate|up, o and down; random weights of the
real shapes) at each row count asked for, the two in turn, repeat after repeat, so a busy
machine slows both alike. Prefill-sized batches by default: a decode batch is bound by
streaming the weights from memory, which repeated calls on one weight (in cache) do not
measure. Prints the best milliseconds of each per Linear and per layer, the
kernel's time over oneDNN's, and whether the two gave the same bits; writes JSON.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.bench_forward import write_results
from hicache_server.models.kernels import cpu_linear
from hicache_server.models.linear import PACK_ROWS_HINT
from hicache_server.models.loader import KERNELS_DIR, hicache_home

# name -> the layer's Linears as (outputs, inputs)
MODELS = {
    "gemma3-270m": {"q|k|v": (1536, 640), "o": (640, 1024), "gate|up": (4096, 640),
                    "down": (640, 2048)},
    "smollm2-135m": {"q|k|v": (960, 576), "o": (576, 576), "gate|up": (3072, 576),
                     "down": (576, 1536)},
}


def compare(kernel: cpu_linear.CpuLinearKernel, n: int, k: int, rows: int,
            gen: torch.Generator, repeats: int) -> tuple[dict[str, float], bool]:
    """Best milliseconds of each side for `rows` x [n, k], one call each in turn; and
    whether they gave the same bits."""
    w, x = torch.randn((n, k), generator=gen), torch.randn((rows, k), generator=gen)
    panels = kernel.pack(w)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
    runs = {"kernel": lambda: kernel(x, panels, n, None),
            "oneDNN": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")}
    same = torch.equal(runs["kernel"](), runs["oneDNN"]())
    ms = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for config, fn in runs.items():
            start = time.perf_counter()
            fn()
            ms[config] = min(ms[config], (time.perf_counter() - start) * 1e3)
    return ms, same


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="gemma3-270m")
    p.add_argument("--rows", type=int, nargs="+", default=[64, 300, 512, 2048])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/linear.json"))
    args = p.parse_args(argv)
    kernel = cpu_linear.load(hicache_home() / KERNELS_DIR)
    if kernel is None:
        raise SystemExit("the CPU linear kernel does not build here: nothing to compare")
    print(f"{args.model}, float32, the kernel's {kernel.isa} build, "
          f"{torch.get_num_threads()} threads, best of {args.repeats}")
    gen = torch.Generator().manual_seed(args.seed)
    rows_out = []
    with torch.inference_mode():
        for rows in args.rows:
            total = {"kernel": 0.0, "oneDNN": 0.0}
            for name, (n, k) in MODELS[args.model].items():
                ms, same = compare(kernel, n, k, rows, gen, args.repeats)
                for config in total:
                    total[config] += ms[config]
                rows_out.append({"rows": rows, "linear": name, "shape": [n, k], **ms,
                                 "kernel_over_onednn": ms["kernel"] / ms["oneDNN"],
                                 "same_bits": same})
                print(f"{rows:5d} rows  {name:8s} kernel {ms['kernel']:8.2f} ms  oneDNN "
                      f"{ms['oneDNN']:8.2f} ms  {ms['kernel'] / ms['oneDNN']:.2f}x  "
                      f"{'same bits' if same else 'other bits'}")
            rows_out.append({"rows": rows, "linear": "layer", **total,
                             "kernel_over_onednn": total["kernel"] / total["oneDNN"]})
            print(f"{rows:5d} rows  layer    kernel {total['kernel']:8.2f} ms  oneDNN "
                  f"{total['oneDNN']:8.2f} ms  {total['kernel'] / total['oneDNN']:.2f}x")
    write_results(args, rows_out)


if __name__ == "__main__":
    main()
