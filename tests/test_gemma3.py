"""server/models/gemma3.py: Gemma 3 against transformers' Gemma3ForCausalLM.

Random-weight checkpoints written by transformers (`save_pretrained`) and loaded by
`load_model`: every position's logits of a prompt several windows long, prefilled whole and
extended on a cached prefix, in float32 (tight) and bfloat16 (loose), and greedy tokens
decoded through the KV pool against transformers' greedy `generate`. Then the real Gemma 3
270M (the Q4_K_M GGUF named `gemma3-270m`) against transformers reading the same file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from arch_reference import (
    GEMMA_NORMS,
    alloc,
    check_every_layer_writes_its_kv_in_hook_order,
    check_prefilled_and_extended,
    greedy,
    logits_of,
    make_pool,
    max_rel,
    random_model,
    transformers_greedy,
)
from conftest import missing_tool, needs_cpu_kernel
from test_model import assert_rel_close, hf_logits

from hicache_server.models import LoadedModel, ModelArchConfig, load_model
from hicache_server.models.cpu_forward import LeanForward
from hicache_server.models.kernels import cpu_layer
from hicache_server.models.linear import Linear
from hicache_server.models.named import named_model_file

SEED = 3
PROMPT_LEN = 160  # several windows of every config below
PREFIX = 100  # a cached prefix the rest of the prompt extends
GREEDY_STEPS = 20
BF16_REL = 0.03  # bfloat16 against transformers' bfloat16 (measured 0.6-1.1%): noise, not garbage
SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA3_MODEL = "gemma3-270m"
# The real model: a prompt of ~100 tokens, and the completion whose greedy tokens must agree.
REAL_TEXT = ("The history of the city stretches back more than two thousand years. It began as "
             "a small settlement on an island in the river, grew into a market town under the "
             "Romans, and became the seat of kings in the Middle Ages. Its bridges, churches and "
             "long avenues were rebuilt many times, and today millions of visitors walk along "
             "the same streets every year to see the museums, the gardens and the old quarter. "
             "In the evening the cafes fill with people who talk until late about the day.")
REAL_QUESTION = "The capital of France is"
REAL_STEPS = 12

_COMMON = {"vocab_size": 300, "intermediate_size": 160, "max_position_embeddings": 2048,
           "initializer_range": 0.2, "bos_token_id": None, "eos_token_id": None,
           "pad_token_id": None}
CONFIGS: dict[str, dict[str, Any]] = {
    # sliding and full layers in turn; query_pre_attn_scalar 24, not the head dim 32
    "mixed": {"hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "sliding_window": 32,
              "query_pre_attn_scalar": 24, "layer_types": [SLIDING, SLIDING, FULL] * 2},
    # one KV head (as the 270M), layer types from a pattern, linear RoPE scaling on the
    # full layers only
    "pattern": {"hidden_size": 128, "num_hidden_layers": 5, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 64, "sliding_window": 48,
                "query_pre_attn_scalar": 64, "sliding_window_pattern": 2,
                "rope_parameters": {FULL: {"rope_type": "linear", "factor": 4.0,
                                           "rope_theta": 1e6},
                                    SLIDING: {"rope_type": "default", "rope_theta": 1e4}}},
}


def gemma3_config(kind: str) -> transformers.Gemma3TextConfig:
    return transformers.Gemma3TextConfig(**_COMMON, **CONFIGS[kind])


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """(folder written by transformers, transformers' float32 model) of each config."""
    hf = random_model(transformers.Gemma3ForCausalLM, gemma3_config(request.param), SEED,
                      GEMMA_NORMS)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return folder, hf


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, _COMMON["vocab_size"], (PROMPT_LEN,),
                         generator=torch.Generator().manual_seed(SEED))


# ---------------------------------------------------------------------------------------------
# Random weights against transformers


def test_float32_logits_match_transformers_prefilled_and_extended(
        checkpoint: tuple[Path, torch.nn.Module], prompt: torch.Tensor,
        record_property: Any) -> None:
    folder, hf = checkpoint
    lm = load_model(str(folder), dtype="float32", device="cpu")
    assert type(lm.model).__name__ == "Gemma3ForCausalLM"
    assert None in lm.config.layer_windows and PROMPT_LEN > 3 * lm.config.sliding_window
    ref = hf_logits(hf, prompt)
    whole, _, err = check_prefilled_and_extended(lm.model, prompt, ref, PREFIX)
    record_property("float32_max_rel", err)
    # the windows matter: the same weights with windows wider than the prompt differ
    wide = transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig.from_dict({**hf.config.to_dict(), "sliding_window": 4096}))
    wide.load_state_dict(hf.state_dict())
    assert max_rel(whole, hf_logits(wide.eval(), prompt)) > 100 * max_rel(whole, ref)


def test_bfloat16_logits_stay_near_transformers_bfloat16(
        checkpoint: tuple[Path, torch.nn.Module], prompt: torch.Tensor,
        record_property: Any) -> None:
    folder, _ = checkpoint
    lm = load_model(str(folder), dtype="bfloat16", device="cpu")
    assert next(lm.model.parameters()).dtype == torch.bfloat16
    hf = transformers.Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ref = hf_logits(hf, prompt).float()
    pool = make_pool(lm.config, torch.bfloat16)
    ours = logits_of(lm.model, pool, prompt, alloc(pool, PROMPT_LEN), prefix=0)
    assert ours.dtype == torch.float32
    record_property("bfloat16_max_rel", max_rel(ours, ref))
    assert_rel_close(ours, ref, rel=BF16_REL)


def test_greedy_decode_through_the_pool_is_transformers_greedy(
        checkpoint: tuple[Path, torch.nn.Module], prompt: torch.Tensor) -> None:
    folder, hf = checkpoint
    lm = load_model(str(folder), dtype="float32", device="cpu")
    ids = prompt.tolist()
    assert greedy(lm.model, ids, GREEDY_STEPS) == transformers_greedy(hf, ids, GREEDY_STEPS)


def test_every_layer_writes_its_kv_and_meets_the_hook_in_order(
        checkpoint: tuple[Path, torch.nn.Module], prompt: torch.Tensor) -> None:
    lm = load_model(str(checkpoint[0]), device="cpu")
    check_every_layer_writes_its_kv_in_hook_order(lm.model, prompt)


def test_gemma_lean_path_and_every_layer_op_on_the_layer_kernel(
        checkpoint: tuple[Path, torch.nn.Module]) -> None:
    """LeanForward.build binds Llama's layers, build_gemma_lean Gemma's (test_cpu_forward.py
    compares their bits); the layer kernel runs Gemma's norms (the q/k norms too), RoPE and
    GeGLU, every one of them where it builds."""
    lm = load_model(str(checkpoint[0]), device="cpu")
    assert LeanForward.build(lm.model.model, lm.config, lm.dtype) is None
    lean = lm.model.model.lean
    assert (lean is not None) == (lm.model.layer_ops == "CpuLayerKernel"
                                  and lm.model.model.norm.kernel is not None
                                  and lm.model.linear_backend.startswith("CpuLinearKernel"))
    assert lean is None or lean.new_plan.__module__.endswith("gemma_forward")
    on_layer_kernel = {name for name, m in lm.model.named_modules()
                       if hasattr(m, "kernel") and not isinstance(m, Linear)}
    layers = lm.config.num_hidden_layers
    per_layer = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm", "mlp")
    assert on_layer_kernel == {"model.rotary_emb", "model.rotary_emb_local", "model.norm",
                               *(f"model.layers.{i}.{op}" for i in range(layers)
                                 for op in per_layer)}
    kernels = {lm.model.get_submodule(name).kernel for name in on_layer_kernel}
    if cpu_layer.supported():
        assert lm.model.layer_ops == "CpuLayerKernel" and None not in kernels
        assert len(kernels) == 1
    else:
        assert lm.model.layer_ops == "torch" and kernels == {None}


@pytest.mark.parametrize(("dtype", "rel"), [("float32", 1e-5), ("bfloat16", BF16_REL)])
def test_the_layer_kernel_and_torchs_ops_agree(checkpoint: tuple[Path, torch.nn.Module],
                                               prompt: torch.Tensor, dtype: str,
                                               rel: float) -> None:
    """The same model on the layer kernel and on its torch references (the
    HICACHE_CPU_LAYER_OPS=torch path, and every non-CPU device's): the logits of every
    position agree within float rounding, the bfloat16 ones within bfloat16's."""
    if not cpu_layer.supported():
        needs_cpu_kernel("the CPU layer kernels")
    lm = load_model(str(checkpoint[0]), dtype=dtype, device="cpu")
    kernel = lm.model.model.norm.kernel
    assert kernel is not None
    pool = make_pool(lm.config, lm.dtype)
    slots = alloc(pool, PROMPT_LEN)
    on_kernel = logits_of(lm.model, pool, prompt, slots, prefix=0)
    lm.model.use_layer_kernel(None)
    assert lm.model.layer_ops == "torch"
    on_torch = logits_of(lm.model, pool, prompt, slots, prefix=0)
    assert not torch.equal(on_kernel, on_torch)  # the kernel ran: its float32 rounds differ
    assert_rel_close(on_kernel, on_torch, rel=rel)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_float32_matches_transformers(checkpoint: tuple[Path, torch.nn.Module],
                                           prompt: torch.Tensor) -> None:
    """On CUDA (TorchAttention for prefills, the paged kernel for decodes, windows on both):
    transformers' logits and greedy tokens."""
    folder, hf = checkpoint
    lm = load_model(str(folder), dtype="float32", device="cuda")
    pool = make_pool(lm.config, torch.float32, lm.device)
    ours = logits_of(lm.model, pool, prompt, alloc(pool, PROMPT_LEN), prefix=0).cpu()
    assert_rel_close(ours, hf_logits(hf, prompt))
    ids = prompt.tolist()
    assert greedy(lm.model, ids, GREEDY_STEPS) == transformers_greedy(hf, ids, GREEDY_STEPS)


# ---------------------------------------------------------------------------------------------
# config.json


def _gemma3_dict(**extra: Any) -> dict[str, Any]:
    return {"architectures": ["Gemma3ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
            "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 300,
            "sliding_window": 16} | extra


def test_both_config_generations_parse_alike() -> None:
    """transformers 5's `rope_parameters` per layer type and `layer_types`, and the older
    `rope_theta` / `rope_scaling` / `rope_local_base_freq` / `sliding_window_pattern`."""
    new = ModelArchConfig.from_hf_dict(_gemma3_dict(
        layer_types=[SLIDING, FULL] * 3, query_pre_attn_scalar=48,
        rope_parameters={FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 5e5},
                         SLIDING: {"rope_type": "default", "rope_theta": 2e4}}))
    old = ModelArchConfig.from_hf_dict(_gemma3_dict(
        sliding_window_pattern=2, query_pre_attn_scalar=48, rope_theta=5e5,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_local_base_freq=2e4))
    assert new == old
    assert new.layer_windows == (16, None) * 3
    assert (new.window_of(0), new.window_of(1)) == (16, None)
    assert (new.rope_theta, new.rope_local_theta) == (5e5, 2e4)
    assert new.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert new.attention_scale == 48 ** -0.5 and new.tie_word_embeddings


def test_gemma3_defaults_and_model_type() -> None:
    """What a config.json leaves out is Gemma3TextConfig's default (every 6th layer full,
    RoPE bases 1e6 / 1e4, scalar 256, tied)."""
    c = ModelArchConfig.from_hf_dict({"model_type": "gemma3_text", "hidden_size": 64,
                                      "num_attention_heads": 8, "num_hidden_layers": 12})
    assert c.architecture == "Gemma3ForCausalLM" and c.head_dim == 256
    assert c.layer_windows == ((4096,) * 5 + (None,)) * 2
    assert (c.rope_theta, c.rope_local_theta, c.query_pre_attn_scalar) == (1e6, 1e4, 256.0)
    assert c.tie_word_embeddings and c.hidden_act == "gelu_pytorch_tanh"


def test_mistral_applies_its_window_on_every_layer() -> None:
    mistral = ModelArchConfig.from_hf_dict(_gemma3_dict(
        architectures=["MistralForCausalLM"], num_key_value_heads=2))
    assert mistral.sliding_window == 16 and mistral.layer_windows == (16,) * 6
    assert mistral.window_of(0) == 16 and mistral.attention_scale is None


@pytest.mark.parametrize(("extra", "match"), [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "silu"}, "hidden_activation 'silu'"),
    ({"layer_types": [SLIDING] * 5}, "each of the 6 layers"),
    ({"layer_types": ["chunked_attention"] * 6}, "each of the 6 layers"),
    ({"sliding_window": None}, "need a sliding_window"),
    ({"rope_parameters": {SLIDING: {"rope_type": "linear", "factor": 2.0}}}, "sliding layers"),
    ({"rope_parameters": {"rope_type": "default"}}, "keyed by layer type"),
])
def test_config_refuses_what_is_not_computed(extra: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelArchConfig.from_hf_dict(_gemma3_dict(**extra))


# ---------------------------------------------------------------------------------------------
# The real model: Gemma 3 270M, Q4_K_M GGUF


@pytest.fixture(scope="module")
def real_file() -> Path:
    try:
        path = named_model_file(GEMMA3_MODEL)
    except FileNotFoundError as e:
        missing_tool(str(e))
    assert path is not None, f"{GEMMA3_MODEL} is not a named model"
    return path


@pytest.fixture(scope="module")
def real_reference(real_file: Path) -> tuple[Any, Any]:
    """(transformers' float32 model, its tokenizer), both read from the GGUF file."""
    pytest.importorskip("accelerate")  # transformers needs it for a GGUF
    tok = transformers.AutoTokenizer.from_pretrained(str(real_file.parent),
                                                     gguf_file=real_file.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(real_file.parent), gguf_file=real_file.name, dtype=torch.float32).eval()
    return model, tok


@pytest.fixture(scope="module")
def real_ours(real_file: Path) -> LoadedModel:
    return load_model(str(real_file), dtype="float32", device="cpu")


def test_real_model_logits_match_transformers(real_reference: tuple[Any, Any],
                                              real_ours: LoadedModel,
                                              record_property: Any) -> None:
    model, tok = real_reference
    c = real_ours.config
    assert (c.num_hidden_layers, c.num_key_value_heads, c.head_dim, c.vocab_size) == (
        18, 1, 256, 262144)
    assert c.layer_windows == ((512,) * 5 + (None,)) * 3
    ids = torch.tensor(tok(REAL_TEXT).input_ids)
    assert 90 <= len(ids) <= 120
    pool = make_pool(c)
    ours = logits_of(real_ours.model, pool, ids, alloc(pool, len(ids)), prefix=0)
    ref = hf_logits(model, ids)
    record_property("real_float32_max_rel", max_rel(ours, ref))
    assert_rel_close(ours[-1], ref[-1])
    assert_rel_close(ours, ref)


def test_real_model_greedy_completion_is_transformers(real_reference: tuple[Any, Any],
                                                      real_ours: LoadedModel) -> None:
    model, tok = real_reference
    ids = tok(REAL_QUESTION).input_ids
    ours = greedy(real_ours.model, ids, REAL_STEPS)
    assert ours == transformers_greedy(model, ids, REAL_STEPS)
    assert "France" in tok.decode(ours)  # a sentence, not noise
