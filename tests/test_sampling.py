"""Sampling features and logprobs in the engine, as SGLang defines them: stop token ids,
min_new_tokens, the three penalties, min_p, logit_bias, n (one prefill shared through the tree),
skip_special_tokens, no_stop_trim; logprobs of output and prompt tokens checked against
transformers' own forward of the embedded model; every field's validation; and greedy
answers with default parameters unchanged."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

import hicache_server.engine as engine_module
import hicache_server.scheduler.tokens as scheduler_module
from hicache_server.config import load_config
from hicache_server.engine import Engine
from hicache_server.request import InvalidRequest, SamplingParams
from hicache_server.sampling import LogitsShaper, sample_row
from hicache_server.tokenizer import EOS_ID

PAGE = 16
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
# |ours - transformers| on a float32 log-softmax: both run the same float32 math in a different
# order (paged attention, stacked projections); the logits agree to ~1e-5 (tests/test_model.py).
LOGPROB_ATOL = 2e-4
# A greedy choice is checked against transformers' logits only where its top two are further
# apart than the two forwards can differ (the embedded model's logits are nearly flat).
ARGMAX_MARGIN = 1e-3
FORCED = 65  # "A": the token a +100 logit_bias forces
HF_SPECIALS = {256: "<|bos|>", 257: "<|eos|>", 258: "<|pad|>", 259: "<|unk|>"}


def prompt(n: int, seed: int) -> list[int]:
    """A prompt of `n` byte tokens no other test shares (so cache hits are this test's own)."""
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    cfg = load_config(None, {"cache.page_size": PAGE, "cache.max_total_tokens": 2048,
                             "model.device": "cpu"})
    with Engine(cfg) as e:
        yield e


@pytest.fixture(scope="module")
def hf(engine: Engine) -> Any:
    import transformers  # the `test` extra

    return transformers.LlamaForCausalLM.from_pretrained(
        str(engine.loaded.path), dtype=torch.float32).eval()


def hf_logprobs(hf: Any, ids: Sequence[int]) -> torch.Tensor:
    """`[len(ids), vocab]` float32 log-softmax of transformers' logits (row p predicts p+1)."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([list(ids)])).logits[0].float(), dim=-1)


def assert_entry_matches(entry: list, ref_row: torch.Tensor, token: int) -> None:
    logprob, token_id, _ = entry
    assert token_id == token
    assert abs(logprob - float(ref_row[token])) <= LOGPROB_ATOL, (logprob, ref_row[token])


def assert_top_consistent(top: list, ref_row: torch.Tensor, k: int) -> None:
    """`top` holds the k most likely tokens of `ref_row`, most likely first."""
    values = [v for v, _, _ in top]
    assert len(top) == k and values == sorted(values, reverse=True)
    for v, t, _ in top:
        assert abs(v - float(ref_row[t])) <= LOGPROB_ATOL
    kth_next = ref_row.topk(k + 1).values[-1]  # nothing outside the list beats its last
    assert values[-1] >= float(kth_next) - LOGPROB_ATOL


def assert_healthy(engine: Engine) -> None:
    engine.flush_cache(("device",))
    engine.scheduler.call(engine.cache.tree.check_integrity).result()
    assert engine.cache.tree.protected_size() == 0
    alloc = engine.cache.device_pool.allocator
    assert alloc.available_size() == alloc.total_size()


# ------------------------------------------------------------------ logits, one row at a time


ROW = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]  # vocab of 6
PROMPT_IDS, OUTPUT_IDS = [0, 1], [3, 3, 4]


def shaped(output_ids: Sequence[int] = OUTPUT_IDS, stop_ids: Sequence[int] = (),
           **params: Any) -> list[float]:
    shaper = LogitsShaper(SamplingParams(**params), PROMPT_IDS, stop_ids, len(ROW),
                          torch.device("cpu"))
    row = torch.tensor(ROW)
    shaper.apply(row, list(output_ids))
    return row.tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    # seen: prompt {0, 1} and output {3, 4}; 2 and 5 were never seen
    assert shaped(repetition_penalty=2.0) == [1.0, -2.0, 0.5, 1.5, -4.0, 1.0]
    assert shaped(repetition_penalty=0.5) == [4.0, -0.5, 0.5, 6.0, -1.0, 1.0]


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    # output counts: token 3 twice, token 4 once; the prompt's tokens are not penalised
    assert shaped(frequency_penalty=0.5) == [2.0, -1.0, 0.5, 2.0, -2.5, 1.0]
    assert shaped(presence_penalty=0.75) == [2.0, -1.0, 0.5, 2.25, -2.75, 1.0]
    assert shaped(frequency_penalty=-1.0, presence_penalty=1.0) == [
        2.0, -1.0, 0.5, 4.0, -2.0, 1.0]


def test_logit_bias_and_the_min_new_tokens_mask_come_before_the_penalties() -> None:
    row = shaped(logit_bias=((2, 5.0), (4, 1.0)), repetition_penalty=2.0)
    assert row == [1.0, -2.0, 5.5, 1.5, -2.0, 1.0]  # 4: (-2 + 1) * 2
    masked = shaped(stop_ids=[5], min_new_tokens=4)
    assert masked[5] == -math.inf and masked[:5] == ROW[:5]
    assert shaped(stop_ids=[5], min_new_tokens=3) == ROW  # three tokens out: no mask


def test_token_counts_grow_with_each_step_only_by_the_new_tokens() -> None:
    shaper = LogitsShaper(SamplingParams(frequency_penalty=1.0), PROMPT_IDS, (), len(ROW),
                          torch.device("cpu"))
    for upto in range(1, len(OUTPUT_IDS) + 1):
        row = torch.tensor(ROW)
        shaper.apply(row, OUTPUT_IDS[:upto])
    assert shaper.counts.tolist() == [0.0, 0.0, 0.0, 2.0, 1.0, 0.0]
    assert row.tolist() == shaped(frequency_penalty=1.0)


def test_min_p_drops_tokens_below_its_share_of_the_top_one() -> None:
    row = torch.tensor([0.5, 0.3, 0.1, 0.1]).log()
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, min_p=0.5)  # keeps p >= 0.25: tokens 0 and 1
    drawn = {sample_row(row, params, gen) for _ in range(200)}
    assert drawn == {0, 1}
    assert {sample_row(row, SamplingParams(min_p=1.0), gen) for _ in range(50)} == {0}


# --------------------------------------------------------------------- fields, end to end


def test_stop_token_ids_stop_and_their_text_is_kept_only_with_no_stop_trim(
        engine: Engine) -> None:
    ids = prompt(40, 1)
    base = {"temperature": 0, "max_new_tokens": 12}
    full = engine.generate(input_ids=ids, sampling_params=base)["output_ids"]
    at = next(i for i in range(1, len(full)) if full[i] not in full[:i])
    stop = {**base, "stop_token_ids": [full[at]]}
    cut = engine.generate(input_ids=ids, sampling_params=stop)
    assert cut["output_ids"] == full[:at + 1]
    assert cut["meta_info"]["finish_reason"] == "stop"
    assert cut["text"] == engine.tokenizer.decode(full[:at])
    kept = engine.generate(input_ids=ids, sampling_params={**stop, "no_stop_trim": True})
    assert kept["text"] == engine.tokenizer.decode(full[:at + 1])
    ignored = engine.generate(input_ids=ids, sampling_params={**stop, "ignore_eos": True})
    assert len(ignored["output_ids"]) == base["max_new_tokens"]  # SGLang: ignore_eos
    assert ignored["output_ids"][:len(full)] == full  # ignores stop_token_ids too


def test_a_huge_logit_bias_forces_a_token_greedy_and_sampled(engine: Engine) -> None:
    bias = {"logit_bias": {str(FORCED): 100}}
    for params in ({**GREEDY, **bias}, {**GREEDY, **bias, "temperature": 1.0, "seed": 1}):
        out = engine.generate(input_ids=prompt(30, 2), sampling_params=params)
        assert out["output_ids"] == [FORCED] * GREEDY["max_new_tokens"]


def test_min_new_tokens_holds_back_eos_then_lets_it_stop(engine: Engine) -> None:
    eos_first = {"temperature": 0, "max_new_tokens": 10, "logit_bias": {EOS_ID: 100}}
    early = engine.generate(input_ids=prompt(30, 3), sampling_params=eos_first)
    assert early["output_ids"] == [EOS_ID] and early["meta_info"]["finish_reason"] == "stop"
    late = engine.generate(input_ids=prompt(30, 3), sampling_params={
        **eos_first, "min_new_tokens": 5})
    assert late["meta_info"]["finish_reason"] == "stop"
    assert len(late["output_ids"]) == 6 and late["output_ids"][-1] == EOS_ID
    assert EOS_ID not in late["output_ids"][:5]


def test_min_new_tokens_also_holds_back_stop_strings(engine: Engine) -> None:
    forced = {**GREEDY, "logit_bias": {FORCED: 100}, "stop": "A"}  # every token is "A"
    early = engine.generate(input_ids=prompt(30, 4), sampling_params=forced)
    assert early["output_ids"] == [FORCED] and early["text"] == ""
    late = engine.generate(input_ids=prompt(30, 4), sampling_params={
        **forced, "min_new_tokens": 3})
    assert late["output_ids"] == [FORCED] * 3 and late["text"] == "AA"
    assert late["meta_info"]["finish_reason"] == "stop"
    kept = engine.generate(input_ids=prompt(30, 4), sampling_params={
        **forced, "min_new_tokens": 3, "no_stop_trim": True})
    assert kept["text"] == "AAA"


@pytest.mark.parametrize("penalty", [
    {"repetition_penalty": 1.8}, {"repetition_penalty": 0.6}, {"frequency_penalty": 2.0},
    {"presence_penalty": 2.0}, {"presence_penalty": -2.0, "frequency_penalty": 0.5},
])
def test_greedy_with_penalties_is_the_argmax_of_penalised_logits(
        engine: Engine, hf: Any, penalty: dict) -> None:
    """Each greedy token is the argmax of transformers' logits penalised by hand (formulas
    written out here, independently of `LogitsShaper`)."""
    ids = prompt(30, 5)
    params = {**GREEDY, "max_new_tokens": 12, **penalty}
    out = engine.generate(input_ids=ids, sampling_params=params)["output_ids"]
    plain = engine.generate(input_ids=ids, sampling_params={**params, **dict.fromkeys(
        penalty, 1.0 if "repetition_penalty" in penalty else 0.0)})["output_ids"]
    assert out != plain  # the penalty changed the answer
    with torch.no_grad():
        logits = hf(torch.tensor([ids + out])).logits[0].float()
    checked = 0
    for i, token in enumerate(out):
        row = logits[len(ids) - 1 + i].clone()
        counts = torch.bincount(torch.tensor(out[:i], dtype=torch.int64),
                                minlength=row.numel()).float()
        if "repetition_penalty" in penalty:
            p = penalty["repetition_penalty"]
            seen = counts > 0
            seen[torch.tensor(ids)] = True
            row = torch.where(seen, torch.where(row > 0, row / p, row * p), row)
        row -= penalty.get("frequency_penalty", 0.0) * counts
        row -= penalty.get("presence_penalty", 0.0) * (counts > 0).float()
        top2 = row.topk(2).values
        if top2[0] - top2[1] > ARGMAX_MARGIN:
            assert token == int(row.argmax()), f"token {i}"
            checked += 1
    assert checked >= len(out) // 2


def test_min_p_of_one_samples_the_greedy_answer(engine: Engine) -> None:
    ids = prompt(30, 6)
    greedy = engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
    sampled = engine.generate(input_ids=ids, sampling_params={
        **GREEDY, "temperature": 1.5, "min_p": 1.0, "seed": 9})["output_ids"]
    assert sampled == greedy


def test_n_greedy_choices_share_one_prefill(engine: Engine) -> None:
    ids = prompt(50, 7)
    results = engine.generate(input_ids=ids, sampling_params={**GREEDY, "n": 3})
    assert isinstance(results, list) and len(results) == 3
    assert len({tuple(r["output_ids"]) for r in results}) == 1
    cached = [r["meta_info"]["cached_tokens"] for r in results]
    assert cached == [0, 48, 48]  # the later two read the first one's 3 pages from L1
    assert len({r["meta_info"]["id"] for r in results}) == 3
    assert_healthy(engine)


def test_n_sampled_choices_are_seeded_seed_plus_i(engine: Engine) -> None:
    ids = prompt(40, 8)
    params = {**GREEDY, "temperature": 1.0, "seed": 11}
    choices = engine.generate(input_ids=ids, sampling_params={**params, "n": 3})
    alone = [engine.generate(input_ids=ids, sampling_params={**params, "seed": 11 + i})
             for i in range(3)]
    assert [c["output_ids"] for c in choices] == [a["output_ids"] for a in alone]
    assert len({tuple(c["output_ids"]) for c in choices}) == 3


def test_n_through_async_generate(engine: Engine) -> None:
    ids = prompt(40, 9)
    results = asyncio.run(engine.async_generate(input_ids=ids, sampling_params={
        **GREEDY, "n": 2}))
    assert [r["meta_info"]["cached_tokens"] for r in results] == [0, 32]
    assert results[0]["output_ids"] == results[1]["output_ids"]
    single = asyncio.run(engine.async_generate(input_ids=ids, sampling_params=GREEDY))
    assert isinstance(single, dict) and single["output_ids"] == results[0]["output_ids"]


def test_unseeded_choices_differ(engine: Engine) -> None:
    results = engine.generate(input_ids=prompt(30, 10), sampling_params={
        **GREEDY, "temperature": 1.0, "n": 3})
    assert len({tuple(r["output_ids"]) for r in results}) > 1


def test_skip_special_tokens(engine: Engine) -> None:
    params = {**GREEDY, "max_new_tokens": 3, "logit_bias": {EOS_ID: 100}}  # EOS, not a stop
    out = engine.generate(input_ids=prompt(30, 12), sampling_params=params)
    assert out["output_ids"] == [EOS_ID] * 3 and out["text"] == ""
    kept = engine.generate(input_ids=prompt(30, 12),
                           sampling_params={**params, "skip_special_tokens": False})
    assert kept["output_ids"] == [EOS_ID] * 3 and kept["text"] == "<|eos|>" * 3


# ------------------------------------------------------------------------------ logprobs


def test_output_logprobs_are_the_raw_models_log_softmax(engine: Engine, hf: Any) -> None:
    ids = prompt(40, 20)
    k = 5
    for params in (GREEDY, {**GREEDY, "temperature": 0.7, "seed": 3}):
        out = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True,
                              top_logprobs_num=k)
        meta, tokens = out["meta_info"], out["output_ids"]
        ref = hf_logprobs(hf, ids + tokens)
        assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []
        assert len(meta["output_token_logprobs"]) == len(tokens) == len(
            meta["output_top_logprobs"])
        for i, (entry, top) in enumerate(zip(meta["output_token_logprobs"],
                                             meta["output_top_logprobs"])):
            row = ref[len(ids) - 1 + i]  # before temperature: the model's own distribution
            assert_entry_matches(entry, row, tokens[i])
            assert_top_consistent(top, row, k)
            if params is GREEDY:  # the chosen token heads its own top list, same value
                assert top[0][:2] == entry[:2]
            assert entry[2] is None  # no text unless asked


def test_prompt_logprobs_from_the_first_token(engine: Engine, hf: Any) -> None:
    ids = prompt(37, 21)
    out = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 2},
                          return_logprob=True, logprob_start_len=0, top_logprobs_num=3,
                          return_text_in_logprobs=True)
    meta = out["meta_info"]
    ref = hf_logprobs(hf, ids)
    entries, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert len(entries) == len(tops) == len(ids)
    assert entries[0] == [None, ids[0], engine.tokenizer.decode([ids[0]])] and tops[0] is None
    for p in range(1, len(ids)):
        assert_entry_matches(entries[p], ref[p - 1], ids[p])
        assert_top_consistent(tops[p], ref[p - 1], 3)
        assert entries[p][2] == engine.tokenizer.decode([ids[p]])
    assert meta["cached_tokens"] == 0


def test_prompt_logprobs_cap_the_cache_hit(engine: Engine, hf: Any) -> None:
    """A cached prompt serves a prompt-logprob request only up to `logprob_start_len` (whole
    pages): the same request twice gives the same logprobs, and the tree stays whole."""
    ids = prompt(70, 22)
    engine.generate(input_ids=ids, sampling_params=GREEDY)  # 64 tokens now cached
    start = 20
    ref = hf_logprobs(hf, ids)
    runs = [engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True,
                            logprob_start_len=start) for _ in range(2)]
    for run in runs:
        meta = run["meta_info"]
        assert meta["cached_tokens"] == start // PAGE * PAGE  # 16 of the 64 cached
        entries = meta["input_token_logprobs"]
        assert len(entries) == len(ids) - start and entries[0] == [None, ids[start], None]
        for j, entry in enumerate(entries[1:], start + 1):
            assert_entry_matches(entry, ref[j - 1], ids[j])
        assert "input_top_logprobs" not in meta  # top lists only when asked, as SGLang
    assert runs[0]["meta_info"]["input_token_logprobs"] == runs[1]["meta_info"][
        "input_token_logprobs"]
    assert runs[0]["output_ids"] == runs[1]["output_ids"]
    last = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True,
                           logprob_start_len=len(ids) - 1)
    assert last["meta_info"]["input_token_logprobs"] == [[None, ids[-1], None]]
    assert last["meta_info"]["cached_tokens"] == 64
    assert_healthy(engine)


def test_prompt_logprobs_across_prefill_chunks(monkeypatch: pytest.MonkeyPatch,
                                                hf: Any) -> None:
    monkeypatch.setattr(engine_module, "MAX_BATCH_TOKENS", 24)  # a 100-token prompt: 5 chunks
    cfg = load_config(None, {"cache.page_size": PAGE, "cache.max_total_tokens": 1024,
                             "model.device": "cpu"})
    ids = prompt(100, 23)
    ref = hf_logprobs(hf, ids)
    with Engine(cfg) as e:
        meta = e.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 2},
                          return_logprob=True, logprob_start_len=30,
                          top_logprobs_num=2)["meta_info"]
    entries = meta["input_token_logprobs"]
    assert len(entries) == 70 and entries[0][0] is None
    for j, entry in enumerate(entries[1:], 31):
        assert_entry_matches(entry, ref[j - 1], ids[j])
    assert all(len(top) == 2 for top in meta["input_top_logprobs"][1:])


def test_without_return_logprob_meta_info_has_no_logprobs(engine: Engine) -> None:
    meta = engine.generate(input_ids=prompt(20, 24), sampling_params=GREEDY,
                           logprob_start_len=0, top_logprobs_num=3)["meta_info"]
    assert not [k for k in meta if "logprobs" in k]


def test_logprob_requests_batched_with_plain_ones_change_no_answer(engine: Engine) -> None:
    """Requests that shape logits or want logprobs, in the same batches as plain greedy ones,
    change neither the plain ones' tokens nor their own (against each run alone)."""
    ids = [prompt(45, 30 + i) for i in range(4)]
    kinds = [{}, {"return_logprob": True, "logprob_start_len": 3, "top_logprobs_num": 2},
             {"return_logprob": True}, {}]
    shaping = [{}, {}, {"presence_penalty": 1.0}, {"logit_bias": {7: 3.0}}]
    alone = [engine.generate(input_ids=ids[i], sampling_params={**GREEDY, **shaping[i]},
                             **kinds[i]) for i in range(4)]
    engine.flush_cache(("device",))

    async def together() -> list[dict]:
        return await asyncio.gather(*(engine.async_generate(
            input_ids=ids[i], sampling_params={**GREEDY, **shaping[i]}, **kinds[i])
            for i in range(4)))

    batched = asyncio.run(together())
    assert [r["output_ids"] for r in batched] == [r["output_ids"] for r in alone]
    for a, b in zip(alone, batched):
        for key in ("input_token_logprobs", "output_token_logprobs"):
            got, want = b["meta_info"].get(key, []), a["meta_info"].get(key, [])
            assert [e[1] for e in got] == [e[1] for e in want]
            assert all(x[0] == y[0] or abs(x[0] - y[0]) <= LOGPROB_ATOL
                       for x, y in zip(got, want))


# ------------------------------------------------------------- greedy defaults unchanged


def test_greedy_defaults_are_unchanged_by_the_new_fields(engine: Engine) -> None:
    """Every new field at its default, spelled out, gives the tokens of a request without
    them; and greedy decoding still matches transformers (tests/test_engine.py's check)."""
    from tests.test_engine import conversations

    ids = conversations()[1][0]
    defaults = {"stop_token_ids": [], "min_new_tokens": 0, "repetition_penalty": 1.0,
                "frequency_penalty": 0.0, "presence_penalty": 0.0, "min_p": 0.0,
                "logit_bias": {}, "n": 1, "skip_special_tokens": True, "no_stop_trim": False}
    plain = engine.generate(input_ids=ids, sampling_params=GREEDY)
    spelled = engine.generate(input_ids=ids, sampling_params={**GREEDY, **defaults},
                              return_logprob=False, logprob_start_len=-1)
    assert spelled["output_ids"] == plain["output_ids"] and spelled["text"] == plain["text"]
    assert SamplingParams.from_dict({**GREEDY, **defaults}) == SamplingParams.from_dict(GREEDY)


def test_greedy_defaults_still_match_transformers(engine: Engine, hf: Any) -> None:
    from tests.test_engine import conversations

    ids = list(conversations()[1][0])
    ours = engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
    with torch.no_grad():
        for _ in range(GREEDY["max_new_tokens"]):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    assert ours == ids[-GREEDY["max_new_tokens"]:]


# -------------------------------------------------------------------------- validation


@pytest.mark.parametrize("sampling, message", [
    ({"stop_token_ids": 5}, "stop_token_ids: expected a list"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids: expected a list"),
    ({"stop_token_ids": [1, 260]}, "stop_token_ids: token id 260 is outside"),
    ({"stop_token_ids": [-1]}, "stop_token_ids: token id -1 is outside"),
    ({"min_new_tokens": -1}, r"min_new_tokens: must be in \[0"),
    ({"min_new_tokens": 1.5}, "min_new_tokens: expected an integer"),
    ({"min_new_tokens": 9, "max_new_tokens": 8}, "min_new_tokens: must be <= max_new_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty: must be > 0"),
    ({"repetition_penalty": 2.5}, r"repetition_penalty: must be in \[0.0, 2.0\]"),
    ({"repetition_penalty": "1"}, "repetition_penalty: expected a number"),
    ({"frequency_penalty": 2.01}, r"frequency_penalty: must be in \[-2.0, 2.0\]"),
    ({"frequency_penalty": math.nan}, "frequency_penalty: must be in"),
    ({"presence_penalty": -3}, r"presence_penalty: must be in \[-2.0, 2.0\]"),
    ({"presence_penalty": True}, "presence_penalty: expected a number"),
    ({"min_p": 1.5}, r"min_p: must be in \[0.0, 1.0\]"),
    ({"min_p": -0.1}, "min_p: must be in"),
    ({"logit_bias": [1, 2]}, "logit_bias: expected an object"),
    ({"logit_bias": {"x": 1}}, "logit_bias: key 'x' is not a token id"),
    ({"logit_bias": {"1": 101}}, r"logit_bias\[1\]: must be in \[-100.0, 100.0\]"),
    ({"logit_bias": {"1": "up"}}, r"logit_bias\[1\]: expected a number"),
    ({"logit_bias": {"300": 1}}, "logit_bias: token id 300 is outside"),
    ({"n": 0}, r"n: must be in \[1, 128\]"),
    ({"n": 129}, r"n: must be in \[1, 128\]"),
    ({"n": "2"}, "n: expected an integer"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens: expected a boolean"),
    ({"no_stop_trim": 1}, "no_stop_trim: expected a boolean"),
])
def test_bad_sampling_fields_are_refused_naming_the_field(engine: Engine, sampling: dict,
                                                          message: str) -> None:
    with pytest.raises(InvalidRequest, match=f"sampling_params.{message}"):
        engine.generate(input_ids=[1, 2, 3], sampling_params=sampling)


@pytest.mark.parametrize("options, message", [
    ({"return_logprob": "yes"}, "`return_logprob` must be a boolean"),
    ({"return_text_in_logprobs": 1}, "`return_text_in_logprobs` must be a boolean"),
    ({"logprob_start_len": "0"}, "`logprob_start_len` must be an integer"),
    ({"logprob_start_len": -2}, r"`logprob_start_len` must be -1 .* \[0, 2\]; got -2"),
    ({"logprob_start_len": 3}, r"3-token prompt, in \[0, 2\]; got 3"),
    ({"top_logprobs_num": -1}, r"`top_logprobs_num` must be in \[0, 20\]"),
    ({"top_logprobs_num": 21}, r"`top_logprobs_num` must be in \[0, 20\], got 21"),
    ({"top_logprobs_num": 1.0}, "`top_logprobs_num` must be an integer"),
])
def test_bad_logprob_options_are_refused(engine: Engine, options: dict, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, **{
            "return_logprob": True, **options})


def test_make_request_takes_one_choice_make_requests_several(engine: Engine) -> None:
    with pytest.raises(InvalidRequest, match="n = 2"):
        engine.make_request(input_ids=[1, 2, 3], sampling_params={"n": 2})
    reqs = engine.make_requests(input_ids=[1, 2, 3], sampling_params={"n": 3, "seed": 5},
                                return_logprob=True)
    assert [r.input.params.seed for r in reqs] == [5, 6, 7]
    assert [r.prompt_leader for r in reqs] == [None, reqs[0], reqs[0]]
    assert all(r.input.return_logprob for r in reqs)


def test_an_unknown_option_is_a_type_error_naming_it(engine: Engine) -> None:
    """The options beside the prompt are `GenerateOptions`' fields: any other keyword is
    refused as Python refuses a keyword a function does not take, with the options listed."""
    for call in (engine.make_request, engine.make_requests, engine.generate):
        with pytest.raises(TypeError, match=r"unexpected keyword argument 'return_logprobs'"
                                            r".*return_logprob,"):
            call(input_ids=[1, 2, 3], return_logprobs=True)
    with pytest.raises(InvalidRequest, match="`top_logprobs_num` must be an integer"):
        engine.make_request(input_ids=[1, 2, 3], top_logprobs_num="3")


# ------------------------------------------------------------------- one request's fault


def test_a_fault_while_shaping_or_reading_logprobs_fails_only_that_request(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    real_apply = LogitsShaper.apply

    def apply(self: LogitsShaper, row: torch.Tensor, output_ids: Sequence[int]) -> None:
        if self.params.seed == 666:
            raise RuntimeError("injected shaping fault")
        real_apply(self, row, output_ids)

    def broken_logprobs(*args: Any) -> Any:
        raise RuntimeError("injected logprob fault")

    monkeypatch.setattr(LogitsShaper, "apply", apply)
    ids = prompt(30, 40)
    expected = engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]

    async def mixed() -> list[dict]:
        return await asyncio.gather(
            engine.async_generate(input_ids=ids, sampling_params=GREEDY),
            engine.async_generate(input_ids=ids, sampling_params={
                **GREEDY, "presence_penalty": 1.0, "seed": 666}),
            engine.async_generate(input_ids=ids, sampling_params=GREEDY,
                                  return_logprob=True))

    ok, shaped_bad, logprob_ok = asyncio.run(mixed())
    assert ok["output_ids"] == expected == logprob_ok["output_ids"]
    assert "injected shaping fault" in shaped_bad["meta_info"]["error"]
    monkeypatch.setattr(scheduler_module, "token_logprobs", broken_logprobs)

    async def logprobs_broken() -> list[dict]:
        return await asyncio.gather(
            engine.async_generate(input_ids=ids, sampling_params=GREEDY),
            engine.async_generate(input_ids=ids, sampling_params=GREEDY,
                                  return_logprob=True))

    ok, logprob_bad = asyncio.run(logprobs_broken())
    assert ok["output_ids"] == expected
    assert logprob_bad["meta_info"]["finish_reason"] == "error"
    assert "injected logprob fault" in logprob_bad["meta_info"]["error"]
    assert_healthy(engine)
