"""SentencePiece GGUF tokenizers (server/models/gguf_tokenizer.py) and Gemma 3's chat format.

Gemma 3 270M's own file (the named model `gemma3-270m`, through its companion folder) against
transformers reading the same file: the same ids for every kind of text, the same text back,
its turn markers as single special tokens; the chat template the companion folder gets (the
file carries none) gives the ids of Gemma's official template through transformers'
`apply_chat_template`; the chat turn's end is an eos. A tiny Llama-style vocabulary checks
the space prefix both ways."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import gguf
import pytest
from conftest import missing_tool

from hicache_server.chat_template import ChatTemplateError, load_chat_template
from hicache_server.http.chat import chat_prompt_ids
from hicache_server.models.gguf_tokenizer import (
    GEMMA3_CHAT_TEMPLATE,
    GGUFError,
    tokenizer_config,
    tokenizer_json,
)
from hicache_server.models.loader import ModelSource, resolve_model
from hicache_server.models.named import named_model_file
from hicache_server.tokenizer import HFTokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")
SPACE = "\u2581"
GEMMA3 = "gemma3-270m"
BOS, EOS, START_OF_TURN, END_OF_TURN = 2, 1, 105, 106  # Gemma 3's ids
GEMMA_VOCAB = 262_144
TEXTS = [
    "Hello world", "The quick brown fox jumps over the lazy dog.", "a", "",
    " leading space", "trailing space ", "  two  spaces  inside  ", "     ", " ",
    "line one\nline two\n\n\nthree", "\n", "\r\n windows\r\n", "\ttab\t\tand\t", "\u00a0nbsp",
    "café naïve résumé Ångström Ærøskøbing", "ÿ ß œ ĳ", "日本語のテキスト", "中文 한국어 ไทย",
    "emoji 🎉 😀👍🏽 👩‍👩‍👧", "\x00\x01\x1f\x7f control bytes", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ 𓀀 \U0010fffd",
    "def square(x):\n    return x ** 2\n", "1234567890 3.14159 -42", "it's   the\n\n\nend",
    "<start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\n",
    "no space<start_of_turn>before", " <end_of_turn> spaced ", "<bos>twice<bos>", "<eos>",
    "[multimodal] <h1>title</h1>", "<unused0> and <mask>",
]
SPECIAL_TEXTS = [t for t in TEXTS if "<" in t and ">" in t]
# google/gemma-3-270m-it's tokenizer_config.json `chat_template` (the same in every Gemma 3
# instruction-tuned checkpoint), verbatim: the reference ours is checked against.
OFFICIAL_GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are a pirate."},
     {"role": "user", "content": "Where is the treasure?"}],
    [{"role": "system", "content": "Answer in one word."},
     {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris"},
     {"role": "user", "content": "And of Italy?"}],
    [{"role": "user", "content": "  What is 2+2?\n"},
     {"role": "assistant", "content": "4 "},
     {"role": "user", "content": "And 3 + 3? 😀\n\nShow   your work."}],
]


def read_metadata(path: Path) -> dict[str, Any]:
    return {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()
            if not k.startswith("GGUF.")}


@pytest.fixture(scope="module")
def gemma_source() -> ModelSource:
    """The named model's file and its companion folder (tokenizer, template, generation
    config), written under the session's HICACHE_HOME."""
    try:
        return resolve_model(GEMMA3)
    except FileNotFoundError as e:
        missing_tool(str(e))


@pytest.fixture(scope="module")
def gemma_file(gemma_source: ModelSource) -> Path:
    assert gemma_source.gguf is not None and gemma_source.gguf == named_model_file(GEMMA3)
    return gemma_source.gguf


@pytest.fixture(scope="module")
def gemma_folder(gemma_source: ModelSource) -> Path:
    return gemma_source.folder


@pytest.fixture(scope="module")
def ours(gemma_folder: Path) -> HFTokenizer:
    tok = load_tokenizer(gemma_folder)
    assert isinstance(tok, HFTokenizer)
    return tok


@pytest.fixture(scope="module")
def theirs(gemma_file: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(gemma_file.parent),
                                                      gguf_file=gemma_file.name)


@pytest.mark.parametrize("text", TEXTS)
def test_gemma_ids_and_text_match_transformers(ours: HFTokenizer, theirs: Any,
                                               text: str) -> None:
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ids[0] == BOS  # add_bos_token
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(
        text, add_special_tokens=False) == ids[1:]
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(
        ids, skip_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    if text not in SPECIAL_TEXTS:  # no prefix, byte fallback: every text comes back whole
        assert ours.decode(ids) == text


def test_gemma_random_text_matches_transformers(ours: HFTokenizer, theirs: Any) -> None:
    rng = random.Random(3)
    ranges = [(0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x2FF), (0x4E00, 0x4FFF), (0xAC00, 0xACFF),
              (0x1F300, 0x1F64F), (0x10000, 0x10FFF), (0xE000, 0xE0FF)]
    for _ in range(200):
        text = "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(1, 48)))
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == text


def test_gemma_turn_markers_are_single_special_tokens(ours: HFTokenizer) -> None:
    assert ours.encode("<start_of_turn>", add_special_tokens=False) == [START_OF_TURN]
    assert ours.encode("<end_of_turn>", add_special_tokens=False) == [END_OF_TURN]
    assert ours.encode("x<end_of_turn>\n<start_of_turn>model", add_special_tokens=False)[1:3] \
        == [END_OF_TURN, ours.token_to_id("\n")]
    assert ours.decode([START_OF_TURN, END_OF_TURN]) == ""  # special: skipped
    assert ours.vocab_size == GEMMA_VOCAB  # every special is one of the file's own ids
    # Whitespace runs are user-defined tokens, matched whole: "  " is 138, "\t\t" 255969.
    assert ours.encode("a  b\t\tc", add_special_tokens=False)[1:4:2] == [138, 255969]


def test_gemma_companion_files(gemma_folder: Path, ours: HFTokenizer) -> None:
    config = json.loads((gemma_folder / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"],
            config["unk_token"]) == ("<bos>", "<eos>", "<pad>", "<unk>")
    assert config["add_bos_token"] is True
    assert config["chat_template"] == GEMMA3_CHAT_TEMPLATE  # the file carries none
    assert ours.bos_token_id == BOS
    # Greedy chats stop at the end of the turn, as Gemma's generation_config.json says.
    assert ours.eos_token_ids == {EOS, END_OF_TURN}


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=lambda m: f"{len(m)}-messages")
def test_gemma_chat_prompt_is_the_official_templates(gemma_folder: Path, ours: HFTokenizer,
                                                     theirs: Any,
                                                     messages: list[dict[str, str]]) -> None:
    ids = chat_prompt_ids(load_chat_template(gemma_folder), ours, messages)
    expected = theirs.apply_chat_template(messages, chat_template=OFFICIAL_GEMMA3_TEMPLATE,
                                          add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
    assert ids == list(expected)
    assert ids[:2] == [BOS, START_OF_TURN] and ids[-3:-1] == [START_OF_TURN, ours.token_to_id(
        "model")]
    text = load_chat_template(gemma_folder).render(messages, add_generation_prompt=False)
    assert text == theirs.apply_chat_template(messages, chat_template=OFFICIAL_GEMMA3_TEMPLATE,
                                              tokenize=False)


def test_gemma_template_folds_the_system_message(gemma_folder: Path) -> None:
    template = load_chat_template(gemma_folder)
    assert template.render(CONVERSATIONS[1]) == (
        "<bos><start_of_turn>user\nYou are a pirate.\n\nWhere is the treasure?<end_of_turn>\n"
        "<start_of_turn>model\n")
    with pytest.raises(ChatTemplateError, match="alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_a_files_own_template_wins_over_its_architectures() -> None:
    meta = {"general.architecture": "gemma3", "tokenizer.ggml.model": "llama",
            "tokenizer.chat_template": "{{ messages[0]['content'] }}"}
    assert tokenizer_config(meta)["chat_template"] == "{{ messages[0]['content'] }}"
    assert tokenizer_config({**meta, "tokenizer.chat_template": ""})["chat_template"] \
        == GEMMA3_CHAT_TEMPLATE
    assert "chat_template" not in tokenizer_config({"general.architecture": "llama"})


# A tiny Llama-style SentencePiece vocabulary: specials, the 256 byte tokens, pieces best first.
PIECES = [SPACE, "t", "h", "e", "a", "c", SPACE + "t", "th", "he", SPACE + "th", SPACE + "the",
          "at", SPACE + "c", "ca", SPACE + "ca", SPACE + "cat", SPACE * 2, "<user>", "<|turn|>"]
TINY_TOKENS = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *PIECES]
TINY_TYPES = [2, 3, 3, *[6] * 256, *[1] * (len(PIECES) - 2), 4, 3]
TINY_TEXTS = ["the cat", " the  cat ", "hello", "é ü", "<|turn|>the cat", "x<user>the", "\n", "",
              "<unk>the<s>"]


def tiny_spm(path: Path, add_space_prefix: bool) -> dict[str, Any]:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(TINY_TOKENS)
    w.add_token_types(TINY_TYPES)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(PIECES))])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return read_metadata(path)


def test_llama_style_space_prefix_matches_transformers(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    meta = tiny_spm(path, add_space_prefix=True)
    # ours in a folder of its own: transformers would read a tokenizer.json beside the file
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "tokenizer.json").write_text(tokenizer_json(meta, path),
                                                      encoding="utf-8")
    ours = HFTokenizer(tmp_path / "ours" / "tokenizer.json")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert tokenizer_config(meta)["add_bos_token"] is True  # llama.cpp's default for SPM
    for text in TINY_TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(
            ids, skip_special_tokens=False)
    assert ours.encode("the cat") == [1, 269, 274]  # <s> ▁the ▁cat
    assert ours.decode(ours.encode("é the")) == "é the"  # bytes back, the prefix stripped


def test_llama_style_without_space_prefix_prepends_nothing(tmp_path: Path) -> None:
    """transformers' converter always prepends; llama.cpp honours the file's flag, as here."""
    path = tmp_path / "tiny.gguf"
    meta = tiny_spm(path, add_space_prefix=False)
    (tmp_path / "tokenizer.json").write_text(tokenizer_json(meta, path), encoding="utf-8")
    ours = HFTokenizer(tmp_path / "tokenizer.json")
    # t h e ▁ c a t: th, then at, ▁c, ▁cat by score; "the" is no token
    assert ours.encode("the cat", add_special_tokens=False) == [266, 262, 274]
    assert ours.encode("é", add_special_tokens=False) == [3 + 0xC3, 3 + 0xA9]  # byte fallback
    assert ours.decode(ours.encode(" the  cat ")) == " the  cat "


def test_other_tokenizer_models_are_refused_by_name(tmp_path: Path) -> None:
    meta = {"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["<pad>"]}
    with pytest.raises(GGUFError, match=r"tokenizer model 't5' is not supported; supported: "
                                        r"gpt2 \(byte-level BPE\), llama \(SentencePiece\)"):
        tokenizer_json(meta, tmp_path / "t5.gguf")


def test_a_gemma2_file_without_a_template_gets_gemma2s_which_refuses_a_system_turn() -> None:
    from hicache_server.chat_template import ChatTemplate

    source = tokenizer_config({"general.architecture": "gemma2",
                               "tokenizer.ggml.model": "llama"})["chat_template"]
    template = ChatTemplate(source, bos_token="<bos>")
    assert template.render([{"role": "user", "content": "Hi"}]) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        template.render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
