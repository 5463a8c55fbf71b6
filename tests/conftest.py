"""Shared test set-up: deterministic hypothesis profiles and seeded RNGs."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import random
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import pytest

pytest.register_assert_rewrite("tier_workload", "arch_reference")
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, settings

from hicache.build import build_stack
from hicache.model_kv import ModelKV
from hicache.stack import CacheStack
from hicache_server.config import load_config
from hicache_server.engine import Engine
from hicache_server.http import Handler, add_admin_routes, create_app
from hicache_server.model_runner import ForwardOutput
from hicache_server.request import Request

T = TypeVar("T")
WAIT_S = 60.0  # a bound on waits that never time out in a passing run
# A model's KV geometry without a model (2 layers, 2 KV heads of 8 dims, float32 on the CPU),
# for stacks built with no engine; the path only names it in the page hashes.
TINY_KV = ModelKV(2, 2, 8, torch.float32, torch.device("cpu"), "test-model")

# CI runs derandomized so a run is repeatable; `dev` explores more examples locally.
settings.register_profile(
    "ci", derandomize=True, max_examples=60, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev", derandomize=True, max_examples=200, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="session")
def _hicache_home(tmp_path_factory) -> None:
    """The embedded model is generated once per test session, never in the user's home; so
    are the datasets lm-eval's tasks load (`datasets` caches every JSON file it reads)."""
    os.environ["HICACHE_HOME"] = str(tmp_path_factory.mktemp("hicache_home"))
    os.environ["HF_DATASETS_CACHE"] = str(tmp_path_factory.mktemp("hf_datasets"))


# glibc's malloc keeps what a module's engines and models freed in its arenas; without a trim
# the test process grew past 22 GB of this 24 GiB machine (3.3 GB of it after test_engine
# alone, 0.8 GB after a trim). None where the C library is not glibc.
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6") if sys.platform == "linux" \
    else None


@pytest.fixture(autouse=True, scope="module")
def _give_memory_back() -> Iterator[None]:
    """After each test module, hand the memory its fixtures freed back to the OS."""
    yield
    gc.collect()
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    random.seed(0)
    torch.manual_seed(0)


def cpu_stack(page_size: int, l1_tokens: int, **overrides: object) -> CacheStack:
    """The cache stack of `TINY_KV` on the CPU, `l1_tokens` in L1 (more config keys, dotted,
    in `overrides`), without an engine around it."""
    cfg = load_config(None, {"cache.page_size": page_size, "cache.max_total_tokens": l1_tokens,
                             "model.device": "cpu", **overrides})
    return build_stack(cfg, TINY_KV)


def cache_finished(stack: CacheStack, tokens: list[int]) -> None:
    """A finished request's KV for `tokens`, in `stack`'s tree and unlocked (its slots past
    what the tree already held are the tree's; the rest are freed)."""
    slots = stack.device_pool.alloc(len(tokens))
    stack.device_pool.free(slots[:stack.tree.insert(tokens, slots)])


def cuda_available() -> bool:
    return torch.cuda.is_available()


requires_cuda = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")


def tiered_engine(lmdb_dir, **overrides: object) -> Engine:
    """An engine on the CPU with all three tiers (LMDB in `lmdb_dir`), prefetches waited for;
    more config keys, dotted, in `overrides`."""
    return Engine(load_config(None, {
        "cache.max_total_tokens": 2048, "cache.hierarchical": True, "storage.backend": "lmdb",
        "storage.lmdb.path": str(lmdb_dir), "storage.prefetch_policy": "wait_complete",
        "storage.prefetch_threshold": 32, "model.device": "cpu", **overrides}))


def tiered_engine_in(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Engine]:
    """`tiered_engine` with its LMDB in a fresh temporary folder `name`, for module-scoped
    fixtures (`yield from`, as `small_engine`)."""
    with tiered_engine(tmp_path_factory.mktemp(name)) as e:
        yield e


def missing_tool(message: str) -> NoReturn:
    """A tool the project's tests need is absent: fail under CI (.ci/run must provide it),
    skip on a developer's machine."""
    if os.environ.get("CI"):
        pytest.fail(f"{message}; CI must provide it", pytrace=False)
    pytest.skip(message)


def needs_cpu_kernel(what: str) -> None:
    """`what` (a C kernel built for AVX-512F or AVX2) cannot build here: a missing C compiler
    is a missing tool (`missing_tool`: fails under CI); a CPU with neither is hardware no CI
    can provide, so the test skips."""
    from hicache_server.models.kernels import cpu_build

    if not cpu_build.compiler_found():
        missing_tool(f"{what} needs a C compiler")
    pytest.skip(f"{what} needs AVX-512F or AVX2, which this CPU lacks")


def compile_cubin(source: Path, arch: str, out_dir) -> bytes:
    """`nvcc --cubin` of the kernel source `source` for `arch`; skips only when no nvcc is
    installed."""
    import subprocess

    from hicache.kernels import cuda_utils

    nvcc = cuda_utils.find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc on PATH, $CUDA_HOME/bin or /usr/local/cuda/bin")
    cubin = out_dir / f"{source.name}_{arch}.cubin"
    proc = subprocess.run([nvcc, "--cubin", f"-arch={arch}", "-std=c++17", "-o", str(cubin),
                           str(source)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return cubin.read_bytes()


def small_engine(**overrides: object) -> Iterator[Engine]:
    """A CPU engine with a 2,048-token L1, for module-scoped fixtures (`yield from`)."""
    cfg = load_config(None, {"cache.max_total_tokens": 2048, "model.device": "cpu",
                             **overrides})
    with Engine(cfg) as e:
        yield e


def hold_scheduler(e: Engine) -> threading.Event:
    """Make the scheduler wait in a command (returns once it does) until the event is set:
    what is submitted meanwhile is taken in by one step."""
    started, gate = threading.Event(), threading.Event()
    e.scheduler.call(lambda: (started.set(), gate.wait(WAIT_S)))
    assert started.wait(WAIT_S)
    return gate


def submit_all(e: Engine, reqs: list[Request]) -> list[Future]:
    """Submit `reqs` in this order; the futures of their results."""
    futures = []
    for req in reqs:
        fut: Future = Future()
        req.on_update = lambda r, done, fut=fut: done and fut.set_result(r.result())
        e.scheduler.submit(req)
        futures.append(fut)
    return futures


def submit_in_one_step(e: Engine, reqs: list[Request]) -> list[Future]:
    """Submit `reqs` while the scheduler is held, so that one step takes them all in, in
    this order; the futures of their results."""
    gate = hold_scheduler(e)
    futures = submit_all(e, reqs)
    gate.set()
    return futures


def record_forwards(e: Engine, monkeypatch: pytest.MonkeyPatch,
                    what: Callable[[list[Request]], T]) -> list[T]:
    """Wrap the engine's forward pass: each pass appends `what(its requests)` to the list
    returned (the batch size, the requests' ids, ...)."""
    seen: list[T] = []
    forward = e.scheduler.runner.forward

    def recording(reqs: list[Request], lens: list[int]) -> ForwardOutput:
        seen.append(what(reqs))
        return forward(reqs, lens)
    monkeypatch.setattr(e.scheduler.runner, "forward", recording)
    return seen


def from_remote(remote: str) -> Handler:
    """A middleware that makes every request look as if it came from `remote`."""
    @web.middleware
    async def spoof(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await handler(request.clone(remote=remote))
    return spoof


@asynccontextmanager
async def app_client(engine: Engine, *, wait_idle: bool = True, admin: bool = False,
                     admin_key: str | None = None, remote: str | None = None
                     ) -> AsyncIterator[TestClient]:
    """The engine's app on loopback, with the admin routes (guarded by `admin_key`, as
    `--admin-api-key`) when `admin`, every request seen as from `remote` when given; then
    (`wait_idle`) waits until no request runs, so the next test starts on an idle engine."""
    app = create_app(engine)
    if remote is not None:
        app.middlewares.append(from_remote(remote))
    if admin:
        add_admin_routes(app, engine, admin_key)
    async with TestClient(TestServer(app)) as c:
        yield c
    if wait_idle:
        engine.flush_cache(())


def bf16_paths(kernel: Any, wanted: tuple[str, ...]) -> Iterator[Any]:
    """A CPU kernel (models/kernels/cpu_linear.py, cpu_attention.py) on each of `wanted`'s
    bfloat16 paths this CPU has (AVX-512F always), in turn; its own path again after."""
    default = kernel.bf16_path
    try:
        for path in (p for p in wanted if p in kernel.bf16_paths):
            kernel.bf16_path = path
            yield kernel
    finally:
        kernel.bf16_path = default
