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
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def reference(served: Path) -> torch.nn.Module:
    from transformers import Gemma3ForCausalLM

    return Gemma3ForCausalLM.from_pretrained(served, dtype=torch.float32).eval()


class TestTiers(tiers.TierChecks):
    """Cached prefixes, L2 load-back and L3 give the tokens of recomputation."""


def test_bfloat16_cached_prefixes_give_the_tokens_of_recomputation(served: Path,
                                                                   tmp_path: Path) -> None:
    tiers.check_bfloat16_cached_prefixes(served, tmp_path / "lmdb")
