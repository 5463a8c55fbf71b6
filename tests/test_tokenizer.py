"""server/tokenizer: the byte tokenizer (printable decoding), its tokenizer.json twin and the
embedded folder's tokenizer files (transformers loads them), loading from a model folder."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache_server.models import loader
from hicache_server.models.loader import (
    EMBEDDED_TINY_LLAMA,
    embedded_tokenizer_files,
    resolve_model_path,
)
from hicache_server.tokenizer import (
    BOS_ID,
    BYTE_VOCAB_SIZE,
    EOS_ID,
    NUM_BYTES,
    PAD_ID,
    UNK_ID,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    byte_tokenizer_json,
    bytes_to_unicode,
    load_tokenizer,
    mapped_chars,
)

SEED = 99
# Text that exercises every UTF-8 length, controls, whitespace runs and the bytes the
# ByteLevel alphabet remaps (space, newline, 0x7f..0xa0, 0xad).
SAMPLES = ["", "hello world", "  leading and trailing  ", "tab\tnew\nline\r\n", "\x00\x7f\xa0\xad",
           "héllo wörld", "日本語のテキスト", "emoji 🎉👩‍👩‍👧 mix", "Ωmega ∑ ≠ ∞", "ĠĊ ĀŃ ¡¬®ÿ"]
ASCII = [t for t in SAMPLES if t.isascii()]
byte_ids = st.lists(st.integers(0, BYTE_VOCAB_SIZE - 1), max_size=64)


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


def test_byte_tokenizer_decodes_every_byte_to_one_visible_character() -> None:
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids) == (260, 256, {257})
    shown = tok.decode(list(range(NUM_BYTES)))
    assert len(shown) == len(set(shown)) == NUM_BYTES
    assert all(c.isprintable() and not c.isspace() for c in shown)
    assert shown == "".join(bytes_to_unicode()[b] for b in range(NUM_BYTES))
    assert tok.decode([BOS_ID, *b"hi you", EOS_ID, PAD_ID, UNK_ID]) == "hiĠyou"
    assert tok.decode([0xE6, 0x97, ord("x"), 0x0A, 0x00]) == "æĹxĊĀ"  # no U+FFFD, ever
    with pytest.raises(ValueError, match="260"):
        tok.decode([1, 260])


def test_byte_tokenizer_encode_inverts_the_table() -> None:
    """A table character is its byte; any other character its UTF-8 bytes; ASCII text
    encodes as before (its UTF-8 bytes)."""
    tok = ByteTokenizer()
    mapped = mapped_chars()
    assert len(mapped) == 162 and set(mapped.values()) == set(range(NUM_BYTES)) - set(
        range(ord("!"), ord("~") + 1))
    for cp in range(0x400):  # every mapped character lies below U+0144
        c = chr(cp)
        assert tok.encode(c) == ([mapped[c]] if c in mapped else list(c.encode())), hex(cp)
    for text in ASCII:
        assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.encode("é日Ġ") == [0xE9, *"日".encode(), 0x20]
    assert tok.encode("hé", add_special_tokens=False) == [104, 0xE9]


@given(byte_ids)
def test_byte_tokenizer_encode_of_decode_is_identity(ids: list[int]) -> None:
    tok = ByteTokenizer()
    assert tok.encode(tok.decode(ids)) == [i for i in ids if i < NUM_BYTES]


@given(st.text(alphabet=st.sampled_from(sorted(set(bytes_to_unicode().values()))), max_size=48))
def test_table_text_round_trips_as_text(text: str) -> None:
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text


@given(st.text(max_size=64))
def test_byte_tokenizer_decode_of_encode_is_the_table_spelling(text: str) -> None:
    """Text comes back through the table: each byte of its encoding as one character."""
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < NUM_BYTES for i in ids)
    assert tok.decode(ids) == "".join(bytes_to_unicode()[i] for i in ids)


def test_tokenizer_json_agrees_with_byte_tokenizer(byte_json: HFTokenizer) -> None:
    byte = ByteTokenizer()
    rng = random.Random(SEED)
    texts = SAMPLES + [random_text(rng, rng.randint(1, 80)) for _ in range(200)]
    for text in texts:
        ids = byte_json.encode(text)
        assert ids == byte.encode(text), repr(text)
        assert byte_json.decode(ids) == byte.decode(ids)
    for _ in range(100):
        ids = [rng.randrange(BYTE_VOCAB_SIZE) for _ in range(rng.randint(0, 80))]
        assert byte_json.decode(ids) == byte.decode(ids)
    assert byte_json.vocab_size == byte.vocab_size
    for i, name in zip((BOS_ID, EOS_ID, PAD_ID, UNK_ID), ("bos", "eos", "pad", "unk")):
        assert byte_json.token_to_id(f"<|{name}|>") == i


@given(st.text(max_size=48))
def test_tokenizer_json_agrees_on_any_text(byte_json: HFTokenizer, text: str) -> None:
    if "<|" in text:  # tokenizers turns literal special-token strings into their ids
        return
    assert byte_json.encode(text) == ByteTokenizer().encode(text)


@given(byte_ids)
def test_tokenizer_json_agrees_on_any_ids(byte_json: HFTokenizer, ids: list[int]) -> None:
    assert byte_json.decode(ids) == ByteTokenizer().decode(ids)


# ------------------------------------------------------- the embedded folder's tokenizer


@pytest.fixture
def tokenizer_folder(tmp_path: Path) -> Path:
    for name, text in embedded_tokenizer_files().items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    return tmp_path


def test_transformers_loads_the_embedded_tokenizer_and_agrees(tokenizer_folder: Path) -> None:
    import transformers  # the `test` extra

    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer_folder))
    byte = ByteTokenizer()
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.unk_token_id) == (
        BOS_ID, EOS_ID, PAD_ID, UNK_ID)
    assert len(hf) == BYTE_VOCAB_SIZE
    rng = random.Random(SEED)
    for text in SAMPLES + [random_text(rng, rng.randint(1, 40)) for _ in range(50)]:
        assert hf.encode(text) == byte.encode(text), repr(text)  # no BOS added
        assert hf.decode(hf.encode(text)) == byte.decode(byte.encode(text))
    for _ in range(50):
        ids = [rng.randrange(BYTE_VOCAB_SIZE) for _ in range(rng.randint(0, 80))]
        assert hf.decode(ids, skip_special_tokens=True) == byte.decode(ids)
        assert hf.batch_decode([ids], skip_special_tokens=True) == [byte.decode(ids)]


def old_embedded_folder(home: Path) -> Path:
    """An embedded folder as an older version wrote it: no tokenizer_config.json and a
    tokenizer.json that decoded to UTF-8 (stand-in weights: only the bytes matter here)."""
    folder = home / "models" / "tiny-llama"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"hicache_embedded": "tiny-llama"}')
    (folder / "model.safetensors").write_bytes(b"weights stand-in")
    (folder / "tokenizer.json").write_text('{"old": true}')
    return folder


def test_an_older_embedded_folder_gets_current_tokenizer_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHE_HOME", str(tmp_path))
    folder = old_embedded_folder(tmp_path)
    kept = {name: (folder / name).read_bytes() for name in ("config.json", "model.safetensors")}
    assert resolve_model_path(EMBEDDED_TINY_LLAMA) == folder
    for name, text in embedded_tokenizer_files().items():
        assert (folder / name).read_text(encoding="utf-8") == text
    assert {name: (folder / name).read_bytes() for name in kept} == kept  # page keys intact
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    stamp = (folder / "tokenizer.json").stat().st_mtime_ns
    resolve_model_path(EMBEDDED_TINY_LLAMA)  # up to date: nothing rewritten
    assert (folder / "tokenizer.json").stat().st_mtime_ns == stamp


def test_an_unwritable_embedded_folder_still_resolves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("HICACHE_HOME", str(tmp_path))
    folder = old_embedded_folder(tmp_path)

    def read_only(path: Path, text: str) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(loader, "_replace_text", read_only)
    assert resolve_model_path(EMBEDDED_TINY_LLAMA) == folder
    assert (folder / "tokenizer.json").read_text() == '{"old": true}'
    assert "cannot update" in caplog.text and "tokenizer_config.json" in caplog.text


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


def test_special_tokens_are_kept_when_asked() -> None:
    """`skip_special_tokens=False` writes a special id as its token string, in both
    tokenizers; by default it is dropped."""
    from hicache_server.tokenizer import EOS_ID, SPECIAL_TOKENS, ByteTokenizer

    tok = ByteTokenizer()
    assert tok.decode([72, 105, EOS_ID]) == "Hi"
    assert tok.decode([72, 105, EOS_ID], skip_special_tokens=False) == "Hi" + SPECIAL_TOKENS[1]
