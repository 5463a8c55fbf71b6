"""A hybrid model through every tier: random-weight Gemma 3 (sliding windows of 40 tokens
beside full layers, pages of 16, so every prompt crosses several windows and a window
edge falls inside a page) gives transformers' greedy tokens computed from scratch, and the
very same tokens from a cached prefix plus extend, after an L2 load-back, from L3 after L1
and L2 were flushed, and from L3 after a restart."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hicache_server.config import load_config
from hicache_server.engine import Engine
from hicache_server.models.loader import embedded_tokenizer_files

PAGE = 16
WINDOW = 40
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
# sliding, sliding, full, sliding, sliding, full: Gemma 3's pattern, shortened
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2


def gemma3_config(**overrides: object):
    from transformers import Gemma3TextConfig  # the `test` extra

    fields = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": len(LAYER_TYPES), "layer_types": LAYER_TYPES,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "sliding_window": WINDOW, "max_position_embeddings": 2048,
              "query_pre_attn_scalar": 24, "initializer_range": 0.2,
              "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258}
    return Gemma3TextConfig(**{**fields, **overrides})


def write_random_gemma3(folder: Path, seed: int = 0) -> Path:
    """A random-weight Gemma 3 saved as a Hugging Face folder, with the byte tokenizer (its
    ids fit the vocabulary) so the engine can serve it."""
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(gemma3_config()).eval()
    with torch.no_grad():  # Gemma's norms start at w = 0, i.e. x1: give them some shape
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(folder)
    for name, text in embedded_tokenizer_files().items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


def conversations(n: int = 3, turns: int = 3, seed: int = 0) -> list[list[list[int]]]:
    """Per conversation the prompt of each turn: a shared 96-token system prompt, then a
    history growing by a 40-token question and an 8-token stand-in answer."""
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(96)]
    convs = []
    for _ in range(n):
        history, prompts = list(system), []
        for _ in range(turns):
            history = history + [rng.randrange(256) for _ in range(40)]
            prompts.append(list(history))
            history = history + [rng.randrange(256) for _ in range(8)]
        convs.append(prompts)
    return convs


def run_workload(e: Engine, between_turns=None) -> list[list[int]]:
    outs = []
    for turn in range(3):
        for conv in conversations():
            outs.append(e.generate(input_ids=conv[turn], sampling_params=GREEDY)["output_ids"])
        if between_turns is not None:
            between_turns(e)
    return outs


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_gemma3(tmp_path_factory.mktemp("gemma3"))


def engine(folder: Path, **overrides: object) -> Engine:
    return Engine(load_config(None, {
        "model.path": str(folder), "model.device": "cpu", "cache.page_size": PAGE,
        "cache.max_total_tokens": 2048, "storage.prefill_warmup_s": 0.0, **overrides}))


def tiered(folder: Path, lmdb: Path, **overrides: object) -> Engine:
    return engine(folder, **{"cache.hierarchical": True, "storage.backend": "lmdb",
                             "storage.lmdb.path": str(lmdb),
                             "storage.prefetch_policy": "wait_complete",
                             "storage.prefetch_threshold": 32, "storage.overlap": False,
                             **overrides})


@pytest.fixture(scope="module")
def recomputed(folder: Path) -> list[list[int]]:
    with engine(folder, **{"cache.enable_radix_cache": False}) as e:
        return run_workload(e)


def transformers_greedy(folder: Path, prompt: list[int], steps: int) -> list[int]:
    from transformers import Gemma3ForCausalLM

    model = Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():  # plain greedy decoding, recomputing everything each step
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_recomputation_gives_transformers_greedy_tokens(folder: Path,
                                                        recomputed: list[list[int]]) -> None:
    convs = conversations()
    for i in (0, 8):  # the shortest prompt (136 tokens) and the longest (232)
        prompt = convs[i % 3][i // 3]
        assert recomputed[i] == transformers_greedy(folder, prompt, GREEDY["max_new_tokens"])


def test_a_cached_prefix_plus_extend_gives_the_same_tokens(folder: Path,
                                                           recomputed: list[list[int]]) -> None:
    with engine(folder) as e:
        assert run_workload(e) == recomputed
        assert e.stats()["counters"]["cached_device"] > 0


def test_l2_load_back_gives_the_same_tokens(folder: Path, tmp_path: Path,
                                            recomputed: list[list[int]]) -> None:
    with tiered(folder, tmp_path / "lmdb", **{"cache.max_total_tokens": 256,
                                              "storage.backend": "none",
                                              "host.ratio": 8.0}) as e:
        assert run_workload(e) == recomputed
        host = e.stats()["tiers"]["host"]
    assert host["hits"] > 0 and host["load_back_tokens"] > 0


def test_l3_after_flushing_l1_and_l2_and_after_a_restart(folder: Path, tmp_path: Path,
                                                         recomputed: list[list[int]]) -> None:
    with tiered(folder, tmp_path / "lmdb") as e:
        assert run_workload(e, between_turns=lambda e: e.flush_cache(["device", "host"])) \
            == recomputed
        assert e.stats()["counters"]["cached_storage"] > 0
    prompt = conversations()[0][2]
    with tiered(folder, tmp_path / "lmdb") as again:  # a new process sees the same LMDB
        out = again.generate(input_ids=prompt, sampling_params=GREEDY)
    assert out["output_ids"] == recomputed[6]
    details = out["meta_info"]["cached_tokens_details"]
    assert details == {"device": 0, "host": 0, "storage": (len(prompt) - 1) // PAGE * PAGE}


@pytest.fixture(scope="module")
def bf16_recomputed(folder: Path) -> Iterator[list[list[int]]]:
    with engine(folder, **{"cache.enable_radix_cache": False, "model.dtype": "bfloat16"}) as e:
        yield run_workload(e)


def test_bfloat16_cached_prefixes_give_the_tokens_of_recomputation(
        folder: Path, tmp_path: Path, bf16_recomputed: list[list[int]]) -> None:
    with tiered(folder, tmp_path / "lmdb", **{"model.dtype": "bfloat16"}) as e:
        assert run_workload(e, between_turns=lambda e: e.flush_cache(["device"])) \
            == bf16_recomputed
