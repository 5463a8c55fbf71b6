"""Tokenizers: a model folder's `tokenizer.json` through `tokenizers`, or bytes for the
embedded model.

The embedded model's vocabulary (ids)::

    0 .. 255    the UTF-8 bytes
    256 257     bos eos
    258 259     pad unk

Its folder also carries a `tokenizer.json` (built by `byte_tokenizer_json`) that encodes and
decodes exactly like `ByteTokenizer`, so other tools can load the folder; the one difference is
that `tokenizers` turns a literal special-token string ("<|eos|>") in the text into its id,
while `ByteTokenizer` encodes every character as bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizerImpl

NUM_BYTES = 256
BOS_ID, EOS_ID, PAD_ID, UNK_ID = 256, 257, 258, 259
BYTE_VOCAB_SIZE = 260
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|unk|>")  # ids 256..259, in order
# config.json key that marks a folder written by server/models/loader.py's embedded model.
EMBEDDED_MARKER_KEY = "hicache_embedded"


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids. `encode` adds what the model's tokenizer adds by default (the
    embedded model: nothing); `decode` drops special tokens."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_ids(self) -> set[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are the tokens; ids 256..259 are bos, eos, pad, unk."""

    vocab_size = BYTE_VOCAB_SIZE
    bos_token_id = BOS_ID
    pad_token_id = PAD_ID

    @property
    def eos_token_ids(self) -> set[int]:
        return {EOS_ID}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes of `ids` as UTF-8 (invalid sequences become U+FFFD); specials are dropped.

        ValueError for an id outside [0, vocab_size).
        """
        bad = [i for i in ids if not 0 <= i < BYTE_VOCAB_SIZE]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range [0, {BYTE_VOCAB_SIZE})")
        return bytes(i for i in ids if i < NUM_BYTES).decode("utf-8", errors="replace")


class HFTokenizer:
    """`tokenizer.json` through the `tokenizers` library."""

    def __init__(self, path: str | Path, bos_token_id: int | None = None,
                 eos_token_ids: Iterable[int] = ()) -> None:
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer: {path} does not exist")
        self._tok = _HFTokenizerImpl.from_file(str(path))
        self._bos = bos_token_id
        self._eos = set(eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self._eos)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """ByteTokenizer for the embedded model's folder, else the folder's tokenizer.json.

    bos/eos come from generation_config.json, then config.json, then tokenizer_config.json's
    token strings. FileNotFoundError when the folder or its tokenizer.json is missing.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"no model folder: {model_dir} does not exist")
    config = _read_json(model_dir / "config.json")
    if config.get(EMBEDDED_MARKER_KEY):
        return ByteTokenizer()
    tok_path = model_dir / "tokenizer.json"
    if not tok_path.is_file():
        raise FileNotFoundError(f"no tokenizer: {tok_path} does not exist")
    gen = _read_json(model_dir / "generation_config.json")
    bos = gen.get("bos_token_id", config.get("bos_token_id"))
    eos = gen.get("eos_token_id", config.get("eos_token_id"))
    if bos is None or eos is None:
        bos, eos = _special_ids_from_tokenizer_config(model_dir, HFTokenizer(tok_path), bos, eos)
    eos_ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    return HFTokenizer(tok_path, bos, eos_ids)


def _special_ids_from_tokenizer_config(
    model_dir: Path, tok: HFTokenizer, bos: int | list[int] | None, eos: int | list[int] | None,
) -> tuple[int | None, int | list[int] | None]:
    tc = _read_json(model_dir / "tokenizer_config.json")
    for key in ("bos_token", "eos_token"):
        value = tc.get(key)
        text = value.get("content") if isinstance(value, dict) else value
        token_id = tok.token_to_id(text) if isinstance(text, str) else None
        if key == "bos_token" and bos is None:
            bos = token_id
        elif key == "eos_token" and eos is None:
            eos = token_id
    return bos, eos


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of the ByteLevel pre-tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = (b for b in range(NUM_BYTES) if b not in table)
    for n, b in enumerate(extra):
        table[b] = chr(NUM_BYTES + n)
    return table


def byte_tokenizer_json() -> str:
    """tokenizer.json text equivalent to ByteTokenizer: BPE without merges over the 256
    ByteLevel characters (byte b -> id b), then the 4 specials; no prefix space, no BOS."""
    chars = bytes_to_unicode()
    tok = _HFTokenizerImpl(models.BPE(vocab={chars[b]: b for b in range(NUM_BYTES)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in SPECIAL_TOKENS])
    return tok.to_str(pretty=True)
