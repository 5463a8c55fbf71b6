"""Discovery: what clients ask before they send work, under SGLang's, vLLM's and OpenAI's names.

    GET  /get_model_info, /model_info    the model folder (also the tokenizer path a client
                                         loads with transformers), the served name, context
                                         length, vocabulary and page size (SGLang's shape)
    GET  /get_server_info, /server_info  version, page size, each tier's capacity (tokens and
                                         bytes), the limits, the config with secrets redacted
    POST /tokenize                       {"prompt" | "text", "add_special_tokens"} ->
                                         {"tokens", "count", "max_model_len"}
    POST /detokenize                     {"tokens"} -> {"text", "prompt"}
    GET  /v1/models, /v1/models/{id}     the one model, under its served name
    GET  /get_load                       requests running and waiting and their tokens, in
                                         SGLang's shape: one entry per data-parallel rank
                                         (here always one); sglang-router reads `num_tokens`

`served_model_name(engine)` is the model id every OpenAI route answers with (`model`) and
lists; routes call it rather than reading the config. SGLang and vLLM answer /tokenize in
the same shape; /detokenize's text is `text` in SGLang's and `prompt` in vLLM's, so both are
sent. A list of prompts (of id lists) tokenizes (detokenizes) each, as SGLang does.

Threading: tokenizing and the tiers' sizes run in the default executor (a long text, or a
scheduler step in progress, must not hold the event loop).
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from aiohttp import web

from hicache_server.config import config_to_dict
from hicache_server.engine import Engine
from hicache_server.http.body import brief, check_type, json_type, read_object
from hicache_server.http.errors import HttpError
from hicache_server.http.fields import known_fields
from hicache_server.http.metrics import tier_summaries
from hicache_server.http.offload import off_loop
from hicache_server.http.state import STATE
from hicache_server.request import check_unicode

PACKAGE = "hicache"  # the distribution whose version /get_server_info reports
UNKNOWN_VERSION = "unknown"  # running from a source tree that was never installed
OWNED_BY = "hicache"  # OpenAI model cards' `owned_by`
# The generation routes' field policy (`hicache_server.http.fields`): other fields are ignored, with
# one warning per name (vLLM's clients send e.g. `add_generation_prompt`).
TOKENIZE_FIELDS = frozenset({"model", "prompt", "text", "add_special_tokens",
                             "return_token_strs"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens", "skip_special_tokens"})



def served_model_name(engine: Engine) -> str:
    """The model id clients see and send: `server.served_model_name` when set; else the
    embedded model's local folder (`embedded:tiny-llama` is no path a tokenizer loader
    accepts, the folder is), else `model.path` as given (SGLang's and vLLM's default)."""
    config = engine.config
    if config.server.served_model_name is not None:
        return config.server.served_model_name
    if config.model.is_embedded:
        return model_folder(engine)
    return config.model.path


def model_folder(engine: Engine) -> str:
    """The model's folder as an absolute path: what transformers loads, model and tokenizer."""
    return str(engine.loaded.path.absolute())


def package_version() -> str:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return UNKNOWN_VERSION


# ------------------------------------------------------------------------------ model info


def model_info(engine: Engine) -> dict[str, Any]:
    folder = model_folder(engine)
    return {"model_path": folder, "tokenizer_path": folder,
            "served_model_name": served_model_name(engine), "is_generation": True,
            "preferred_sampling_params": None, "has_image_understanding": False,
            "has_audio_understanding": False, "max_context_length": engine.context_len,
            "context_length": engine.context_len, "vocab_size": engine.vocab_size,
            "page_size": engine.config.cache.page_size}


async def handle_model_info(request: web.Request) -> web.Response:
    return web.json_response(model_info(request.app[STATE].engine))


async def handle_server_info(request: web.Request) -> web.Response:
    """The tiers' sizes come from the scheduler thread (EngineClosed, a 503, once it has
    stopped). The top-level `max_total_num_tokens`, `max_running_requests`,
    `chunked_prefill_size`, `disable_radix_cache` and `enable_hierarchical_cache` are
    SGLang's names for what `limits` and `config` also say, for clients that read them."""
    state = request.app[STATE]
    engine = state.engine
    sizes = await off_loop(lambda: tier_sizes(engine))
    tiers = {tier: {"capacity_tokens": tokens, "capacity_bytes": size}
             for tier, (tokens, size) in sizes.items()}
    windows = await off_loop(lambda: engine.cache_stats().device.windows)
    if windows is not None:  # a hybrid model: L1's window layers beside its full ones
        tiers["device"]["window_layers"] = {"capacity_tokens": windows.capacity_tokens,
                                            "capacity_bytes": windows.capacity_bytes}
    limits = {"max_batch_tokens": engine.scheduler.max_batch_tokens,
              "max_running_requests": engine.scheduler.max_running,
              "max_body_bytes": state.max_body_bytes, "context_length": engine.context_len}
    cache = engine.config.cache
    info = {"version": package_version(), **model_info(engine), "tiers": tiers,
            "limits": limits, "max_total_num_tokens": sizes["device"][0],
            "max_running_requests": limits["max_running_requests"],
            "chunked_prefill_size": limits["max_batch_tokens"],
            "disable_radix_cache": not cache.enable_radix_cache,
            "enable_hierarchical_cache": cache.hierarchical,
            "config": config_to_dict(engine.config, redact=True)}
    return web.json_response(info)


# ---------------------------------------------------------------------------------- load


async def handle_get_load(request: web.Request) -> web.Response:
    """SGLang's `GET /get_load`: a list with one entry per data-parallel rank
    (`Engine.load`; a 503 once the scheduler has stopped)."""
    engine = request.app[STATE].engine
    return web.json_response([await off_loop(engine.load)])


# --------------------------------------------------------------------- tokenize, detokenize


def _prompts(body: dict[str, Any]) -> tuple[list[str], bool]:
    """The texts to tokenize and whether one was sent (not a list); `text` is an alias of
    `prompt` (SGLang's native name)."""
    given = [name for name in ("prompt", "text") if body.get(name) is not None]
    if len(given) != 1:
        raise HttpError(400, "give exactly one of `prompt` or `text`: a string or an array "
                        f"of strings, got {'both' if given else 'neither'}")
    name = given[0]
    value = body[name]
    texts = value if isinstance(value, list) else [value]
    if not isinstance(value, (str, list)) or not all(isinstance(t, str) for t in texts):
        raise HttpError(400, f"`{name}` must be a string or an array of strings, got "
                        f"{json_type(value)}")
    for i, text in enumerate(texts):
        check_unicode(name if isinstance(value, str) else f"{name}[{i}]", text)
    return texts, isinstance(value, str)


async def handle_tokenize(request: web.Request) -> web.Response:
    body = known_fields(await read_object(request), TOKENIZE_FIELDS, "POST /tokenize")
    check_type(body, "model", (str,), "a string")  # any name: one model is served
    if check_type(body, "return_token_strs", (bool,), "a boolean"):
        raise HttpError(400, "`return_token_strs`: token strings are not supported; "
                        "/tokenize answers ids only")
    specials = check_type(body, "add_special_tokens", (bool,), "a boolean")
    texts, single = _prompts(body)
    engine = request.app[STATE].engine
    add = True if specials is None else specials  # vLLM's and SGLang's default

    def encode() -> list[list[int]]:
        return [engine.tokenizer.encode(text, add_special_tokens=add) for text in texts]

    ids = await off_loop(encode)
    tokens: list[int] | list[list[int]] = ids[0] if single else ids
    count: int | list[int] = len(ids[0]) if single else [len(i) for i in ids]
    return web.json_response({"tokens": tokens, "count": count,
                              "max_model_len": engine.context_len})


def _id_lists(value: Any, vocab_size: int) -> tuple[list[list[int]], bool]:
    """`tokens` as id lists and whether one list was sent; 400 naming the first id that is
    not an integer in [0, vocab_size)."""
    if not isinstance(value, list):
        raise HttpError(400, "`tokens` is required: an array of token ids (or of arrays of "
                        f"them), got {json_type(value)}")
    single = not value or not isinstance(value[0], list)
    lists = [value] if single else value
    for i, ids in enumerate(lists):
        where = "tokens" if single else f"tokens[{i}]"
        if not isinstance(ids, list):
            raise HttpError(400, f"`{where}` must be an array of token ids, got "
                            f"{json_type(ids)}")
        for j, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool):
                raise HttpError(400, f"`{where}[{j}]` must be a token id (an integer), got "
                                f"{brief(t)}")
            if not 0 <= t < vocab_size:
                raise HttpError(400, f"`{where}[{j}]`: token id {t} is outside [0, "
                                f"{vocab_size}), the model's vocabulary")
    return lists, single


async def handle_detokenize(request: web.Request) -> web.Response:
    """Special tokens are dropped, as every answer's text drops them."""
    body = known_fields(await read_object(request), DETOKENIZE_FIELDS, "POST /detokenize")
    check_type(body, "model", (str,), "a string")
    if check_type(body, "skip_special_tokens", (bool,), "a boolean") is False:
        raise HttpError(400, "`skip_special_tokens`: only true is supported (special tokens "
                        "are never shown as text)")
    engine = request.app[STATE].engine
    lists, single = _id_lists(body.get("tokens"), engine.vocab_size)
    texts = await off_loop(lambda: [engine.tokenizer.decode(ids) for ids in lists])
    text: str | list[str] = texts[0] if single else texts
    return web.json_response({"text": text, "prompt": text})


# ------------------------------------------------------------------------------ /v1/models


def _model_card(request: web.Request) -> dict[str, Any]:
    state = request.app[STATE]
    return {"id": served_model_name(state.engine), "object": "model",
            "created": state.started, "owned_by": OWNED_BY, "root": model_folder(state.engine),
            "max_model_len": state.engine.context_len}


async def handle_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request)]})


async def handle_model(request: web.Request) -> web.Response:
    """The card of `{id}` (which may hold slashes: a folder path, "org/name"); 404 unless it
    is the served name. An absolute path's leading slash may be missing: the URL then holds
    "//", which proxies merge into one (nginx's merge_slashes is on by default)."""
    card = _model_card(request)
    asked = request.match_info["id"]
    if asked not in (card["id"], card["id"].removeprefix("/")):
        raise HttpError(404, f"model {asked!r} is not served here; the one model served is "
                        f"{card['id']!r}")
    return web.json_response(card)


def tier_sizes(engine: Engine) -> dict[str, tuple[int, int]]:
    """Each tier's capacity as (tokens, bytes)."""
    stats = engine.cache_stats()
    summaries, tiers = tier_summaries(stats), stats.tiers()
    return {name: (s.capacity, tiers[name].capacity_bytes) for name, s in summaries.items()}
