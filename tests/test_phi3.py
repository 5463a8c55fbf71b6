"""server/models/phi3.py: Phi-3 / Phi-4-mini against transformers' Phi3ForCausalLM.

Random-weight checkpoints written by transformers (`save_pretrained`), three configs: plain;
partial rotary (0.75, as Phi-4-mini) with a sliding window; longrope with partial rotary
0.5. Every position's logits of a prompt several windows long, prefilled whole and extended
on a cached prefix, in float32 (tight) and bfloat16 (loose); greedy tokens decoded through
the KV pool against transformers' greedy `generate`. The same weights as llama.cpp's `phi3`
GGUF: against transformers reading the file (full rotary; transformers' GGUF reader drops
rope.dimension_count, the window and the longrope factors, so the Phi-4-mini-like file is
compared with the Hugging Face folder of its weights). Through the engine: a cached prefix,
an L2 load-back, L3 after flushing and after a restart give the tokens of recomputation.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import tier_workload as tiers
import torch
import transformers
from arch_reference import (
    add_bpe_vocabulary,
    alloc,
    check_prefilled_and_extended,
    finish_gguf,
    greedy,
    make_pool,
    max_rel,
    random_model,
    save_servable,
    transformers_greedy,
)
from gguf_files import CONTROL, vocabulary
from test_model import assert_rel_close, hf_logits, run

from hicache_server.models import ModelArchConfig, load_model
from hicache_server.models.cpu_forward import LeanForward
from hicache_server.models.fingerprint import model_fingerprint
from hicache_server.models.gguf_tokenizer import GGUFError
from hicache_server.models.phi3 import _gguf_config
from hicache_server.models.registry import GGUFSource

SEED = 7
VOCAB = 300
PROMPT_LEN = 160  # several windows of 40; within the longrope config's 256
PREFIX = 100  # a cached prefix the rest of the prompt extends
GREEDY_STEPS = 16
POOL_PAGES = 32  # 512 slots: two prompts and a decode
BF16_REL = 0.03  # bfloat16 against transformers' bfloat16: noise, not garbage
WINDOW = 40
ORIGINAL_CONTEXT = 256  # the longrope config's original_max_position_embeddings

_COMMON = {"vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 160,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 1024, "initializer_range": 0.1,
           "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
CONFIGS: dict[str, dict[str, Any]] = {
    "plain": {},
    # Phi-4-mini's rotation of the first 3/4 of each head (24 of 32), a window on every layer
    "partial_window": {"partial_rotary_factor": 0.75, "sliding_window": WINDOW},
    # longrope (factor 1024 / 256 = 4: attention factor sqrt(1 + ln 4 / ln 256)), half rotary
    "longrope": {"partial_rotary_factor": 0.5,
                 "original_max_position_embeddings": ORIGINAL_CONTEXT,
                 "rope_scaling": {"rope_type": "longrope",
                                  "short_factor": [1.0 + 0.15 * i for i in range(8)],
                                  "long_factor": [2.0 + 1.5 * i for i in range(8)]}},
}


def phi3_config(kind: str, **overrides: Any) -> transformers.Phi3Config:
    return transformers.Phi3Config(**{**_COMMON, **CONFIGS[kind], **overrides})


def random_phi3(config: transformers.Phi3Config, seed: int = SEED) -> torch.nn.Module:
    return random_model(transformers.Phi3ForCausalLM, config, seed)


def write_checkpoint(kind: str, tmp_path_factory: pytest.TempPathFactory
                     ) -> tuple[Path, torch.nn.Module]:
    """(folder written by transformers, transformers' float32 model) of config `kind`."""
    hf = random_phi3(phi3_config(kind))
    folder = tmp_path_factory.mktemp(kind)
    hf.save_pretrained(folder)
    return folder, hf


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    return write_checkpoint(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    return write_checkpoint("plain", tmp_path_factory)


@pytest.fixture(scope="module")
def longrope(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    return write_checkpoint("longrope", tmp_path_factory)


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(SEED))


# ---------------------------------------------------------------------------------------------
# Random weights against transformers


def test_float32_logits_match_transformers_prefilled_and_extended(
        checkpoint: tuple[Path, torch.nn.Module], prompt: torch.Tensor,
        record_property: Any) -> None:
    folder, hf = checkpoint
    lm = load_model(str(folder), dtype="float32", device="cpu")
    assert type(lm.model).__name__ == "Phi3ForCausalLM"
    ref = hf_logits(hf, prompt)
    err = check_prefilled_and_extended(lm.model, prompt, ref, PREFIX).max_rel
    record_property("float32_max_rel", err)


def test_partial_rotary_longrope_and_the_window_each_matter(
        checkpoint: tuple[Path, torch.nn.Module], prompt: torch.Tensor) -> None:
    """What each config adds changes transformers' logits far past our tolerance: the test
    above checks them, not a Llama that happens to agree."""
    folder, hf = checkpoint
    kind = folder.name.rstrip("0123456789")
    c = load_model(str(folder), dtype="float32", device="cpu").config
    without: dict[str, Any] = {"plain": {}, "partial_window": {"partial_rotary_factor": 1.0},
                               "longrope": {"rope_scaling": None}}[kind]
    if kind == "plain":
        assert (c.rotary_dim, c.rope_scaling, c.layer_windows) == (32, None, ())
        return
    if kind == "partial_window":
        assert c.rotary_dim == 24 and c.layer_windows == (WINDOW,) * 3
        variants = [without, {"sliding_window": None}]
    else:
        assert c.rotary_dim == 16 and c.rope_scaling["rope_type"] == "longrope"
        assert c.rope_scaling["attention_factor"] == math.sqrt(1 + math.log(4) / math.log(256))
        variants = [without, {"partial_rotary_factor": 1.0, "rope_scaling": None}]
    ref = hf_logits(hf, prompt)
    for overrides in variants:
        other = random_phi3(phi3_config(kind, **overrides))
        other.load_state_dict(hf.state_dict())
        assert max_rel(hf_logits(other.eval(), prompt), ref) > 100 * 1e-4, overrides


def test_bfloat16_logits_stay_near_transformers_bfloat16(
        checkpoint: tuple[Path, torch.nn.Module], prompt: torch.Tensor,
        record_property: Any) -> None:
    folder, _ = checkpoint
    lm = load_model(str(folder), dtype="bfloat16", device="cpu")
    assert next(lm.model.parameters()).dtype == torch.bfloat16
    hf = transformers.Phi3ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ref = hf_logits(hf, prompt).float()
    pool = make_pool(lm.config, torch.bfloat16)
    ours = run(lm, pool, prompt, alloc(pool, PROMPT_LEN), prefix=0)
    record_property("bfloat16_max_rel", max_rel(ours, ref))
    assert_rel_close(ours, ref, rel=BF16_REL)


def test_greedy_decode_through_the_pool_is_transformers_greedy(
        checkpoint: tuple[Path, torch.nn.Module], prompt: torch.Tensor) -> None:
    folder, hf = checkpoint
    for dtype in ("float32", "bfloat16"):
        lm = load_model(str(folder), dtype=dtype, device="cpu")
        if lm.model.linear_backend.startswith("CpuLinearKernel") and lm.model.layer_ops != "torch":
            assert LeanForward.build(lm.model.model, lm.config, lm.dtype) is not None
        ids = prompt.tolist()
        if dtype == "float32":
            assert greedy(lm.model, ids, GREEDY_STEPS) == transformers_greedy(hf, ids, GREEDY_STEPS)
        else:  # the lean path's decode steps are the modules' (prefill) arithmetic
            lean = greedy(lm.model, ids, GREEDY_STEPS)
            lm.model.model.lean = None
            assert greedy(lm.model, ids, GREEDY_STEPS) == lean


def test_longrope_context_ends_where_transformers_switches_to_long_factors(
        longrope: tuple[Path, torch.nn.Module], caplog: pytest.LogCaptureFixture) -> None:
    """Past original_max_position_embeddings transformers rotates every position of the
    sequence with long_factor, the earlier ones' logits change with it (a paged cache keeps
    each key rotated once): the context served ends there, and the log says why."""
    folder, hf = longrope
    with caplog.at_level(logging.WARNING):
        lm = load_model(str(folder), dtype="float32", device="cpu")
    assert lm.config.max_position_embeddings == ORIGINAL_CONTEXT
    assert f"original_max_position_embeddings={ORIGINAL_CONTEXT}" in caplog.text
    tokens = torch.randint(0, VOCAB, (ORIGINAL_CONTEXT + 1,),
                           generator=torch.Generator().manual_seed(1))
    early = hf_logits(hf, tokens[:ORIGINAL_CONTEXT])[:100]
    assert max_rel(hf_logits(hf, tokens)[:100], early) > 0.01  # long factors, all positions
    pool = make_pool(lm.config)
    ours = run(lm, pool, tokens[:ORIGINAL_CONTEXT], alloc(pool, ORIGINAL_CONTEXT), prefix=0)
    assert_rel_close(ours[:100], early)  # up to the last position served: short factors


# ---------------------------------------------------------------------------------------------
# config.json


def _phi3_dict(**extra: Any) -> dict[str, Any]:
    return {"architectures": ["Phi3ForCausalLM"], "hidden_size": 128,
            "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 4096} | extra


def test_both_config_generations_parse_alike() -> None:
    """transformers 5's `rope_parameters` (partial_rotary_factor inside) and the older
    `rope_scaling` of type su (Phi-3-128k's first configs) with a top-level factor."""
    factors = {"short_factor": [1.0] * 12, "long_factor": [4.0] * 12}
    new = ModelArchConfig.from_hf_dict(_phi3_dict(
        original_max_position_embeddings=1024, max_position_embeddings=8192,
        rope_parameters={"rope_type": "longrope", "rope_theta": 2e5,
                         "partial_rotary_factor": 0.75, **factors}))
    old = ModelArchConfig.from_hf_dict(_phi3_dict(
        original_max_position_embeddings=1024, max_position_embeddings=8192, rope_theta=2e5,
        partial_rotary_factor=0.75, rope_scaling={"type": "su", **factors}))
    assert new == old
    assert (new.rotary_dim, new.rope_theta, new.max_position_embeddings) == (24, 2e5, 1024)
    assert new.rope_scaling["attention_factor"] == math.sqrt(1 + math.log(8) / math.log(1024))


def test_defaults_windows_and_model_type() -> None:
    """What a config.json leaves out is Phi3Config's default; a window shorter than the
    context applies on every layer, a longer one (Phi-4-mini's 262144) is dropped."""
    c = ModelArchConfig.from_hf_dict({"model_type": "phi3", "sliding_window": 2047})
    assert c.architecture == "Phi3ForCausalLM"
    assert (c.hidden_size, c.head_dim, c.vocab_size, c.rotary_dim) == (3072, 96, 32064, 96)
    assert c.layer_windows == (2047,) * 32 and c.max_position_embeddings == 4096
    assert c.eos_token_ids == (32000,) and not c.tie_word_embeddings
    wide = ModelArchConfig.from_hf_dict(_phi3_dict(sliding_window=262144))
    assert wide.sliding_window == 262144 and wide.layer_windows == ()
    assert wide.window_of(0) is None


@pytest.mark.parametrize(("extra", "match"), [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope type 'llama3'"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 15,
                       "long_factor": [1.0] * 16}}, "short_factor must hold 16"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"partial_rotary_factor": 0.3}, "rotary"),
])
def test_config_refuses_what_is_not_computed(extra: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelArchConfig.from_hf_dict(_phi3_dict(**extra))


def test_partial_rotary_factor_is_part_of_the_fingerprint(
        plain: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    """Two folders of the same weights whose configs differ only in partial_rotary_factor
    compute different K: their pages never meet."""
    folder, _ = plain
    config = json.loads((folder / "config.json").read_text())
    folders = []
    for factor in (1.0, 0.75):
        copy = tmp_path / str(factor)
        copy.mkdir()
        (copy / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
        config["partial_rotary_factor"] = factor
        config.get("rope_parameters", {}).pop("partial_rotary_factor", None)
        (copy / "config.json").write_text(json.dumps(config))
        folders.append(copy)
    a, b = (ModelArchConfig.from_file(f) for f in folders)
    assert a.rotary_dim != b.rotary_dim
    assert model_fingerprint(folders[0]) != model_fingerprint(folders[1])


def test_a_fused_tensor_of_another_height_is_named(plain: tuple[Path, torch.nn.Module]) -> None:
    folder, hf = plain
    lm = load_model(str(folder), dtype="float32", device="cpu")
    weights = dict(hf.state_dict())
    name = "model.layers.1.self_attn.qkv_proj.weight"
    weights[name] = weights[name][:-1]
    with pytest.raises(ValueError, match="qkv_proj.weight' has shape"):
        lm.model.load_weights(weights.items())


# ---------------------------------------------------------------------------------------------
# llama.cpp's phi3 GGUF


def write_phi3_gguf(path: Path, hf: torch.nn.Module) -> Path:
    """`hf`'s weights as convert_hf_to_gguf.py's Phi3MiniModel writes them: q|k|v fused in
    attn_qkv and gate|up in ffn_up, unpermuted; the rotated dims, the original context, the
    window (0: none); longrope's factors as tensors beside the attention factor."""
    c = hf.config
    params = c.rope_parameters
    tokens = vocabulary()[0]
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_name("tiny-phi3")
    for add, value in ((w.add_block_count, c.num_hidden_layers),
                       (w.add_context_length, c.max_position_embeddings),
                       (w.add_rope_scaling_orig_ctx_len, c.original_max_position_embeddings),
                       (w.add_embedding_length, c.hidden_size),
                       (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads),
                       (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_rope_dimension_count,
                        int(params["partial_rotary_factor"] * c.hidden_size)
                        // c.num_attention_heads),
                       (w.add_sliding_window, c.sliding_window or 0),
                       (w.add_vocab_size, len(tokens))):
        add(value)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(params["rope_theta"])
    add_bpe_vocabulary(w, "smollm")
    w.add_bos_token_id(tokens.index(CONTROL[0]))
    w.add_eos_token_id(tokens.index(CONTROL[1]))
    w.add_pad_token_id(tokens.index(CONTROL[1]))  # transformers' default 32000 is past the vocab
    if params.get("rope_type") == "longrope":
        scale = c.max_position_embeddings / c.original_max_position_embeddings
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(c.original_max_position_embeddings)))
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight",
                         np.array(params[f"{kind}_factor"], dtype=np.float32))
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
             "lm_head": "output", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv",
             "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for name, tensor in hf.state_dict().items():
        module = name.removesuffix(".weight")
        if module.startswith("model.layers."):
            layer, rest = module.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{names[rest]}.weight"
        else:
            gguf_name = f"{names[module]}.weight"
        w.add_tensor(gguf_name, tensor.float().numpy())
    return finish_gguf(w, path)


GGUF_VOCAB = len(vocabulary()[0])
GGUF_KINDS = {
    "plain": {},
    # Phi-4-mini's partial rotary: rope.dimension_count below the head dim
    "partial": {"partial_rotary_factor": 0.75},
    # longrope's factors as tensors, its attention factor, the original context and a window
    "longrope_window": {"sliding_window": WINDOW,
                        "original_max_position_embeddings": ORIGINAL_CONTEXT,
                        "rope_scaling": {"rope_type": "longrope",
                                         "short_factor": [1.0 + 0.1 * i for i in range(16)],
                                         "long_factor": [3.0 + i for i in range(16)]}},
}


@pytest.fixture(scope="module", params=list(GGUF_KINDS))
def gguf_file(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """(a phi3 GGUF file, transformers' float32 model whose weights it holds)."""
    hf = random_phi3(transformers.Phi3Config(**{**_COMMON, "vocab_size": GGUF_VOCAB,
                                                **GGUF_KINDS[request.param]}))
    folder = tmp_path_factory.mktemp(f"gguf-{request.param}")
    return write_phi3_gguf(folder / f"tiny-{request.param}.gguf", hf), hf


def test_phi3_file_gives_transformers_logits(gguf_file: tuple[Path, torch.nn.Module],
                                             prompt: torch.Tensor,
                                             record_property: Any) -> None:
    """The fused tensors loaded as the folder's, the metadata read as the converter wrote
    it. The plain file against transformers reading the file itself; the longrope one
    against the Hugging Face model it was written from, since transformers' GGUF reader
    drops the window and the longrope factors."""
    path, hf = gguf_file
    prompt = prompt % GGUF_VOCAB
    lm = load_model(str(path), dtype="float32", device="cpu")
    c = lm.config
    assert c.architecture == "Phi3ForCausalLM" and c.vocab_size == GGUF_VOCAB
    if path.stem.endswith("plain"):
        assert (c.rotary_dim, c.rope_scaling, c.layer_windows) == (32, None, ())
        ref = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval(), prompt)
    elif path.stem.endswith("partial"):
        assert (c.rotary_dim, c.rope_scaling) == (24, None)
        ref = hf_logits(hf, prompt)
    else:
        assert c.layer_windows == (WINDOW,) * 3 and c.max_position_embeddings == ORIGINAL_CONTEXT
        assert c.rope_scaling["short_factor"] == pytest.approx(
            GGUF_KINDS["longrope_window"]["rope_scaling"]["short_factor"])
        ref = hf_logits(hf, prompt)
    pool = make_pool(c)
    ours = run(lm, pool, prompt, alloc(pool, PROMPT_LEN), prefix=0)
    record_property("float32_max_rel", max_rel(ours, ref))
    assert_rel_close(ours, ref)


# ---------------------------------------------------------------------------------------------
# Through the engine's tiers (tests/test_gemma3_tiers.py's workload)



@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The partial-rotary, windowed Phi-3 as a folder the engine serves: the byte tokenizer
    (its ids fit the vocabulary)."""
    hf = random_phi3(phi3_config("partial_window", bos_token_id=256, eos_token_id=257,
                                 pad_token_id=258))
    return save_servable(hf, tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def reference(served: Path) -> torch.nn.Module:
    return transformers.Phi3ForCausalLM.from_pretrained(served, dtype=torch.float32).eval()


class TestTiers(tiers.TierChecks):
    """Cached prefixes, L2 load-back and L3 give the tokens of recomputation."""


def _phi4_mini_source(**meta: Any) -> GGUFSource:
    """Phi-4-mini-instruct's metadata as convert_hf_to_gguf.py writes it (its config.json:
    hidden 3072, 24 heads of 128, 3/4 rotated, 131072 positions of an original 4096, window
    262144), its 48 short and long factors as tensors."""
    keys = {"embedding_length": 3072, "attention.head_count": 24,
            "attention.head_count_kv": 8, "rope.dimension_count": 96,
            "context_length": 131072, "rope.scaling.original_context_length": 4096,
            "attention.sliding_window": 262144,
            "rope.scaling.attn_factor": math.sqrt(1 + math.log(32) / math.log(4096))} | meta
    tensors = {"rope_factors_long.weight": np.linspace(1.0, 40.0, 48, dtype=np.float32),
               "rope_factors_short.weight": np.linspace(1.0, 2.0, 48, dtype=np.float32)}
    return GGUFSource(Path("phi-4-mini.gguf"), {"general.architecture": "phi3",
                                                **{f"phi3.{k}": v for k, v in keys.items()}},
                      frozenset(tensors), read=lambda name: tensors[name])


def test_phi4_mini_metadata_gives_its_config() -> None:
    """The rotated dims as partial_rotary_factor 0.75, the factors read from their tensors,
    the converter's attention factor, the context served ending at the original 4096 and
    the window past it dropped."""
    keys = _gguf_config(_phi4_mini_source())
    assert keys["partial_rotary_factor"] == 0.75 and keys["sliding_window"] == 262144
    c = ModelArchConfig.from_hf_dict(_phi3_dict(
        hidden_size=3072, num_attention_heads=24, num_key_value_heads=8,
        max_position_embeddings=131072, **keys))
    assert (c.head_dim, c.rotary_dim, c.max_position_embeddings) == (128, 96, 4096)
    assert c.layer_windows == ()
    assert c.rope_scaling["short_factor"] == pytest.approx(np.linspace(1.0, 2.0, 48).tolist())
    assert c.rope_scaling["attention_factor"] == pytest.approx(1.1902380714238083)
    assert _gguf_config(_phi4_mini_source(**{"attention.sliding_window": 0}))[
        "sliding_window"] is None


@pytest.mark.parametrize("rotary", [95, 130, 0])
def test_phi3_metadata_refuses_rotary_dims_not_computed(rotary: int) -> None:
    with pytest.raises(GGUFError, match=f"rope.dimension_count {rotary} is not an even part"):
        _gguf_config(_phi4_mini_source(**{"rope.dimension_count": rotary}))


def test_phi3_metadata_refuses_one_factors_tensor_without_the_other() -> None:
    source = _phi4_mini_source()
    half = source._replace(tensor_names=frozenset({"rope_factors_long.weight"}))
    with pytest.raises(GGUFError, match="needs both"):
        _gguf_config(half)
