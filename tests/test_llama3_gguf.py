"""Llama 3.x GGUFs: llama.cpp's converter stores Llama 3's RoPE scaling as a `rope_freqs.weight`
tensor of per-frequency factors and leaves the llama3 parameters out of the metadata; the
engine divides each inverse frequency by its factor, as llama.cpp does.

The reference is transformers' LlamaForCausalLM with the llama3 scaling the factors were made
from, over the file's weights as transformers' GGUF reader dequantises and un-permutes them
(its reader itself drops `rope_freqs`: a test shows what that costs), and the same weights
saved as a Hugging Face folder and served from there."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from arch_reference import alloc, make_pool, max_rel
from gguf import GGMLQuantizationType as Q
from gguf_files import HEAD_DIM, llama3_rope_factors, write_gguf
from test_model import assert_rel_close, hf_logits, run

from hicache_server.models import load_model
from hicache_server.models.gguf import GGUFError
from hicache_server.models.loader import resolve_model
from hicache_server.models.rope import rope_inv_freq

pytest.importorskip("accelerate")  # transformers needs it to read a GGUF (the reference)
THETA = 500_000.0  # Llama 3's
# Llama 3.1's scaling (8B, 70B, 405B): transformers' rope_parameters
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
CONTEXT = 16384  # past the original 8192, as transformers wants of a llama3 scaling
PROMPT_LEN = 300  # long enough for the slow frequencies to turn: where the factors act
POOL_PAGES = 19  # 304 slots


@pytest.fixture(scope="module")
def factors() -> np.ndarray:
    return llama3_rope_factors(THETA, LLAMA31)


@pytest.fixture(scope="module", params=[Q.F32, Q.Q8_0], ids=lambda t: t.name)
def files(request: pytest.FixtureRequest, factors: np.ndarray,
          tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a Llama 3.1-style GGUF, the Hugging Face folder of its weights with its llama3
    scaling, as transformers reads the file)."""
    tmp = tmp_path_factory.mktemp(f"llama31-{request.param.name}")
    path = write_gguf(tmp / "tiny-llama31.gguf", request.param, rope_theta=THETA,
                      rope_freqs=factors, context_length=CONTEXT)
    read = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp), gguf_file=path.name, dtype=torch.float32)
    fields = {k: v for k, v in read.config.to_dict().items() if k != "quantization_config"}
    config = transformers.LlamaConfig.from_dict(
        fields | {"rope_parameters": {**LLAMA31, "rope_theta": THETA}})
    hf = transformers.LlamaForCausalLM(config)
    hf.load_state_dict(read.state_dict())
    hf.save_pretrained(tmp / "hf")
    return path, tmp / "hf"


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, 263, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5))


def reference(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_the_factors_are_the_converters_three_bands(factors: np.ndarray) -> None:
    """The test file exercises all three: kept, slowed by `factor`, smoothed between."""
    assert factors.shape == (HEAD_DIM // 2,)
    assert (factors == 1).any() and (factors == LLAMA31["factor"]).any()
    assert ((factors > 1) & (factors < LLAMA31["factor"])).sum() >= 2


def test_the_factors_give_transformers_llama3_frequencies(files: tuple[Path, Path]) -> None:
    path, _ = files
    config = load_model(str(path), dtype="float32", device="cpu").config
    assert config.rope_scaling["rope_type"] == "rope_freqs" and config.rope_theta == THETA
    ours = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    theirs = rope_inv_freq(config.head_dim, THETA, LLAMA31)  # transformers' (test_model)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert not torch.equal(ours, rope_inv_freq(config.head_dim, THETA, None))


def test_gguf_logits_match_transformers_llama3(files: tuple[Path, Path],
                                               prompt: torch.Tensor) -> None:
    path, folder = files
    lm = load_model(str(path), dtype="float32", device="cpu")
    pool = make_pool(lm.config, pages=POOL_PAGES)
    slots = alloc(pool, PROMPT_LEN)
    ours = run(lm, pool, prompt, slots, prefix=0)
    assert_rel_close(ours, hf_logits(reference(folder), prompt))
    # the folder of the same weights, served: the same model but for RoPE's last bits
    from_folder = load_model(str(folder), dtype="float32", device="cpu")
    assert from_folder.config.rope_scaling["rope_type"] == "llama3"
    assert_rel_close(ours, run(from_folder, pool, prompt, slots, prefix=0))


def test_without_the_factors_the_logits_are_far(files: tuple[Path, Path],
                                                prompt: torch.Tensor) -> None:
    """transformers' own GGUF reader drops rope_freqs (no llama3 scaling): its logits are
    far from the scaled model's, so the comparison above can fail."""
    path, folder = files
    plain = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    assert plain.config.rope_parameters.get("rope_type", "default") == "default"
    scaled = hf_logits(reference(folder), prompt)
    assert max_rel(hf_logits(plain, prompt), scaled) > 100 * 1e-4


def test_the_factors_are_not_a_weight_and_key_the_companion(files: tuple[Path, Path],
                                                            factors: np.ndarray) -> None:
    """rope_freqs goes into config.json (which the fingerprint hashes), not the weights."""
    path, _ = files
    import json

    config = json.loads((resolve_model(str(path)).folder / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "rope_freqs",
                                      "factors": factors.tolist()}


def test_factors_beside_other_scaling_or_of_the_wrong_length_are_refused(
        tmp_path: Path, factors: np.ndarray) -> None:
    both = write_gguf(tmp_path / "both.gguf", rope_freqs=factors,
                      extra={"llama.rope.scaling.type": "linear",
                             "llama.rope.scaling.factor": 2.0})
    with pytest.raises(GGUFError, match="rope_freqs.weight beside rope scaling 'linear'"):
        load_model(str(both), device="cpu")
    short = write_gguf(tmp_path / "short.gguf", rope_freqs=factors[:-2])
    with pytest.raises(ValueError, match="needs head_dim / 2 = 32 factors, got 30"):
        load_model(str(short), device="cpu")
