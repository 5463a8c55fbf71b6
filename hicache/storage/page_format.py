"""The stored page format: one value per KV page, a fixed header, the payload, its tag.

Value layout (all integers little-endian; offsets in bytes)::

    0   magic            4s   b"HKV1"
    4   format version   u16  3 (FORMAT_VERSION), the only one read
    6   num_layers       u32
    10  kv_heads         u32
    14  head_dim         u32
    18  page_size        u32
    22  dtype code       u8   DTYPE_CODES
    23  protection       u8   `page_seal.Protection`: checksum, MAC or encrypted
    24  payload length   u64
    32  salt             16   random per write with the fleet secret; zero without
    48  payload               [num_layers, 2, page_size, kv_heads, head_dim], K then V per
                              layer (AES-GCM ciphertext when encrypted); 16-byte aligned
    48+len  tag          16   `page_seal`: over the page key, the namespace, bytes 0-47 and
                              the payload

A value is served only under the key it was written under: the tag covers the page key and
the codec's namespace with the header and payload, so a value moved, swapped or copied to
another key, a foreign page, a torn or truncated write, flipped bits, another secret or
protection, are all a miss, never data. Bytes 0-31 must be exactly this codec's; versions 1
and 2 (a checksum of the payload alone: they cannot prove their key) are misses too, so an
upgrade to v3 starts with a cold L3 (docs/architecture.md, "Stored page format").

A payload may arrive in parts (`Payload`: the K and V blocks of a page that lie apart in
another engine's host pool): the value holds them back to back. Another engine's page whose
layout is not `[num_layers, 2, page_size, kv_heads, head_dim]` (SGLang's MLA latent has one
part per layer, not two) states its length (`payload_bytes`): the header then describes its
geometry and true length, and hicache's own pools refuse it.

A hybrid model's page is stored as two values, one per kind of layer (`storage/kinds.py`): a
codec with `layers` stores only those layers of a host page, its header counting them, its
tag covering their indices.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from hicache.kernels.layouts import PAGE_FIRST
from hicache.memory.host import HostKVPool
from hicache.storage.page_seal import (
    SALT_BYTES,
    TAG_BYTES,
    FleetKeys,
    make_seal,
)

MAGIC = b"HKV1"
FORMAT_VERSION = 3  # the version written, and the only one read (docs/architecture.md)
Buffer = memoryview | bytes | bytearray
# A page's payload: one buffer, or its parts in order (a list or tuple of buffers).
Payload = Buffer | Sequence[Buffer]
_FIELDS = struct.Struct("<4sHIIIIBBQ")  # magic .. payload length: compared as bytes
HEADER_BYTES = _FIELDS.size + SALT_BYTES  # 48: where the payload starts (16-byte aligned)
VALUE_OVERHEAD = HEADER_BYTES + TAG_BYTES  # a value's bytes beyond its payload

# Stored dtype codes. Append only: a code, once written to disk, keeps its meaning. 0 is never
# a valid code, so a zeroed header can not pass.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5,
    torch.float64: 6,
    torch.int8: 7,
    torch.uint8: 8,
}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """`"bfloat16"`, `"torch.bfloat16"` or `torch.bfloat16` -> `torch.bfloat16`."""
    if isinstance(name, torch.dtype):
        found = name
    else:
        found = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(found, torch.dtype) or found not in DTYPE_CODES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
        raise ValueError(f"unsupported KV dtype {name!r} for storage; allowed: {allowed}")
    return found


def payload_parts(payload: Payload) -> tuple[memoryview, ...]:
    """`payload` as byte views of its parts, in order (one part for a single buffer)."""
    parts = payload if isinstance(payload, (list, tuple)) else (payload,)
    return tuple(memoryview(part).cast("B") for part in parts)


class PageGeometry(NamedTuple):
    """Shape and dtype of one stored KV page."""

    num_layers: int
    kv_heads: int
    head_dim: int
    page_size: int  # tokens per page
    dtype: torch.dtype

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """`[num_layers, 2, page_size, kv_heads, head_dim]`."""
        return (self.num_layers, 2, self.page_size, self.kv_heads, self.head_dim)

    @property
    def payload_bytes(self) -> int:
        """Bytes of one page's K and V over all layers (== HostKVPool.page_bytes)."""
        elements = 2 * self.num_layers * self.page_size * self.kv_heads * self.head_dim
        return elements * self.dtype.itemsize


class PageCodec:
    """Encodes and checks stored pages of one geometry and namespace, and moves them to and
    from a pool.

    `namespace`: the bytes every key of this store is rooted in (the page hasher's namespace
    of the model and geometry, an integration's own); `keys`: the fleet secret's keys (None:
    a checksum, no secret). `payload_bytes`: the length of a page of another engine's layout
    (see the module docstring); None, hicache's `geometry.payload_bytes`. Every method that
    writes or reads a value takes the key (the 16-byte page hash) it is stored under.

    Threading: immutable; any thread may call any method. The functions from `payload_reader`
    and `value_writer` touch only the host page they are given.
    """

    def __init__(self, geometry: PageGeometry, payload_bytes: int | None = None, *,
                 namespace: bytes = b"", keys: FleetKeys | None = None,
                 layers: Sequence[int] | None = None) -> None:
        dims = (geometry.num_layers, geometry.kv_heads, geometry.head_dim, geometry.page_size)
        if min(dims) < 1:
            raise ValueError(f"page geometry must be all >= 1, got {geometry}")
        if payload_bytes is not None and payload_bytes < 1:
            raise ValueError(f"a page payload must be >= 1 byte, got {payload_bytes}")
        self.pool_layers = geometry.num_layers  # the host page's layers
        self.layers = _layer_selection(layers, geometry.num_layers)  # None: all of them
        stored = geometry.num_layers if self.layers is None else len(self.layers)
        self.geometry = PageGeometry(stored, *geometry[1:4], dtype_from_name(geometry.dtype))
        self.payload_bytes = payload_bytes or self.geometry.payload_bytes
        self.value_bytes = VALUE_OVERHEAD + self.payload_bytes
        self.seal = make_seal(namespace, keys)
        g = self.geometry
        # Bytes 0-31 of every value this codec writes, and the only ones it serves.
        self._fields = _FIELDS.pack(MAGIC, FORMAT_VERSION, g.num_layers, g.kv_heads,
                                    g.head_dim, g.page_size, DTYPE_CODES[g.dtype],
                                    self.seal.protection, self.payload_bytes)

    @property
    def protection(self) -> int:
        """`page_seal.Protection` of the values this codec writes and reads."""
        return self.seal.protection

    def encode_into(self, key: bytes, payload: Payload,
                    out: bytearray | memoryview | None = None) -> bytes | memoryview:
        """The value storing `payload` under `key`: header, sealed payload, tag.

        Into `out` (a writable buffer of `value_bytes`, reused across pages: no allocation,
        and the copy runs with the GIL released), returning a view of it; without `out`, a
        new bytes. A payload in parts is joined first (one more copy).
        """
        parts = self._parts_of_a_page(payload)
        value = memoryview(bytearray(self.value_bytes) if out is None else out)
        if len(value) != self.value_bytes:
            raise ValueError(f"a stored value of {self.geometry} is {self.value_bytes} "
                             f"bytes, got a buffer of {len(value)}")
        salt = self.seal.salt()
        value[:HEADER_BYTES] = self._fields + salt
        whole = parts[0] if len(parts) == 1 else memoryview(b"".join(parts))
        self.seal.seal(self._binding(key), salt, whole, value[HEADER_BYTES:])
        return value if out is not None else value.tobytes()

    def _binding(self, key: bytes) -> bytes:
        """What the tag covers beside the payload (and the namespace, in the seal)."""
        if self.layers is None:
            return bytes(key) + self._fields
        return bytes(key) + self._fields + struct.pack(f"<{len(self.layers)}I", *self.layers)

    def _parts_of_a_page(self, payload: Payload) -> tuple[memoryview, ...]:
        parts = payload_parts(payload)
        size = sum(part.nbytes for part in parts)
        if size != self.payload_bytes:
            raise ValueError(f"a page payload of {self.geometry} is {self.payload_bytes} "
                             f"bytes, got {size}")
        return parts

    def header_ok(self, value: memoryview | bytes) -> bool:
        """Whether `value` is this codec's size and its bytes 0-31 are exactly this codec's
        (version, geometry, dtype, protection, length)."""
        return (len(value) == self.value_bytes
                and memoryview(value)[:_FIELDS.size] == self._fields)

    def copy_into(self, key: bytes, value: memoryview | bytes, parts: Payload) -> bool:
        """Copy the payload of `value`, stored under `key`, into `parts` (writable buffers,
        in order, `payload_bytes` in all; decrypted where encrypted) and check its tag; False
        when the header is not this codec's or the tag fails (a value of another key,
        namespace, secret or protection, or damaged). The stored value is read once (for
        LMDB: the mapped file). After False the parts hold undefined bytes.
        """
        if not self.header_ok(value):
            return False
        view = memoryview(value)
        salt = bytes(view[_FIELDS.size:HEADER_BYTES])
        return self.seal.open_into(self._binding(key), salt, view[HEADER_BYTES:],
                                   self._parts_of_a_page(parts))

    def decode(self, key: bytes, value: memoryview | bytes) -> bytearray | None:
        """The payload of `value` stored under `key`, a new buffer, if it checks; else None.
        Never raises on garbage: short, long, foreign or corrupted values all give None."""
        payload = bytearray(self.payload_bytes)
        return payload if self.copy_into(key, value, payload) else None

    def check_pool(self, pool: HostKVPool) -> None:
        """ValueError unless `pool` holds pages of exactly this geometry and dtype."""
        if self.payload_bytes != self.geometry.payload_bytes:
            raise ValueError(f"this codec's pages ({self.payload_bytes} bytes) are not "
                             f"hicache's layout of {tuple(self.geometry)}: no host pool holds them")
        have = (pool.num_layers, pool.kv_heads, pool.head_dim, pool.page_size, pool.dtype)
        want = (self.pool_layers, *self.geometry[1:])
        if have != want:
            raise ValueError(f"host pool geometry {have} does not match the stored pages' "
                             f"{want}")

    def payload_reader(self, pool: HostKVPool) -> Callable[[int], Payload]:
        """page id -> its payload (views of the pool for page_first, else a copy)."""
        if self.layers is not None:
            return self._layers_reader(pool)
        if pool.layout == PAGE_FIRST:
            return pool.page_buffer
        return lambda page: memoryview(pool.get_page(page).reshape(-1).view(torch.uint8).numpy())

    def _layer_runs(self) -> list[tuple[int, int]]:
        """`layers` as runs [a, b) of consecutive layers."""
        runs: list[tuple[int, int]] = []
        for layer in self.layers or ():
            if runs and runs[-1][1] == layer:
                runs[-1] = (runs[-1][0], layer + 1)
            else:
                runs.append((layer, layer + 1))
        return runs

    def _layers_reader(self, pool: HostKVPool) -> Callable[[int], Payload]:
        if pool.layout == PAGE_FIRST:
            return self._page_parts(pool)
        index = torch.tensor(self.layers)
        return lambda page: memoryview(
            pool.get_page(page).index_select(0, index).reshape(-1).view(torch.uint8).numpy())

    def _page_parts(self, pool: HostKVPool) -> Callable[[int], Payload]:
        """A page_first pool's page id -> this codec's parts of it, views of the pool's
        memory: [num_pages, page_bytes] as numpy, a page's view in ~0.2 us, where
        `page_buffer` (a torch view per call) takes ~6 us, 15% of a 128 KiB page's read."""
        pages = pool.buffer.view(pool.num_pages, -1).view(torch.uint8).numpy()
        per_layer = pool.page_bytes // pool.num_layers
        runs = self._layer_runs() or [(0, pool.num_layers)]

        def parts(page: int) -> Payload:
            if not 0 <= page < pool.num_pages:  # numpy would wrap a negative id
                raise IndexError(f"host page {page} is out of range [0, {pool.num_pages})")
            row = pages[page]
            return [row[a * per_layer:b * per_layer] for a, b in runs]
        return parts

    def value_writer(self, pool: HostKVPool) -> Callable[[bytes, memoryview | bytes, int], bool]:
        """(page key, stored value, page id) -> copy its payload into the page (only this
        codec's layers of it); False when it is bad (`copy_into`). After False those layers
        hold undefined bytes. layer_first pages go through a scratch page (not thread-safe:
        one writer per thread).
        """
        if pool.layout == PAGE_FIRST:
            parts = self._page_parts(pool)
            return lambda key, value, page: self.copy_into(key, value, parts(page))
        scratch = torch.empty(self.geometry.page_shape, dtype=self.geometry.dtype)
        scratch_bytes = memoryview(scratch.view(-1).view(torch.uint8).numpy())

        def copy_layer_first(key: bytes, value: memoryview | bytes, page: int) -> bool:
            if not self.copy_into(key, value, scratch_bytes):
                return False
            if self.layers is None:
                pool.set_page(page, scratch)
            for i, layer in enumerate(self.layers or ()):
                k, v = pool.layer_kv(layer)
                k[page].copy_(scratch[i, 0])
                v[page].copy_(scratch[i, 1])
            return True
        return copy_layer_first


def _layer_selection(layers: Sequence[int] | None, num_layers: int) -> tuple[int, ...] | None:
    """`layers` checked: distinct, ascending, in [0, num_layers), at least one."""
    if layers is None:
        return None
    out = tuple(int(layer) for layer in layers)
    if not out or list(out) != sorted(set(out)) or out[0] < 0 or out[-1] >= num_layers:
        raise ValueError(f"a page part's layers must be distinct, ascending and in "
                         f"[0, {num_layers}), got {list(layers)}")
    return out
