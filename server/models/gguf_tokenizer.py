"""tokenizer.json and tokenizer_config.json of a GGUF file's metadata, built with `tokenizers`:
byte-level BPE (`tokenizer.ggml.model` "gpt2": Llama 3, Qwen2, SmolLM, ...) split before the
merges as llama.cpp splits the file's `tokenizer.ggml.pre` (llama-vocab.cpp)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizerImpl

_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # llama.cpp's `llama_token_type`
# `tokenizer.ggml.pre` -> the split its merges were learned with (llama.cpp's llama-vocab.cpp;
# SmolLM's is the StarCoder tokenizer's: digits one by one, then GPT-2's byte-level regex).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT}
_IGNORE_MERGES = ("llama-bpe", "llama3", "llama-v3")  # Llama 3's tokenizer.json: whole words first
_BYTE_LEVEL_PRE = ("gpt2", "smollm", "starcoder")
SUPPORTED_PRE_TOKENIZERS = (*_BYTE_LEVEL_PRE, *_SPLITS)


class GGUFError(ValueError):
    """A GGUF file this engine cannot serve; the message names the file and what was found."""


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens' text, whether a BOS is added, the chat
    template (`tokenizer.chat_template`) when the file has one."""
    tokens = meta.get("tokenizer.ggml.tokens") or []

    def text(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": text("bos"),
        "eos_token": text("eos"), "unk_token": text("unknown"), "pad_token": text("padding"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        config["chat_template"] = template
    return {k: v for k, v in config.items() if v is not None}


def tokenizer_json(meta: dict[str, Any], file: Path) -> str:
    """tokenizer.json of a byte-level BPE vocabulary (`tokenizer.ggml.model` "gpt2": Llama 3,
    Qwen2, SmolLM, ...) built with `tokenizers`; GGUFError for any other tokenizer."""
    # No `pre` (files written before mid-2024) is llama.cpp's "default": four regexes of its
    # own, not GPT-2's; refused rather than tokenized almost right.
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise GGUFError(f"{file}: tokenizer model {kind!r} is not supported; supported: gpt2 "
                        "(byte-level BPE)")
    if pre not in SUPPORTED_PRE_TOKENIZERS:
        raise GGUFError(f"{file}: pre-tokenizer {pre!r} is not supported; supported: "
                        f"{', '.join(SUPPORTED_PRE_TOKENIZERS)}")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise GGUFError(f"{file}: the metadata holds no vocabulary (tokenizer.ggml.tokens)")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = _HFTokenizerImpl(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                      ignore_merges=pre in _IGNORE_MERGES))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type") or [])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == _TOKEN_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == _TOKEN_USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], int(bos))])
    return tok.to_str(pretty=True)


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
