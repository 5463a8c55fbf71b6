"""Small GGUF files written with the `gguf` package (llama.cpp's writer), for the GGUF tests.

`write_gguf` lays out a 2-layer Llama or Qwen2 of hidden 256 (a K-quant block is 256 values)
as llama.cpp's converter does: its metadata keys, q/k rows permuted for a Llama, a byte-level
BPE vocabulary with a few merges and two control tokens, and a ChatML template; for a Llama
3.x, Llama 3's RoPE scaling as the converter stores it, a `rope_freqs.weight` tensor of
per-frequency factors (`llama3_rope_factors`) and no scaling metadata. Weights of the
types `gguf.quants.quantize` implements are quantised from seeded normal weights; the K-quants,
which it cannot quantise, are seeded random blocks whose float16 scales are set small, so
every dequantised weight is finite and small.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from hicache_server.tokenizer import bytes_to_unicode

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 256, 2, 4, 2, 64
CONTROL = ["<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Byte offsets of the float16 scales inside one 256-value block (ggml-common.h's block_qN_K).
_K_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
                    Q.Q6_K: (208,)}
_K_SCALE = 2e-4  # keeps every weight below 0.2 (Q4_K: 63 * 15 * scale), 0.82 (Q6_K: 128 * 32)
WEIGHT_STD = 0.05


def vocabulary() -> tuple[list[str], list[int]]:
    """Tokens (the 256 byte characters, the merges' results, the controls) and their types."""
    tokens = [bytes_to_unicode()[b] for b in range(256)]
    tokens += [m.replace(" ", "") for m in MERGES] + CONTROL
    return tokens, [1] * (len(tokens) - len(CONTROL)) + [3] * len(CONTROL)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `permute` (convert_hf_to_gguf.py): q/k rows for its RoPE."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _shapes(arch: str, tied: bool) -> dict[str, tuple[int, ...]]:
    vocab = len(vocabulary()[0])
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, HIDDEN),
                                          "output_norm.weight": (HIDDEN,)}
    if not tied:
        shapes["output.weight"] = (vocab, HIDDEN)
    for i in range(LAYERS):
        b = f"blk.{i}."
        shapes |= {b + "attn_norm.weight": (HIDDEN,), b + "ffn_norm.weight": (HIDDEN,),
                   b + "attn_q.weight": (q, HIDDEN), b + "attn_k.weight": (kv, HIDDEN),
                   b + "attn_v.weight": (kv, HIDDEN), b + "attn_output.weight": (HIDDEN, q),
                   b + "ffn_gate.weight": (INTER, HIDDEN), b + "ffn_up.weight": (INTER, HIDDEN),
                   b + "ffn_down.weight": (HIDDEN, INTER)}
        if arch == "qwen2":
            shapes |= {b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)}
    return shapes


def _k_blocks(qtype: Q, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, blocks = shape[0], shape[1] // block_values
    data = rng.integers(0, 256, size=(rows, blocks, block_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(_K_SCALE).tobytes(), dtype=np.uint8)
    for offset in _K_SCALE_OFFSETS[qtype]:
        data[:, :, offset:offset + 2] = scale
    return data.reshape(rows, blocks * block_bytes)


def _tensor(name: str, shape: tuple[int, ...], qtype: Q, arch: str,
            rng: np.random.Generator) -> tuple[np.ndarray, Q]:
    if len(shape) == 1:  # norms and biases stay F32, as llama.cpp keeps them
        base = 1.0 if name.endswith("norm.weight") else 0.0
        return (base + rng.normal(0, WEIGHT_STD, shape)).astype(np.float32), Q.F32
    if qtype in K_QUANTS:
        return _k_blocks(qtype, shape, rng), qtype
    w = rng.normal(0, WEIGHT_STD, shape).astype(np.float32)
    if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
        w = _permute(w, HEADS if "attn_q" in name else KV_HEADS)
    if qtype == Q.F32:
        return w, qtype
    if qtype == Q.F16:
        return w.astype(np.float16), qtype
    return gguf.quants.quantize(w, qtype), qtype


def llama3_rope_factors(theta: float, scaling: dict[str, Any],
                        hparams: dict[str, Any] | None = None) -> np.ndarray:
    """The `rope_freqs.weight` llama.cpp's converter writes for a llama3 `scaling` (its
    LlamaModel.generate_extra_tensors, line for line): 1 for short wavelengths, `factor`
    for long ones, the smoothed band between. As there, the original context length comes
    from the config's top level (`hparams`), not from the scaling dict: 8192 (Llama 3.1's
    and 3.2's value) when the top level has none."""
    import torch

    dim = HEAD_DIM
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = scaling.get("factor", 8.0)
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = (hparams or {}).get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = ((old_context_len / wavelen - low_freq_factor)
                      / (high_freq_factor - low_freq_factor))
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(rope_factors, dtype=torch.float32).numpy()


def write_gguf(path: Path, qtype: Q = Q.F32, *, arch: str = "llama", tied: bool = False,
               seed: int = 0, pre: str = "smollm", chat_template: str | None = CHATML,
               extra: dict[str, int | float | str] | None = None, rope_theta: float = 10000.0,
               rope_freqs: np.ndarray | None = None, context_length: int = 2048) -> Path:
    """A small model of `arch` with its matrices in `qtype`, written to `path`; `extra`:
    more metadata (`split.count`, ...: an int as uint32, a float as float32); `rope_freqs`: the per-frequency RoPE factors
    tensor, written first as the converter does."""
    rng = np.random.default_rng(seed)
    tokens, types = vocabulary()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(LAYERS)
    w.add_context_length(context_length)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(rope_theta)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(tokens.index(CONTROL[0]))
    w.add_eos_token_id(tokens.index(CONTROL[1]))
    w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for key, value in (extra or {}).items():
        add = {str: w.add_string, float: w.add_float32}.get(type(value), w.add_uint32)
        add(key, value)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32), raw_dtype=Q.F32)
    for name, shape in _shapes(arch, tied).items():
        data, kind = _tensor(name, shape, qtype, arch, rng)
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
