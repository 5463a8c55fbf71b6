"""server/models/cpu_forward.py and gemma_forward.py: the lean forward of small batches gives
the modules' bits (logits and the K/V it writes) for Llama's layers (the embedded model,
Qwen2) and Gemma's (random Gemma 3 and Gemma 2: windows, two RoPE bases, q/k norms, caps),
runs without them, and steps aside where it does not apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from arch_reference import GEMMA_NORMS, random_model
from test_gemma2 import CONFIGS as GEMMA2_CONFIGS
from test_gemma2 import gemma2_config
from test_gemma3 import gemma3_config

from hicache.memory.device import DeviceKVPool
from hicache_server.models import EMBEDDED_TINY_LLAMA, ForwardBatch, LoadedModel, load_model
from hicache_server.models.attention import CpuKernelAttention, TorchAttention
from hicache_server.models.cpu_forward import LEAN_MAX_ROWS
from hicache_server.models.kernels import cpu_attention, cpu_layer
from hicache_server.models.loader import KERNELS_DIR, hicache_home, iter_safetensors

pytestmark = pytest.mark.skipif(not cpu_attention.supported(),
                                reason="needs AVX-512F or AVX2, and a C compiler")

SEED = 7
PAGE_SIZE = 16
POOL_PAGES = 40
PREFIXES = (37, 5, 90)  # cached tokens of the batch's sequences
_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}


def write_qwen2(folder: Path, seed: int) -> Path:
    """A tiny Qwen2 checkpoint (q|k|v biases, tied head) written by transformers."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(**_TINY, tie_word_embeddings=True)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen2(tmp_path_factory.mktemp("qwen2"), SEED)


@pytest.fixture(scope="module")
def gemma_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Gemma 3 ("mixed": windows of 32 beside full layers, q/k norms, two RoPE bases) and
    Gemma 2 ("alternating": windows of 32, scores soft-capped, no q/k norms)."""
    models = {"gemma3": (transformers.Gemma3ForCausalLM, gemma3_config("mixed")),
              "gemma2": (transformers.Gemma2ForCausalLM,
                         gemma2_config(**GEMMA2_CONFIGS["alternating"]))}
    folders = {}
    for name, (cls, config) in models.items():
        folders[name] = tmp_path_factory.mktemp(name)
        random_model(cls, config, SEED, GEMMA_NORMS).save_pretrained(folders[name])
    return folders


@pytest.fixture(scope="module", params=[f"{m}-{d}" for m in ("embedded", "qwen2", "gemma3",
                                                              "gemma2")
                                        for d in ("float32", "bfloat16")])
def lm(request: pytest.FixtureRequest, qwen2_folder: Path,
       gemma_folders: dict[str, Path]) -> LoadedModel:
    name, dtype = request.param.split("-")
    folder = {"embedded": EMBEDDED_TINY_LLAMA, "qwen2": str(qwen2_folder),
              **{k: str(v) for k, v in gemma_folders.items()}}[name]
    model = load_model(folder, dtype=dtype, device="cpu")
    assert isinstance(model.model.attn_backend, CpuKernelAttention)
    assert model.model.model.lean is not None  # every op on the kernels: the lean path is on
    return model


def make_pool(lm: LoadedModel) -> DeviceKVPool:
    c = lm.config
    return DeviceKVPool(POOL_PAGES, PAGE_SIZE, c.num_hidden_layers, c.num_key_value_heads,
                        c.head_dim, lm.dtype, "cpu")


def make_batch(lm: LoadedModel, pool: DeviceKVPool, extends: list[int]) -> ForwardBatch:
    """Sequences with PREFIXES[i] cached tokens (their K/V computed into `pool`) and
    `extends[i]` new ones, on scattered slots."""
    gen = torch.Generator().manual_seed(SEED)
    perm = torch.randperm(pool.num_slots - PAGE_SIZE, generator=gen) + PAGE_SIZE
    seqs, used = [], 0
    for prefix, extend in zip(PREFIXES, extends):
        slots = perm[used:used + prefix + extend]
        used += prefix + extend
        seqs.append((torch.randint(0, lm.config.vocab_size, (prefix + extend,), generator=gen),
                     slots, prefix))
    prefill = ForwardBatch(
        torch.cat([t[:p] for t, _, p in seqs]), torch.cat([torch.arange(p) for _, _, p in seqs]),
        torch.cat([s[:p] for _, s, p in seqs]), [s[:p] for _, s, p in seqs],
        [0] * len(seqs), [p for _, _, p in seqs])
    lm.model.forward(prefill, pool)
    return ForwardBatch(
        torch.cat([t[p:] for t, _, p in seqs]),
        torch.cat([torch.arange(p, len(t)) for t, _, p in seqs]),
        torch.cat([s[p:] for _, s, p in seqs]), [s for _, s, _ in seqs],
        [p for _, _, p in seqs], [len(t) - p for t, _, p in seqs])


def modules_only(lm: LoadedModel, batch: ForwardBatch, pool: DeviceKVPool) -> torch.Tensor:
    lean, lm.model.model.lean = lm.model.model.lean, None
    try:
        return lm.model.forward_all_logits(batch, pool)
    finally:
        lm.model.model.lean = lean


@pytest.mark.parametrize("extends", [[1], [1, 1, 1], [4, 1, 11]], ids=["decode-1", "decode-3",
                                                                       "mixed"])
def test_lean_forward_gives_the_modules_bits(lm: LoadedModel, extends: list[int]) -> None:
    lean_pool, pool = make_pool(lm), make_pool(lm)
    batch = make_batch(lm, lean_pool, extends)
    make_batch(lm, pool, extends)
    for _ in range(2):  # the second step reuses the first's plan
        got = lm.model.forward_all_logits(batch, lean_pool)
        want = modules_only(lm, batch, pool)
        assert torch.equal(got, want)
        for layer in range(lm.config.num_hidden_layers):
            assert torch.equal(lean_pool.k_buffers[layer], pool.k_buffers[layer])
            assert torch.equal(lean_pool.v_buffers[layer], pool.v_buffers[layer])


def test_lean_forward_runs_without_the_modules(lm: LoadedModel,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    pool = make_pool(lm)
    batch = make_batch(lm, pool, [1, 1, 1])
    seen: list[int] = []
    batch.layer_hook = seen.append
    for layer in lm.model.model.layers:
        monkeypatch.setattr(layer, "forward", _refuse)
    logits = lm.model.forward(batch, pool)
    assert logits.shape == (3, lm.config.vocab_size) and torch.isfinite(logits).all()
    assert seen == list(range(lm.config.num_hidden_layers))  # the hook, once per layer


def _refuse(*args: object) -> None:
    raise AssertionError("a module ran where the lean path should have")


def test_lean_forward_steps_aside(lm: LoadedModel) -> None:
    lean, pool = lm.model.model.lean, make_pool(lm)
    assert lean(make_batch(lm, pool, [LEAN_MAX_ROWS + 1]), pool) is None  # too many rows
    batch = make_batch(lm, pool, [1])
    other = torch.float32 if lm.dtype == torch.bfloat16 else torch.bfloat16
    c = lm.config
    other_pool = DeviceKVPool(POOL_PAGES, PAGE_SIZE, c.num_hidden_layers, c.num_key_value_heads,
                              c.head_dim, other, "cpu")
    assert lean(batch, other_pool) is None
    kernel_backend = lm.model.attn_backend
    try:
        for layer in lm.model.model.layers:
            layer.self_attn.backend = TorchAttention()
        assert lean(batch, pool) is None
    finally:
        for layer in lm.model.model.layers:
            layer.self_attn.backend = kernel_backend
    assert lean(batch, pool) is not None


def test_lean_forward_follows_reloaded_weights(qwen2_folder: Path, tmp_path: Path) -> None:
    lm = load_model(str(qwen2_folder), dtype="float32", device="cpu")
    pool = make_pool(lm)
    batch = make_batch(lm, pool, [1, 1, 1])
    before = lm.model.forward_all_logits(batch, pool)  # a plan bound to the first weights
    lm.model.load_weights(iter_safetensors(write_qwen2(tmp_path, SEED + 1)))
    after = lm.model.forward_all_logits(batch, pool)
    assert not torch.equal(before, after)
    assert torch.equal(after, modules_only(lm, batch, pool))


def test_lean_forward_is_off_without_the_kernels(qwen2_folder: Path) -> None:
    lm = load_model(str(qwen2_folder), dtype="float32", device="cpu")
    lm.model.use_layer_kernel(None)
    assert lm.model.model.lean is None
    lm.model.use_layer_kernel(cpu_layer.load(hicache_home() / KERNELS_DIR))
    assert lm.model.model.lean is not None
    lm.model.use_linear_kernel(None)
    assert lm.model.model.lean is None
