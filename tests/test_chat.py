"""POST /v1/chat/completions and the chat templates: shapes, streaming, usage, bad messages,
the field policy, `n`, logprobs, the sampling fields, multi-turn cache hits, Hugging Face template folders (checked against transformers), the
"no template" 400, and the real openai SDK over a loopback port."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer
from conftest import app_client, small_engine
from tokenizers import Tokenizer as HFTokenizerImpl
from tokenizers import processors

from hicache_server.chat_template import (
    EMBEDDED_CHAT_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    NoChatTemplate,
    load_chat_template,
)
from hicache_server.config import load_config
from hicache_server.engine import Engine
from hicache_server.http import HttpError, create_app
from hicache_server.http.chat import chat_prompt_ids
from hicache_server.models.loader import EMBEDDED_TINY_LLAMA, resolve_model_path
from hicache_server.scheduler.text import REPLACEMENT_CHAR
from hicache_server.tokenizer import (
    BOS_ID,
    EMBEDDED_MARKER_KEY,
    SPECIAL_TOKENS,
    byte_tokenizer_json,
)

PAGE = 16  # the default cache.page_size
ANSWER_TOKENS = 16  # turn 1 of the multi-turn test: its answer spans a page boundary
URL = "/v1/chat/completions"
GREEDY = {"temperature": 0, "ignore_eos": True}
LOGPROB_TOLERANCE = 1e-3  # a logit from a prefill vs from a decode step: float32 sums
SYSTEM = "You are a careful assistant. Answer in one short sentence and cite a source. "
HELLO = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there!"}]
# Meta-Llama-3-8B-Instruct's tokenizer_config.json `chat_template`, as published.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] "
    "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# ChatML as Qwen2 writes it: a default system prompt when the chat has none.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Mistral-style: the roles must alternate, or the template raises.
ALTERNATING_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{{ '[' + message['role'] + '] ' + message['content'] }}{% endfor %}")


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield from small_engine()


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[TestClient]:
    async with app_client(engine) as c:
        yield c


def template_of(engine: Engine) -> ChatTemplate:
    return load_chat_template(engine.loaded.path)


async def post(client: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    resp = await client.post(URL, json=body)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def assert_error(resp: ClientResponse, status: int, words: str) -> None:
    assert resp.status == status, await resp.text()
    error = (await resp.json())["error"]
    assert error["code"] == status and words.lower() in error["message"].lower(), error


async def sse_events(resp: ClientResponse) -> list[dict[str, Any]]:
    """The `data:` payloads of a stream, decoded; `[DONE]` must end it."""
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    blocks = (await resp.text()).split("\n\n")
    assert blocks[-2:] == ["data: [DONE]", ""]
    return [json.loads(b.removeprefix("data: ")) for b in blocks[:-2]]


def content_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


# ------------------------------------------------------------------------- answers, usage


async def test_plain_answer_shape_and_usage(client: TestClient, engine: Engine) -> None:
    out = await post(client, {"model": "any", "messages": HELLO, "max_tokens": 6, **GREEDY})
    assert set(out) == {"id", "object", "created", "model", "choices", "usage", "sglext"}
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    choice = out["choices"][0]
    assert choice == {"index": 0, "message": {"role": "assistant",
                                              "content": choice["message"]["content"]},
                      "logprobs": None, "finish_reason": "length"}
    prompt = chat_prompt_ids(template_of(engine), engine.tokenizer, HELLO)
    usage = out["usage"]
    assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == 6
    assert usage["total_tokens"] == len(prompt) + 6
    details = out["sglext"]["cached_tokens_details"]
    assert set(details) == {"device", "host", "storage"}
    assert usage["prompt_tokens_details"]["cached_tokens"] == sum(details.values())


async def test_stream_equals_plain(client: TestClient) -> None:
    body = {"messages": HELLO, "max_tokens": 12, **GREEDY}
    plain = await post(client, body)
    chunks = await sse_events(await client.post(URL, json={
        **body, "stream": True, "stream_options": {"include_usage": True}}))
    first, *middle, last, usage_chunk = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert content_of(chunks) == plain["choices"][0]["message"]["content"]
    assert [c["choices"][0]["finish_reason"] for c in [first, *middle]] == [None] * (
        len(middle) + 1)
    assert last["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert all("usage" not in c for c in [first, *middle, last])
    assert usage_chunk["choices"] == [] and set(usage_chunk) >= {"usage", "sglext"}
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage_chunk["usage"][key] == plain["usage"][key]


async def test_stream_without_usage(client: TestClient) -> None:
    chunks = await sse_events(await client.post(URL, json={
        "messages": HELLO, "max_tokens": 3, "stream": True, **GREEDY}))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c and c["choices"] for c in chunks)


async def test_continuous_usage_stats(client: TestClient) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = await sse_events(await client.post(URL, json={
        "messages": HELLO, "max_tokens": 5, "stream": True, "stream_options": options,
        **GREEDY}))
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts[0] == 0 and counts[-1] == 5 and counts == sorted(counts)
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + n
               for c, n in zip(chunks, counts))
    assert chunks[-1]["choices"] == [] and all("sglext" in c for c in chunks)
    # as in vLLM, continuous stats ride on include_usage: alone they add nothing
    alone = await sse_events(await client.post(URL, json={
        "messages": HELLO, "max_tokens": 2, "stream": True, **GREEDY,
        "stream_options": {"continuous_usage_stats": True}}))
    assert all("usage" not in c for c in alone)


async def test_stream_never_sends_a_stop_string(client: TestClient) -> None:
    # a prompt the seeded model answers in ASCII ("kkk...kWWW"): a stop string can be chosen
    body = {"messages": [{"role": "user", "content": "abc" * 20}], "max_tokens": 32, **GREEDY}
    text = (await post(client, body))["choices"][0]["message"]["content"]
    stop = next((text[i:i + 2] for i in range(4, len(text) - 1)  # first seen past 4 chars
                 if text[i:i + 2].isascii() and text[i:i + 2].isprintable()
                 and text.find(text[i:i + 2]) == i), None)
    assert stop is not None, "the seeded model's greedy answer should hold a printable pair"
    cut = await post(client, {**body, "stop": stop})
    chunks = await sse_events(await client.post(URL, json={**body, "stop": stop,
                                                           "stream": True}))
    assert content_of(chunks) == cut["choices"][0]["message"]["content"]
    assert cut["choices"][0]["message"]["content"] == text[:text.find(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_max_completion_tokens_wins_over_max_tokens(client: TestClient) -> None:
    out = await post(client, {"messages": HELLO, "max_tokens": 9, "max_completion_tokens": 3,
                              **GREEDY})
    assert out["usage"]["completion_tokens"] == 3


async def test_text_parts_are_joined_like_a_string(client: TestClient) -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there!"}]
    as_parts = await post(client, {"messages": [{"role": "user", "content": parts}],
                                   "max_tokens": 4, **GREEDY})
    as_text = await post(client, {"messages": [{"role": "user", "content": "Hello\nthere!"}],
                                  "max_tokens": 4, **GREEDY})
    assert as_parts["choices"][0]["message"] == as_text["choices"][0]["message"]
    assert as_parts["usage"]["prompt_tokens"] == as_text["usage"]["prompt_tokens"]


@pytest.mark.parametrize(("body", "words"), [
    ({"messages": []}, "`messages` must be a non-empty array of messages, got an empty array"),
    ({}, "`messages` is required"),
    ({"messages": "hi"}, "`messages` must be a non-empty array of messages, got a string"),
    ({"messages": ["hi"]}, "`messages[0]` must be an object with `role` and `content`"),
    ({"messages": [{"role": "tool", "content": "x"}]},
     "`messages[0].role` must be one of system, user, assistant, got 'tool'"),
    ({"messages": [{"content": "x"}]}, "`messages[0].role` must be one of"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user"}]},
     "`messages[1].content` must be a string or an array of text parts"),
    ({"messages": [{"role": "user", "content": 5}]}, "got a number"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "`messages[0].content[0].type`: content parts of type 'image_url' are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "`messages[0].content[0].text` must be a string, got null"),
    ({"messages": [{"role": "user", "content": ["hi"]}]},
     "`messages[0].content[0]` must be a text part"),
    ({"messages": [{"role": "user", "content": "x", "name": 3}]}, "`messages[0].name`"),
    ({"messages": [{"role": "user", "content": "a\ud800"}]},
     "`messages[0].content` is not valid Unicode"),
    ({"messages": HELLO, "n": 0}, "n: must be in [1, 128], got 0"),
    ({"messages": HELLO, "n": "2"}, "n: expected an integer"),
    ({"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "`tools`: tool (function) calling is not supported"),
    ({"messages": HELLO, "tool_choice": "auto"}, "`tool_choice`"),
    ({"messages": HELLO, "functions": [{"name": "f"}]}, "`functions`"),
    ({"messages": HELLO, "response_format": {"type": "json_object"}}, "`response_format`"),
    ({"messages": HELLO, "audio": {"voice": "x"}}, "`audio`"),
    ({"messages": HELLO, "modalities": ["text", "audio"]}, "`modalities`"),
    ({"messages": HELLO, "logprobs": 2}, "`logprobs` must be a boolean"),
    ({"messages": HELLO, "logprobs": True, "top_logprobs": 21},
     "`top_logprobs` must be in [0, 20], got 21"),
    ({"messages": HELLO, "top_logprobs": 2}, "needs `logprobs: true`"),
    ({"messages": HELLO, "presence_penalty": 3}, "presence_penalty"),
    ({"messages": HELLO, "stop_token_ids": [999]}, "stop_token_ids"),
    ({"messages": HELLO, "min_tokens": -1}, "min_tokens"),
    ({"messages": HELLO, "max_tokens": 0}, "max_tokens: must be in [1, 1048576], got 0"),
    ({"messages": HELLO, "max_completion_tokens": "8"}, "max_completion_tokens: expected an"),
    ({"messages": HELLO, "max_tokens": 4000}, "lower max_tokens"),
    ({"messages": HELLO, "temperature": -1}, "temperature: must be in [0.0, 100.0]"),
    ({"messages": HELLO, "stream": "yes"}, "`stream` must be a boolean"),
])
async def test_bad_requests_are_400(client: TestClient, body: dict[str, Any],
                                    words: str) -> None:
    await assert_error(await client.post(URL, json=body), 400, words)


# ---------------------------------------------- the field policy, n, logprobs, sampling


async def test_unknown_fields_are_ignored_with_one_warning_each(
        client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    top, option, key = (f"x_{uuid.uuid4().hex[:8]}" for _ in range(3))
    message = {"role": "user", "content": "Hello there!", key: 1, "tool_calls": []}
    body = {"messages": [message], "max_tokens": 2, top: {"a": 1}, **GREEDY,
            "stream_options": {option: True}, "tool_choice": "none", "parallel_tool_calls": True}
    with caplog.at_level(logging.WARNING, logger="hicache_server.http.fields"):
        first = await post(client, body)
        again = await post(client, body)
    assert first["choices"] == again["choices"]  # served, the extras changing nothing
    warned = [r.getMessage() for r in caplog.records if r.name == "hicache_server.http.fields"]
    for name in (top, f"stream_options.{option}", f"messages[].{key}"):
        assert sum(f"`{name}`" in m for m in warned) == 1, (name, warned)


async def test_n_choices_share_one_prefill(client: TestClient, engine: Engine) -> None:
    """n = 2 greedy: two identical choices; the prompt is counted once in `usage` and its
    cached tokens are choice 0's (a fresh prompt: none), as /v1/completions reports `n`;
    choice 1 read the prompt's full pages from the tree (the engine's counters)."""
    fresh = [{"role": "system", "content": f"{uuid.uuid4().hex} " * 4}, HELLO[1]]
    prompt = chat_prompt_ids(template_of(engine), engine.tokenizer, fresh)
    before = engine.stats()["counters"]
    out = await post(client, {"messages": fresh, "max_tokens": 5, "n": 2, **GREEDY})
    after = engine.stats()["counters"]
    one, two = out["choices"]
    assert [one["index"], two["index"]] == [0, 1] and one["message"] == two["message"]
    usage = out["usage"]
    assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == 10
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert out["sglext"]["cached_tokens_details"]["device"] == 0
    assert after["prompt_tokens"] - before["prompt_tokens"] == 2 * len(prompt)
    assert after["cached_device"] - before["cached_device"] == len(prompt) // PAGE * PAGE > 0
    chunks = await sse_events(await client.post(URL, json={
        "messages": fresh, "max_tokens": 5, "n": 2, "stream": True, **GREEDY}))
    for k, choice in enumerate((one, two)):
        mine = [c for c in chunks if c["choices"][0]["index"] == k]
        assert mine[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        # the role chunk, then one chunk per token (or fewer: tokens that came while the
        # client read are merged into one chunk)
        assert 2 <= len(mine) <= 1 + 5
        assert "".join(c["choices"][0]["delta"]["content"] for c in mine) == (
            choice["message"]["content"])
        assert mine[-1]["choices"][0]["finish_reason"] == "length"


def check_chat_logprobs(content: list[dict[str, Any]], k: int) -> None:
    """OpenAI's chat shape; greedy picks each top list's first, with the same logprob."""
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["bytes"] == list(item["token"].encode()) and item["logprob"] <= 0
        top = item["top_logprobs"]
        assert len(top) == k and all(set(t) == {"token", "logprob", "bytes"} for t in top)
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        if k:
            assert (top[0]["token"], top[0]["logprob"]) == (item["token"], item["logprob"])


async def test_logprobs_plain_and_streamed(client: TestClient) -> None:
    body = {"messages": HELLO, "max_tokens": 6, "logprobs": True, "top_logprobs": 3, **GREEDY}
    plain = (await post(client, body))["choices"][0]
    content = plain["logprobs"]["content"]
    assert len(content) == 6 and "".join(c["token"] for c in content) == (
        plain["message"]["content"])
    check_chat_logprobs(content, 3)
    chunks = await sse_events(await client.post(URL, json={**body, "stream": True}))
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role chunk: no token yet
    streamed = [c["choices"][0]["logprobs"]["content"] for c in chunks[1:]]
    assert all(len(c) == 1 for c in streamed)  # one token per chunk
    for ours, theirs in zip((c[0] for c in streamed), content, strict=True):
        assert ours["token"] == theirs["token"] and ours["bytes"] == theirs["bytes"]
        assert abs(ours["logprob"] - theirs["logprob"]) < LOGPROB_TOLERANCE
        assert [t["token"] for t in ours["top_logprobs"]] == [
            t["token"] for t in theirs["top_logprobs"]]
    zero = (await post(client, {**body, "top_logprobs": 0}))["choices"][0]
    check_chat_logprobs(zero["logprobs"]["content"], 0)
    off = {**body, "logprobs": False, "top_logprobs": None}
    assert (await post(client, off))["choices"][0]["logprobs"] is None


async def test_sampling_fields_reach_the_engine(client: TestClient) -> None:
    biased = await post(client, {"messages": HELLO, "max_tokens": 3, "logit_bias": {"65": 100},
                                 **GREEDY})
    assert biased["choices"][0]["message"]["content"] == "AAA"
    greedy = {"messages": HELLO, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    ids = (await post(client, greedy))["choices"][0]["token_ids"]
    stopped = await post(client, {**greedy, "stop_token_ids": [ids[2]]})
    first = ids.index(ids[2])
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["token_ids"] == ids[:first + 1]
    assert stopped["usage"]["completion_tokens"] == first + 1
    held = await post(client, {**greedy, "stop_token_ids": [ids[0]], "min_tokens": 3})
    assert held["usage"]["completion_tokens"] >= 3
    for fields in ({"presence_penalty": 0.5}, {"frequency_penalty": 0.5},
                   {"repetition_penalty": 1.2}, {"min_p": 0.1}, {"top_k": 5, "seed": 3},
                   {"skip_special_tokens": True}, {"include_stop_str_in_output": True}):
        out = await post(client, {"messages": HELLO, "max_tokens": 2, **GREEDY, **fields})
        assert out["usage"]["completion_tokens"] == 2, fields


# -------------------------------------------------------------------------- multi-turn


@pytest.mark.parametrize("system", [
    "(multi-turn) " + SYSTEM,  # the seeded model answers bytes that are not UTF-8 text
    "Be brief. " + "abc" * 12,  # ... and here plain ASCII
], ids=["noise-answer", "ascii-answer"])
async def test_multi_turn_hits_the_cache(client: TestClient, engine: Engine,
                                         system: str) -> None:
    """Turn 2 (system, user, turn 1's answer, user) reuses every full page of turn 1's
    prompt and of its answer: the template renders turn 1 + its answer as turn 2's prefix,
    and the embedded model's printable text re-encodes to exactly the generated tokens,
    whatever bytes they are."""
    template = template_of(engine)
    turn1 = [{"role": "system", "content": system},
             {"role": "user", "content": "What is a radix tree?"}]
    first = await post(client, {"messages": turn1, "max_tokens": ANSWER_TOKENS, **GREEDY})
    answer = first["choices"][0]["message"]["content"]
    assert REPLACEMENT_CHAR not in answer
    turn2 = [*turn1, {"role": "assistant", "content": answer},
             {"role": "user", "content": "And a page?"}]
    assert template.render(turn2).startswith(template.render(turn1) + answer)
    second = await post(client, {"messages": turn2, "max_tokens": 8, **GREEDY})
    turn1_ids = chat_prompt_ids(template, engine.tokenizer, turn1)
    turn2_ids = chat_prompt_ids(template, engine.tokenizer, turn2)
    assert turn2_ids[:len(turn1_ids)] == turn1_ids
    # the tree holds turn 1's prompt and every answer token but the last (whose KV was
    # never computed), in full pages
    reusable = len(turn1_ids) + ANSWER_TOKENS - 1
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert reusable // PAGE * PAGE <= cached < len(turn2_ids)
    assert second["sglext"]["cached_tokens_details"]["device"] == cached
    print(f"multi-turn: turn 1 prompt {len(turn1_ids)} tokens, turn 2 prompt "
          f"{len(turn2_ids)}, cached {cached}")


# ------------------------------------------------------------------------ chat templates


@pytest.mark.parametrize("source", [EMBEDDED_CHAT_TEMPLATE, CHATML_TEMPLATE, LLAMA3_TEMPLATE])
def test_templates_render_earlier_turns_as_a_stable_prefix(source: str) -> None:
    template = ChatTemplate(source, bos_token="<|bos|>", eos_token="<|eos|>")
    turn1 = [{"role": "user", "content": "Hi"}]
    answer = "Hello! How can I help?"
    turn2 = [*turn1, {"role": "assistant", "content": answer},
             {"role": "user", "content": "Tell me more."}]
    assert template.render(turn2).startswith(template.render(turn1) + answer)


def test_embedded_template_is_role_tagged() -> None:
    template = load_chat_template(resolve_model_path(EMBEDDED_TINY_LLAMA))
    assert template.render(HELLO) == (f"<|system|>\n{SYSTEM}\n<|user|>\nHello there!\n"
                                      "<|assistant|>\n")
    assert template.render(HELLO, add_generation_prompt=False).endswith("there!\n")


def test_template_helpers_behave_as_in_transformers() -> None:
    source = ("{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}"
              "{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}|{{ messages | tojson }}"
              "|{{ strftime_now('%Y') | length }}")
    rendered = ChatTemplate(source).render([{"role": "user", "content": "<é>"}] * 3)
    assert rendered == '<é><é>|' + json.dumps([{"role": "user", "content": "<é>"}] * 3,
                                              ensure_ascii=False) + "|4"


def test_raise_exception_is_a_400_with_the_templates_message(engine: Engine) -> None:
    template = ChatTemplate(ALTERNATING_TEMPLATE, origin="test")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(HttpError, match="roles must alternate") as e:
        chat_prompt_ids(template, engine.tokenizer, [{"role": "assistant", "content": "a"}])
    assert e.value.status == 400


def test_template_sources_in_transformers_order(tmp_path: Path) -> None:
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>",
              "chat_template": [{"name": "tool_use", "template": "tools"},
                                {"name": "default", "template": "{{ bos_token }}default"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(tmp_path).render(HELLO) == "<s>default"
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}from the file")
    assert load_chat_template(tmp_path).render(HELLO) == "</s>from the file"


def test_missing_or_broken_template_is_named(tmp_path: Path) -> None:
    with pytest.raises(NoChatTemplate, match="the model has no chat template"):
        load_chat_template(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(NoChatTemplate, match="does not compile"):
        load_chat_template(tmp_path)


# ------------------------------------------------------ a Hugging Face folder, no template


def hf_folder(dest: Path, chat_template: str | None) -> Path:
    """The embedded model as a plain Hugging Face folder: no embedded marker, so its
    tokenizer.json is used, with a post-processor that adds BOS as Llama's does."""
    src = resolve_model_path(EMBEDDED_TINY_LLAMA)
    dest.mkdir()
    (dest / "model.safetensors").symlink_to(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    del config[EMBEDDED_MARKER_KEY]
    (dest / "config.json").write_text(json.dumps(config))
    (dest / "generation_config.json").write_bytes((src / "generation_config.json").read_bytes())
    tok = HFTokenizerImpl.from_str(byte_tokenizer_json())
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL_TOKENS[0]} $A", special_tokens=[(SPECIAL_TOKENS[0], BOS_ID)])
    (dest / "tokenizer.json").write_text(tok.to_str())
    tok_config = {"bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[1],
                  "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template is not None:
        tok_config["chat_template"] = chat_template
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return dest


@pytest.fixture(scope="module")
def llama3_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    folder = hf_folder(tmp_path_factory.mktemp("llama3") / "model", LLAMA3_TEMPLATE)
    cfg = load_config(None, {"model.path": str(folder), "cache.max_total_tokens": 2048,
                             "model.device": "cpu"})
    with Engine(cfg) as e:
        yield e


async def test_hf_template_matches_transformers_and_bos_is_single(
        llama3_engine: Engine) -> None:
    import transformers  # the `test` extra

    folder = llama3_engine.loaded.path
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = chat_prompt_ids(template_of(llama3_engine), llama3_engine.tokenizer, HELLO)
    text = reference.apply_chat_template(HELLO, tokenize=False, add_generation_prompt=True)
    encoded = reference.apply_chat_template(HELLO, tokenize=True, add_generation_prompt=True)
    theirs = encoded if isinstance(encoded, list) else encoded["input_ids"]
    assert template_of(llama3_engine).render(HELLO) == text
    assert ours == theirs and ours[0] == BOS_ID and ours.count(BOS_ID) == 1
    async with TestClient(TestServer(create_app(llama3_engine))) as c:
        out = await post(c, {"messages": HELLO, "max_tokens": 2, **GREEDY})
        plain = await (await c.post("/v1/completions", json={
            "prompt": "hi", "max_tokens": 1, **GREEDY})).json()
    assert out["usage"]["prompt_tokens"] == len(ours)
    assert plain["usage"]["prompt_tokens"] == 3  # /v1/completions: the tokenizer adds BOS


async def test_model_without_template_answers_400(tmp_path: Path) -> None:
    cfg = load_config(None, {"model.path": str(hf_folder(tmp_path / "model", None)),
                             "cache.max_total_tokens": 1024, "model.device": "cpu"})
    with Engine(cfg) as engine:
        async with TestClient(TestServer(create_app(engine))) as c:
            await assert_error(await c.post(URL, json={"messages": HELLO}), 400,
                               "the model has no chat template")
            await assert_error(await c.post(URL, json={"messages": []}), 400,
                               "non-empty array")  # the body is still checked first
            plain = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert plain.status == 200


# ------------------------------------------------------------------------ the openai SDK


async def test_openai_sdk_chat_plain_and_streaming(engine: Engine) -> None:
    import openai  # the `test` extra

    async with TestServer(create_app(engine), host="127.0.0.1") as server:
        client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused",
                                    max_retries=0, timeout=60)
        try:
            args = {"model": EMBEDDED_TINY_LLAMA, "messages": HELLO, "max_tokens": 7,
                    "temperature": 0, "extra_body": {"ignore_eos": True}}
            plain = await client.chat.completions.create(**args)
            stream = await client.chat.completions.create(
                **args, stream=True, stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
        finally:
            await client.close()
    engine.flush_cache(())
    message = plain.choices[0].message
    assert message.role == "assistant" and plain.choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == 7
    assert plain.usage.prompt_tokens_details.cached_tokens >= 0
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        message.content)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


async def test_openai_sdk_chat_n_and_logprobs(engine: Engine) -> None:
    import openai  # the `test` extra

    async with TestServer(create_app(engine), host="127.0.0.1") as server:
        client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused",
                                    max_retries=0, timeout=60)
        try:
            args = {"model": EMBEDDED_TINY_LLAMA, "messages": HELLO, "max_tokens": 4, "n": 2,
                    "temperature": 0, "logprobs": True, "top_logprobs": 2,
                    "extra_body": {"ignore_eos": True}}
            plain = await client.chat.completions.create(**args)
            stream = await client.chat.completions.create(**args, stream=True)
            chunks = [chunk async for chunk in stream]
        finally:
            await client.close()
    engine.flush_cache(())
    assert [c.index for c in plain.choices] == [0, 1]
    assert plain.choices[0].message.content == plain.choices[1].message.content
    assert plain.usage.completion_tokens == 8
    for choice in plain.choices:
        content = choice.logprobs.content
        assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
        assert all(t.top_logprobs[0].token == t.token for t in content)
        assert "".join(t.token for t in content) == choice.message.content
    for k in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == k]
        assert "".join(c.delta.content or "" for c in mine) == plain.choices[k].message.content
        tokens = [t.token for c in mine if c.logprobs for t in c.logprobs.content]
        assert tokens == [t.token for t in plain.choices[k].logprobs.content]
