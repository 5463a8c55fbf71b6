"""Build FlashInfer's attention modules for a GPU ahead of time, on a machine with `nvcc` and
no GPU, for a GPU host that cannot compile them itself (no `nvcc`, no registry) or should not
spend its time on it (FlashInfer compiles each module at first use: minutes per module).

Builds the modules hicache's `FlashInferAttention` plans (`server/models/flashinfer_attention.py`):
the paged decode (FA2) and, for sm_90a, the FA3 paged prefill that FlashInfer picks on a Hopper
GPU, for each dtype and head dim asked; then lays them out as FlashInfer's AOT directory
(`flashinfer/data/aot/<module>/<module>.so`, found before any JIT build) and packs it:

    FLASHINFER_CUDA_ARCH_LIST=9.0a CUDA_HOME=/usr/local/cuda \\
        python -m benchmarks.flashinfer_aot --out flashinfer_aot.tgz
    # on the GPU host, after installing the same flashinfer-python version:
    tar xzf flashinfer_aot.tgz -C "$(python -c 'import flashinfer, os;
        print(os.path.dirname(flashinfer.__file__))')/data/aot"

FlashInfer links its modules against `libcuda`; a build machine without a driver needs a
stub of it on `LIBRARY_PATH` (CUDA's `lib64/stubs`), and the FA3 sources include
`curand_kernel.h` (CUDA's curand headers on `CPATH`). Written for flashinfer-python 0.6.
"""

from __future__ import annotations

import argparse
import tarfile
import time
from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bfloat16", "float16"])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--prefill-backend", choices=["fa3", "fa2"], default="fa3",
                   help="fa3 on Hopper (sm_90a), fa2 elsewhere")
    p.add_argument("--out", type=Path, default=Path("flashinfer_aot.tgz"))
    args = p.parse_args(argv)
    from flashinfer.jit import build_jit_specs
    from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module

    specs = []
    for name in args.dtypes:
        dt = DTYPES[name]
        for hd in args.head_dims:
            specs.append(gen_batch_decode_module(dt, dt, dt, torch.int32, hd, hd, 0, False, False))
            specs.append(gen_batch_prefill_module(args.prefill_backend, dt, dt, dt, torch.int32,
                                                  hd, hd, 0, False, False, False))
    start = time.monotonic()
    build_jit_specs(specs, verbose=False, skip_prebuilt=False)
    print(f"built {len(specs)} modules in {time.monotonic() - start:.0f} s")
    with tarfile.open(args.out, "w:gz") as tar:
        for spec in specs:
            tar.add(spec.jit_library_path, arcname=f"{spec.name}/{spec.name}.so")
    print(f"{args.out}: {args.out.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
