"""SGLang's host pool seen as pages of bytes: the format `HiCacheStore` stores, and each page's
bytes where they lie in the pool. Imports no SGLang: the pool is duck-typed as SGLang's
`HostKVCache`, through the methods its cache controller calls.

A stored page is SGLang's flat data page, the bytes of `get_data_page(index, flat=True)`
(which `set_from_flat_data_page` takes back), whichever path moves it::

    generic     batch_get / batch_set         the flat page tensors SGLang hands over
    zero-copy   batch_get_v1 / batch_set_v1   the page's view in the pool,
                                              `get_data_page(index, flat=False)`, read and
                                              written in place, run by contiguous run

so a server that switches `interface_v1` keeps its L3. The runs of a page, in the flat order
(MHA, `L` layers)::

    page_first    [K: page_size x L x heads x dim] [V: ...]                        2 runs
    layer_first   [K layer 0] ... [K layer L-1] [V layer 0] ... [V layer L-1]     2L runs

The zero-copy path needs that view to be the pool's memory, never a copy (a write into a copy
would be lost and the page served as garbage): `check_in_place` proves it once, when the pool
is registered, against the buffers SGLang's own zero-copy backends move
(`get_page_buffer_meta`): the runs of a page must cover exactly those bytes.

Threads: SGLang's prefetch and backup threads call at once on disjoint host pages; the pool
is only asked for views, and this module keeps no state.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hicache.storage.page_format import PageCodec, PageGeometry
from hicache.storage.page_seal import FleetKeys


def flat_page_bytes(pool: Any) -> int:
    """Bytes of one of `pool`'s flat pages (what a stored payload holds)."""
    dummy = pool.get_dummy_flat_data_page()
    return dummy.numel() * dummy.element_size()


def pool_format(pool: Any) -> dict[str, Any]:
    """What makes `pool`'s page bytes mean what they mean: its class, layout, dtype, page
    size, page bytes and geometry (MHA: heads and their dims; MLA: the latent's width)."""
    return {
        "class": type(pool).__name__,
        "layout": pool.layout,
        "dtype": str(pool.dtype).removeprefix("torch."),
        "page_size": pool.page_size,
        "page_bytes": flat_page_bytes(pool),
        "layers": pool.layer_num,
        "heads": getattr(pool, "head_num", 1),
        "head_dim": _head_dim(pool),
        "v_head_dim": getattr(pool, "v_head_dim", None),
    }


def page_codec(pool: Any, namespace: bytes = b"", fleet: FleetKeys | None = None) -> PageCodec:
    """The codec of `pool`'s pages in `namespace`: its geometry in the header, its flat
    page's length, sealed with `fleet`'s keys where given (`page_seal`)."""
    geometry = PageGeometry(pool.layer_num, getattr(pool, "head_num", 1), _head_dim(pool),
                            pool.page_size, pool.dtype)
    return PageCodec(geometry, payload_bytes=flat_page_bytes(pool), namespace=namespace,
                     keys=fleet)


def _head_dim(pool: Any) -> int:
    """MHA pools have `head_dim`; MLA pools one latent row of `kv_cache_dim` per token."""
    dim = getattr(pool, "head_dim", None) or getattr(pool, "kv_cache_dim", None)
    if not dim:
        raise ValueError(f"{type(pool).__name__} has neither head_dim nor kv_cache_dim: "
                         "hicache stores pages of SGLang's MHA and MLA host pools")
    return dim


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor (a flat data page), shared, not copied."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError(f"a flat data page must be a contiguous CPU tensor, got one on "
                         f"{tensor.device} with strides {tensor.stride()}")
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def page_runs(pool: Any, index: int) -> list[np.ndarray]:
    """The page at host slot `index` as its contiguous runs in the pool, in the flat page's
    order: 1-D uint8 arrays sharing the pool's memory."""
    view = pool.get_data_page(index, flat=False)
    # Bytes of the same memory, strided as the view is (its last dim is contiguous).
    return contiguous_runs(view.view(torch.uint8).numpy())


def contiguous_runs(array: np.ndarray) -> list[np.ndarray]:
    """`array`'s elements in C order as the fewest contiguous 1-D uint8 runs (views)."""
    inner, dims = array.itemsize, array.ndim
    # Fold trailing dims while they are contiguous under the ones already folded; a dim of
    # one element is contiguous whatever its stride.
    while dims and (array.shape[dims - 1] == 1 or array.strides[dims - 1] == inner):
        inner *= array.shape[dims - 1]
        dims -= 1
    return [array[outer].reshape(-1).view(np.uint8) for outer in np.ndindex(*array.shape[:dims])]


def check_in_place(pool: Any) -> None:
    """ValueError unless `pool`'s page views are its memory: the runs of its first page
    cover exactly the bytes `get_page_buffer_meta` names for that page."""
    name = type(pool).__name__
    try:
        pointers, sizes = pool.get_page_buffer_meta(torch.arange(pool.page_size))
    except (NotImplementedError, ValueError, AssertionError) as e:
        raise ValueError(f"interface_v1 needs {name}.get_page_buffer_meta, which failed "
                         f"({e!r}); set interface_v1 to 0") from e
    buffers = _merged((int(p), int(p) + int(n)) for p, n in zip(pointers, sizes))
    runs = _merged((run.ctypes.data, run.ctypes.data + run.nbytes)
                   for run in page_runs(pool, 0))
    if runs != buffers:
        raise ValueError(f"{name}.get_data_page(flat=False) is not a view of the page's "
                         f"buffers ({len(runs)} ranges against get_page_buffer_meta's "
                         f"{len(buffers)}): interface_v1 cannot write it in place; set it to 0")


def _merged(ranges: Any) -> list[tuple[int, int]]:
    """Byte ranges [start, end), sorted, with touching ones joined."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out
