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

A payload may arrive in parts (`Payload`: the K and V blocks of a page that lie apart in
another engine's host pool): the value holds them back to back, and the checksum is that of
the concatenation, hashed part by part (xxhash's streaming digest equals its one-shot one).
Another engine's page whose layout is not `[num_layers, 2, page_size, kv_heads, head_dim]`
(SGLang's MLA latent has one part per layer, not two) states its length (`payload_bytes`):
the header then describes its geometry and true length, and hicache's own pools refuse it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
import xxhash

from hicache.kernels.layouts import PAGE_FIRST
from hicache.memory.host import HostKVPool

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
# The same checksums fed part by part (a payload in parts), one per version as above.
PAYLOAD_HASHERS: dict[int, Callable[[], xxhash.xxh64 | xxhash.xxh3_64]] = {
    1: xxhash.xxh64,
    2: xxhash.xxh3_64,
}
READABLE_VERSIONS = frozenset(PAYLOAD_CHECKSUMS)
Buffer = memoryview | bytes | bytearray
# A page's payload: one buffer, or its parts in order (a list or tuple of buffers).
Payload = Buffer | Sequence[Buffer]
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


def payload_parts(payload: Payload) -> tuple[memoryview, ...]:
    """`payload` as byte views of its parts, in order (one part for a single buffer)."""
    parts = payload if isinstance(payload, (list, tuple)) else (payload,)
    return tuple(memoryview(part).cast("B") for part in parts)


def digest(version: int, parts: Sequence[memoryview]) -> int:
    """Version `version`'s checksum of the concatenation of `parts`."""
    if len(parts) == 1:
        return PAYLOAD_CHECKSUMS[version](parts[0])
    hasher = PAYLOAD_HASHERS[version]()
    for part in parts:
        hasher.update(part)
    return hasher.intdigest()


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
    with its own version's checksum. `payload_bytes`: the length of a page of another
    engine's layout (see the module docstring); None, hicache's `geometry.payload_bytes`.

    Threading: immutable; any thread may call any method. Buffers: `check` returns a view
    into the value it was given, valid only as long as that value's memory is (for an LMDB
    `buffers=True` read, until the transaction ends). The functions from `payload_reader`
    and `value_writer` touch only the host page they are given.
    """

    def __init__(self, geometry: PageGeometry, payload_bytes: int | None = None) -> None:
        dims = (geometry.num_layers, geometry.kv_heads, geometry.head_dim, geometry.page_size)
        if min(dims) < 1:
            raise ValueError(f"page geometry must be all >= 1, got {geometry}")
        if payload_bytes is not None and payload_bytes < 1:
            raise ValueError(f"a page payload must be >= 1 byte, got {payload_bytes}")
        self.geometry = PageGeometry(*geometry[:4], dtype_from_name(geometry.dtype))
        self.payload_bytes = payload_bytes or self.geometry.payload_bytes
        self.value_bytes = HEADER_BYTES + self.payload_bytes
        g = self.geometry
        self._fields = (g.num_layers, g.kv_heads, g.head_dim, g.page_size,
                        DTYPE_CODES[g.dtype], self.payload_bytes)
        # Bytes 0-31 of every value this codec serves, one per readable version -> that
        # version (whose checksum its payloads carry).
        self._version_of: dict[bytes, int] = {
            _FIELDS.pack(MAGIC, version, *self._fields): version
            for version in PAYLOAD_CHECKSUMS}

    def header_for(self, payload: Payload) -> bytes:
        """The header (FORMAT_VERSION) of a value holding `payload`, one page of this codec."""
        parts = self._parts_of_a_page(payload)
        return _HEADER.pack(MAGIC, FORMAT_VERSION, *self._fields,
                            digest(FORMAT_VERSION, parts))

    def encode_into(self, payload: Payload,
                    out: bytearray | memoryview | None = None) -> bytes | memoryview:
        """The stored value of `payload`: header + payload, copying the payload once.

        Into `out` (a writable buffer of `value_bytes`, reused across pages: no allocation,
        and the copy runs with the GIL released), returning a view of it; without `out`, a
        new bytes.
        """
        parts = self._parts_of_a_page(payload)
        header = self.header_for(parts)
        if out is None:
            return b"".join((header, *parts))
        value = memoryview(out)
        if len(value) != self.value_bytes:
            raise ValueError(f"a stored value of {self.geometry} is {self.value_bytes} "
                             f"bytes, got a buffer of {len(value)}")
        value[:HEADER_BYTES] = header
        start = HEADER_BYTES
        for part in parts:
            copy_bytes(value[start:start + part.nbytes], part)
            start += part.nbytes
        return value

    def _parts_of_a_page(self, payload: Payload) -> tuple[memoryview, ...]:
        parts = payload_parts(payload)
        size = sum(part.nbytes for part in parts)
        if size != self.payload_bytes:
            raise ValueError(f"a page payload of {self.geometry} is {self.payload_bytes} "
                             f"bytes, got {size}")
        return parts

    def _version_for(self, value: memoryview | bytes) -> int | None:
        """The version of `value` when its size and header fields (bytes 0-31) are exactly
        those of a readable version of this codec; else None."""
        if len(value) != self.value_bytes:
            return None
        return self._version_of.get(bytes(memoryview(value)[:_FIELDS.size]))

    def header_ok(self, value: memoryview | bytes) -> bool:
        """Whether `value` is this codec's size and its header describes this geometry
        exactly, in a readable version."""
        return self._version_for(value) is not None

    def checksum_ok(self, value: memoryview | bytes, payload: Payload) -> bool:
        """Whether `payload` (the value's payload, or a copy of it, maybe in parts) matches
        value's checksum, computed as value's version computes it."""
        version = self._version_for(value)
        if version is None:
            return False
        return _CHECKSUM.unpack_from(value, _FIELDS.size)[0] == digest(
            version, payload_parts(payload))

    def check(self, value: memoryview | bytes) -> memoryview | None:
        """The payload (a view of `value`) when the header and checksum match, else None.

        Never raises on garbage: short, long, foreign or corrupted values all give None.
        """
        if not self.header_ok(value):
            return None
        payload = memoryview(value)[HEADER_BYTES:]
        return payload if self.checksum_ok(value, payload) else None

    def copy_into(self, value: memoryview | bytes, parts: Payload) -> bool:
        """Copy `value`'s payload into `parts` (writable buffers, in order, `payload_bytes`
        in all) and check it there; False, without copying, when the header is not this
        codec's. The stored value is read once (for LMDB: the mapped file) and what is
        checked is exactly what the parts received. After False they hold undefined bytes.
        """
        version = self._version_for(value)
        if version is None:
            return False
        dst = self._parts_of_a_page(parts)
        src, start = memoryview(value), HEADER_BYTES
        for part in dst:
            copy_bytes(part, src[start:start + part.nbytes])
            start += part.nbytes
        return _CHECKSUM.unpack_from(value, _FIELDS.size)[0] == digest(version, dst)

    def check_pool(self, pool: HostKVPool) -> None:
        """ValueError unless `pool` holds pages of exactly this geometry and dtype."""
        if self.payload_bytes != self.geometry.payload_bytes:
            raise ValueError(f"this codec's pages ({self.payload_bytes} bytes) are not "
                             f"hicache's layout of {tuple(self.geometry)}: no host pool holds them")
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

        As `copy_into`: copied first, checked on the copy. After False the page holds
        undefined bytes. layer_first pages go through a scratch page (not thread-safe: one
        writer per thread).
        """
        if pool.layout == PAGE_FIRST:
            # [num_pages, page_bytes], the pool's memory: a page's view in ~0.2 us, where
            # `page_buffer` (a torch view per call) takes ~6 us, 15% of a 128 KiB page's read.
            pages = pool.buffer.view(pool.num_pages, -1).view(torch.uint8).numpy()

            def copy_page_first(value: memoryview | bytes, page: int) -> bool:
                if not 0 <= page < pool.num_pages:  # numpy would wrap a negative id
                    raise IndexError(f"host page {page} is out of range [0, {pool.num_pages})")
                return self.copy_into(value, pages[page])
            return copy_page_first
        scratch = torch.empty(self.geometry.page_shape, dtype=self.geometry.dtype)
        scratch_bytes = memoryview(scratch.view(-1).view(torch.uint8).numpy())

        def copy_layer_first(value: memoryview | bytes, page: int) -> bool:
            if not self.copy_into(value, scratch_bytes):
                return False
            pool.set_page(page, scratch)
            return True
        return copy_layer_first
