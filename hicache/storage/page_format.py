"""The stored page format: one value per KV page, a fixed header then the payload.

Value layout (all integers little-endian; offsets in bytes)::

    0   magic            4s   b"HKV1"
    4   format version   u16  2 written (FORMAT_VERSION); 1 and 2 read (READABLE_VERSIONS)
    6   num_layers       u32
    10  kv_heads         u32
    14  head_dim         u32
    18  page_size        u32
    22  dtype code       u8   DTYPE_CODES
    23  (pad)            1    zero
    24  payload length   u64
    32  payload checksum u64  PAYLOAD_CHECKSUMS[version]: version 1 xxh64, version 2 xxh3_64
    40  (reserved)       8    zero, not checked; puts the payload at a multiple of 16
    48  payload               [num_layers, 2, page_size, kv_heads, head_dim], K then V per layer

The versions differ only in the checksum. A value is served only when bytes 0-31 are exactly
those of a readable version and this codec's geometry and dtype, and the payload matches that
version's checksum: anything else (another model's page under a colliding key, a torn or
truncated write, flipped bits, a version this code does not know) is a miss, never data.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
import xxhash

from hicache.memory.host import HostKVPool
from kernels.layouts import PAGE_FIRST

MAGIC = b"HKV1"
FORMAT_VERSION = 2  # the version every value is written in
# The payload checksum of each format version. Append only: every version ever written stays
# readable (docs/architecture.md, "Stored page format"). Measured on docs/benchmarks.md's 2-core EPYC (AVX2):
# xxh64 ~9 GB/s, xxh3_64 ~25-45 GB/s on pages in cache; python-xxhash hashes with the GIL
# released.
Checksum = Callable[[memoryview | bytes], int]  # payload -> its u64 checksum
PAYLOAD_CHECKSUMS: dict[int, Checksum] = {
    1: xxhash.xxh64_intdigest,
    2: xxhash.xxh3_64_intdigest,
}
READABLE_VERSIONS = frozenset(PAYLOAD_CHECKSUMS)
_FIELDS = struct.Struct("<4sHIIIIBxQ")  # magic .. payload length: compared as bytes
_CHECKSUM = struct.Struct("<Q")  # at _FIELDS.size
_HEADER = struct.Struct("<4sHIIIIBxQQ8x")
HEADER_BYTES = _HEADER.size  # 48

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


def copy_bytes(dst: memoryview | bytearray, src: memoryview | bytes) -> None:
    """`dst[:] = src` with the GIL released: numpy drops it for a copy this large (a memoryview
    slice assignment holds it for the whole memcpy), so fetch threads copying pages at once
    run in parallel."""
    to, frm = np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8)
    if to.size != frm.size:  # np.copyto would broadcast a 1-byte source
        raise ValueError(f"copy of {frm.size} bytes into a buffer of {to.size}")
    np.copyto(to, frm)


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
    """Encodes and checks stored pages of one geometry, and moves them to and from a pool.

    Values are written in FORMAT_VERSION and read in any of READABLE_VERSIONS, each checked
    with its own version's checksum.

    Threading: immutable; any thread may call any method. Buffers: `check` returns a view
    into the value it was given, valid only as long as that value's memory is (for an LMDB
    `buffers=True` read, until the transaction ends). The functions from `payload_reader`
    and `value_writer` touch only the host page they are given.
    """

    def __init__(self, geometry: PageGeometry) -> None:
        dims = (geometry.num_layers, geometry.kv_heads, geometry.head_dim, geometry.page_size)
        if min(dims) < 1:
            raise ValueError(f"page geometry must be all >= 1, got {geometry}")
        self.geometry = PageGeometry(*geometry[:4], dtype_from_name(geometry.dtype))
        self.payload_bytes = self.geometry.payload_bytes
        self.value_bytes = HEADER_BYTES + self.payload_bytes
        g = self.geometry
        self._fields = (g.num_layers, g.kv_heads, g.head_dim, g.page_size,
                        DTYPE_CODES[g.dtype], self.payload_bytes)
        # Bytes 0-31 of every value this codec serves, one per readable version -> the
        # checksum that version's payloads carry.
        self._checksum_of: dict[bytes, Checksum] = {
            _FIELDS.pack(MAGIC, version, *self._fields): digest
            for version, digest in PAYLOAD_CHECKSUMS.items()}

    def header_for(self, payload: memoryview | bytes) -> bytes:
        """The header (FORMAT_VERSION) of a value holding `payload`, one page of this geometry."""
        if len(payload) != self.payload_bytes:
            raise ValueError(f"a page payload of {self.geometry} is {self.payload_bytes} "
                             f"bytes, got {len(payload)}")
        checksum = PAYLOAD_CHECKSUMS[FORMAT_VERSION](payload)
        return _HEADER.pack(MAGIC, FORMAT_VERSION, *self._fields, checksum)

    def encode_into(self, payload: memoryview | bytes,
                    out: bytearray | memoryview | None = None) -> bytes | memoryview:
        """The stored value of `payload`: header + payload, copying the payload once.

        Into `out` (a writable buffer of `value_bytes`, reused across pages: no allocation,
        and the copy runs with the GIL released), returning a view of it; without `out`, a
        new bytes.
        """
        header = self.header_for(payload)
        if out is None:
            return b"".join((header, payload))
        value = memoryview(out)
        if len(value) != self.value_bytes:
            raise ValueError(f"a stored value of {self.geometry} is {self.value_bytes} "
                             f"bytes, got a buffer of {len(value)}")
        value[:HEADER_BYTES] = header
        copy_bytes(value[HEADER_BYTES:], payload)
        return value

    def _checksum_for(self, value: memoryview | bytes) -> Checksum | None:
        """The checksum of `value`'s version when its size and header fields (bytes 0-31)
        are exactly those of a readable version of this geometry; else None."""
        if len(value) != self.value_bytes:
            return None
        return self._checksum_of.get(bytes(memoryview(value)[:_FIELDS.size]))

    def header_ok(self, value: memoryview | bytes) -> bool:
        """Whether `value` is this codec's size and its header describes this geometry
        exactly, in a readable version."""
        return self._checksum_for(value) is not None

    def checksum_ok(self, value: memoryview | bytes, payload: memoryview | bytes) -> bool:
        """Whether `payload` (the value's payload, or a copy of it) matches value's checksum,
        computed as value's version computes it."""
        digest = self._checksum_for(value)
        if digest is None:
            return False
        return _CHECKSUM.unpack_from(value, _FIELDS.size)[0] == digest(payload)

    def check(self, value: memoryview | bytes) -> memoryview | None:
        """The payload (a view of `value`) when the header and checksum match, else None.

        Never raises on garbage: short, long, foreign or corrupted values all give None.
        """
        if not self.header_ok(value):
            return None
        payload = memoryview(value)[HEADER_BYTES:]
        return payload if self.checksum_ok(value, payload) else None

    def check_pool(self, pool: HostKVPool) -> None:
        """ValueError unless `pool` holds pages of exactly this geometry and dtype."""
        have = (pool.num_layers, pool.kv_heads, pool.head_dim, pool.page_size, pool.dtype)
        if have != tuple(self.geometry):
            raise ValueError(f"host pool geometry {have} does not match the stored pages' "
                             f"{tuple(self.geometry)}")

    def payload_reader(self, pool: HostKVPool) -> Callable[[int], memoryview]:
        """page id -> its payload bytes (a view of the pool for page_first, else a copy)."""
        if pool.layout == PAGE_FIRST:
            return pool.page_buffer
        return lambda page: memoryview(pool.get_page(page).reshape(-1).view(torch.uint8).numpy())

    def value_writer(self, pool: HostKVPool) -> Callable[[memoryview | bytes, int], bool]:
        """(stored value, page id) -> copy its payload into the page; False when it is bad.

        The payload is copied first (once, with the GIL released: `copy_bytes`) and its
        checksum verified on the copy, while it is hot in the CPU cache: the stored value is
        read once (for LMDB: the mapped file), and what is checked is exactly what the host
        page received. After False the page holds undefined bytes. layer_first pages go
        through a scratch page (not thread-safe: one writer per thread).
        """
        if pool.layout == PAGE_FIRST:
            # [num_pages, page_bytes], the pool's memory: a page's view in ~0.2 us, where
            # `page_buffer` (a torch view per call) takes ~6 us, 15% of a 128 KiB page's read.
            pages = pool.buffer.view(pool.num_pages, -1).view(torch.uint8).numpy()

            def copy_page_first(value: memoryview | bytes, page: int) -> bool:
                if not 0 <= page < pool.num_pages:  # numpy would wrap a negative id
                    raise IndexError(f"host page {page} is out of range [0, {pool.num_pages})")
                if not self.header_ok(value):
                    return False
                dst = pages[page]
                copy_bytes(dst, memoryview(value)[HEADER_BYTES:])
                return self.checksum_ok(value, dst)
            return copy_page_first
        scratch = torch.empty(self.geometry.page_shape, dtype=self.geometry.dtype)
        scratch_bytes = memoryview(scratch.view(-1).view(torch.uint8).numpy())

        def copy_layer_first(value: memoryview | bytes, page: int) -> bool:
            if not self.header_ok(value):
                return False
            copy_bytes(scratch_bytes, memoryview(value)[HEADER_BYTES:])
            if not self.checksum_ok(value, scratch_bytes):
                return False
            pool.set_page(page, scratch)
            return True
        return copy_layer_first
