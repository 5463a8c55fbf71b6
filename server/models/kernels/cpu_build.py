"""Compile a C kernel of src/ once with the system compiler and load it (ctypes).

    path = build(Path("src/cpu_linear.c"), cache_dir, FLAGS)  # cache_dir/cpu_linear-<key>.so
    kernel = load(source, cache_dir, CpuLinearKernel, "CPU linear kernel", "oneDNN")

The .so is keyed by a hash of the source, the folder's headers (`cpu_exp.h`), the flags and
the compiler's version, and kept in `cache_dir` (`$HICACHE_HOME/kernels`): a machine
compiles each kernel once (about a second). A finished build is renamed into place, so
concurrent processes never load a half-written file. The kernels use AVX-512 (F, BW, VL, DQ)
intrinsics, not -march=native, so one build runs on every AVX-512 machine; the bfloat16
linear kernel's AVX512-BF16 and AMX paths are compiled per function (`target` attributes)
and chosen at run time from CPUID. OpenMP comes from libgomp.so.1, the very runtime torch
loaded (same soname), so torch and the kernels share one thread pool.

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
COMPILE_TIMEOUT_S = 120


def compiler() -> str:
    """`$CC`, else `cc`."""
    return os.environ.get("CC") or "cc"


def supported() -> bool:
    """AVX-512F on this CPU (what torch dispatches its own kernels on) and a C compiler."""
    return (torch.backends.cpu.get_cpu_capability() == "AVX512"
            and shutil.which(compiler()) is not None)


def build(source: Path, cache_dir: Path, flags: Sequence[str] = FLAGS) -> Path:
    """`source` compiled into `cache_dir` once per (source, flags, compiler); the .so's path.
    subprocess.CalledProcessError (with the compiler's stderr) when the build fails."""
    cc = compiler()
    version = subprocess.run([cc, "--version"], check=False, capture_output=True, text=True,
                             timeout=COMPILE_TIMEOUT_S).stdout  # a broken one fails below
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(source.read_bytes() + headers + " ".join(flags).encode()
                         + version.encode()).hexdigest()[:16]
    path = cache_dir / f"{source.stem}-{key}.so"
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
         fallback: str, flags: Sequence[str] = FLAGS) -> T | None:
    """`make(library, path)` of `source` built (`build`) and loaded; None where unsupported,
    or where the build, the load or `make` (a symbol missing) fails: logged, naming `what`
    and the `fallback` the caller keeps."""
    if not supported():
        logger.info("%s unavailable (needs AVX-512F and %s): using %s", what, compiler(),
                    fallback)
        return None
    try:
        path = build(source, cache_dir, flags)
        return make(ctypes.CDLL(str(path)), path)
    except subprocess.CalledProcessError as exc:
        logger.warning("%s did not build (%s exited %s: %s): using %s", what, exc.cmd[0],
                       exc.returncode, (exc.stderr or "").strip()[-500:], fallback)
        return None
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        logger.warning("%s did not build or load (%s): using %s", what, exc, fallback)
        return None
