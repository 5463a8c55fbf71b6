"""Page hashes: the keys under which KV pages are stored in L3, identical in every process.

The chain (docs/architecture.md, "Page hash")::

    h_0 = xxh3_128(b"hicache/v1" + namespace)
    h_i = xxh3_128(h_{i-1} + tokens of page i as little-endian uint32)

`namespace` is the canonical JSON of everything that makes two KV pages of the same tokens
differ: the model's identity (`model_fingerprint`), the KV dtype, page size and geometry, the
tensor-parallel rank and size, and the request's `extra_key` (cache salt, LoRA id, ...).

Nothing here depends on the process: no random seed, no Python `hash`, no path. Two servers
of the same model agree on every key; two different models (or geometries) never share one.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

HASH_DOMAIN = b"hicache/v1"  # bump with any change to the chain or the namespace fields
DIGEST_BYTES = 16  # xxh3_128 digest: one page key
MAX_TOKEN_ID = 2**32 - 1  # tokens are hashed as uint32
_TOKEN_DTYPE = np.dtype("<u4")

MODEL_CONFIG = "config.json"
SAFETENSORS_GLOB = "*.safetensors"
# config.json key of a folder whose weights are a GGUF file elsewhere (server/models/gguf.py):
# its "identity" is that file's digest (header, tensor table, data samples), so the config
# alone identifies the weights and the folder holds no safetensors.
GGUF_IDENTITY_KEY = "hicache_gguf"
# A safetensors file starts with its header length (uint64, little-endian), then the JSON
# header (names, dtypes, shapes, byte offsets). The format caps the header at 100 MB.
_SAFETENSORS_LEN = struct.Struct("<Q")
_SAFETENSORS_MAX_HEADER = 100_000_000
_FRAME_LEN = struct.Struct("<Q")  # length prefix of each fingerprint part (no ambiguity)
# Bytes of tensor data sampled at the start, middle and end of each file's data section:
# fine-tunes of one base model have identical headers, and differ in (nearly) every weight.
_DATA_SAMPLE_BYTES = 4096


def canonical_json(value: Any) -> bytes:
    """One byte string per value: sorted keys, no spaces, ASCII only, UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _safetensors_identity(path: Path) -> list[bytes]:
    """A safetensors file's header (8-byte length + JSON) and three samples of its data.

    Reads at most the header and 3 x 4 KiB: tensors are never loaded.
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(_SAFETENSORS_LEN.size)
        if len(head) < _SAFETENSORS_LEN.size:
            raise ValueError(f"{path} is not a safetensors file: {size} bytes, shorter than "
                             f"its {_SAFETENSORS_LEN.size}-byte header length")
        (length,) = _SAFETENSORS_LEN.unpack(head)
        if length > min(_SAFETENSORS_MAX_HEADER, size - _SAFETENSORS_LEN.size):
            raise ValueError(f"{path} is not a safetensors file: header length {length} "
                             f"does not fit in the file ({size} bytes)")
        parts = [head + f.read(length)]
        data_start = f.tell()
        data_bytes = size - data_start
        for offset in (0, data_bytes // 2, max(0, data_bytes - _DATA_SAMPLE_BYTES)):
            f.seek(data_start + offset)
            parts.append(f.read(_DATA_SAMPLE_BYTES))
        return parts


def model_fingerprint(model_dir: str | Path) -> str:
    """Hex xxh3_128 of a model folder's identity: its config and its weights' headers.

    A GGUF companion folder is identified by its config alone, which carries the GGUF file's
    own identity digest (`GGUF_IDENTITY_KEY`).

    Hashed, each part length-prefixed: the canonical JSON of `config.json`, then for every
    `*.safetensors` file in name order its name, its size, its header (length + JSON: every
    tensor's dtype, shape and byte offsets) and 4 KiB of tensor data at the start, middle
    and end of the data (so fine-tunes of one base model, whose headers are identical,
    differ). Tensors are not loaded: milliseconds even for a 100 GB model. The folder's
    path is not part of it.
    """
    folder = Path(model_dir)
    config_path = folder / MODEL_CONFIG
    if not config_path.is_file():
        raise ValueError(f"cannot fingerprint model folder {str(folder)!r}: no {MODEL_CONFIG}")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    gguf = config.get(GGUF_IDENTITY_KEY)
    weights = [] if gguf else sorted(folder.glob(SAFETENSORS_GLOB), key=lambda p: p.name)
    if gguf and not (isinstance(gguf, dict) and gguf.get("identity")):
        raise ValueError(f"cannot fingerprint model folder {str(folder)!r}: its "
                         f"{GGUF_IDENTITY_KEY} names no identity")
    if not weights and not gguf:
        raise ValueError(f"cannot fingerprint model folder {str(folder)!r}: no "
                         f"{SAFETENSORS_GLOB} files (weights are safetensors, or a GGUF file whose "
                         f"companion folder's config carries {GGUF_IDENTITY_KEY})")
    digest = xxhash.xxh3_128()
    parts = [canonical_json(config)]
    for path in weights:
        parts += [path.name.encode(), str(path.stat().st_size).encode(),
                  *_safetensors_identity(path)]
    for part in parts:
        digest.update(_FRAME_LEN.pack(len(part)))
        digest.update(part)
    return digest.hexdigest()


def namespace(
    model_fingerprint: str,
    dtype: str,
    page_size: int,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    extra_key: str | None = None,
) -> bytes:
    """Canonical JSON (UTF-8) of every field that makes two pages of equal tokens differ."""
    fields = {
        "model_fingerprint": model_fingerprint, "dtype": dtype, "page_size": page_size,
        "num_layers": num_layers, "kv_heads": kv_heads, "head_dim": head_dim,
        "tp_rank": tp_rank, "tp_size": tp_size, "extra_key": extra_key,
    }
    return canonical_json(fields)


def _tokens_as_uint32(tokens: Sequence[int] | torch.Tensor) -> np.ndarray:
    """`tokens` as a 1-D little-endian uint32 array; ValueError outside 0..2**32-1."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().to("cpu").numpy()
    try:
        values = np.asarray(tokens)
    except OverflowError as err:
        raise ValueError(f"token ids must be in [0, {MAX_TOKEN_ID}]: {err}") from err
    if values.size == 0:
        return np.empty(0, dtype=_TOKEN_DTYPE)
    if values.ndim != 1 or values.dtype.kind not in "iu":
        raise ValueError("tokens must be a 1-D sequence of integer token ids, got "
                         f"shape {values.shape} dtype {values.dtype}")
    low, high = int(values.min()), int(values.max())
    if low < 0 or high > MAX_TOKEN_ID:
        bad = low if low < 0 else high
        raise ValueError(f"token id {bad} is outside [0, {MAX_TOKEN_ID}] (hashed as uint32)")
    return values.astype(_TOKEN_DTYPE, copy=False)


class PageHasher:
    """Hashes token sequences into page keys for one model, geometry and TP rank.

    Threading: immutable after construction except the cache of roots per `extra_key`; any
    thread may call it (a racing cache fill computes the same value twice, harmlessly).
    """

    def __init__(
        self,
        page_size: int,
        model_fingerprint: str,
        dtype: str,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size={tp_size}), got {tp_rank}")
        self.page_size = page_size
        self._fields: dict[str, Any] = {
            "model_fingerprint": model_fingerprint, "dtype": dtype, "page_size": page_size,
            "num_layers": num_layers, "kv_heads": kv_heads, "head_dim": head_dim,
            "tp_rank": tp_rank, "tp_size": tp_size,
        }
        self._roots: dict[str | None, bytes] = {}

    def root(self, extra_key: str | None = None) -> bytes:
        """`h_0` of the namespace with `extra_key`: the hash before the first page."""
        found = self._roots.get(extra_key)
        if found is None:
            found = xxhash.xxh3_128_digest(
                HASH_DOMAIN + namespace(**self._fields, extra_key=extra_key)
            )
            self._roots[extra_key] = found
        return found

    def hash_pages(
        self,
        tokens: Sequence[int] | torch.Tensor,
        prev: bytes | None = None,
        extra_key: str | None = None,
    ) -> list[bytes]:
        """Keys of the full pages of `tokens` (a partial last page is not hashed).

        `prev` is the key of the page just before `tokens[0]` (so a long sequence can be
        hashed in pieces); None starts at the root of `extra_key`. When `prev` is given,
        `extra_key` is not used: it is already folded into `prev`.
        """
        if prev is not None and len(prev) != DIGEST_BYTES:
            raise ValueError(f"prev must be a {DIGEST_BYTES}-byte page hash, got {len(prev)} bytes")
        raw = _tokens_as_uint32(tokens).tobytes()
        page_bytes = self.page_size * _TOKEN_DTYPE.itemsize
        num_pages = len(raw) // page_bytes
        h = self.root(extra_key) if prev is None else bytes(prev)
        keys: list[bytes] = []
        for start in range(0, num_pages * page_bytes, page_bytes):
            h = xxhash.xxh3_128_digest(h + raw[start : start + page_bytes])
            keys.append(h)
        return keys
