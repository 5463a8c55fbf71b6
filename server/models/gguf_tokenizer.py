r"""tokenizer.json and tokenizer_config.json of a GGUF file's metadata, built with `tokenizers`.

Two vocabularies (`tokenizer.ggml.model`):
- "gpt2": byte-level BPE (Llama 3, Qwen2, SmolLM, ...), split before the merges as llama.cpp
  splits the file's `tokenizer.ggml.pre` (llama-vocab.cpp).
- "llama": SentencePiece (Llama 2, Mistral, Gemma, ...): a space is written "\u2581" (with one
  put before the text when `add_space_prefix`), a character outside the vocabulary is spelled
  by its UTF-8 bytes' `<0xXX>` tokens, and pairs merge best-scored result first. The file
  holds no merges: they are every split of a token into two tokens, ranked by the whole
  token's score, as transformers' GGUF converter ranks them.
Control tokens become special tokens, user-defined ones added tokens: both are matched whole
in the text, before any splitting, as llama.cpp matches them (Gemma's whitespace runs "  ",
"\t\t" and newlines "\n\n" are user-defined).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizerImpl

# llama.cpp's `llama_token_type`: the unknown token (Llama 2's <unk>) and control tokens are
# matched whole as special tokens, user-defined ones as added tokens.
_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 2, 3, 4
_SPECIAL_TYPES = (_TOKEN_UNKNOWN, _TOKEN_CONTROL)
_SPACE = "\u2581"  # SentencePiece's visible space
# `tokenizer.ggml.pre` -> the split its merges were learned with (llama.cpp's llama-vocab.cpp;
# SmolLM's is the StarCoder tokenizer's: digits one by one, then GPT-2's byte-level regex).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-4o's (o200k; Phi-4-mini's tokenizer.json, which transformers' GGUF reader uses too): a
# word is its capitals then its small letters (CJK, marks count as both), a contraction kept
# on it, digits in threes, "/" kept after punctuation. llama.cpp runs a rewrite without
# \p{Lu}/\p{Ll} (its regex engine lacks them) that splits a few non-ASCII words otherwise.
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "gpt-4o": _GPT4O_SPLIT}
_IGNORE_MERGES = ("llama-bpe", "llama3", "llama-v3")  # Llama 3's tokenizer.json: whole words first
_BYTE_LEVEL_PRE = ("gpt2", "smollm", "starcoder")
SUPPORTED_PRE_TOKENIZERS = (*_BYTE_LEVEL_PRE, *_SPLITS)
SUPPORTED_TOKENIZERS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}
# Gemma 3's chat format, for a file that carries no template (google/gemma-3-*-it's
# tokenizer_config.json renders the same text for text messages): BOS, then each turn as
# <start_of_turn>ROLE\n...<end_of_turn>\n with the assistant's role written `model`; Gemma has
# no system turn, so a system message's text and a blank line open the first turn. Contents
# are trimmed as Gemma's template trims them: an answer with leading or trailing whitespace
# is not a prefix of the next turn's prompt (chat_template.py, prefix stability).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set turns = messages -%}{%- set opening = '' -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set turns = messages[1:] -%}{%- set opening = messages[0]['content'] + '\\n\\n' -%}"
    "{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Gemma wants turns that alternate user, assistant, user, ... after "
    "an optional system message') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (opening if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
# Gemma 2's own: Gemma 3's turns, but a system message is refused (its official template
# raises "System role not supported").
GEMMA2_CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{ raise_exception('System role not supported') }}{%- endif -%}" + GEMMA3_CHAT_TEMPLATE)
# `general.architecture` -> the chat template of a file that carries none.
ARCHITECTURE_CHAT_TEMPLATES = {"gemma3": GEMMA3_CHAT_TEMPLATE, "gemma2": GEMMA2_CHAT_TEMPLATE}


class GGUFError(ValueError):
    """A GGUF file this engine cannot serve; the message names the file and what was found."""


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens' text, whether a BOS is added, the chat
    template: the file's (`tokenizer.chat_template`), else its architecture's own when this
    module knows one (`ARCHITECTURE_CHAT_TEMPLATES`)."""
    tokens = meta.get("tokenizer.ggml.tokens") or []

    def text(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": text("bos"),
        "eos_token": text("eos"), "unk_token": text("unknown"), "pad_token": text("padding"),
        "add_bos_token": _adds_bos(meta), "clean_up_tokenization_spaces": False,
    }
    template = meta.get("tokenizer.chat_template")
    if not (isinstance(template, str) and template):
        template = ARCHITECTURE_CHAT_TEMPLATES.get(meta.get("general.architecture"))
    config["chat_template"] = template
    return {k: v for k, v in config.items() if v is not None}


def _adds_bos(meta: dict[str, Any]) -> bool:
    """`tokenizer.ggml.add_bos_token`; when absent llama.cpp adds one to a SentencePiece
    vocabulary (llama-vocab.cpp's default), not to a byte-level one."""
    default = meta.get("tokenizer.ggml.model") == "llama"
    return bool(meta.get("tokenizer.ggml.add_bos_token", default))


def tokenizer_json(meta: dict[str, Any], file: Path) -> str:
    """tokenizer.json of the file's vocabulary (one of SUPPORTED_TOKENIZERS) built with
    `tokenizers`; GGUFError for any other tokenizer."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZERS:
        raise GGUFError(f"{file}: tokenizer model {kind!r} is not supported; supported: "
                        + ", ".join(f"{k} ({what})" for k, what in SUPPORTED_TOKENIZERS.items()))
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise GGUFError(f"{file}: the metadata holds no vocabulary (tokenizer.ggml.tokens)")
    types = list(meta.get("tokenizer.ggml.token_type") or [])
    tok = (_byte_level_bpe(meta, tokens, file) if kind == "gpt2"
           else _sentencepiece_bpe(meta, tokens))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind in _SPECIAL_TYPES])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == _TOKEN_USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if _adds_bos(meta) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], int(bos))])
    return tok.to_str(pretty=True)


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str], file: Path) -> _HFTokenizerImpl:
    """GPT-2's byte-level BPE over the file's merges, split first as `pre` says."""
    # No `pre` (files written before mid-2024) is llama.cpp's "default": four regexes of its
    # own, not GPT-2's; refused rather than tokenized almost right.
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in SUPPORTED_PRE_TOKENIZERS:
        raise GGUFError(f"{file}: pre-tokenizer {pre!r} is not supported; supported: "
                        f"{', '.join(SUPPORTED_PRE_TOKENIZERS)}")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = _HFTokenizerImpl(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                      ignore_merges=pre in _IGNORE_MERGES))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str]) -> _HFTokenizerImpl:
    """SentencePiece's BPE with byte fallback: spaces as "\u2581", one put first when the file
    says `add_space_prefix` (llama.cpp's default: yes)."""
    # No scores: a SentencePiece vocabulary is stored best first.
    scores = meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
    merges = ([tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
              if meta.get("tokenizer.ggml.merges") else _sentencepiece_merges(tokens, scores))
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = _HFTokenizerImpl(models.BPE(
        vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=True,
        byte_fallback=True, unk_token=tokens[unk] if unk is not None else None))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # split=False: the whole text is one word; SentencePiece merges across spaces.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPACE, prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best first: the whole token's score, then the
    longer left part, the longer right part, the token's first place in the file (the order
    transformers' converter gives, so the two tokenize alike). A token listed twice keeps
    its first place and its last score."""
    score: dict[str, float] = {}
    for token, value in zip(tokens, scores):
        score[token] = float(value)
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for place, (token, value) in enumerate(score.items()):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in score and right in score:
                ranked.append((-value, -cut, cut - len(token), place, left, right))
    ranked.sort()  # the four numbers differ between any two entries: no string is compared
    return [(left, right) for *_, left, right in ranked]


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The split of `pre` (one of SUPPORTED_PRE_TOKENIZERS), then GPT-2's bytes."""
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        byte_level])
    return byte_level
