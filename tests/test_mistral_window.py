"""Mistral's sliding window applied (and Qwen2's, with `use_sliding_window`, on the layers
from `max_window_layers` up): random tiny models whose window (32) is shorter than the
prompt give transformers' float32 logits and greedy tokens, prefilled, extended from a cached
prefix, decoded, on every CPU attention backend and the lean path, and through the engine's
cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from arch_reference import logits_of, recomputed_greedy, save_servable
from test_model import assert_rel_close, extend_batch, hf_logits, make_pool

from hicache_server.config import load_config
from hicache_server.engine import Engine
from hicache_server.models import LoadedModel, ModelArchConfig, load_model
from hicache_server.models.attention import ReferenceAttention, TorchAttention
from hicache_server.models.kernels import cpu_attention

WINDOW = 32
PAGE = 16
PROMPT_LEN = 100  # three windows and some
SLOTS = 112  # the pool slots of a prompt: whole pages
PREFIX = 61  # cached tokens of the extend check: not a page or window multiple
SEED = 3
# initializer_range 0.2: attention far from uniform, so what the window hides shows
_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
         "max_position_embeddings": 2048, "initializer_range": 0.2, "bos_token_id": 256,
         "eos_token_id": 257, "pad_token_id": 258}
KINDS = {
    "mistral": lambda window: transformers.MistralConfig(**_TINY, sliding_window=window),
    # layer 0 full, layers 1 and 2 slide
    "qwen2": lambda window: transformers.Qwen2Config(
        **_TINY, use_sliding_window=window is not None, sliding_window=window,
        max_window_layers=1),
}
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def hf_model(kind: str, folder: Path) -> torch.nn.Module:
    cls = {"mistral": transformers.MistralForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}
    return cls[kind].from_pretrained(folder, dtype=torch.float32,
                                     attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=list(KINDS))
def checkpoint(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """(kind, folder) of a random model saved by transformers, with the byte tokenizer (its
    ids fit the vocabulary) so the engine can serve it."""
    torch.manual_seed(SEED)
    cfg = KINDS[request.param](WINDOW)
    model = {"mistral": transformers.MistralForCausalLM,
             "qwen2": transformers.Qwen2ForCausalLM}[request.param](cfg)
    return request.param, save_servable(model, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(SEED))


def windows_of_kind(kind: str) -> tuple[int | None, ...]:
    return (WINDOW,) * 3 if kind == "mistral" else (None, WINDOW, WINDOW)


def use_backend(lm: LoadedModel, backend: str) -> None:
    """Every layer on `backend` ("loaded": what load_model chose, the CPU kernel where it
    runs); the lean path then steps aside for the others."""
    if backend != "loaded":
        make = {"torch": TorchAttention, "reference": ReferenceAttention}[backend]
        for layer in lm.model.model.layers:
            layer.self_attn.backend = make()


def test_config_applies_the_window_where_transformers_does() -> None:
    mistral = ModelArchConfig.from_hf_dict(KINDS["mistral"](WINDOW).to_dict())
    assert mistral.layer_windows == (WINDOW,) * 3 and mistral.window_of(2) == WINDOW
    qwen2 = ModelArchConfig.from_hf_dict(KINDS["qwen2"](WINDOW).to_dict())
    assert qwen2.layer_windows == (None, WINDOW, WINDOW)
    derived = {k: v for k, v in KINDS["qwen2"](WINDOW).to_dict().items() if k != "layer_types"}
    assert ModelArchConfig.from_hf_dict(derived).layer_windows == (None, WINDOW, WINDOW)
    for make in KINDS.values():  # no window: full attention everywhere
        assert ModelArchConfig.from_hf_dict(make(None).to_dict()).layer_windows == ()
    off = ModelArchConfig.from_hf_dict(transformers.Qwen2Config(
        **_TINY, sliding_window=WINDOW, max_window_layers=1).to_dict())
    assert off.layer_windows == () and off.sliding_window is None  # use_sliding_window false


@pytest.mark.parametrize("backend", ["loaded", "torch", "reference"])
def test_logits_match_transformers_prefilled_extended_and_decoded(
        checkpoint: tuple[str, Path], prompt: torch.Tensor, backend: str) -> None:
    kind, folder = checkpoint
    lm = load_model(str(folder), dtype="float32", device="cpu")
    assert lm.config.layer_windows == windows_of_kind(kind)
    use_backend(lm, backend)
    ref = hf_logits(hf_model(kind, folder), prompt)
    pool = make_pool(lm.config)
    slots = pool.alloc(SLOTS)[:PROMPT_LEN]
    assert_rel_close(logits_of(lm.model, pool, prompt, slots, 0), ref)
    # the cached prefix's K/V stay in the pool: extend from it, then decode one at a time
    end = PROMPT_LEN - 4
    assert_rel_close(logits_of(lm.model, pool, prompt[:end], slots[:end], PREFIX),
                     ref[PREFIX:end])
    for p in range(end, PROMPT_LEN):
        assert_rel_close(logits_of(lm.model, pool, prompt[:p + 1], slots[:p + 1], p),
                         ref[p:p + 1])


def test_the_window_changes_the_logits(checkpoint: tuple[str, Path],
                                       prompt: torch.Tensor) -> None:
    """The comparison above can fail: transformers without the window is far from it."""
    kind, folder = checkpoint
    windowed = hf_logits(hf_model(kind, folder), prompt)
    torch.manual_seed(SEED)
    no_window = transformers.AutoModelForCausalLM.from_config(
        KINDS[kind](None), dtype=torch.float32, attn_implementation="eager").eval()
    no_window.load_state_dict(hf_model(kind, folder).state_dict())
    full = hf_logits(no_window, prompt)
    assert torch.equal(full[:WINDOW], windowed[:WINDOW])  # the same model within the window
    err = (full[WINDOW:] - windowed[WINDOW:]).abs().max().item()
    assert err > 100 * 1e-4 * windowed.abs().max().item()


@pytest.mark.skipif(not cpu_attention.supported(), reason="needs AVX-512F or AVX2, and a C compiler")
def test_the_lean_path_binds_each_layers_window(checkpoint: tuple[str, Path],
                                                prompt: torch.Tensor) -> None:
    """Decode steps on the lean path (the C kernel's `bind_layers(windows=)`) give the
    modules' bits and transformers' logits."""
    kind, folder = checkpoint
    lm = load_model(str(folder), dtype="float32", device="cpu")
    lean = lm.model.model.lean
    assert lean is not None and lean.windows == list(windows_of_kind(kind))
    ref = hf_logits(hf_model(kind, folder), prompt)
    pools = make_pool(lm.config), make_pool(lm.config)
    slots = pools[0].alloc(SLOTS)[:PROMPT_LEN]
    end = PROMPT_LEN - 3
    for pool in pools:
        logits_of(lm.model, pool, prompt[:end], slots[:end], 0)
    for p in range(end, PROMPT_LEN):
        batch = extend_batch([(prompt[:p + 1], slots[:p + 1], p)])
        got = lm.model.forward_all_logits(batch, pools[0])
        lm.model.model.lean = None
        try:
            want = lm.model.forward_all_logits(batch, pools[1])
        finally:
            lm.model.model.lean = lean
        assert torch.equal(got, want)
        assert_rel_close(got, ref[p:p + 1])


def engine(folder: Path, **overrides: object) -> Engine:
    return Engine(load_config(None, {
        "model.path": str(folder), "model.device": "cpu", "model.dtype": "float32",
        "cache.page_size": PAGE, "cache.max_total_tokens": 1024,
        "storage.prefill_warmup_s": 0.0, **overrides}))


def prompts_and_recomputed(folder: Path, prompt: torch.Tensor
                           ) -> tuple[list[list[int]], list[list[int]]]:
    """(the prompt and two sharing its first 80 tokens, the engine's greedy tokens of each
    computed from scratch: no radix cache)."""
    first = prompt.tolist()
    prompts = [first] + [first[:80] + [(t * 7 + i) % 256 for t in range(i, i + 30)]
                         for i in (1, 2)]
    with engine(folder, **{"cache.enable_radix_cache": False}) as e:
        recomputed = [e.generate(input_ids=p, sampling_params=GREEDY)["output_ids"]
                      for p in prompts]
    return prompts, recomputed


def test_engine_greedy_tokens_from_scratch_and_from_a_cached_prefix(
        checkpoint: tuple[str, Path], prompt: torch.Tensor) -> None:
    """transformers' greedy tokens; then prompts sharing the first's 80 tokens, served from
    the cache (a prefix past two windows, the window's edge inside a page), and the first
    again, give the very tokens of their recomputation. Qwen2's full layer beside its window
    ones splits L1 (`WindowedKVPool`): the first request's window KV before its last page
    boundary's window is spare, in a pool with room for it, so the shared 80 tokens hit as
    they do for Mistral (every layer windowed, every layer's KV kept)."""
    kind, folder = checkpoint
    prompts, recomputed = prompts_and_recomputed(folder, prompt)
    assert recomputed[0] == recomputed_greedy(hf_model(kind, folder), prompts[0],
                                              GREEDY["max_new_tokens"])
    with engine(folder) as e:
        cached = [e.generate(input_ids=p, sampling_params=GREEDY)["output_ids"]
                  for p in prompts]
        shared = e.stats()["counters"]["cached_device"]
        again = e.generate(input_ids=prompts[0], sampling_params=GREEDY)
    assert shared == 2 * 80 // PAGE * PAGE
    assert again["meta_info"]["cached_tokens"] == (PROMPT_LEN - 1) // PAGE * PAGE
    assert cached == recomputed and again["output_ids"] == recomputed[0]


def test_l2_load_back_and_l3_after_a_restart_give_the_same_tokens(
        checkpoint: tuple[str, Path], prompt: torch.Tensor, tmp_path: Path) -> None:
    """The same prompts from L2 (L1 flushed between them) and from L3 (a new engine on the
    same LMDB) give the tokens of their recomputation."""
    _, folder = checkpoint
    prompts, recomputed = prompts_and_recomputed(folder, prompt)
    first = prompts[0]
    tiers = {"cache.hierarchical": True, "storage.backend": "lmdb",
             "storage.lmdb.path": str(tmp_path / "lmdb"), "storage.overlap": False,
             "storage.prefetch_policy": "wait_complete", "storage.prefetch_threshold": 16}
    with engine(folder, **tiers) as e:
        from_l2 = []
        for p in prompts:
            from_l2.append(e.generate(input_ids=p, sampling_params=GREEDY)["output_ids"])
            e.flush_cache(["device"])
        assert e.stats()["tiers"]["host"]["load_back_tokens"] > 0
    with engine(folder, **tiers) as again:  # a new process would see the same LMDB
        out = again.generate(input_ids=first, sampling_params=GREEDY)
    assert from_l2 == recomputed and out["output_ids"] == recomputed[0]
    assert out["meta_info"]["cached_tokens_details"]["storage"] == (len(first) - 1) // PAGE * PAGE
