"""The fields real clients send, through the real app on loopback: the unknown-field policy,
the 400s for what the server cannot do, batches, `rid`, logprobs on both routes, `echo`, `n`
and `best_of`, stream chunks adding up to the plain answer (multi-byte
characters included), the usage options, and the openai SDK."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer
from conftest import app_client, small_engine
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizerImpl

from hicache_server.config import load_config
from hicache_server.engine import Engine
from hicache_server.http import create_app
from hicache_server.http.discovery import served_model_name
from hicache_server.models.loader import EMBEDDED_TINY_LLAMA, resolve_model_path
from hicache_server.request import MAX_TOP_LOGPROBS
from hicache_server.tokenizer import (
    EMBEDDED_MARKER_KEY,
    NUM_BYTES,
    SPECIAL_TOKENS,
    bytes_to_unicode,
)

GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPT = "The radix tree keeps every prefix once. "
CJK_IDS = list("缓存前缀树。".encode())  # a UTF-8 prompt of 3-byte characters
# After this prompt the seeded model answers two-byte characters (0xDA 0x85 is "څ") and
# bytes that end none: the case where a token completes no character yet.
ACCENTED_IDS = list("héllo wörld".encode())
OVERLAP_S = 0.05  # long enough for a request to be submitted, short against 24 tokens
LOGPROB_TOLERANCE = 1e-3  # a logit from a prefill vs from a decode step: float32 sums


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield from small_engine()


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[TestClient]:
    async with app_client(engine) as c:
        yield c


async def ok(client: TestClient, path: str, body: dict[str, Any]) -> Any:
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def assert_400(resp: ClientResponse, *words: str) -> str:
    assert resp.status == 400, await resp.text()
    message = (await resp.json())["error"]["message"]
    assert all(w in message for w in words), message
    return message


async def events(client: TestClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    resp = await client.post(path, json={**body, "stream": True})
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    blocks = (await resp.text()).split("\n\n")
    assert blocks[-2:] == ["data: [DONE]", ""]
    return [json.loads(b.removeprefix("data: ")) for b in blocks[:-2]]


def flat(lists: Iterable[list[Any]]) -> list[Any]:
    return list(itertools.chain.from_iterable(lists))


def completion(prompt: Any, max_tokens: int = 4, **fields: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, **GREEDY, **fields}


# ------------------------------------------------------------------------- field policy


async def test_unknown_fields_are_ignored_with_one_warning_each(
        client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    top, nested, option = (f"x_{uuid.uuid4().hex[:8]}" for _ in range(3))
    # greedy and past EOS: both requests answer 2 tokens whatever the weights' rounding
    body = {"text": PROMPT, top: 1, "sampling_params": {
        "max_new_tokens": 2, "temperature": 0, "ignore_eos": True, nested: True}}
    with caplog.at_level(logging.WARNING, logger="hicache_server.http.fields"):
        first = await ok(client, "/generate", body)
        again = await ok(client, "/generate", body)
        await ok(client, "/v1/completions", completion(PROMPT, 2, **{top: 1}, stream_options={
            option: 1}))
        await ok(client, "/v1/completions", completion(PROMPT, 2, stream_options={option: 1}))
    assert len(first["output_ids"]) == len(again["output_ids"]) == 2  # both served
    warned = [r.getMessage() for r in caplog.records if r.name == "hicache_server.http.fields"]
    for name in (top, f"sampling_params.{nested}", f"stream_options.{option}"):
        assert sum(f"`{name}`" in m for m in warned) == 1, (name, warned)


GENERATE_REFUSED = [
    ({"lora_path": "my-adapter"}, "lora_path"), ({"lora_path": ["a", None]}, "lora_path"),
    ({"return_routed_experts": True}, "return_routed_experts"),
    ({"return_hidden_states": True}, "return_hidden_states"),
    ({"image_data": "http://x/cat.png"}, "image_data"),
    ({"input_embeds": [[0.5, 0.5]]}, "input_embeds"),
    ({"sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
    ({"sampling_params": {"json_schema": "{}"}}, "sampling_params.json_schema"),
]
COMPLETION_REFUSED = [
    ({"suffix": "!"}, "suffix"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logprobs": MAX_TOP_LOGPROBS + 1}, "logprobs"), ({"logprobs": -1}, "logprobs"),
    ({"logprobs": True}, "logprobs"), ({"n": 2, "best_of": 1}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"), ({"lora_path": "a"}, "lora_path"),
    ({"use_beam_search": True}, "use_beam_search"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"guided_json": {"type": "object"}}, "guided_json"), ({"n": 0}, "n"),
    ({"logit_bias": {"token": 1}}, "logit_bias"), ({"logit_bias": {"65": 101}}, "logit_bias"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"min_tokens": -1}, "min_tokens"),
    ({"stop_token_ids": [999]}, "stop_token_ids"), ({"echo": "yes"}, "echo"),
]


@pytest.mark.parametrize(("fields", "name"), GENERATE_REFUSED)
async def test_generate_refuses_what_it_cannot_do(client: TestClient, fields: dict[str, Any],
                                                  name: str) -> None:
    await assert_400(await client.post("/generate", json={"text": "a", **fields}), f"`{name}`",
                     "allowed")


@pytest.mark.parametrize(("fields", "name"), COMPLETION_REFUSED)
async def test_completions_refuse_what_they_cannot_do(client: TestClient,
                                                      fields: dict[str, Any], name: str) -> None:
    message = await assert_400(await client.post("/v1/completions", json={
        "prompt": "a", **fields}), name)
    assert "sampling_params" not in message  # OpenAI's names


async def test_the_harmless_values_of_those_fields_are_served(client: TestClient) -> None:
    """What SGLang's and OpenAI's clients send by default."""
    await ok(client, "/generate", {
        "text": "a", "sampling_params": {"max_new_tokens": 1}, "lora_path": None,
        "return_routed_experts": False, "return_hidden_states": False, "image_data": None,
        "return_cached_tokens_details": True, "stream_options": {"include_usage": True},
        "logprob_start_len": -1, "return_logprob": False})
    await ok(client, "/v1/completions", completion("a", 1, suffix=None, best_of=1, user="u",
                                                   response_format={"type": "text"},
                                                   presence_penalty=0, seed=3, lora_path=""))


# ---------------------------------------------------------------------------- /generate


async def test_a_batch_answers_a_list_in_order(client: TestClient, engine: Engine) -> None:
    texts = [PROMPT, "abc" * 5, "zz"]
    params = {"max_new_tokens": 3, **GREEDY}
    alone = [await ok(client, "/generate", {"text": t, "sampling_params": params})
             for t in texts]
    batch = await ok(client, "/generate", {"text": texts, "sampling_params": params})
    assert [r["output_ids"] for r in batch] == [r["output_ids"] for r in alone]
    ids = [engine.tokenizer.encode(t) for t in texts]
    by_ids = await ok(client, "/generate", {"input_ids": ids, "sampling_params": [
        {**params, "max_new_tokens": k} for k in (1, 2, 3)]})
    assert [len(r["output_ids"]) for r in by_ids] == [1, 2, 3]
    assert [r["meta_info"]["prompt_tokens"] for r in by_ids] == [len(i) for i in ids]


async def test_rid_names_the_results(client: TestClient) -> None:
    params = {"max_new_tokens": 1}
    one = await ok(client, "/generate", {"text": "a", "rid": "mine", "sampling_params": params})
    assert one["meta_info"]["id"] == "mine"
    prefixed = await ok(client, "/generate", {"text": ["a", "b"], "rid": "job",
                                              "sampling_params": params})
    assert [r["meta_info"]["id"] for r in prefixed] == ["job_0", "job_1"]
    listed = await ok(client, "/generate", {"text": ["a", "b"], "rid": ["p", "q"],
                                            "sampling_params": params})
    assert [r["meta_info"]["id"] for r in listed] == ["p", "q"]
    samples = await ok(client, "/generate", {"text": "a", "rid": "s",
                                             "sampling_params": {**params, "n": 2}})
    assert [r["meta_info"]["id"] for r in samples] == ["s_0", "s_1"]
    await assert_400(await client.post("/generate", json={"text": ["a", "b"], "rid": ["p"]}),
                     "`rid`", "one value per prompt")
    await assert_400(await client.post("/generate", json={"text": "a", "rid": 5}), "`rid`")


async def test_a_shared_rid_never_aborts_another_clients_request(client: TestClient) -> None:
    """Inside the engine each request keeps its own id: a client leaving aborts its own."""
    body = {"text": PROMPT, "rid": "same", "sampling_params": {"max_new_tokens": 24, **GREEDY}}
    leaving = await client.post("/generate", json={**body, "stream": True})
    await leaving.content.readuntil(b"\n\n")
    staying = asyncio.ensure_future(client.post("/generate", json=body))
    await asyncio.sleep(OVERLAP_S)  # both run now
    leaving.close()
    result = await (await staying).json()
    assert result["meta_info"]["id"] == "same" and result["meta_info"]["finish_reason"] == "length"
    assert result["meta_info"]["completion_tokens"] == 24


async def test_a_bad_prompt_in_a_batch_is_named(client: TestClient) -> None:
    await assert_400(await client.post("/generate", json={"input_ids": [[65], [999]]}),
                     "prompt 1 of the batch", "vocabulary")
    await assert_400(await client.post("/generate", json={"text": []}), "`text`")


async def test_a_streamed_batch_tags_each_event_with_its_index(client: TestClient) -> None:
    body = {"text": [PROMPT, "xyz"], "sampling_params": {"max_new_tokens": 3, **GREEDY}}
    plain = await ok(client, "/generate", body)
    streamed = await events(client, "/generate", body)
    assert sorted(e["index"] for e in streamed) == [0, 0, 0, 1, 1, 1]
    for i in (0, 1):
        last = [e for e in streamed if e["index"] == i][-1]
        assert last["text"] == plain[i]["text"] and last["output_ids"] == plain[i]["output_ids"]


async def test_generate_logprobs_shapes(client: TestClient, engine: Engine) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    out = await ok(client, "/generate", {
        "input_ids": ids, "sampling_params": {"max_new_tokens": 4, **GREEDY},
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3,
        "return_text_in_logprobs": True})
    meta = out["meta_info"]
    prompt, output = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert [e[1] for e in prompt] == ids and prompt[0][0] is None
    assert all(e[0] <= 0 for e in prompt[1:])
    assert [e[1] for e in output] == out["output_ids"]
    assert "".join(e[2] for e in output) == out["text"]
    for chosen, top in zip(output, meta["output_top_logprobs"]):
        assert len(top) == 3 and top[0][1] == chosen[1]  # greedy: the chosen is the top one
        assert math.isclose(top[0][0], chosen[0])
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(ids)


# ------------------------------------------------------------------------ /v1/completions


def check_logprobs(logprobs: dict[str, Any], text: str, k: int) -> None:
    """OpenAI's object is consistent: parallel lists, the chosen token in its top dict with
    its own logprob, offsets that walk the text."""
    tokens, lps, tops = logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]
    assert len(tokens) == len(lps) == len(tops) == len(logprobs["text_offset"])
    assert "".join(tokens) == text  # the embedded model: one character per token
    assert logprobs["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
    for token, lp, top in zip(tokens, lps, tops):
        if lp is None:
            assert top is None
            continue
        assert top[token] == lp and len(top) in (k, k + 1)


async def test_completion_logprobs(client: TestClient) -> None:
    out = await ok(client, "/v1/completions", completion(PROMPT, 5, logprobs=3))
    choice = out["choices"][0]
    check_logprobs(choice["logprobs"], choice["text"], 3)
    assert len(choice["logprobs"]["tokens"]) == 5
    for token, top in zip(choice["logprobs"]["tokens"], choice["logprobs"]["top_logprobs"]):
        assert token == max(top, key=top.get)  # greedy picks the argmax
    zero = await ok(client, "/v1/completions", completion(PROMPT, 2, logprobs=0))
    assert all(len(t) == 1 for t in zero["choices"][0]["logprobs"]["top_logprobs"])
    as_ids = await ok(client, "/v1/completions", completion(PROMPT, 2, logprobs=1,
                                                            return_tokens_as_token_ids=True))
    assert all(t.startswith("token_id:") for t in as_ids["choices"][0]["logprobs"]["tokens"])


async def test_echo_with_logprobs_is_what_loglikelihood_needs(client: TestClient,
                                                               engine: Engine) -> None:
    """lm-eval's request: token-id prompts, echo, logprobs=1, max_tokens=1. The prompt's
    logprobs must be those the model gives when it generates the same tokens."""
    context = engine.tokenizer.encode(PROMPT)
    made = await ok(client, "/v1/completions", completion(context, 3, logprobs=0))
    generated = made["choices"][0]["logprobs"]["token_logprobs"]
    continuation = made["choices"][0]["text"]
    whole = context + engine.tokenizer.encode(continuation)
    out = await ok(client, "/v1/completions", completion([whole, context], 1, logprobs=1,
                                                         echo=True))
    first, second = out["choices"]
    assert [first["index"], second["index"]] == [0, 1]
    logprobs = first["logprobs"]
    check_logprobs(logprobs, first["text"], 1)
    assert first["text"].startswith(engine.tokenizer.decode(whole))  # id prompts: decoded
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert len(logprobs["tokens"]) == len(whole) + 1
    scored = logprobs["token_logprobs"][len(context):len(whole)]
    assert all(abs(a - b) < LOGPROB_TOLERANCE for a, b in zip(scored, generated))
    plain = await ok(client, "/v1/completions", completion(PROMPT, 2, echo=True))
    assert plain["choices"][0]["text"].startswith(PROMPT)


async def test_n_and_a_list_of_prompts_index_prompt_major(client: TestClient) -> None:
    body = {"prompt": ["ab", "cd"], "max_tokens": 3, "n": 2, "seed": 7, "temperature": 1.0,
            "return_token_ids": True}
    out = await ok(client, "/v1/completions", body)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in out["choices"]] == [[97, 98]] * 2 + [[99, 100]] * 2
    assert all(len(c["token_ids"]) == 3 for c in out["choices"])
    assert out["usage"]["prompt_tokens"] == 4 and out["usage"]["completion_tokens"] == 12
    again = await ok(client, "/v1/completions", body)
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in out["choices"]]


async def test_best_of_keeps_the_most_likely_samples(client: TestClient) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "seed": 11, "temperature": 1.5}
    every = await ok(client, "/v1/completions", {**body, "n": 3, "logprobs": 0})
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in every["choices"]]
    best = await ok(client, "/v1/completions", {**body, "n": 1, "best_of": 3})
    assert len(best["choices"]) == 1 and best["choices"][0]["logprobs"] is None
    assert best["choices"][0]["text"] == every["choices"][sums.index(max(sums))]["text"]
    assert best["usage"]["completion_tokens"] == 12  # all three were computed


async def test_sampling_fields_reach_the_engine(client: TestClient) -> None:
    biased = await ok(client, "/v1/completions", completion(PROMPT, 3, logit_bias={"65": 100}))
    assert biased["choices"][0]["text"] == "AAA"
    first = (await ok(client, "/v1/completions", completion(
        PROMPT, 4, return_token_ids=True)))["choices"][0]["token_ids"][0]
    stopped = await ok(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4,
                                                   "temperature": 0, "stop_token_ids": [first]})
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == 1
    held = await ok(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4,
                                                "temperature": 0, "stop_token_ids": [first],
                                                "min_tokens": 3})
    assert held["usage"]["completion_tokens"] >= 3
    alias = await ok(client, "/v1/completions", {"prompt": PROMPT, "max_completion_tokens": 2,
                                                 "max_tokens": 9, **GREEDY})
    assert alias["usage"]["completion_tokens"] == 2
    for fields in ({"presence_penalty": 0}, {"frequency_penalty": 0.5},
                   {"repetition_penalty": 1.2}, {"min_p": 0.1}):
        await ok(client, "/v1/completions", completion(PROMPT, 2, **fields))


# ------------------------------------------------------- chunks add up to the plain answer


async def test_completion_chunks_add_up_to_the_plain_answer(client: TestClient) -> None:
    body = completion(PROMPT, 8, logprobs=2, return_token_ids=True)
    plain = (await ok(client, "/v1/completions", body))["choices"][0]
    chunks = await events(client, "/v1/completions", body)
    choices = [c["choices"][0] for c in chunks]
    # one per token, or fewer: the tokens that came while the client read merge into one
    assert 1 <= len(choices) <= 8 and all(c["token_ids"] for c in choices)
    assert "".join(c["text"] for c in choices) == plain["text"]
    assert flat(c["token_ids"] for c in choices) == plain["token_ids"]
    assert choices[0]["prompt_token_ids"] == plain["prompt_token_ids"]
    merged = {key: flat(c["logprobs"][key] for c in choices) for key in plain["logprobs"]}
    assert merged == plain["logprobs"]
    echoed = completion(PROMPT, 3, logprobs=1, echo=True)
    plain_echo = (await ok(client, "/v1/completions", echoed))["choices"][0]
    streamed_echo = [c["choices"][0] for c in await events(client, "/v1/completions", echoed)]
    assert "".join(c["text"] for c in streamed_echo) == plain_echo["text"]
    assert flat(c["logprobs"]["tokens"] for c in streamed_echo) == (
        plain_echo["logprobs"]["tokens"])


async def test_usage_options_of_a_stream(client: TestClient) -> None:
    body = completion(PROMPT, 3, n=2, seed=1)
    bare = await events(client, "/v1/completions", body)
    assert all("usage" not in c for c in bare)
    indexes = [c["choices"][0]["index"] for c in bare]
    assert set(indexes) == {0, 1} and len(indexes) <= 6  # a chunk per token or fewer
    every = await events(client, "/v1/completions", {**body, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    *tokens, last = every
    counts = [c["usage"]["completion_tokens"] for c in tokens]
    assert counts == sorted(counts) and counts[-1] == 6
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    assert last["usage"]["prompt_tokens"] == len(PROMPT)
    alone = await events(client, "/v1/completions", {**body, "stream_options": {
        "continuous_usage_stats": True}})
    assert all("usage" not in c for c in alone)  # as vLLM: only with include_usage


async def test_cached_token_details_always_beside_usage(client: TestClient) -> None:
    """One rule for completions and chat: `sglext` wherever `usage` is, asked for or not
    (`return_cached_tokens_details` is accepted and changes nothing)."""
    body = completion(PROMPT * 3, 1)
    await ok(client, "/v1/completions", body)
    out = await ok(client, "/v1/completions", body)
    details = out["sglext"]["cached_tokens_details"]
    assert set(details) == {"device", "host", "storage"}
    assert sum(details.values()) == out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    asked = await ok(client, "/v1/completions", {**body, "return_cached_tokens_details": True})
    assert asked["sglext"] == out["sglext"]
    chunks = await events(client, "/v1/completions", {**body, "stream_options": {
        "include_usage": True}})
    assert chunks[-1]["choices"] == [] and set(chunks[-1]) >= {"usage", "sglext"}


# ------------------------------------------- multi-byte characters: a UTF-8 byte tokenizer


def utf8_folder(dest: Path) -> Path:
    """The embedded model's weights under a byte-level tokenizer that decodes UTF-8 (as
    GPT-2's does): a byte that ends no character yet decodes to U+FFFD."""
    src = resolve_model_path(EMBEDDED_TINY_LLAMA)
    dest.mkdir()
    (dest / "model.safetensors").symlink_to(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    del config[EMBEDDED_MARKER_KEY]
    (dest / "config.json").write_text(json.dumps(config))
    (dest / "generation_config.json").write_bytes((src / "generation_config.json").read_bytes())
    chars = bytes_to_unicode()
    tok = HFTokenizerImpl(models.BPE(vocab={chars[b]: b for b in range(NUM_BYTES)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in SPECIAL_TOKENS])
    (dest / "tokenizer.json").write_text(tok.to_str())
    return dest


@pytest.fixture(scope="module")
def utf8_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    cfg = load_config(None, {"model.path": str(utf8_folder(tmp_path_factory.mktemp("utf8")
                                                           / "model")),
                             "cache.max_total_tokens": 1024, "model.device": "cpu"})
    with Engine(cfg) as e:
        yield e


async def test_streams_send_a_chunk_per_token_even_inside_a_character(
        utf8_engine: Engine) -> None:
    empty = 0
    async with TestClient(TestServer(create_app(utf8_engine))) as c:
        for prompt in (ACCENTED_IDS, CJK_IDS, [0xE4, 0xBD]):
            body = completion(prompt, 12, return_token_ids=True)
            plain = (await ok(c, "/v1/completions", body))["choices"][0]
            choices = [ch["choices"][0] for ch in await events(c, "/v1/completions", body)]
            assert len(choices) == 12
            assert "".join(ch["text"] for ch in choices) == plain["text"]
            assert flat(ch["token_ids"] for ch in choices) == plain["token_ids"]
            empty += sum(ch["text"] == "" for ch in choices)
            native = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 12, **GREEDY}}
            generated = await ok(c, "/generate", native)
            streamed = await events(c, "/generate", native)
            assert len(streamed) == 12 and streamed[-1]["text"] == generated["text"]
            assert generated["output_ids"] == plain["token_ids"]
    assert empty > 0, "no token ended inside a character: the case under test never arose"


# ---------------------------------------------------------------------------- openai SDK


async def test_openai_sdk_completions(engine: Engine) -> None:
    import openai  # the `test` extra

    model = served_model_name(engine)
    async with TestServer(create_app(engine), host="127.0.0.1") as server:
        client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused",
                                    max_retries=0, timeout=60)
        try:
            args = {"model": model, "max_tokens": 3, "temperature": 0}
            scored = await client.completions.create(prompt=PROMPT, logprobs=2, echo=True,
                                                     **args)
            two = await client.completions.create(prompt=PROMPT, n=2, seed=5, **{
                **args, "temperature": 1.0})
            batch = await client.completions.create(prompt=["ab", "cd"], **args)
            penalised = await client.completions.create(prompt=PROMPT, presence_penalty=0,
                                                        **args)
        finally:
            await client.close()
    engine.flush_cache(())
    logprobs = scored.choices[0].logprobs
    assert scored.choices[0].text.startswith(PROMPT)
    assert logprobs.token_logprobs[0] is None and len(logprobs.tokens) == len(PROMPT) + 3
    assert all(logprobs.top_logprobs[i][t] == logprobs.token_logprobs[i]
               for i, t in enumerate(logprobs.tokens) if i)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.index for c in batch.choices] == [0, 1] and batch.usage.prompt_tokens == 4
    assert penalised.usage.completion_tokens == 3


async def test_the_chunk_that_ends_a_choice_carries_its_cached_tokens(client) -> None:
    """SGLang's `bench_serving --cache-report` reads `sglext` off the stream's chunks; with
    no usage chunk asked for, the one that ends each choice carries it."""
    import json as _json

    body = {"prompt": "sglext at the end " * 2 + "!" * 4, "max_tokens": 3, "temperature": 0,
            "stream": True}  # 40 tokens no other test sends
    for attempt in range(2):
        async with client.post("/v1/completions", json=body) as resp:
            raw = (await resp.read()).decode()
        chunks = [_json.loads(b.removeprefix("data: ")) for b in raw.strip().split("\n\n")
                  if b != "data: [DONE]"]
        ends = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert len(ends) == 1 and all("sglext" not in c for c in chunks if c not in ends)
        assert ends[0]["sglext"]["cached_tokens_details"]["device"] == (32 if attempt else 0)
