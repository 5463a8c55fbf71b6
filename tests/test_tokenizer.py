"""server/tokenizer: the byte tokenizer, its tokenizer.json twin, loading from a model folder."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    byte_tokenizer_json,
    load_tokenizer,
)

SEED = 99
# Text that exercises every UTF-8 length, controls, whitespace runs and the bytes the
# ByteLevel alphabet remaps (space, newline, 0x7f..0xa0, 0xad).
SAMPLES = ["", "hello world", "  leading and trailing  ", "tab\tnew\nline\r\n", "\x00\x7f\xa0\xad",
           "héllo wörld", "日本語のテキスト", "emoji 🎉👩‍👩‍👧 mix", "Ωmega ∑ ≠ ∞"]


@pytest.fixture(scope="module")
def byte_json(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(byte_tokenizer_json(), encoding="utf-8")
    return HFTokenizer(path, BOS_ID, [EOS_ID])


def random_text(rng: random.Random, n: int) -> str:
    ranges = [(0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x2FF), (0x4E00, 0x4FFF), (0x1F300, 0x1F64F)]
    chars = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        chars.append(chr(rng.randint(lo, hi)))
    return "".join(chars)


def test_byte_tokenizer_round_trips_and_specials() -> None:
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids) == (260, 256, {257})
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
    assert tok.decode([BOS_ID, *tok.encode("ab"), EOS_ID, PAD_ID, UNK_ID]) == "ab"
    assert tok.decode([0xE6, 0x97, ord("x")]) == "\ufffdx"  # a cut-off character
    with pytest.raises(ValueError, match="260"):
        tok.decode([1, 260])


@given(st.text(max_size=64))
def test_byte_tokenizer_round_trips_any_text(text: str) -> None:
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_tokenizer_json_agrees_with_byte_tokenizer(byte_json: HFTokenizer) -> None:
    byte = ByteTokenizer()
    rng = random.Random(SEED)
    texts = SAMPLES + [random_text(rng, rng.randint(1, 80)) for _ in range(200)]
    for text in texts:
        ids = byte_json.encode(text)
        assert ids == byte.encode(text), repr(text)
        assert byte_json.decode(ids) == byte.decode(ids) == text
    assert byte_json.vocab_size == byte.vocab_size
    for i, name in zip((BOS_ID, EOS_ID, PAD_ID, UNK_ID), ("bos", "eos", "pad", "unk")):
        assert byte_json.token_to_id(f"<|{name}|>") == i
    assert byte_json.decode([BOS_ID, 104, 105, EOS_ID]) == byte.decode([BOS_ID, 104, 105, EOS_ID])


@given(st.text(max_size=48))
def test_tokenizer_json_agrees_on_any_text(byte_json: HFTokenizer, text: str) -> None:
    if "<|" in text:  # tokenizers turns literal special-token strings into their ids
        return
    assert byte_json.encode(text) == ByteTokenizer().encode(text)


def test_load_tokenizer_embedded_folder_is_bytes(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hicache_embedded": "tiny-llama"}))
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)


def test_load_tokenizer_reads_special_ids(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text(byte_tokenizer_json(), encoding="utf-8")
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, {2})
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 256, "eos_token_id": [257, 258]}))
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_ids) == (256, {257, 258})
    assert tok.encode("hi") == [104, 105]


def test_load_tokenizer_falls_back_on_tokenizer_config(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text(byte_tokenizer_json(), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": {"content": "<|eos|>"}}))
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_ids) == (BOS_ID, {EOS_ID})


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1}))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFTokenizer(tmp_path)
