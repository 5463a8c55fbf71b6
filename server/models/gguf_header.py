"""A GGUF file's header walked before gguf-py reads it: every count and length is checked
against the bytes the file has left, so a file that claims more than it holds is refused
at once, with the field named. gguf-py's reader loops once per claimed element and reads
past the end as empty arrays: a 49-byte file claiming 10^6 array elements took ~5 s and
~1 GB there, and one claiming 2^63 would never finish.

The layout (llama.cpp's `gguf.h`; little-endian, or byte-swapped as gguf-py detects it):

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count times:      key string | value type u32 | value
    tensor_count times:  name string | n_dims u32 | dims u64 x n_dims | type u32 | offset u64
    padding to `general.alignment` (32), then the tensors' data at their offsets

    string = length u64 | bytes      array = item type u32 | count u64 | items

The walk reads each length once and never more than the file holds, so its time is bounded
by the header's size whatever the claims. A file whose magic or version gguf-py does not
take is left to gguf-py, which says so.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import NamedTuple

from hicache_server.models.gguf_tokenizer import GGUFError

GGUF_MAGIC = b"GGUF"
READABLE_VERSIONS = (2, 3)  # gguf-py's READER_SUPPORTED_VERSIONS
DEFAULT_ALIGNMENT = 32  # gguf.h's GGUF_DEFAULT_ALIGNMENT
MAX_DIMS = 4  # ggml.h's GGML_MAX_DIMS: llama.cpp refuses a tensor of more
# llama.cpp reads no array of arrays at all and gguf-py flattens them, recursing per level:
# deeper nesting is refused so that neither the walk nor gguf-py recurses far.
MAX_ARRAY_DEPTH = 4
# Value types (gguf.h's `gguf_type`) and the bytes of each fixed-size one.
STRING, ARRAY = 8, 9
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
UINT32 = 4
# The fewest bytes an item can take: a string its length, an array its type and count.
MIN_STRING_BYTES, MIN_ARRAY_BYTES = 8, 12
# The fewest bytes of one metadata entry (an empty key, its type, a 1-byte value) and of
# one tensor's info (an empty name, n_dims 0, its type and offset).
MIN_KV_BYTES = MIN_STRING_BYTES + 4 + 1
MIN_TENSOR_INFO_BYTES = MIN_STRING_BYTES + 4 + 4 + 8
NAME_CHARS = 80  # of a key or tensor name shown in an error


class TensorInfo(NamedTuple):
    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int  # from the start of the data section


class _Cursor:
    """Reads the header's fields in order; GGUFError for any that passes the file's end."""

    def __init__(self, data: bytes | mmap.mmap, order: str, file: Path) -> None:
        self.data, self.order, self.file = data, order, file
        self.pos = 0

    @property
    def left(self) -> int:
        return len(self.data) - self.pos

    def need(self, size: int, what: str) -> int:
        """Take `size` bytes for `what`; where they start."""
        if size > self.left:
            raise GGUFError(f"{self.file}: {what} needs {size} bytes at offset {self.pos}, but "
                            f"the file has {self.left} left: a damaged or hostile GGUF file")
        start, self.pos = self.pos, self.pos + size
        return start

    def uint(self, size: int, what: str) -> int:
        start = self.need(size, what)
        return struct.unpack_from(self.order + ("I" if size == 4 else "Q"), self.data, start)[0]

    def count(self, what: str, item_bytes: int) -> int:
        """A u64 count of items of at least `item_bytes` each, checked against the rest."""
        n = self.uint(8, what)
        if n * item_bytes > self.left:
            raise GGUFError(f"{self.file}: {what} is {n}, which needs at least "
                            f"{n * item_bytes} bytes, but the file has {self.left} left: a "
                            "damaged or hostile GGUF file")
        return n

    def string(self, what: str) -> str:
        n = self.count(f"the length of {what}", 1)
        start = self.need(n, what)
        text = bytes(self.data[start:start + min(n, NAME_CHARS)])
        return text.decode("utf-8", errors="replace")


def check_gguf_header(file: Path) -> None:
    """GGUFError naming the field when `file`'s header claims more than the file holds (a
    count, a string's or an array's length, a tensor's data); nothing is parsed beyond
    the header, nothing returned."""
    with file.open("rb") as f:
        if file.stat().st_size == 0:
            raise GGUFError(f"{file} is empty, not a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _opened(data, file)
            if cursor is not None:
                _walk(cursor)


def _opened(data: mmap.mmap, file: Path) -> _Cursor | None:
    """A cursor past the magic and version, in the file's byte order; None for a file that
    is no GGUF gguf-py reads (gguf-py's own error says what it is)."""
    if len(data) < 8 or data[:4] != GGUF_MAGIC:
        return None
    little = struct.unpack_from("<I", data, 4)[0]
    order = ">" if little & 0xFFFF == 0 else "<"  # gguf-py's test for a byte-swapped file
    if struct.unpack_from(order + "I", data, 4)[0] not in READABLE_VERSIONS:
        return None
    cursor = _Cursor(data, order, file)
    cursor.pos = 8
    return cursor


def _walk(cursor: _Cursor) -> None:
    tensor_count = cursor.count("the header's tensor_count", MIN_TENSOR_INFO_BYTES)
    kv_count = cursor.count("the header's kv_count", MIN_KV_BYTES)
    alignment = DEFAULT_ALIGNMENT
    for i in range(kv_count):
        key = cursor.string(f"metadata key #{i}")
        kind = cursor.uint(4, f"the type of metadata {key!r}")
        start = cursor.pos
        _value(cursor, kind, f"metadata {key!r}", 0)
        if key == "general.alignment" and kind == UINT32:
            alignment = struct.unpack_from(cursor.order + "I", cursor.data, start)[0]
    tensors = [_tensor_info(cursor, i) for i in range(tensor_count)]
    if alignment > 0:  # gguf-py refuses 0 and other non-powers of two itself
        cursor.pos += -cursor.pos % alignment
    _check_tensor_data(cursor, tensors)


def _value(cursor: _Cursor, kind: int, what: str, depth: int) -> None:
    if kind in SCALAR_BYTES:
        cursor.need(SCALAR_BYTES[kind], what)
    elif kind == STRING:
        cursor.string(what)
    elif kind == ARRAY:
        _array(cursor, what, depth + 1)
    else:
        raise GGUFError(f"{cursor.file}: {what} has value type {kind}, which GGUF does not "
                        f"define (0-12)")


def _array(cursor: _Cursor, what: str, depth: int) -> None:
    if depth > MAX_ARRAY_DEPTH:
        raise GGUFError(f"{cursor.file}: {what} nests arrays {depth} deep; llama.cpp reads "
                        f"no nested array, and more than {MAX_ARRAY_DEPTH} levels are refused")
    item = cursor.uint(4, f"the item type of {what}")
    if item in SCALAR_BYTES:  # fixed-size items: one check for all of them
        n = cursor.count(f"the length of {what}", SCALAR_BYTES[item])
        cursor.need(n * SCALAR_BYTES[item], what)
        return
    least = MIN_STRING_BYTES if item == STRING else MIN_ARRAY_BYTES
    n = cursor.count(f"the length of {what}", least)
    if item == STRING:
        _strings(cursor, n, what)
        return
    for i in range(n):
        _value(cursor, item, f"{what}[{i}]", depth)


def _strings(cursor: _Cursor, n: int, what: str) -> None:
    """Skip `n` strings (a vocabulary: 262,144 of them in Gemma 3's), each length checked;
    the item is named only when one fails (its name would cost more than the walk)."""
    length = struct.Struct(cursor.order + "Q").unpack_from
    data, pos, end = cursor.data, cursor.pos, len(cursor.data)
    for i in range(n):
        # `count` checked 8 bytes an item, but earlier strings' bytes may have used them up
        size = length(data, pos)[0] if pos + 8 <= end else end
        if pos + 8 + size > end:
            cursor.pos = pos
            cursor.string(f"{what}[{i}]")  # raises (its length or bytes pass the end)
        pos += 8 + size
    cursor.pos = pos


def _tensor_info(cursor: _Cursor, i: int) -> TensorInfo:
    name = cursor.string(f"the name of tensor #{i}")
    n_dims = cursor.uint(4, f"n_dims of tensor {name!r}")
    if n_dims > MAX_DIMS:
        raise GGUFError(f"{cursor.file}: tensor {name!r} has n_dims {n_dims}; GGML's most is "
                        f"{MAX_DIMS}")
    dims = tuple(cursor.uint(8, f"dimension {d} of tensor {name!r}") for d in range(n_dims))
    ggml_type = cursor.uint(4, f"the type of tensor {name!r}")
    return TensorInfo(name, dims, ggml_type, cursor.uint(8, f"the offset of tensor {name!r}"))


def _check_tensor_data(cursor: _Cursor, tensors: list[TensorInfo]) -> None:
    """Each tensor's data (its elements at its type's size) inside the file; a type
    gguf-py does not know is left to its own error."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # only GGUF models need it

    known = {int(t): size for t, size in GGML_QUANT_SIZES.items()}
    data_start, size = cursor.pos, len(cursor.data)
    for t in tensors:
        if t.ggml_type not in known:
            continue
        block, block_bytes = known[t.ggml_type]
        elements = 1
        for d in t.dims:
            elements *= d
        end = data_start + t.offset + elements * block_bytes // block
        if end > size:
            kind = GGMLQuantizationType(t.ggml_type).name
            raise GGUFError(f"{cursor.file}: tensor {t.name!r} ({kind}, dims {list(t.dims)}) "
                            f"ends at byte {end}, past the file's {size} bytes: a truncated, "
                            "damaged or hostile GGUF file")
