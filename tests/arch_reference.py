"""What the architecture tests share (test_gemma2, test_gemma3, test_qwen3, test_phi3,
test_mistral_window, test_llama3_gguf, test_gguf_pretokenizers): random-weight transformers
models and the folders the engine serves from them; a KV pool and its slots; our logits of a
prompt prefilled whole and extended on a cached prefix, and our greedy tokens through the pool,
beside transformers'; the start and end of a GGUF file as llama.cpp's converter writes them.

Registered for assert rewriting in conftest.py, as tier_workload is.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import gguf
import torch
from gguf_files import MERGES, vocabulary
from test_model import PAGE_SIZE, REL_TOL, assert_rel_close, extend_batch

from hicache.memory.device import DeviceKVPool
from hicache_server.models import CausalLM, ModelArchConfig
from hicache_server.models.loader import embedded_tokenizer_files

POOL_PAGES = 32  # 512 slots of PAGE_SIZE: two prompts of 160 tokens and a decode
# Norm weights drawn from here (transformers starts them at 1: every norm the same) so a
# norm computed wrong shows; Gemma's norms multiply by 1 + w and start at w = 0
NORMS = (0.5, 1.5)
GEMMA_NORMS = (-0.5, 0.5)


def random_model(cls: type, config: object, seed: int,
                 norms: tuple[float, float] = NORMS) -> torch.nn.Module:
    """transformers' float32 `cls(config)` with seeded weights, every `*norm.weight` drawn
    uniformly from `norms`."""
    torch.manual_seed(seed)
    hf = cls(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(*norms)
    return hf


def save_servable(hf: torch.nn.Module, folder: Path) -> Path:
    """`hf` saved as a Hugging Face folder with the byte tokenizer (ids 0-258: the config's
    vocabulary must hold them), so the engine can serve it."""
    hf.save_pretrained(folder)
    for name, text in embedded_tokenizer_files().items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


def make_pool(config: ModelArchConfig, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu", pages: int = POOL_PAGES) -> DeviceKVPool:
    return DeviceKVPool(pages, PAGE_SIZE, config.num_hidden_layers, config.num_key_value_heads,
                        config.head_dim, dtype, device)


def alloc(pool: DeviceKVPool, n: int) -> torch.Tensor:
    """`n` slots (whole pages taken)."""
    return pool.alloc(-(-n // PAGE_SIZE) * PAGE_SIZE)[:n]


def logits_of(model: CausalLM, pool: DeviceKVPool, tokens: torch.Tensor, slots: torch.Tensor,
              prefix: int) -> torch.Tensor:
    """Logits `[len - prefix, vocab]` of tokens[prefix:], the prefix already in the pool."""
    return model.forward_all_logits(extend_batch([(tokens, slots, prefix)]), pool)


class PrefilledExtended(NamedTuple):
    whole: torch.Tensor  # [len, vocab]: the prompt prefilled from scratch
    extended: torch.Tensor  # [len - prefix, vocab]: its tail extended on the cached prefix
    max_rel: float = 0.0  # of both against transformers (`check_prefilled_and_extended`)


def prefilled_and_extended(model: CausalLM, prompt: torch.Tensor, prefix: int,
                           pages: int = POOL_PAGES) -> PrefilledExtended:
    """Our logits of `prompt` prefilled whole, and of its tokens past `prefix` extended on
    that prefix computed first into the pool."""
    pool = make_pool(model.config, model.dtype, model.device, pages)
    whole = logits_of(model, pool, prompt, alloc(pool, len(prompt)), prefix=0)
    slots = alloc(pool, len(prompt))
    logits_of(model, pool, prompt[:prefix], slots[:prefix], prefix=0)
    return PrefilledExtended(whole, logits_of(model, pool, prompt, slots, prefix=prefix))


def check_prefilled_and_extended(model: CausalLM, prompt: torch.Tensor, ref: torch.Tensor,
                                 prefix: int, rel: float = REL_TOL,
                                 pages: int = POOL_PAGES) -> PrefilledExtended:
    """Both of `prefilled_and_extended` within `rel` of transformers' logits `ref` of the
    prompt; with the larger relative error (for `record_property`)."""
    whole, extended, _ = prefilled_and_extended(model, prompt, prefix, pages)
    assert_rel_close(whole, ref, rel=rel)
    assert_rel_close(extended, ref[prefix:], rel=rel)
    return PrefilledExtended(whole, extended,
                             max(max_rel(whole, ref), max_rel(extended, ref[prefix:])))


def check_every_layer_writes_its_kv_in_hook_order(model: CausalLM, prompt: torch.Tensor
                                                   ) -> None:
    """A prefill of `prompt` meets the layer hook once per layer, in order, and writes
    every layer's K and V (window layers' too: the cache keeps every layer's KV) at its
    slots."""
    pool = make_pool(model.config, model.dtype, model.device)
    slots = alloc(pool, len(prompt))
    seen: list[int] = []
    batch = extend_batch([(prompt, slots, 0)])
    batch.layer_hook = seen.append
    model(batch, pool)
    layers = model.config.num_hidden_layers
    assert seen == list(range(layers))
    for layer in range(layers):
        k, v = pool.get_kv(layer)
        assert k[slots].abs().sum(-1).gt(0).all() and v[slots].abs().sum(-1).gt(0).all()


def greedy(model: CausalLM, prompt: list[int], steps: int, pages: int = POOL_PAGES
           ) -> list[int]:
    """Our greedy tokens after `prompt`: prefilled, then each token decoded alone through
    the KV pool (on the CPU kernels, the lean path where the architecture has one)."""
    pool = make_pool(model.config, model.dtype, model.device, pages)
    slots = alloc(pool, len(prompt) + steps)
    tokens = torch.tensor(prompt)
    logits = model(extend_batch([(tokens, slots[:len(tokens)], 0)]), pool)
    out: list[int] = []
    while True:
        out.append(int(logits[0].argmax()))
        if len(out) == steps:
            return out
        tokens = torch.cat([tokens, torch.tensor(out[-1:])])
        n = len(tokens)
        logits = model(extend_batch([(tokens, slots[:n], n - 1)]), pool)


def transformers_greedy(hf: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy `generate` (its own KV cache)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False)
    return out[0, len(prompt):].tolist()


def recomputed_greedy(hf: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy tokens recomputing every position each step: no cache of its
    own (eager Gemma 2's and a windowed Mistral's reference)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def max_rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| relative to max |ref|."""
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


# ---------------------------------------------------------------------------------------------
# GGUF files as llama.cpp's converter writes them


def add_bpe_vocabulary(w: gguf.GGUFWriter, pre: str,
                       vocab: tuple[list[str], list[int]] | None = None,
                       merges: list[str] | None = None) -> list[str]:
    """A byte-level BPE tokenizer (`tokenizer.ggml.model = gpt2`) with pre-tokenizer `pre`:
    gguf_files' vocabulary and merges unless given; returns the tokens."""
    tokens, types = vocab or vocabulary()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES if merges is None else merges)
    return tokens


def finish_gguf(w: gguf.GGUFWriter, path: Path) -> Path:
    """Header, metadata and tensors written, the file closed; its path."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
