"""SGLang's storage interface on the CPU, for tests/test_integration_sglang.py: the real
modules from the sglang wheel, and a host pool that does what SGLang's does.

    with sglang_modules() as api:   api.HiCacheStorage, api.StorageBackendFactory, ...
    FakeHostPool(layout, mla=False) the HostKVCache methods SGLang's cache controller calls

`make test` installs the wheel alone (`make sglang-api`: `pip install --no-deps --target
.venv-sglang`). Its dependencies are a CUDA stack, and `sglang/__init__.py` imports its
frontend (IPython, orjson, ...), so the package is entered without running that file: a
module object for `sglang` whose path is the wheel's folder. The two modules the backend
needs, `sglang.srt.mem_cache.hicache_storage` (the `HiCacheStorage` ABC and its config) and
`...storage.backend_factory` (how `dynamic` backends are built), then import as they are,
needing only torch and `sglang.srt.environ`, found through that module object's path (the
wheel's folder never joins `sys.path`). The block puts `sys.modules` back as it was, so no
other test sees SGLang.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from conftest import missing_tool

from hicache.kernels.layouts import LAYER_FIRST, PAGE_FIRST

SGLANG_DIR = Path(__file__).resolve().parent.parent / ".venv-sglang"
SGLANG_MODULES = ("sglang.srt.mem_cache.hicache_storage",
                  "sglang.srt.mem_cache.storage.backend_factory")
BACKEND_MODULE = "hicache.integrations.sglang"


@contextmanager
def sglang_modules() -> Iterator[types.SimpleNamespace]:
    """SGLang's storage modules and hicache's backend, imported for the block only."""
    if not (SGLANG_DIR / "sglang" / "srt" / "mem_cache" / "hicache_storage.py").exists():
        missing_tool(f"SGLang's wheel is not unpacked in {SGLANG_DIR}; run `make sglang-api`")
    saved = set(sys.modules)
    package = types.ModuleType("sglang")
    package.__path__ = [str(SGLANG_DIR / "sglang")]
    package.__spec__ = importlib.machinery.ModuleSpec("sglang", None, is_package=True)
    sys.modules["sglang"] = package
    try:
        storage, factory = (importlib.import_module(name) for name in SGLANG_MODULES)
        backend = importlib.import_module(BACKEND_MODULE)
        yield types.SimpleNamespace(
            HiCacheStorage=storage.HiCacheStorage, Config=storage.HiCacheStorageConfig,
            ExtraInfo=storage.HiCacheStorageExtraInfo,
            StorageBackendFactory=factory.StorageBackendFactory,
            HiCacheStore=backend.HiCacheStore, StoreMetrics=backend.StoreMetrics)
    finally:
        for name in set(sys.modules) - saved:
            if name == "sglang" or name.startswith(("sglang.", BACKEND_MODULE)):
                del sys.modules[name]


class FakeHostPool:
    """A host KV pool as SGLang's MHA (`mla=False`) and MLA host pools hold it, on the CPU.

    Buffers (`size` token slots; page p holds slots [p * page_size, (p + 1) * page_size))::

        MHA  layer_first  [2, layers, size, heads, head_dim]      K and V, then layer
             page_first   [2, size, layers, heads, head_dim]
        MLA  layer_first  [layers, size, 1, kv_cache_dim]          one latent per token
             page_first   [size, layers, 1, kv_cache_dim]

    A flat data page is the page's slice of the buffer in that order, flattened;
    `get_page_buffer_meta` gives each page's contiguous pieces as SGLang's pools do: one per
    layer and part for layer_first, one per part for page_first.
    """

    def __init__(self, layout: str, *, mla: bool = False, num_pages: int = 8,
                 page_size: int = 4, layer_num: int = 3, head_num: int = 2, head_dim: int = 8,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.layout, self.mla, self.page_size, self.dtype = layout, mla, page_size, dtype
        self.layer_num, self.size = layer_num, num_pages * page_size
        if mla:
            self.kv_cache_dim = head_dim
            dims = ((layer_num, self.size, 1, head_dim) if layout == LAYER_FIRST
                    else (self.size, layer_num, 1, head_dim))
        else:
            self.head_num, self.head_dim = head_num, head_dim
            dims = ((2, layer_num, self.size, head_num, head_dim) if layout == LAYER_FIRST
                    else (2, self.size, layer_num, head_num, head_dim))
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def fill(self, seed: int) -> FakeHostPool:
        generator = torch.Generator().manual_seed(seed)
        self.kv_buffer.copy_(torch.randn(self.kv_buffer.shape, generator=generator))
        return self

    def _page(self, index: int) -> torch.Tensor:
        tokens = slice(index, index + self.page_size)
        if self.layout == PAGE_FIRST:
            return self.kv_buffer[tokens] if self.mla else self.kv_buffer[:, tokens]
        return self.kv_buffer[:, tokens] if self.mla else self.kv_buffer[:, :, tokens]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._page(index)
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self._page(0).numel(), dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = self._page(index)
        page.copy_(data_page.reshape(page.shape))

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        pointers: list[int] = []
        sizes: list[int] = []
        for first in indices[::self.page_size].tolist():
            page = self._page(first)
            pieces = ([page] if self.mla and self.layout == PAGE_FIRST
                      else list(page) if self.mla or self.layout == PAGE_FIRST
                      else [page[part, layer] for layer in range(self.layer_num)
                            for part in range(2)])
            pointers += [piece.data_ptr() for piece in pieces]
            sizes += [piece.numel() * piece.element_size() for piece in pieces]
        return pointers, sizes

    def page_bytes(self, index: int) -> bytes:
        return self.get_data_page(index).view(torch.uint8).numpy().tobytes()
