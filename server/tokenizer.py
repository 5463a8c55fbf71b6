"""Tokenizers: a model folder's `tokenizer.json` through `tokenizers`, or bytes for the
embedded model.

The embedded model's vocabulary (ids)::

    0 .. 255    the bytes; byte b is id b
    256 257     bos eos
    258 259     pad unk

Its text is printable: `ByteTokenizer.decode` shows each byte id as one visible character of
GPT-2's byte-to-character table (`bytes_to_unicode`: printable ASCII as itself, space as "Ġ",
newline as "Ċ", 0xE6 as "æ", ...), so any id sequence decodes to one character per byte and a
stream shows a character for every token, never a U+FFFD mark. `encode` inverts that table:
a character of the table's image becomes its byte, and every other character its UTF-8 bytes.
Hence encode(decode(ids)) == ids for every sequence of byte ids (what a multi-turn chat
relies on: an answer sent back as text re-encodes to the tokens that were generated), and
plain ASCII text encodes to its UTF-8 bytes as before. The price is paid by text holding
the table's non-ASCII characters: "é" (U+00E9, in the image) encodes to the single byte 0xE9,
not to UTF-8's C3 A9, and text round-trips as text only through the table, so
decode(encode("a b")) == "aĠb".

Its folder also carries a `tokenizer.json` (built by `byte_tokenizer_json`) that encodes and
decodes exactly like `ByteTokenizer`, so other tools (transformers' AutoTokenizer) load the
folder and agree with the server; the one difference is that `tokenizers` turns a literal
special-token string ("<|eos|>") in the text into its id, while `ByteTokenizer` encodes every
character as bytes.
"""

from __future__ import annotations

import json
import re
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
# GPT-2's byte-to-character table (`bytes_to_unicode`) shows bytes outside these ranges as
# chr(REMAPPED_BASE + n): U+0100..U+0143 for the 68 control, space and non-printing bytes.
PRINTABLE_BYTE_RANGES = ((ord("!"), ord("~")), (ord("¡"), ord("¬")), (ord("®"), ord("ÿ")))
REMAPPED_BASE = NUM_BYTES


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids. `encode` adds what the model's tokenizer adds by default (the
    embedded model: nothing), or nothing with `add_special_tokens=False` (for text that already
    holds its specials, as a rendered chat template does); `decode` drops special tokens."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_ids(self) -> set[int]: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """Bytes are the tokens, shown as GPT-2's printable characters; ids 256..259 are bos,
    eos, pad, unk (see the module docstring for what encode and decode promise)."""

    vocab_size = BYTE_VOCAB_SIZE
    bos_token_id = BOS_ID
    pad_token_id = PAD_ID

    @property
    def eos_token_ids(self) -> set[int]:
        return {EOS_ID}

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """A table character -> its byte; any other character -> its UTF-8 bytes. Adds no
        specials either way. Plain runs are encoded in bulk: only the table's non-ASCII
        characters (rare in real text) are looked up one by one."""
        ids: list[int] = []
        start = 0
        for match in _MAPPED_CHAR.finditer(text):
            ids += text[start:match.start()].encode("utf-8")
            ids.append(_CHAR_BYTES[match.group()])
            start = match.end()
        ids += text[start:].encode("utf-8")
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """One printable character per byte id (`bytes_to_unicode`); specials are dropped,
        or written as their names (`<|bos|>`, ...) with `skip_special_tokens=False`.

        ValueError for an id outside [0, vocab_size).
        """
        bad = [i for i in ids if not 0 <= i < BYTE_VOCAB_SIZE]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range [0, {BYTE_VOCAB_SIZE})")
        if skip_special_tokens:
            return "".join([_BYTE_CHARS[i] for i in ids if i < NUM_BYTES])
        return "".join([_BYTE_CHARS[i] if i < NUM_BYTES else SPECIAL_TOKENS[i - NUM_BYTES]
                        for i in ids])


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

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """`encode_batch`, not `encode`: it releases the GIL while it works (`encode` held
        it for 1.0 s over a 1 M-character text, stalling every thread, the event loop's
        too, although it ran off the loop), and gives the same ids."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


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
    printable = [b for lo, hi in PRINTABLE_BYTE_RANGES for b in range(lo, hi + 1)]
    table = {b: chr(b) for b in printable}
    extra = (b for b in range(NUM_BYTES) if b not in table)
    for n, b in enumerate(extra):
        table[b] = chr(REMAPPED_BASE + n)
    return table


def mapped_chars() -> dict[str, int]:
    """The table's characters that are not their byte's UTF-8 spelling (everything but
    printable ASCII): 162 characters in U+00A1..U+0143, each -> its byte."""
    return {c: b for b, c in bytes_to_unicode().items() if c.encode("utf-8") != bytes([b])}


_BYTE_CHARS = tuple(bytes_to_unicode()[b] for b in range(NUM_BYTES))  # indexed by byte
_CHAR_BYTES = mapped_chars()
# Matches every character of `_CHAR_BYTES` and nothing else (the tests check it): the
# Latin-1 letters and signs U+00A1..U+00FF but the soft hyphen, then U+0100..U+0143.
_MAPPED_CHAR = re.compile("[\u00a1-\u00ac\u00ae-\u0143]")


def byte_tokenizer_json() -> str:
    """tokenizer.json text equivalent to ByteTokenizer: BPE without merges over the 256
    ByteLevel characters (byte b -> id b), then the 4 specials; no prefix space, no BOS.

    Encoding: the table's non-ASCII characters are added tokens (not special) matched in the
    raw text before the ByteLevel pre-tokenizer runs; `tokenizers` gives an added token that
    the vocabulary already holds its vocabulary id, so each becomes its byte and the
    vocabulary stays 260. The rest of the text goes through ByteLevel as UTF-8 bytes.
    Decoding concatenates the tokens' table characters (`Fuse`), which ByteLevel's own
    decoder would turn back into bytes and then into UTF-8 with U+FFFD marks.
    """
    chars = bytes_to_unicode()
    tok = _HFTokenizerImpl(models.BPE(vocab={chars[b]: b for b in range(NUM_BYTES)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(c, special=False, normalized=False)
                    for c in sorted(_CHAR_BYTES, key=_CHAR_BYTES.__getitem__)])
    return tok.to_str(pretty=True)
