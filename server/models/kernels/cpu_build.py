"""Compile a C kernel of src/ once with the system compiler and load it (ctypes).

    path = build(Path("src/cpu_linear.c"), cache_dir, FLAGS)  # cache_dir/cpu_linear-avx512-<key>.so
    kernel = load(source, cache_dir, CpuLinearKernel, "CPU linear kernel", "oneDNN")

The .so is keyed by a hash of the source, the folder's headers (`cpu_exp.h`), the flags and
the compiler's version, and kept in `cache_dir` (`$HICACHE_HOME/kernels`): a machine
compiles each kernel once (about a second). A finished build is renamed into place, so
concurrent processes never load a half-written file. The kernels use AVX-512 (F, BW, VL, DQ)
intrinsics, not -march=native, so one build runs on every AVX-512 machine; the bfloat16
linear kernel's AVX512-BF16 and AMX paths are compiled per function (`target` attributes)
and chosen at run time from CPUID. Every kernel also builds with AVX2_FLAGS, on a CPU
whose best is AVX2 (`isa()`, as torch dispatches): the linear kernel with its own AVX2
tiles, attention and the layer ops with cpu_v16.h's 16-float vectors as two AVX2 halves
(`built_isa(path)` says which build a .so is). OpenMP comes from libgomp.so.1, the very
runtime torch loaded (same soname), so torch and the kernels share one thread pool.

Threading: any thread.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch

logger = logging.getLogger(__name__)
T = TypeVar("T")

FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-fopenmp",
         "-fPIC", "-shared", "-std=c11")  # AVX-512 F+BW+VL+DQ: what torch calls AVX512
# AVX2 + FMA (what torch calls AVX2): every kernel's build on a CPU without AVX-512
# (`#ifndef __AVX512F__` picks its AVX2 half)
AVX2_FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared", "-std=c11")
ISA_FLAGS = {"avx512": FLAGS, "avx2": AVX2_FLAGS}
ISA_NAMES = {"avx512": "AVX-512F", "avx2": "AVX2 and FMA"}
# the bfloat16 path of a kernel's AVX2 build (its plain path, in AVX2): the ISA's name
AVX2_PATH = "avx2"
COMPILE_TIMEOUT_S = 120


def compiler() -> str:
    """`$CC`, else `cc`."""
    return os.environ.get("CC") or "cc"


def compiler_found() -> bool:
    """Whether `compiler()` is on PATH."""
    return shutil.which(compiler()) is not None


def isa() -> str | None:
    """The vector ISA this CPU gives the kernels, as torch dispatches its own: "avx512",
    "avx2" (AVX2 + FMA, no AVX-512), or None (neither, or no C compiler)."""
    if not compiler_found():
        return None
    return {"AVX512": "avx512", "AVX2": "avx2"}.get(torch.backends.cpu.get_cpu_capability())


def built_isa(path: Path) -> str:
    """The ISA a .so of `build` was compiled for ("avx512" or "avx2"), from its name."""
    return next((i for i in ISA_FLAGS if f"-{i}-" in path.name), "avx512")


def build(source: Path, cache_dir: Path, flags: Sequence[str] = FLAGS) -> Path:
    """`source` compiled into `cache_dir` once per (source, flags, compiler); the .so's path.
    subprocess.CalledProcessError (with the compiler's stderr) when the build fails."""
    cc = compiler()
    version = subprocess.run([cc, "--version"], check=False, capture_output=True, text=True,
                             timeout=COMPILE_TIMEOUT_S).stdout  # a broken one fails below
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(source.read_bytes() + headers + " ".join(flags).encode()
                         + version.encode()).hexdigest()[:16]
    tag = next((i for i, f in ISA_FLAGS.items() if tuple(flags) == f), "custom")
    path = cache_dir / f"{source.stem}-{tag}-{key}.so"
    if path.exists():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, str(source), "-o", tmp, "-lm"], check=True,
                       capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load(source: Path, cache_dir: Path, make: Callable[[ctypes.CDLL, Path], T], what: str,
         fallback: str, isas: Sequence[str] = ("avx512",)) -> T | None:
    """`make(library, path)` of `source` built (`build`, with this CPU's ISA's flags) and
    loaded; None where this CPU's ISA is not one of `isas` (the source's builds), or where
    the build, the load or `make` (a symbol missing) fails: logged, naming `what` and the
    `fallback` the caller keeps. `make` finds the ISA built in the .so's name."""
    found = isa()
    if found not in isas:
        logger.info("%s unavailable (needs %s and %s): using %s", what,
                    " or ".join(ISA_NAMES[i] for i in isas), compiler(), fallback)
        return None
    try:
        path = build(source, cache_dir, ISA_FLAGS[found])
        return make(ctypes.CDLL(str(path)), path)
    except subprocess.CalledProcessError as exc:
        logger.warning("%s did not build (%s exited %s: %s): using %s", what, exc.cmd[0],
                       exc.returncode, (exc.stderr or "").strip()[-500:], fallback)
        return None
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        logger.warning("%s did not build or load (%s): using %s", what, exc, fallback)
        return None
