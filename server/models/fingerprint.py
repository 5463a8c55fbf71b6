"""A model folder's fingerprint: the string the cache roots its L3 page keys in
(`hicache.storage.hashing.PageHasher`), so two servers of the same weights share pages and
two different models never do.

What must stay true: the value for given files never changes (a change orphans every page
stored under the old one; tests/test_fingerprint.py pins one), and the folder's path is no
part of it (a copy elsewhere finds the same pages).

Threading: any thread (at model load).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import xxhash

MODEL_CONFIG = "config.json"
SAFETENSORS_GLOB = "*.safetensors"
# config.json key of a folder whose weights are a GGUF file elsewhere (gguf.py): its
# "identity" is that file's digest (header, tensor table, data samples), so the config
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


def _canonical_json(value: Any) -> bytes:
    """The config as one byte string whatever its key order and spacing: sorted keys, no
    spaces, ASCII only, UTF-8 (part of the pinned value: never change it)."""
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
    differ). Tensors are not loaded: milliseconds even for a 100 GB model.
    """
    folder = Path(model_dir)
    config_path = folder / MODEL_CONFIG
    if not config_path.is_file():
        raise ValueError(f"cannot fingerprint model folder {str(folder)!r}: no {MODEL_CONFIG}")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot fingerprint model folder {str(folder)!r}: cannot read its "
                         f"{MODEL_CONFIG}: {e}") from e
    if not isinstance(config, dict):  # ValueError as for every other unreadable folder
        raise ValueError(  # noqa: TRY004
            f"cannot fingerprint model folder {str(folder)!r}: its {MODEL_CONFIG} "
            f"is a JSON {type(config).__name__}, not an object")
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
    parts = [_canonical_json(config)]
    for path in weights:
        parts += [path.name.encode(), str(path.stat().st_size).encode(),
                  *_safetensors_identity(path)]
    for part in parts:
        digest.update(_FRAME_LEN.pack(len(part)))
        digest.update(part)
    return digest.hexdigest()
