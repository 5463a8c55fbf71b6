"""Loading `.cu` files (this package's src/, and the model's): CuPy modules, nvcc and NVRTC
discovery.

CuPy is optional (the `cuda` extra): it is imported inside the functions that need it, so
`kernels` imports, and its pure-torch references run, on a machine without it or without a GPU.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

# Where a CUDA toolkit lives when its bin/ is not on PATH (the NVIDIA installers' default).
DEFAULT_CUDA_HOME = "/usr/local/cuda"

# The CuPy module options every kernel here is compiled with: the sources use nullptr and
# C++17 only, nothing from the CUDA headers (NVRTC has no include path by default).
NVRTC_OPTIONS: tuple[str, ...] = ("-std=c++17",)


def kernel_source(source: Path) -> str:
    """Text of the `.cu` file `source` (e.g. `transfer_kv_cuda.SOURCE`)."""
    return source.read_text(encoding="utf-8")


def find_nvcc() -> str | None:
    """Path of nvcc: PATH, then $CUDA_HOME/bin, then /usr/local/cuda/bin; None when absent."""
    on_path = shutil.which("nvcc")
    if on_path is not None:
        return on_path
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), DEFAULT_CUDA_HOME):
        if home:
            candidate = Path(home) / "bin" / "nvcc"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    return None


def import_cupy() -> Any:
    """`cupy`, or a RuntimeError saying how to install it."""
    try:
        import cupy  # optional dependency (the `cuda` extra): imported on the CUDA path only
    except ImportError as e:
        raise RuntimeError(
            "the 'cuda' backend needs CuPy; install it with `pip install -e '.[cuda]'` "
            "(cupy-cuda12x) or use backend='reference' / 'direct'"
        ) from e
    return cupy


@functools.cache
def raw_module(source: Path, options: tuple[str, ...] = NVRTC_OPTIONS) -> Any:
    """`cupy.RawModule` of the `.cu` file `source`, compiled once per process (CuPy also
    caches on disk).

    The module is compiled for the current device on first use; call it with that device current.
    """
    cupy = import_cupy()
    return cupy.RawModule(code=kernel_source(source), options=options)


def as_torch_stream(stream: Any, device: torch.device) -> torch.cuda.Stream:
    """`stream` as a torch stream: None = the current torch stream of `device`; a
    `torch.cuda.Stream` as is; anything with a `.ptr` handle (a CuPy stream) wrapped, not copied.
    """
    if stream is None:
        return torch.cuda.current_stream(device)
    if isinstance(stream, torch.cuda.Stream):
        return stream
    wrap = getattr(torch.cuda, "get_stream_from_external", None)  # torch >= 2.6
    if wrap is not None:
        return wrap(stream.ptr, device)
    return torch.cuda.ExternalStream(stream.ptr, device=device)


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` without blocking the CPU: a CPU tensor goes through pinned memory (a
    pageable source may make the copy wait for the stream). Enqueued on the current stream; the
    caching host allocator keeps the pinned copy alive until the copy has run.
    """
    if t.device == device:
        return t
    if t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _nvrtc_candidates() -> list[str]:
    found: list[str] = []
    for entry in sys.path:  # the nvidia-cuda-nvrtc wheel that torch depends on
        found += sorted(glob.glob(os.path.join(entry, "nvidia", "*", "lib", "libnvrtc.so*")))
        found += sorted(glob.glob(os.path.join(entry, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")))
    for home in (os.environ.get("CUDA_HOME"), DEFAULT_CUDA_HOME):
        if home:
            found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
    return [f for f in found if "alt" not in os.path.basename(f)] + ["libnvrtc.so"]


def load_nvrtc() -> ctypes.CDLL | None:
    """The NVRTC shared library (what CuPy compiles with), or None when none is installed."""
    for candidate in _nvrtc_candidates():
        # NVRTC dlopens libnvrtc-builtins by name; a wheel's lib/ is on no loader path, so
        # load the one next to it first.
        for builtins in sorted(glob.glob(os.path.join(os.path.dirname(candidate),
                                                      "libnvrtc-builtins.so*"))):
            if "alt" not in os.path.basename(builtins):
                try:
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                except OSError:
                    continue
        try:
            return ctypes.CDLL(candidate)
        except OSError:
            continue
    return None


def nvrtc_compile(source: str, options: tuple[str, ...] = NVRTC_OPTIONS) -> str:
    """Compile `source` to PTX with NVRTC exactly as CuPy's RawModule would (no include path).

    Needs no GPU. Raises RuntimeError with NVRTC's log when compilation fails, and when no
    NVRTC library is found.
    """
    lib = load_nvrtc()
    if lib is None:
        raise RuntimeError("no NVRTC library found (libnvrtc.so)")
    prog = ctypes.c_void_p()
    _nvrtc_check(lib, lib.nvrtcCreateProgram(
        ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None))
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = lib.nvrtcCompileProgram(prog, len(options), opts)
        if status != 0:
            raise RuntimeError(f"NVRTC failed to compile the source:\n{_nvrtc_log(lib, prog)}")
        size = ctypes.c_size_t()
        _nvrtc_check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(size)))
        ptx = ctypes.create_string_buffer(size.value)
        _nvrtc_check(lib, lib.nvrtcGetPTX(prog, ptx))
        return ptx.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _nvrtc_log(lib: ctypes.CDLL, prog: ctypes.c_void_p) -> str:
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    return log.value.decode(errors="replace")


def _nvrtc_check(lib: ctypes.CDLL, status: int) -> None:
    if status != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"NVRTC error {status}: {lib.nvrtcGetErrorString(status).decode()}")
