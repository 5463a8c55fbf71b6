"""Byte-level GGUF tokenizers split as their `tokenizer.ggml.pre` says (server/models/
gguf_tokenizer.py), against transformers reading the same file: Phi-4-mini's `gpt-4o`
(no real Phi-4-mini GGUF is reachable here, so a small file carries a BPE vocabulary trained
for the test and that pre).

The vocabulary is trained on whole lines, split at spaces only, so its merges cross every
boundary GPT-4o's regex draws (a contraction onto its word, digits past three, a capital
after a small letter, punctuation into letters, "/" after a newline): a tokenizer that
splits otherwise gives other ids. The same file is read by transformers' GGUF reader
(`AutoTokenizer.from_pretrained(folder, gguf_file=...)`, which splits with GPT-4o's
tokenizer.json regex) and by ours; ids and decoded text agree on fixed strings of every kind
and on seeded random ones. llama.cpp runs a rewrite of that regex (its engine has no
\\p{Lu}/\\p{Ll}); on ASCII the two split alike, and a test pins where they part.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import gguf
import pytest
from arch_reference import add_bpe_vocabulary, finish_gguf
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from hicache_server.models.gguf_tokenizer import (
    SUPPORTED_PRE_TOKENIZERS,
    tokenizer_config,
    tokenizer_json,
)
from hicache_server.tokenizer import HFTokenizer

transformers = pytest.importorskip("transformers")
SEED = 11
VOCAB_SIZE = 1200  # the 256 bytes and ~900 merges
CONTROL = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"]  # Phi-4-mini's turn marks
CORPUS = [
    "I don't think they're here. We've said it's John's and I'M SURE you'll see; she'd know.",
    "DON'T SHOUT. They'RE Here'S the plan: can't won't shouldn't o'clock rock'n'roll",
    "1234567890 3.14159 -42 1,000,000 2024-06-01 12:30:45 0x1F 1e-9 ٣٤٥٦ ①②③ 10/10 1/2",
    "HelloWorld camelCaseName XMLHttpRequest getHTTPResponse iPhone McDonald's ABCdef",
    "def square(x):\n    return x ** 2  # squared\n\nfor i in range(10):\n\tprint(i)\n",
    "path/to/file.txt https://example.com/a/b?c=d&e=f //comment /* block */ a//b\n/root",
    "日本語のテキストです。中文句子，还有标点！한국어 문장입니다. ไทย ภาษา",
    "emoji 🎉 😀👍🏽 👩‍👩‍👧 ❤️ ✨🚀 ok 👍👍👍",
    "café naïve résumé Ångström Ærøskøbing ÉTÉ été Éric àÉ ß œ ĳ e\u0301 n\u0303",
    "  two  spaces   three   \n\n\nnewlines\r\nwindows\r\n\ttab\t\tand\t end  ",
    "<html><body class=\"x\">Hi!</body></html> {\"key\": [1, 2, 3]} a+b=c; x->y",
]
TEXTS = [
    *CORPUS, "", " ", "a", "A", "   ", "\n", "\n\n", " \n ", "x \n", "\r\n\r\n",
    "don't", "DON'T", "Don'T", "it's", "IT'S", "we'VE", "o'clock", "'s", "x's y'S", "'twas",
    "1", "12", "123", "1234", "12345678901", "a1b22c333d4444", "v1.2.3", "٣٤٥٦٧", "½ ⅓",
    "HelloWorld", "HELLOworld", "helloWORLD", "ÉtéÀ", "aÉb", "ǅemal", "ǅEMAL", "ᾈ ᾀ",
    "日本語", "中文，标点！", "한국어", "e\u0301\u0301", "\u0301abc", "🎉🎉", " 🎉", "a/b",
    "!!!/\n/", "...\n\n/", "  leading", "trailing  ", "a  b   c", "\t\t", "\u00a0nbsp\u00a0",
    "<|user|>Hi<|end|><|assistant|>", "x<|endoftext|>y",
]
# llama.cpp's llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_GPT4O: its rewrite of the tokenizer.json
# regex for an engine without \p{Lu}/\p{Ll} ("a capital" = a letter not a-z)
LLAMA_CPP_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
RANDOM_TEXTS = 300
RANDOM_ALPHABET = ("aAbBzZéÉßŁłΩωдД日本中한ไ0123456789٣①'\"/\\.,;:!?-_()[]{}<>@#$%^&*+=~`|"
                   " \t\n\r\u00a0🎉👍🏽\u0301\u200d")


def train_vocabulary() -> tuple[list[str], list[str]]:
    """(byte-level tokens, merges) of a BPE trained on CORPUS split at spaces only, the
    bytes first in GPT-2's order, then every merge's result."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r" "), behavior="merged_with_next"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    trained = tok.to_str()
    import json

    model = json.loads(trained)["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def write_file(path: Path, pre: str) -> dict[str, Any]:
    """A phi3 GGUF (Phi-4-mini's form) of the trained vocabulary with pre-tokenizer `pre`,
    Phi-4-mini's turn markers as control tokens; its metadata as hicache reads it."""
    tokens, merges = train_vocabulary()
    tokens += CONTROL
    types = [1] * (len(tokens) - len(CONTROL)) + [3] * len(CONTROL)
    w = gguf.GGUFWriter(str(path), "phi3")
    add_bpe_vocabulary(w, pre, (tokens, types), merges)
    w.add_bos_token_id(tokens.index(CONTROL[0]))
    w.add_eos_token_id(tokens.index(CONTROL[0]))
    w.add_add_bos_token(False)
    finish_gguf(w, path)
    return {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()
            if not k.startswith("GGUF.")}


@pytest.fixture(scope="module")
def gpt4o(tmp_path_factory: pytest.TempPathFactory) -> tuple[HFTokenizer, Any]:
    """(ours, transformers') tokenizer of the same gpt-4o file."""
    folder = tmp_path_factory.mktemp("gpt4o")
    path = folder / "tiny-phi4-mini.gguf"
    meta = write_file(path, "gpt-4o")
    # ours apart from the file: transformers would read a tokenizer.json beside it instead
    ours = tmp_path_factory.mktemp("ours") / "tokenizer.json"
    ours.write_text(tokenizer_json(meta, path), encoding="utf-8")
    assert tokenizer_config(meta)["add_bos_token"] is False
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=path.name)
    return HFTokenizer(ours), theirs


def random_texts() -> list[str]:
    rng = random.Random(SEED)
    return ["".join(rng.choice(RANDOM_ALPHABET) for _ in range(rng.randint(1, 40)))
            for _ in range(RANDOM_TEXTS)]


def assert_same(ours: HFTokenizer, theirs: Any, text: str) -> list[int]:
    ids = ours.encode(text)
    assert ids == theirs.encode(text), repr(text)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(
        ids, skip_special_tokens=False) == text, repr(text)
    return ids


def test_gpt4o_is_supported() -> None:
    assert "gpt-4o" in SUPPORTED_PRE_TOKENIZERS


def test_gpt4o_ids_and_text_match_transformers(gpt4o: tuple[HFTokenizer, Any]) -> None:
    ours, theirs = gpt4o
    merged = 0
    for text in TEXTS:
        ids = assert_same(ours, theirs, text)
        merged += len(text.encode("utf-8")) - len(ids)
    assert merged > 500  # the merges act: most of the text is not byte by byte


def test_gpt4o_random_text_matches_transformers(gpt4o: tuple[HFTokenizer, Any]) -> None:
    ours, theirs = gpt4o
    for text in random_texts():
        assert_same(ours, theirs, text)


def test_gpt4o_splits_where_its_regex_does(gpt4o: tuple[HFTokenizer, Any]) -> None:
    """The splits that set GPT-4o apart (each would merge whole under the spaces-only split
    the vocabulary was trained with): a contraction stays on its word, a capital after small
    letters starts a word, digits go in threes, "/" stays after a newline run's punctuation,
    a turn marker is one token."""
    ours, _ = gpt4o

    def pieces(text: str) -> list[str]:
        return [ours.decode([i], skip_special_tokens=False) for i in ours.encode(text)]
    assert "".join(pieces(" don't")) == " don't"
    assert not any(p.endswith("o") and p != "o" for p in pieces("helloWorld")[1:])
    assert all(len(p) <= 3 for p in pieces("1234567890"))
    assert pieces("<|user|>")[0] == "<|user|>" and len(ours.encode("<|user|>")) == 1
    ids = ours.encode("camelCaseName")
    words = [ours.decode(ids[:k]) for k in range(1, len(ids))]
    assert "camel" in words and "camelCase" in words  # a piece ends at each capital


def test_the_regex_is_llama_cpps_on_ascii_and_tokenizer_jsons_beyond() -> None:
    """llama.cpp's rewrite splits every ASCII text as the tokenizer.json regex does; past
    ASCII it calls any letter outside a-z a capital, so a small letter then an accented
    capital stays one piece there and splits here (and in transformers, and in the model's
    own tokenizer.json)."""
    from hicache_server.models.gguf_tokenizer import _SPLITS

    ours, cpp = (pre_tokenizers.Split(Regex(r), behavior="isolated")
                 for r in (_SPLITS["gpt-4o"], LLAMA_CPP_GPT4O))

    def split(pre: pre_tokenizers.Split, text: str) -> list[str]:
        return [piece for piece, _ in pre.pre_tokenize_str(text)]
    ascii_texts = [t for t in TEXTS + random_texts() if t.isascii()]
    assert len(ascii_texts) > 50
    for text in ascii_texts:
        assert split(ours, text) == split(cpp, text), repr(text)
    assert split(ours, "aÉb") == ["a", "Éb"] and split(cpp, "aÉb") == ["aÉb"]
