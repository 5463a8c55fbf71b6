"""Discovery routes (server/http/discovery.py) through aiohttp's test client and the real
clients: model and server info, tokenize / detokenize, /v1/models, the served model name."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import random
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import quote

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer
from conftest import app_client

from hicache.config import REDACTED
from hicache_server.config import load_config
from hicache_server.engine import Engine
from hicache_server.http import create_app
from hicache_server.http.discovery import served_model_name, tier_sizes
from hicache_server.tokenizer import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID, NUM_BYTES, PAD_ID, UNK_ID

ADMIN_KEY = "s3cret-discovery"
SEED = 15
TEXTS = ["Hello, my name is", "tab\tnew\nline", "héllo wörld ĠĊ", "日本語 🎉", ""]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    lmdb = tmp_path_factory.mktemp("discovery_lmdb")
    cfg = load_config(None, {"cache.max_total_tokens": 1024, "cache.hierarchical": True,
                             "storage.backend": "lmdb", "storage.lmdb.path": str(lmdb),
                             "model.device": "cpu", "server.admin_api_key": ADMIN_KEY})
    with Engine(cfg) as e:
        yield e


@pytest.fixture
async def client(engine: Engine) -> AsyncIterator[TestClient]:
    async with app_client(engine, wait_idle=False) as c:
        yield c


@pytest.fixture
def renamed(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> str:
    """The engine serving under `--served-model-name team/tiny-llama` for one test."""
    name = "team/tiny-llama"
    server = dataclasses.replace(engine.config.server, served_model_name=name)
    monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, server=server))
    return name


async def ok(resp: ClientResponse) -> Any:
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def assert_error(resp: ClientResponse, status: int, words: str) -> None:
    assert resp.status == status, await resp.text()
    body = await resp.json()
    assert set(body) == {"error"} and body["error"]["code"] == status
    assert words in body["error"]["message"], body["error"]["message"]


def folder_of(engine: Engine) -> str:
    return str(engine.loaded.path.absolute())


# ------------------------------------------------------------------------ model, server


async def test_model_info_and_alias(client: TestClient, engine: Engine) -> None:
    info = await ok(await client.get("/get_model_info"))
    assert await ok(await client.get("/model_info")) == info
    folder = folder_of(engine)
    assert info == {"model_path": folder, "tokenizer_path": folder, "served_model_name": folder,
                    "is_generation": True, "preferred_sampling_params": None,
                    "has_image_understanding": False, "has_audio_understanding": False,
                    "max_context_length": 8192, "context_length": 8192,
                    "vocab_size": BYTE_VOCAB_SIZE, "page_size": 16}
    assert (Path(folder) / "tokenizer_config.json").is_file()


async def test_server_info_tiers_limits_config_version(client: TestClient,
                                                       engine: Engine) -> None:
    info = await ok(await client.get("/get_server_info"))
    assert await ok(await client.get("/server_info")) == info
    assert info["version"] == importlib.metadata.version("hicache")
    sizes = tier_sizes(engine)
    assert list(info["tiers"]) == ["device", "host", "storage"]
    assert info["tiers"] == {t: {"capacity_tokens": n, "capacity_bytes": b}
                             for t, (n, b) in sizes.items()}
    assert info["tiers"]["device"]["capacity_tokens"] == 1024 == info["max_total_num_tokens"]
    assert all(t["capacity_bytes"] > 0 for t in info["tiers"].values())
    assert info["limits"] == {"max_batch_tokens": engine.scheduler.max_batch_tokens,
                              "max_running_requests": engine.scheduler.max_running,
                              "max_body_bytes": 8 * 1024 * 1024, "context_length": 8192}
    assert (info["page_size"], info["tokenizer_path"]) == (16, folder_of(engine))
    assert (info["disable_radix_cache"], info["enable_hierarchical_cache"]) == (False, True)
    assert info["config"]["server"]["admin_api_key"] == REDACTED
    assert ADMIN_KEY not in await (await client.get("/server_info")).text()
    assert info["config"]["storage"]["backend"] == "lmdb"


# ---------------------------------------------------------------------- /v1/models


async def test_models_list_and_card_by_served_name(client: TestClient, engine: Engine) -> None:
    models = await ok(await client.get("/v1/models"))
    [card] = models["data"]
    folder = folder_of(engine)
    assert card["id"] == folder == served_model_name(engine)
    assert (card["object"], card["root"], card["max_model_len"]) == ("model", folder, 8192)
    for path in ("/v1/models/" + folder, "/v1/models/" + quote(folder, safe=""),
                 "/v1/models/" + folder.removeprefix("/")):  # "//" merged by a proxy
        assert await ok(await client.get(path)) == card
    await assert_error(await client.get("/v1/models/embedded:tiny-llama"), 404,
                       f"the one model served is {folder!r}")


async def test_served_model_name_everywhere(client: TestClient, engine: Engine,
                                            renamed: str) -> None:
    [card] = (await ok(await client.get("/v1/models")))["data"]
    assert card["id"] == renamed and card["root"] == folder_of(engine)
    assert await ok(await client.get(f"/v1/models/{renamed}")) == card
    await assert_error(await client.get("/v1/models/" + folder_of(engine)), 404, renamed)
    out = await ok(await client.post("/v1/completions", json={
        "model": renamed, "prompt": "hi", "max_tokens": 2, "temperature": 0}))
    assert out["model"] == renamed
    info = await ok(await client.get("/model_info"))
    assert (info["served_model_name"], info["tokenizer_path"]) == (renamed, folder_of(engine))


def test_default_served_name_rule(tmp_path: Path) -> None:
    """Embedded: its folder; a real model: --model-path as given; the flag wins over both."""
    def fake(path: str, name: str | None = None) -> Any:
        config = load_config(None, {"model.path": path, "server.served_model_name": name})
        return SimpleNamespace(config=config, loaded=SimpleNamespace(path=tmp_path / "m"))

    assert served_model_name(fake("embedded:tiny-llama")) == str(tmp_path / "m")
    assert served_model_name(fake("~/models/Llama-3-8B")) == "~/models/Llama-3-8B"
    assert served_model_name(fake("~/models/Llama-3-8B", "llama")) == "llama"


async def test_openai_sdk_lists_and_retrieves(engine: Engine) -> None:
    import openai  # the `test` extra

    async with TestServer(create_app(engine), host="127.0.0.1") as server:
        client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused",
                                    max_retries=0)
        try:
            [model] = [m async for m in client.models.list()]
            assert model.id == served_model_name(engine)
            assert (await client.models.retrieve(model.id)).id == model.id
            with pytest.raises(openai.NotFoundError):
                await client.models.retrieve("gpt-4")
        finally:
            await client.close()


# ----------------------------------------------------------------- the tokenizer path


def test_served_name_loads_with_transformers_and_agrees(engine: Engine) -> None:
    """What a client does with the model id (bench_serving, lm-eval, guidellm): load it as
    a tokenizer. It must encode and decode exactly as the server does."""
    import transformers  # the `test` extra

    hf = transformers.AutoTokenizer.from_pretrained(served_model_name(engine))
    ours = engine.tokenizer
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.unk_token_id) == (
        BOS_ID, EOS_ID, PAD_ID, UNK_ID)
    assert len(hf) == BYTE_VOCAB_SIZE and hf.model_max_length == engine.context_len
    rng = random.Random(SEED)
    for text in TEXTS:
        assert hf.encode(text) == hf.encode(text, add_special_tokens=False) == ours.encode(text)
    for _ in range(50):
        ids = [rng.randrange(BYTE_VOCAB_SIZE) for _ in range(rng.randint(0, 64))]
        assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids)
        plain = [i for i in ids if i < NUM_BYTES]
        assert hf.encode(ours.decode(ids), add_special_tokens=False) == plain


# ------------------------------------------------------------------ tokenize, detokenize


async def test_tokenize_shapes(client: TestClient, engine: Engine) -> None:
    for text in TEXTS:
        ids = engine.tokenizer.encode(text)
        want = {"tokens": ids, "count": len(ids), "max_model_len": 8192}
        assert await ok(await client.post("/tokenize", json={"prompt": text})) == want
        assert await ok(await client.post("/tokenize", json={
            "text": text, "add_special_tokens": False, "model": "any"})) == want
    batch = await ok(await client.post("/tokenize", json={"prompt": TEXTS[:2]}))
    assert batch["tokens"] == [engine.tokenizer.encode(t) for t in TEXTS[:2]]
    assert batch["count"] == [len(t) for t in batch["tokens"]]


async def test_detokenize_and_round_trip(client: TestClient, engine: Engine) -> None:
    rng = random.Random(SEED)
    ids = [rng.randrange(BYTE_VOCAB_SIZE) for _ in range(200)]
    out = await ok(await client.post("/detokenize", json={"tokens": ids}))
    assert out["text"] == out["prompt"] == engine.tokenizer.decode(ids)
    assert "\ufffd" not in out["text"]  # printable: one visible character per byte id
    back = await ok(await client.post("/tokenize", json={"prompt": out["text"]}))
    assert back["tokens"] == [i for i in ids if i < NUM_BYTES]
    assert await ok(await client.post("/detokenize", json={"tokens": [72, 105, 32, 257]})) == {
        "text": "HiĠ", "prompt": "HiĠ"}
    batch = await ok(await client.post("/detokenize", json={"tokens": [[72], [], [105]]}))
    assert batch["text"] == ["H", "", "i"]
    assert (await ok(await client.post("/detokenize", json={"tokens": []})))["text"] == ""


@pytest.mark.parametrize(("route", "body", "words"), [
    ("/detokenize", {"tokens": [72, 260]}, "`tokens[1]`: token id 260 is outside [0, 260)"),
    ("/detokenize", {"tokens": [[1], [2, -1]]}, "`tokens[1][1]`: token id -1 is outside"),
    ("/detokenize", {"tokens": [1, True]}, "`tokens[1]` must be a token id (an integer)"),
    ("/detokenize", {"tokens": [1.5]}, "`tokens[0]` must be a token id"),
    ("/detokenize", {"tokens": [[1], 2]}, "`tokens[1]` must be an array of token ids"),
    ("/detokenize", {"tokens": "abc"}, "`tokens` is required"),
    ("/detokenize", {}, "`tokens` is required"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": False}, "`skip_special_tokens`"),
    ("/tokenize", {}, "give exactly one of `prompt` or `text`"),
    ("/tokenize", {"prompt": "a", "text": "b"}, "got both"),
    ("/tokenize", {"prompt": 5}, "`prompt` must be a string or an array of strings"),
    ("/tokenize", {"text": ["a", 1]}, "`text` must be a string or an array of strings"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "`add_special_tokens`"),
    ("/tokenize", {"prompt": "a", "return_token_strs": True}, "`return_token_strs`"),
    ("/tokenize", {"prompt": "a\ud800"}, "`prompt` is not valid Unicode"),
    ("/tokenize", [1], "must be a JSON object"),
])
async def test_bad_input_is_400(client: TestClient, route: str, body: Any, words: str) -> None:
    await assert_error(await client.post(route, json=body), 400, words)


async def test_unknown_fields_are_ignored_with_one_warning(
        client: TestClient, engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    """The generation routes' field policy: vLLM's clients send e.g. `add_generation_prompt`."""
    extra = f"x_{uuid.uuid4().hex[:8]}"
    with caplog.at_level(logging.WARNING, logger="hicache_server.http.fields"):
        for _ in range(2):
            tokens = await ok(await client.post("/tokenize", json={"prompt": "hi", extra: 1}))
            text = await ok(await client.post("/detokenize", json={"tokens": [104], extra: 1}))
    assert tokens["tokens"] == engine.tokenizer.encode("hi") and text["text"] == "h"
    warned = [r.getMessage() for r in caplog.records if f"`{extra}`" in r.getMessage()]
    assert len(warned) == 1 and "POST /tokenize" in warned[0]


async def test_wrong_method_is_405(client: TestClient) -> None:
    assert (await client.get("/tokenize")).status == 405
    assert (await client.post("/get_model_info")).status == 405
