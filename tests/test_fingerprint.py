"""The model fingerprint the L3 page keys are rooted in: stable, path-free, different for
every model, and pinned (pages stored under an earlier value must still be found)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hicache.storage.hashing import PageHasher
from hicache_server.models.config import ModelArchConfig
from hicache_server.models.fingerprint import model_fingerprint


def write_safetensors_by_hand(folder: Path) -> Path:
    """One float32 [2, 2] tensor in a safetensors file written byte by byte (the library's
    own writer may lay a header out differently from one release to the next)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama",
                                                    "num_hidden_layers": 2}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}})
    header += " " * (-len(header) % 8)  # the format pads its header to 8 bytes
    (folder / "model.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header.encode() + struct.pack("<4f", 1, 2, 3, 4))
    return folder


# Frozen once (computed when the fingerprint lived in hicache/storage/hashing.py): a change
# here orphans every L3 page stored by every user.
GOLDEN_FINGERPRINT = "d35328e3b1cc6db7c9bf4a5dc8a6a6fb"
GOLDEN_PAGE_HEX = "85569adf7822bc228ea352e7b8f754c4"  # tokens [1, 2, 3, 4], pages of 2 (page format v3)


def test_golden_fingerprint_and_page_key_are_pinned(tmp_path: Path) -> None:
    fingerprint = model_fingerprint(write_safetensors_by_hand(tmp_path / "m"))
    assert fingerprint == GOLDEN_FINGERPRINT
    hasher = PageHasher(2, fingerprint, "float32", 2, 1, 4)
    assert hasher.hash_pages([1, 2, 3, 4])[-1].hex() == GOLDEN_PAGE_HEX


def write_model(folder: Path, config: dict[str, object], weights: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(folder / "model.safetensors"))
    return folder


CONFIG = {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 2}


def weights(rows: int = 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(rows, 8, generator=gen),
            "norm.weight": torch.ones(8)}


def test_model_fingerprint_is_stable_and_path_free(tmp_path: Path) -> None:
    model = write_model(tmp_path / "a", CONFIG, weights())
    first = model_fingerprint(model)
    assert first == model_fingerprint(str(model))
    assert len(first) == 32 and int(first, 16) >= 0
    copy = shutil.copytree(model, tmp_path / "elsewhere" / "b")
    assert model_fingerprint(copy) == first
    # Key order and whitespace of config.json do not matter: it is hashed canonically.
    (copy / "config.json").write_text(json.dumps(dict(reversed(CONFIG.items()))))
    assert model_fingerprint(copy) == first


@pytest.mark.parametrize("variant", ["shape", "config", "dtype", "values", "extra_file"])
def test_model_fingerprint_changes_with_the_model(tmp_path: Path, variant: str) -> None:
    base = model_fingerprint(write_model(tmp_path / "base", CONFIG, weights()))
    config, tensors = dict(CONFIG), weights()
    if variant == "shape":
        tensors = weights(rows=5)
    elif variant == "config":
        config["num_hidden_layers"] = 3
    elif variant == "dtype":
        tensors = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
    elif variant == "values":  # a fine-tune: same config, shapes and dtypes (same header)
        tensors = {k: v + 0.01 for k, v in tensors.items()}
    other = write_model(tmp_path / "other", config, tensors)
    if variant == "extra_file":
        save_file({"lm_head.weight": torch.zeros(2, 8)}, str(other / "z-extra.safetensors"))
    assert model_fingerprint(other) != base


def test_model_fingerprint_rejects_incomplete_folders(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        model_fingerprint(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read its config.json"):
        model_fingerprint(tmp_path)
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(ValueError, match="config.json is a JSON list"):
        model_fingerprint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="safetensors"):
        model_fingerprint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 12)
    with pytest.raises(ValueError, match="not a safetensors file"):
        model_fingerprint(tmp_path)


def test_mistral_window_is_part_of_the_fingerprint(tmp_path: Path) -> None:
    """Mistral's window is applied, so two windows are two models: their pages never meet,
    whatever the weights."""
    mistral = {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
               "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
               "num_attention_heads": 2, "vocab_size": 4}
    prints, windows = [], []
    for window in (32, 64):
        config = mistral | {"sliding_window": window}
        prints.append(model_fingerprint(write_model(tmp_path / str(window), config, weights())))
        windows.append(ModelArchConfig.from_hf_dict(config).layer_windows)
    assert windows == [(32, 32), (64, 64)]
    assert prints[0] != prints[1]
