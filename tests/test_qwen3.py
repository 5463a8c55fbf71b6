"""server/models/qwen3.py: Qwen3 dense against transformers' Qwen3ForCausalLM.

Random-weight checkpoints written by transformers (`save_pretrained`), built from a
ModelArchConfig by hand and loaded by `load_model`: every position's logits of a prompt,
prefilled whole and extended on a cached prefix, in float32 (tight) and bfloat16 (loose),
greedy tokens decoded through the KV pool against transformers' greedy `generate`, the lean
path's bits against the modules'. Through the engine (the byte tokenizer written into the
folder): the same greedy tokens from a cached prefix, an L2 load-back, L3 after flushing L1
and L2 and after a restart. Then the same weights as llama.cpp's `qwen3` GGUF against
transformers reading that file, the config.json keys, and the fingerprint.
"""

from __future__ import annotations

import json
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
    check_every_layer_writes_its_kv_in_hook_order,
    check_prefilled_and_extended,
    finish_gguf,
    greedy,
    make_pool,
    max_rel,
    prefilled_and_extended,
    random_model,
    save_servable,
    transformers_greedy,
)
from gguf import GGMLQuantizationType as Q
from gguf_files import CONTROL, vocabulary
from test_model import assert_rel_close, extend_batch, hf_logits

from hicache.memory.device import DeviceKVPool
from hicache_server.models import (
    CpuKernelAttention,
    LoadedModel,
    ModelArchConfig,
    load_model,
    make_attention_backend,
)
from hicache_server.models.causal_lm import CausalLM
from hicache_server.models.cpu_kernels import make_layer_kernel, make_linear_kernel
from hicache_server.models.fingerprint import model_fingerprint
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.models.gguf import GGUFError
from hicache_server.models.kernels import cpu_attention
from hicache_server.models.loader import KERNELS_DIR, hicache_home
from hicache_server.models.qwen3 import QWEN3, Qwen3ForCausalLM

SEED = 5
VOCAB = 300
PROMPT_LEN = 80
PREFIX = 50  # a cached prefix the rest of the prompt extends
GREEDY_STEPS = 16
BF16_REL = 0.04  # bfloat16 against transformers' bfloat16 (measured 1-3%): noise, not garbage
WINDOW = 24  # the window config's: the prompt crosses it several times

_COMMON = {"vocab_size": VOCAB, "intermediate_size": 128, "max_position_embeddings": 1024,
           "initializer_range": 0.2, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
           "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
CONFIGS: dict[str, dict[str, Any]] = {
    # head_dim 32, not hidden / heads = 16; an untied head
    "untied": {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": False},
    # head_dim = hidden / heads, one KV head, the head tied to the embeddings
    "tied": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 64, "tie_word_embeddings": True},
    # use_sliding_window: layers from max_window_layers on read only their window
    "window": {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 32, "use_sliding_window": True,
               "sliding_window": WINDOW, "max_window_layers": 1},
}


def qwen3_config(kind: str, **overrides: Any) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(**{**_COMMON, **CONFIGS[kind], **overrides})


def random_qwen3(config: transformers.Qwen3Config, seed: int = SEED) -> torch.nn.Module:
    return random_model(transformers.Qwen3ForCausalLM, config, seed)


def arch_config(c: transformers.Qwen3Config) -> ModelArchConfig:
    """Our config of a full-attention Qwen3Config, written out by hand."""
    return ModelArchConfig(
        architecture=QWEN3, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_parameters["rope_theta"],
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings)


def build(config: ModelArchConfig, hf: torch.nn.Module, dtype: torch.dtype) -> CausalLM:
    """Our Qwen3ForCausalLM of `config` on the CPU kernels (as `load_model` builds it),
    holding transformers' weights."""
    kernels = hicache_home() / KERNELS_DIR
    model = Qwen3ForCausalLM(config, make_attention_backend("cpu", kernel_dir=kernels), dtype)
    model.use_linear_kernel(make_linear_kernel("cpu", dtype, kernels))
    model.use_layer_kernel(make_layer_kernel("cpu", dtype, kernels))
    model.load_weights(hf.state_dict().items())
    return model.eval()


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """(folder written by transformers, transformers' float32 model) of each config."""
    hf = random_qwen3(qwen3_config(request.param))
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return folder, hf


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(SEED))


# ---------------------------------------------------------------------------------------------
# Random weights against transformers


def test_built_from_a_config_by_hand_matches_transformers(record_property: Any) -> None:
    """The model class alone: a ModelArchConfig written out, transformers' state dict."""
    hf = random_qwen3(qwen3_config("untied"))
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,))
    model = build(arch_config(hf.config), hf, torch.float32)
    err = check_prefilled_and_extended(model, prompt, hf_logits(hf, prompt), PREFIX).max_rel
    record_property("float32_max_rel", err)


def test_float32_logits_match_transformers_prefilled_and_extended(
        checkpoint: tuple[Path, torch.nn.Module], prompt: torch.Tensor,
        record_property: Any) -> None:
    folder, hf = checkpoint
    lm = load_model(str(folder), dtype="float32", device="cpu")
    assert type(lm.model) is Qwen3ForCausalLM and lm.config.head_dim == hf.config.head_dim
    err = check_prefilled_and_extended(lm.model, prompt, hf_logits(hf, prompt), PREFIX).max_rel
    record_property("float32_max_rel", err)


def test_the_qk_norms_and_the_windows_matter(checkpoint: tuple[Path, torch.nn.Module],
                                             prompt: torch.Tensor) -> None:
    """Without its q/k norms, or (the window config) without its windows, the same weights
    give other logits: the comparisons above see both."""
    folder, hf = checkpoint
    lm = load_model(str(folder), dtype="float32", device="cpu")
    ref = hf_logits(hf, prompt)
    for layer in lm.model.model.layers:
        layer.self_attn.q_norm.weight.data.fill_(1.0)
        layer.self_attn.k_norm.weight.data.fill_(1.0)
    assert max_rel(prefilled_and_extended(lm.model, prompt, PREFIX).whole, ref) > 1e-2
    if hf.config.use_sliding_window:
        assert lm.config.layer_windows == (None, WINDOW, WINDOW)
        full = transformers.Qwen3ForCausalLM(qwen3_config("window", use_sliding_window=False))
        full.load_state_dict(hf.state_dict())
        assert max_rel(hf_logits(full.eval(), prompt), ref) > 1e-2


def test_bfloat16_logits_stay_near_transformers_bfloat16(
        checkpoint: tuple[Path, torch.nn.Module], prompt: torch.Tensor,
        record_property: Any) -> None:
    folder, _ = checkpoint
    lm = load_model(str(folder), dtype="bfloat16", device="cpu")
    assert next(lm.model.parameters()).dtype == torch.bfloat16
    hf = transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ref = hf_logits(hf, prompt).float()
    ours = prefilled_and_extended(lm.model, prompt, PREFIX).whole
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


# ---------------------------------------------------------------------------------------------
# The lean path: small CPU batches on the C kernels alone, q/k norms included

needs_kernels = pytest.mark.skipif(not cpu_attention.supported(),
                                   reason="needs AVX-512F or AVX2, and a C compiler")


def decode_batch(lm: LoadedModel, pool: DeviceKVPool, prompt: torch.Tensor,
                 new: list[int]) -> ForwardBatch:
    """Sequences of the prompt's first 30 + 7i tokens cached in `pool`, `new[i]` tokens each
    to extend them with."""
    seqs = []
    for i, n in enumerate(new):
        length = 30 + 7 * i
        tokens = torch.cat([prompt[:length], prompt[-n:]])
        slots = alloc(pool, length + n)
        lm.model(extend_batch([(tokens[:length], slots[:length], 0)]), pool)
        seqs.append((tokens, slots, length))
    return extend_batch(seqs)


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("new", [[1], [1, 1, 1], [3, 1, 9]], ids=["decode-1", "decode-3",
                                                                  "mixed"])
def test_lean_path_gives_the_modules_bits(checkpoint: tuple[Path, torch.nn.Module],
                                          prompt: torch.Tensor, dtype: str,
                                          new: list[int]) -> None:
    lm = load_model(str(checkpoint[0]), dtype=dtype, device="cpu")
    assert isinstance(lm.model.attn_backend, CpuKernelAttention)
    assert lm.model.model.lean is not None and lm.model.layer_ops == "CpuLayerKernel"
    lean_pool, pool = make_pool(lm.config, lm.dtype), make_pool(lm.config, lm.dtype)
    batch = decode_batch(lm, lean_pool, prompt, new)
    decode_batch(lm, pool, prompt, new)
    got = lm.model.forward_all_logits(batch, lean_pool)
    lean, lm.model.model.lean = lm.model.model.lean, None
    want = lm.model.forward_all_logits(batch, pool)  # the modules
    lm.model.model.lean = lean
    assert torch.equal(got, want)
    for layer in range(lm.config.num_hidden_layers):
        assert torch.equal(lean_pool.k_buffers[layer], pool.k_buffers[layer])
        assert torch.equal(lean_pool.v_buffers[layer], pool.v_buffers[layer])


@needs_kernels
def test_a_decode_step_runs_on_the_lean_path_alone(checkpoint: tuple[Path, torch.nn.Module],
                                                   prompt: torch.Tensor,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    lm = load_model(str(checkpoint[0]), dtype="float32", device="cpu")
    pool = make_pool(lm.config)
    batch = decode_batch(lm, pool, prompt, [1, 1])

    def refuse(*args: object) -> None:
        raise AssertionError("a module ran where the lean path should have")
    for layer in lm.model.model.layers:
        monkeypatch.setattr(layer, "forward", refuse)
    logits = lm.model(batch, pool)
    assert logits.shape == (2, VOCAB) and torch.isfinite(logits).all()


# ---------------------------------------------------------------------------------------------
# Through the engine and every tier (test_gemma3_tiers' workload)



@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The untied config (head_dim 32, not hidden / heads) saved with the byte tokenizer,
    whose ids (bos 256, eos 257, pad 258) fit its vocabulary, so the engine can serve it."""
    hf = random_qwen3(qwen3_config("untied", max_position_embeddings=2048, bos_token_id=256,
                                   eos_token_id=257, pad_token_id=258))
    return save_servable(hf, tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def reference(served: Path) -> torch.nn.Module:
    return transformers.Qwen3ForCausalLM.from_pretrained(served, dtype=torch.float32).eval()


class TestTiers(tiers.TierChecks):
    """Cached prefixes, L2 load-back and L3 give the tokens of recomputation."""


# ---------------------------------------------------------------------------------------------
# config.json


def _qwen3_dict(**extra: Any) -> dict[str, Any]:
    return {"architectures": [QWEN3], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "vocab_size": 300} | extra


def test_config_json_of_transformers_parses_to_the_config_by_hand() -> None:
    for kind in ("untied", "tied"):
        c = qwen3_config(kind)
        d = json.loads(c.to_json_string()) | {"architectures": [QWEN3]}
        assert ModelArchConfig.from_hf_dict(d) == arch_config(c)


def test_qwen3_defaults_and_model_type() -> None:
    """What a config.json leaves out is Qwen3Config's default: head_dim 128 whatever
    hidden / heads, untied, no window, no biases."""
    c = ModelArchConfig.from_hf_dict({"model_type": "qwen3", "hidden_size": 64,
                                      "num_attention_heads": 4, "num_key_value_heads": 1,
                                      "num_hidden_layers": 2})
    assert c.architecture == QWEN3 and c.head_dim == 128 and c.q_size == 512
    assert not c.tie_word_embeddings and not c.attention_bias and c.layer_windows == ()
    assert (c.rms_norm_eps, c.rope_theta, c.vocab_size) == (1e-6, 10000.0, 151_936)


def test_windows_as_qwen3config_places_them() -> None:
    off = ModelArchConfig.from_hf_dict(_qwen3_dict(sliding_window=16, max_window_layers=2))
    assert off.layer_windows == () and off.sliding_window is None
    on = ModelArchConfig.from_hf_dict(_qwen3_dict(use_sliding_window=True, sliding_window=16,
                                                  max_window_layers=2))
    assert on.layer_windows == (None, None, 16, 16)
    typed = ModelArchConfig.from_hf_dict(_qwen3_dict(
        use_sliding_window=True, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2))
    assert typed.layer_windows == (16, None, 16, None)
    biased = ModelArchConfig.from_hf_dict(_qwen3_dict(attention_bias=True))
    assert biased.attention_bias and biased.o_proj_bias  # q, k, v and o, as transformers


@pytest.mark.parametrize(("extra", "match"), [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"use_sliding_window": True, "sliding_window": 8, "layer_types": ["full_attention"]},
     "each of the 4 layers"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
])
def test_config_refuses_what_is_not_computed(extra: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelArchConfig.from_hf_dict(_qwen3_dict(**extra))


def test_fingerprint_sees_head_dim_and_rms_eps(tmp_path: Path) -> None:
    """Two checkpoints of one seed differing only in head_dim, or only in rms_norm_eps (the
    very same weights), key their pages apart."""
    prints = []
    for name, overrides in (("base", {}), ("head_dim", {"head_dim": 16}),
                            ("eps", {"rms_norm_eps": 1e-5})):
        random_qwen3(qwen3_config("untied", **overrides)).save_pretrained(tmp_path / name)
        prints.append(model_fingerprint(tmp_path / name))
    assert len(set(prints)) == 3
    assert (tmp_path / "base" / "model.safetensors").read_bytes() == (
        tmp_path / "eps" / "model.safetensors").read_bytes()


# ---------------------------------------------------------------------------------------------
# llama.cpp's qwen3 GGUF

# transformers reads a qwen3 file's head dim as Qwen3Config's 128 (its GGUF key map has no
# attention.key_length for qwen3), so the reference's files have head_dim 128: 4x hidden/heads
GGUF_CONFIG = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
               "num_key_value_heads": 1, "head_dim": 128}
# transformers' names -> llama.cpp's (gguf-py's tensor map for qwen3)
_GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
               "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down"}


def gguf_name(name: str) -> str:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    _, _, layer, *module, kind = name.split(".")  # model.layers.<i>.<module>.<kind>
    return f"blk.{layer}.{_GGUF_LAYER_NAMES['.'.join(module)]}.{kind}"


def write_qwen3_gguf(path: Path, hf: torch.nn.Module, qtype: Q = Q.F32,
                     extra_tensors: dict[str, np.ndarray] | None = None) -> Path:
    """`hf`'s weights as convert_hf_to_gguf.py writes a Qwen3: q/k rows as they are (not
    permuted), matrices in `qtype`, norms in F32, no output.weight when tied; the metadata
    of its Qwen2 base with the head dim in attention.key_length, a byte-level vocabulary."""
    c, tokens = hf.config, vocabulary()[0]
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_name("tiny-qwen3")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    add_bpe_vocabulary(w, "qwen2")
    w.add_eos_token_id(tokens.index(CONTROL[1]))
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = tensor.numpy().astype(np.float32)
        if data.ndim == 2 and qtype == Q.Q8_0:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), data)
    for name, data in (extra_tensors or {}).items():
        w.add_tensor(name, data)
    return finish_gguf(w, path)


@pytest.mark.parametrize(("qtype", "tied"), [(Q.F32, False), (Q.Q8_0, True)],
                         ids=["f32-untied", "q8_0-tied"])
def test_gguf_gives_transformers_reading_the_file(qtype: Q, tied: bool, tmp_path: Path,
                                                  prompt: torch.Tensor,
                                                  record_property: Any) -> None:
    pytest.importorskip("accelerate")  # transformers needs it to read a GGUF (the reference)
    hf = random_qwen3(transformers.Qwen3Config(
        **{**_COMMON, **GGUF_CONFIG, "vocab_size": len(vocabulary()[0]),
           "tie_word_embeddings": tied}))
    path = write_qwen3_gguf(tmp_path / f"tiny-{qtype.name}.gguf", hf, qtype)
    lm = load_model(str(path), dtype="float32", device="cpu")
    assert type(lm.model) is Qwen3ForCausalLM
    assert (lm.config.head_dim, lm.config.tie_word_embeddings) == (128, tied)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    ids = prompt % len(vocabulary()[0])
    ref = hf_logits(ref_model, ids)
    whole = check_prefilled_and_extended(lm.model, ids, ref, PREFIX).whole
    record_property("gguf_float32_max_rel", max_rel(whole, ref))
    if qtype == Q.F32:  # the very weights of the folder: transformers' own logits of them
        assert_rel_close(whole, hf_logits(hf, ids))
    steps = GREEDY_STEPS // 2
    assert greedy(lm.model, ids.tolist(), steps) == transformers_greedy(ref_model, ids.tolist(),
                                                                         steps)


def test_gguf_with_attention_biases_is_refused(tmp_path: Path) -> None:
    hf = random_qwen3(transformers.Qwen3Config(
        **{**_COMMON, **GGUF_CONFIG, "vocab_size": len(vocabulary()[0])}))
    bias = np.zeros(GGUF_CONFIG["num_attention_heads"] * GGUF_CONFIG["head_dim"], np.float32)
    path = write_qwen3_gguf(tmp_path / "biased.gguf", hf,
                            extra_tensors={"blk.0.attn_q.bias": bias})
    with pytest.raises(GGUFError, match="attention biases"):
        load_model(str(path), dtype="float32", device="cpu")
