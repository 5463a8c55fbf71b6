"""A hybrid model through every tier: random-weight Gemma 3 (sliding windows of 40 tokens
beside full layers, pages of 16, so every prompt crosses several windows and a window
edge falls inside a page) gives transformers' greedy tokens computed from scratch, and the
very same tokens from a cached prefix plus extend, after an L2 load-back, from L3 after L1
and L2 were flushed, and from L3 after a restart."""

from __future__ import annotations

from pathlib import Path

import pytest
import tier_workload as tiers
import torch
from arch_reference import GEMMA_NORMS, random_model, save_servable

WINDOW = 40  # pages are tier_workload.PAGE (16): a window edge falls inside a page
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
    """A random-weight Gemma 3 saved as a Hugging Face folder the engine serves."""
    from transformers import Gemma3ForCausalLM

    return save_servable(random_model(Gemma3ForCausalLM, gemma3_config(), seed, GEMMA_NORMS),
                         folder)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def recomputed(folder: Path) -> list[list[int]]:
    return tiers.recompute(folder)


def test_recomputation_gives_transformers_greedy_tokens(folder: Path,
                                                        recomputed: list[list[int]]) -> None:
    from transformers import Gemma3ForCausalLM

    model = Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tiers.check_transformers_greedy(model, recomputed)


def test_a_cached_prefix_plus_extend_gives_the_same_tokens(folder: Path,
                                                           recomputed: list[list[int]]) -> None:
    tiers.check_cached_prefix(folder, recomputed)


def test_l2_load_back_gives_the_same_tokens(folder: Path, tmp_path: Path,
                                            recomputed: list[list[int]]) -> None:
    tiers.check_l2_load_back(folder, tmp_path / "lmdb", recomputed)


def test_l3_after_flushing_l1_and_l2_and_after_a_restart(folder: Path, tmp_path: Path,
                                                         recomputed: list[list[int]]) -> None:
    tiers.check_l3_flush_and_restart(folder, tmp_path / "lmdb", recomputed)


def test_bfloat16_cached_prefixes_give_the_tokens_of_recomputation(folder: Path,
                                                                   tmp_path: Path) -> None:
    want = tiers.recompute(folder, **{"model.dtype": "bfloat16"})
    with tiers.tiered(folder, tmp_path / "lmdb", **{"model.dtype": "bfloat16"}) as e:
        assert tiers.run_workload(e, between_turns=lambda e: e.flush_cache(["device"])) == want
