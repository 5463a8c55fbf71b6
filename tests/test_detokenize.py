"""Incremental detokenization (`hicache_server.scheduler.text`): fed one token at a time, a
request's text deltas joined are the whole output decoded at once, cut at the first stop
string (or not, with `no_stop_trim`), over the tokenizers the tests use: the embedded
model's bytes (`ByteTokenizer`, and its tokenizer.json read by `tokenizers`), and SmolLM2's
real byte-level BPE, whose multi-byte characters are split across tokens (their prefixes
decode to U+FFFD). The reference is the former rule: the whole output decoded again at
every token. And `Request.ids_between`, what a decode step reads of the ids instead of the
whole `all_ids`."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_server.models.loader import resolve_model
from hicache_server.models.named import DEFAULT_MODEL
from hicache_server.request import Request, RequestInput, SamplingParams
from hicache_server.scheduler.text import REPLACEMENT_CHAR, OutputText
from hicache_server.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    byte_tokenizer_json,
    load_tokenizer,
)

# Text that splits into multi-byte pieces: accents, CJK, emoji (4 bytes), a combining mark.
SAMPLES = ("héllo wörld", "日本語のテキスト", "emoji 😀🎉 end", "a\u0301b", "mixed: ĉu 中 😀!")
STOPS = ("ö", "本語", "😀", "lo", "!", "\n", "end")


@pytest.fixture(scope="module", params=["bytes", "hf-bytes", "smollm2"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> Tokenizer:
    if request.param == "bytes":
        return ByteTokenizer()
    if request.param == "hf-bytes":
        path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
        path.write_text(byte_tokenizer_json())
        return HFTokenizer(path, eos_token_ids=[257])
    return load_tokenizer(resolve_model(DEFAULT_MODEL).folder)


class Ending(NamedTuple):
    text: str
    reason: str | None
    tokens: int  # output tokens when it ended


def incremental(tok: Tokenizer, ids: list[int], params: SamplingParams) -> Ending:
    """Feed `ids` one at a time as the scheduler does; the deltas, joined."""
    req, text = Request(RequestInput([1], params)), OutputText(tok)
    pieces = []
    for token in ids:
        req.output.ids.append(token)
        reason = text.stop_reason(req, token)
        if reason is not None:
            req.output.finish_reason = reason
            break
        pieces.append(req.take_delta().text)
    else:
        reason = None
        text.flush(req)  # ended otherwise (an abort): the held text goes out
    pieces.append(req.take_delta().text)
    return Ending("".join(pieces), reason, len(req.output.ids))


def whole(tok: Tokenizer, ids: list[int], params: SamplingParams) -> Ending:
    """The former rule: decode everything at every token, look for a stop string in it."""
    skip = params.skip_special_tokens
    stop_ids = set() if params.ignore_eos else set(tok.eos_token_ids) | set(params.stop_token_ids)
    for n in range(1, len(ids) + 1):
        out = ids[:n]
        if n < params.min_new_tokens:
            continue
        if out[-1] in stop_ids:
            return Ending(tok.decode(out if params.no_stop_trim else out[:-1],
                                     skip_special_tokens=skip), "stop", n)
        text = tok.decode(out, skip_special_tokens=skip)
        floor = len(tok.decode(out[:params.min_new_tokens - 1])) if params.min_new_tokens > 1 else 0
        cuts = [i for i in (text.find(s, max(0, floor - len(s) + 1)) for s in params.stop)
                if i >= 0]
        if cuts:
            return Ending(text if params.no_stop_trim else text[:min(cuts)], "stop", n)
        if n >= params.max_new_tokens:
            return Ending(text, "length", n)
    return Ending(tok.decode(ids, skip_special_tokens=skip), None, len(ids))


def check(tok: Tokenizer, ids: list[int], params: SamplingParams) -> None:
    got, want = incremental(tok, ids, params), whole(tok, ids, params)
    assert (got.text, got.reason) == (want.text, want.reason)
    # a stop string just before an unfinished character is found once the character has
    # come (its text settles then): a token or three later, never earlier
    assert want.tokens <= got.tokens <= want.tokens + 3
    assert not got.text.endswith(REPLACEMENT_CHAR) or want.text.endswith(REPLACEMENT_CHAR)


def params_of(stop: tuple[str, ...], max_new: int, no_trim: bool) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, stop=stop, no_stop_trim=no_trim)


@settings(max_examples=150, deadline=None)
@given(texts=st.lists(st.text(max_size=12) | st.sampled_from(SAMPLES), min_size=1, max_size=4),
       noise=st.lists(st.integers(0, 255), max_size=6),
       stop=st.lists(st.sampled_from(STOPS) | st.text(min_size=1, max_size=3), max_size=3),
       no_trim=st.booleans(), max_new=st.integers(1, 200))
def test_deltas_join_to_the_whole_decode(tokenizer: Tokenizer, texts: list[str],
                                         noise: list[int], stop: list[str], no_trim: bool,
                                         max_new: int) -> None:
    ids = [t for text in texts for t in tokenizer.encode(text, add_special_tokens=False)]
    ids += noise  # stray bytes (ids 0..255): invalid UTF-8 for the byte-level ones
    check(tokenizer, ids, params_of(tuple(stop), max_new, no_trim))


@pytest.mark.parametrize("seed", range(40))
def test_seeded_cases_with_multi_byte_text_and_stops(tokenizer: Tokenizer, seed: int) -> None:
    import random

    rng = random.Random(seed)
    text = "".join(rng.choice(SAMPLES) + rng.choice(" \n.") for _ in range(rng.randint(1, 6)))
    ids = tokenizer.encode(text, add_special_tokens=False)
    stops = tuple(rng.sample(STOPS, rng.randint(0, 3)))
    for no_trim in (False, True):
        check(tokenizer, ids, params_of(stops, len(ids) + 1, no_trim))


def test_a_stop_string_spanning_two_deltas_is_found_and_never_sent() -> None:
    tok = ByteTokenizer()
    params = SamplingParams(max_new_tokens=50, stop=("STOP",))
    req, text = Request(RequestInput([1], params)), OutputText(tok)
    sent = []
    for token in tok.encode("abc STOP def"):
        req.output.ids.append(token)
        reason = text.stop_reason(req, token)
        sent.append(req.take_delta().text)
        if reason:
            break
    assert reason == "stop" and "".join(sent) == "abcĠ" and len(req.output.ids) == 8
    assert all("S" not in piece for piece in sent)  # held back until it could not be a stop


def test_min_new_tokens_ignores_a_stop_string_that_ends_before_it() -> None:
    tok = ByteTokenizer()
    params = SamplingParams(max_new_tokens=50, stop=("ab",), min_new_tokens=3)
    ids = tok.encode("abxab!")
    assert incremental(tok, ids, params) == Ending("abx", "stop", 5)
    assert whole(tok, ids, params) == Ending("abx", "stop", 5)


def test_a_stop_token_is_trimmed_unless_no_stop_trim(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(byte_tokenizer_json())
    tok = HFTokenizer(path, eos_token_ids=[257])
    ids = tok.encode("ok é", add_special_tokens=False) + [257, 65]
    for no_trim, skip in ((False, True), (True, True), (True, False), (False, False)):
        params = SamplingParams(max_new_tokens=20, no_stop_trim=no_trim,
                                skip_special_tokens=skip)
        got = incremental(tok, ids, params)
        assert got == whole(tok, ids, params)
        assert got.reason == "stop" and got.tokens == len(ids) - 1
        assert got.text.startswith("okĠé")
        assert got.text.endswith("<|eos|>") == (no_trim and not skip)


@given(prompt=st.lists(st.integers(0, 255), min_size=1, max_size=8),
       output=st.lists(st.integers(0, 255), max_size=8), start=st.integers(0, 16),
       length=st.integers(0, 16))
def test_ids_between_is_a_slice_of_all_ids(prompt: list[int], output: list[int], start: int,
                                           length: int) -> None:
    req = Request(RequestInput(prompt, SamplingParams()))
    req.output.ids.extend(output)
    assert req.ids_between(start, start + length) == req.all_ids[start:start + length]
