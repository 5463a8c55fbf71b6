"""Page hash chain, namespaces and model fingerprints: deterministic across processes."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import save_file

from hicache.storage.hashing import (
    DIGEST_BYTES,
    MAX_TOKEN_ID,
    PageHasher,
    model_fingerprint,
    namespace,
)

REPO = Path(__file__).resolve().parents[1]
FIELDS = {"page_size": 2, "model_fingerprint": "f00d", "dtype": "float32", "num_layers": 2,
          "kv_heads": 1, "head_dim": 4}
TOKENS = [1, 2, 3, 4, 5, 6, 7]  # three full pages of 2, and one token that is never hashed


def make_hasher(**changes: object) -> PageHasher:
    return PageHasher(**{**FIELDS, **changes})  # type: ignore[arg-type]


def test_golden_chain_by_hand() -> None:
    ns = (b'{"dtype":"float32","extra_key":null,"head_dim":4,"kv_heads":1,'
          b'"model_fingerprint":"f00d","num_layers":2,"page_size":2,"tp_rank":0,"tp_size":1}')
    assert namespace("f00d", "float32", 2, 2, 1, 4) == ns
    h0 = xxhash.xxh3_128_digest(b"hicache/v1" + ns)
    h1 = xxhash.xxh3_128_digest(h0 + struct.pack("<2I", 1, 2))
    h2 = xxhash.xxh3_128_digest(h1 + struct.pack("<2I", 3, 4))
    h3 = xxhash.xxh3_128_digest(h2 + struct.pack("<2I", 5, 6))
    hasher = make_hasher()
    assert hasher.root() == h0
    assert hasher.hash_pages(TOKENS) == [h1, h2, h3]
    assert all(len(h) == DIGEST_BYTES for h in (h0, h1, h2, h3))


def test_golden_vector_is_pinned() -> None:
    # Frozen once: a change here means every stored L3 page of every user is orphaned.
    last = make_hasher().hash_pages(TOKENS)[-1]
    assert last == make_hasher().hash_pages(torch.tensor(TOKENS))[-1]
    assert last.hex() == GOLDEN_LAST_HEX


GOLDEN_LAST_HEX = "f4958e89b2dce5b7627fcb077c1def22"


def test_chaining_from_prev_equals_whole_sequence() -> None:
    hasher = make_hasher()
    tokens = list(range(100, 120))  # 10 pages
    whole = hasher.hash_pages(tokens, extra_key="salt")
    head = hasher.hash_pages(tokens[:6], extra_key="salt")
    tail = hasher.hash_pages(tokens[6:], prev=head[-1])
    assert head + tail == whole
    assert hasher.hash_pages(tokens[6:], prev=head[-1], extra_key="ignored") == tail


def test_partial_last_page_is_ignored() -> None:
    hasher = make_hasher(page_size=4)
    assert hasher.hash_pages(list(range(11))) == hasher.hash_pages(list(range(8)))
    assert len(hasher.hash_pages(list(range(11)))) == 2
    assert hasher.hash_pages([1, 2, 3]) == [] and hasher.hash_pages([]) == []


@pytest.mark.parametrize("as_input", [list, tuple, lambda t: torch.tensor(t, dtype=torch.int32),
                                      lambda t: torch.tensor(t, dtype=torch.int64)])
def test_input_types_agree(as_input: object) -> None:
    hasher = make_hasher()
    assert hasher.hash_pages(as_input(TOKENS)) == hasher.hash_pages(TOKENS)  # type: ignore


@pytest.mark.parametrize("bad", [-1, MAX_TOKEN_ID + 1, 2**70])
def test_tokens_outside_uint32_raise(bad: int) -> None:
    hasher = make_hasher()
    with pytest.raises(ValueError, match="token|integer"):
        hasher.hash_pages([1, bad, 3, 4])
    assert len(hasher.hash_pages([0, MAX_TOKEN_ID])) == 1


def test_same_hashes_in_another_process_with_another_hash_seed() -> None:
    code = (
        "from hicache.storage.hashing import PageHasher\n"
        f"h = PageHasher(**{FIELDS!r})\n"
        "print(h.root('x').hex(), *[k.hex() for k in h.hash_pages(list(range(40)), "
        "extra_key='x')])\n"
    )
    here = make_hasher()
    expected = [here.root("x").hex()] + [k.hex() for k in here.hash_pages(list(range(40)),
                                                                          extra_key="x")]
    # This process runs with a random hash seed (or the one pytest was given): another one.
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    assert out == expected


@pytest.mark.parametrize("change", [
    {"extra_key": "tenant-a"}, {"dtype": "bfloat16"}, {"page_size": 4}, {"tp_rank": 1},
    {"tp_size": 2}, {"model_fingerprint": "beef"}, {"num_layers": 3}, {"kv_heads": 2},
    {"head_dim": 8},
])
def test_each_namespace_field_changes_the_root(change: dict[str, object]) -> None:
    extra_key = change.pop("extra_key", None)
    if change.get("tp_rank"):
        change["tp_size"] = 2
    base = make_hasher()
    other = make_hasher(**change)
    assert other.root(extra_key) != base.root()
    assert other.hash_pages([1, 2, 3, 4], extra_key=extra_key)[0] != base.hash_pages([1, 2])[0]


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="page_size"):
        make_hasher(page_size=0)
    with pytest.raises(ValueError, match="tp_rank"):
        make_hasher(tp_rank=1, tp_size=1)
    with pytest.raises(ValueError, match="16-byte"):
        make_hasher().hash_pages([1, 2], prev=b"short")


# ----------------------------------------------------------------------- model fingerprint


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
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="safetensors"):
        model_fingerprint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 12)
    with pytest.raises(ValueError, match="not a safetensors file"):
        model_fingerprint(tmp_path)
