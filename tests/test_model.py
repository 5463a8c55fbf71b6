"""server/models: our Llama family against transformers, the paged KV contract, the loader.

Small random checkpoints are written by transformers itself (`save_pretrained`), loaded by
`load_model`, and compared logit by logit with transformers' own forward on CPU in float32.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from hicache.memory.device import DeviceKVPool
from hicache_server.models import (
    EMBEDDED_TINY_LLAMA,
    CausalLM,
    ForwardBatch,
    LoadedModel,
    ModelArchConfig,
    TorchAttention,
    load_model,
    make_attention_backend,
    registry,
    resolve_model_path,
)
from hicache_server.models import loader as loader_mod
from hicache_server.models.cpu_kernels import CPU_LINEAR_CHOICES, CPU_LINEAR_ENV
from hicache_server.models.gguf_tokenizer import GGUFError
from hicache_server.models.kernels import cpu_linear
from hicache_server.models.linear import (
    ONEDNN_MAX_ROWS,
    Linear,
    linear,
    onednn_linear_works,
    onednn_matches_kernel,
    onednn_packing_works,
)
from hicache_server.models.llama import RMSNorm
from hicache_server.models.rope import rope_inv_freq
from hicache_server.tokenizer import byte_tokenizer_json

SEED = 1234
REL_TOL = 1e-4  # max |ours - transformers| relative to max |transformers| (float32)
SEQ_LEN = 40
DECODE_PREFIX = 30
CHUNK_PREFIX = 17
PAGE_SIZE = 16
POOL_PAGES = 16  # 256 slots: room for every test's sequences at once
VOCAB = 300
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB}
KINDS: dict[str, Callable[[], object]] = {
    "llama": lambda: transformers.LlamaConfig(**_TINY),
    "qwen2": lambda: transformers.Qwen2Config(**_TINY),
    "llama3_rope": lambda: transformers.LlamaConfig(**_TINY, rope_scaling=LLAMA3_ROPE),
    "mistral": lambda: transformers.MistralConfig(**_TINY),
    "tied": lambda: transformers.LlamaConfig(**_TINY, tie_word_embeddings=True),
}
_HF_CLASSES = {"LlamaConfig": "LlamaForCausalLM", "Qwen2Config": "Qwen2ForCausalLM",
               "MistralConfig": "MistralForCausalLM"}


# ---------------------------------------------------------------------------------------------
# Helpers


def assert_rel_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = REL_TOL) -> None:
    assert ours.shape == ref.shape
    err = (ours.float() - ref.float()).abs().max().item()
    assert err <= rel * ref.abs().max().item(), f"max error {err} vs scale {ref.abs().max()}"


def make_pool(config: ModelArchConfig, dtype: torch.dtype = torch.float32) -> DeviceKVPool:
    return DeviceKVPool(POOL_PAGES, PAGE_SIZE, config.num_hidden_layers,
                        config.num_key_value_heads, config.head_dim, dtype, "cpu")


def extend_batch(seqs: list[tuple[torch.Tensor, torch.Tensor, int]]) -> ForwardBatch:
    """One batch from (all tokens, all slots, prefix_len) per sequence: the tokens past the
    prefix are new."""
    new = [(tok[p:], slots[p:], torch.arange(p, len(tok))) for tok, slots, p in seqs]
    return ForwardBatch(
        input_ids=torch.cat([n[0] for n in new]), positions=torch.cat([n[2] for n in new]),
        out_slots=torch.cat([n[1] for n in new]), seq_slots=[s for _, s, _ in seqs],
        prefix_lens=[p for _, _, p in seqs], extend_lens=[len(t) - p for t, _, p in seqs])


def run(lm: LoadedModel, pool: DeviceKVPool, tokens: torch.Tensor, slots: torch.Tensor,
        prefix: int) -> torch.Tensor:
    """Logits `[len - prefix, vocab]` of tokens[prefix:], the prefix already in the pool."""
    return lm.model.forward_all_logits(extend_batch([(tokens, slots, prefix)]), pool)


@pytest.fixture(scope="module", params=list(KINDS))
def checkpoint(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """(folder written by transformers, transformers' model) for each architecture."""
    torch.manual_seed(SEED)
    cfg = KINDS[request.param]()
    hf = getattr(transformers, _HF_CLASSES[type(cfg).__name__])(cfg).eval()
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return folder, hf


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (SEQ_LEN,), generator=torch.Generator().manual_seed(SEED))


def hf_logits(hf: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(tokens[None]).logits[0]  # [len, vocab]


# ---------------------------------------------------------------------------------------------
# Against transformers


def test_prefill_matches_transformers(checkpoint: tuple[Path, torch.nn.Module],
                                      tokens: torch.Tensor) -> None:
    folder, hf = checkpoint
    lm = load_model(str(folder), device="cpu")
    pool = make_pool(lm.config)
    ours = run(lm, pool, tokens, pool.alloc(48)[:SEQ_LEN], prefix=0)
    assert ours.dtype == torch.float32
    assert_rel_close(ours, hf_logits(hf, tokens))


def test_decode_and_chunked_prefill_match_transformers(
        checkpoint: tuple[Path, torch.nn.Module], tokens: torch.Tensor) -> None:
    folder, hf = checkpoint
    lm = load_model(str(folder), device="cpu")
    ref = hf_logits(hf, tokens)  # causal: row i is the logits of the (i+1)-token sequence
    pool = make_pool(lm.config)
    slots = pool.alloc(48)[:SEQ_LEN]
    run(lm, pool, tokens[:DECODE_PREFIX], slots[:DECODE_PREFIX], prefix=0)
    seq, seq_slots = tokens[:DECODE_PREFIX + 1], slots[:DECODE_PREFIX + 1]
    decode = lm.model(extend_batch([(seq, seq_slots, DECODE_PREFIX)]), pool)
    assert decode.shape == (1, VOCAB)
    assert_rel_close(decode[0], ref[DECODE_PREFIX])
    other = pool.alloc(48)[:SEQ_LEN]
    run(lm, pool, tokens[:CHUNK_PREFIX], other[:CHUNK_PREFIX], prefix=0)
    assert_rel_close(run(lm, pool, tokens, other, prefix=CHUNK_PREFIX), ref[CHUNK_PREFIX:])


def test_batch_equals_each_sequence_alone(checkpoint: tuple[Path, torch.nn.Module],
                                          tokens: torch.Tensor) -> None:
    lm = load_model(str(checkpoint[0]), device="cpu")
    pool = make_pool(lm.config)
    a, b = tokens, tokens.flip(0)[:11]
    sa, sb = pool.alloc(48)[:len(a)], pool.alloc(16)[:len(b)]
    run(lm, pool, a, sa, prefix=0)  # prefix of a in the pool
    alone = [run(lm, pool, a, sa, CHUNK_PREFIX)[-1], run(lm, pool, b, sb, 0)[-1]]
    together = lm.model(extend_batch([(a, sa, CHUNK_PREFIX), (b, sb, 0)]), pool)
    torch.testing.assert_close(together, torch.stack(alone), rtol=1e-5, atol=1e-5)
    decode_alone = [run(lm, pool, a, sa, len(a) - 1)[0], run(lm, pool, b, sb, len(b) - 1)[0]]
    batch = extend_batch([(a, sa, len(a) - 1), (b, sb, len(b) - 1)])
    assert batch.is_decode
    torch.testing.assert_close(lm.model(batch, pool), torch.stack(decode_alone),
                               rtol=1e-5, atol=1e-5)


def test_scattered_slots_give_the_same_logits(checkpoint: tuple[Path, torch.nn.Module],
                                              tokens: torch.Tensor) -> None:
    lm = load_model(str(checkpoint[0]), device="cpu")
    pool = make_pool(lm.config)
    contiguous = pool.alloc(48)[:SEQ_LEN]
    free = pool.alloc(POOL_PAGES * PAGE_SIZE - 64)  # everything else, then a random subset
    scattered = free[torch.randperm(len(free))[:SEQ_LEN]]
    assert not torch.equal(scattered.sort().values, scattered)  # really out of order
    results = []
    for slots in (contiguous, scattered):
        run(lm, pool, tokens[:CHUNK_PREFIX], slots[:CHUNK_PREFIX], prefix=0)
        results.append(run(lm, pool, tokens, slots, prefix=CHUNK_PREFIX))
    torch.testing.assert_close(results[1], results[0], rtol=1e-6, atol=1e-6)
    for layer in range(lm.config.num_hidden_layers):  # the new K/V landed in those slots
        k, _ = pool.get_kv(layer)
        torch.testing.assert_close(k[scattered], k[contiguous])


def test_sharded_checkpoint_loads_identically(tmp_path: Path) -> None:
    torch.manual_seed(SEED)
    hf = transformers.LlamaForCausalLM(KINDS["llama"]()).eval()
    hf.save_pretrained(tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    one, sharded = load_model(str(tmp_path / "one")), load_model(str(tmp_path / "sharded"))
    for (name, p), (_, q) in zip(one.model.named_parameters(), sharded.model.named_parameters()):
        assert torch.equal(p, q), name


def test_layer_hook_runs_before_each_layer_in_order(checkpoint: tuple[Path, torch.nn.Module],
                                                    tokens: torch.Tensor) -> None:
    lm = load_model(str(checkpoint[0]), device="cpu")
    pool = make_pool(lm.config)
    slots = pool.alloc(48)[:SEQ_LEN]
    seen: list[int] = []
    batch = extend_batch([(tokens, slots, 0)])
    batch.layer_hook = seen.append
    lm.model(batch, pool)
    assert seen == list(range(lm.config.num_hidden_layers))


# ---------------------------------------------------------------------------------------------
# RoPE scaling, config parsing, weight loading errors


@pytest.mark.parametrize("scaling", [LLAMA3_ROPE, {"rope_type": "linear", "factor": 4.0}])
def test_rope_scaling_matches_transformers(scaling: dict) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(**_TINY, rope_scaling=dict(scaling))
    expected, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
    ours = ModelArchConfig.from_hf_dict(cfg.to_dict() | {"architectures": ["LlamaForCausalLM"]})
    got = rope_inv_freq(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    assert torch.equal(got, expected)
    assert not torch.equal(got, rope_inv_freq(ours.head_dim, ours.rope_theta, None))


def _base_config(**extra: object) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 300} | extra


def test_config_defaults_and_legacy_keys() -> None:
    c = ModelArchConfig.from_hf_dict(_base_config(
        rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0},
        torch_dtype="bfloat16", eos_token_id=[7, 9]))
    assert (c.num_key_value_heads, c.head_dim, c.rope_theta) == (4, 16, 500000.0)
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert c.torch_dtype == torch.bfloat16 and c.eos_token_ids == (7, 9)
    qwen = ModelArchConfig.from_hf_dict(_base_config(architectures=["Qwen2ForCausalLM"]))
    assert qwen.attention_bias and not qwen.o_proj_bias


@pytest.mark.parametrize(("extra", "match"), [
    ({"architectures": ["GPT2LMHeadModel"]}, "LlamaForCausalLM, MistralForCausalLM"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"num_key_value_heads": 3}, "not a multiple"),
    ({"torch_dtype": "int8"}, "int8"),
])
def test_config_rejects_unsupported(extra: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelArchConfig.from_hf_dict(_base_config(**extra))


def test_registry_finds_each_architecture_and_refuses_by_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    names = registry.supported()
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
            "Gemma3ForCausalLM"} <= set(names)
    assert all(issubclass(registry.architecture(n).model_class, CausalLM) for n in names)
    assert registry.architecture_of_config({"model_type": "qwen2"}).name == "Qwen2ForCausalLM"
    assert registry.architecture_of_gguf("gemma3", Path("g.gguf")).name == "Gemma3ForCausalLM"
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported; supported: .*"
                                         r"llama.*\(architectures: LlamaForCausalLM"):
        registry.architecture_of_config({"model_type": "gpt2"})
    with pytest.raises(GGUFError, match=r"x.gguf: GGUF architecture 'falcon' is not "
                                        r"supported; supported: llama \(LlamaForCausalLM\)"):
        registry.architecture_of_gguf("falcon", Path("x.gguf"))
    monkeypatch.setattr(registry, "_MODULES", ("llama", "llama"))
    registry._table.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="'LlamaForCausalLM' is already registered"):
            registry.supported()
    finally:
        monkeypatch.undo()
        registry._table.cache_clear()
    assert registry.supported() == names


def test_load_weights_rejects_bad_checkpoints(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    folder, hf = checkpoint
    model = load_model(str(folder)).model
    state = dict(hf.state_dict())
    name = "model.layers.0.self_attn.k_proj.weight"
    with pytest.raises(ValueError, match=r"k_proj|qkv_proj.*shard 1"):
        model.load_weights((n, t) for n, t in state.items() if n != name)
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([(name, state[name][:-1])])
    with pytest.raises(ValueError, match="no place"):
        model.load_weights([("model.layers.9.mlp.up_proj.weight", state[name])])


# ---------------------------------------------------------------------------------------------
# Loader: errors, the embedded model


def test_loader_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(_base_config()))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="embedded:tiny-llama"):
        resolve_model_path("embedded:huge-llama")


@pytest.fixture(scope="module")
def embedded_homes(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The embedded model generated into two fresh HICACHE_HOMEs."""
    homes = [tmp_path_factory.mktemp("home_a"), tmp_path_factory.mktemp("home_b")]
    with pytest.MonkeyPatch.context() as mp:
        for home in homes:
            mp.setenv("HICACHE_HOME", str(home))
            assert resolve_model_path(EMBEDDED_TINY_LLAMA) == home / "models" / "tiny-llama"
    return homes


def test_embedded_model_is_byte_identical(embedded_homes: list[Path]) -> None:
    a, b = (h / "models" / "tiny-llama" for h in embedded_homes)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert [p.name for p in a.parent.iterdir()] == ["tiny-llama"]  # no temp folder left
    assert (a / "tokenizer.json").read_text(encoding="utf-8") == byte_tokenizer_json()


def test_embedded_model_matches_transformers(embedded_homes: list[Path],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHE_HOME", str(embedded_homes[0]))
    lm = load_model(EMBEDDED_TINY_LLAMA, device="cpu")
    c = lm.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.vocab_size, c.max_position_embeddings) == (512, 8, 8, 2, 64, 260, 8192)
    assert lm.dtype == torch.float32 and c.hicache_embedded == "tiny-llama"
    hf = transformers.LlamaForCausalLM.from_pretrained(str(lm.path)).eval()
    prompt = torch.tensor(list(b"Hello, hierarchical cache!"))
    pool = make_pool(c)
    slots = pool.alloc(32)[:len(prompt)]
    ours = run(lm, pool, prompt, slots, prefix=0)
    assert_rel_close(ours, hf_logits(hf, prompt))
    bf16 = load_model(EMBEDDED_TINY_LLAMA, dtype="bfloat16", device="cpu")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    low = run(bf16, make_pool(c, torch.bfloat16), prompt, slots, prefix=0)
    assert low.dtype == torch.float32
    assert (low - ours).abs().max() < 0.1 * ours.abs().max()  # bf16 noise, not garbage


def test_bfloat16_stays_within_its_tolerance_of_float32(embedded_homes: list[Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`--dtype bfloat16` against float32 over a 250-token prompt, every position: logits
    within 5% of their scale (measured: 1.2-1.4%), the same argmax at >= 95% of positions
    (measured: 98-99%), and where the argmax differs, float32's own top-2 margin was within
    the error bound (a near tie, not a broken model)."""
    monkeypatch.setenv("HICACHE_HOME", str(embedded_homes[0]))
    f32 = load_model(EMBEDDED_TINY_LLAMA, dtype="float32", device="cpu")
    b16 = load_model(EMBEDDED_TINY_LLAMA, dtype="bfloat16", device="cpu")
    prompt = torch.randint(0, 256, (250,), generator=torch.Generator().manual_seed(SEED))
    slots = make_pool(f32.config).alloc(256)[:len(prompt)]
    ref = run(f32, make_pool(f32.config), prompt, slots, prefix=0)
    low = run(b16, make_pool(f32.config, torch.bfloat16), prompt, slots, prefix=0)
    bound = 0.05 * ref.abs().max().item()
    assert (low - ref).abs().max().item() < bound
    same = low.argmax(-1) == ref.argmax(-1)
    assert same.float().mean().item() >= 0.95
    top2 = ref.topk(2, dim=-1).values
    assert ((top2[:, 0] - top2[:, 1])[~same] < 2 * bound).all()


def test_embedded_generation_is_atomic_under_a_race(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads generate at once: both get the folder, exactly one write lands, no temp
    folder is left behind."""
    monkeypatch.setenv("HICACHE_HOME", str(tmp_path))
    both_writing = threading.Barrier(2)

    def fake_write(directory: Path) -> None:
        (Path(directory) / "config.json").write_text(threading.current_thread().name)
        both_writing.wait(timeout=10)  # both temp folders exist before either rename

    monkeypatch.setattr(loader_mod, "write_embedded_model", fake_write)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(
        resolve_model_path(EMBEDDED_TINY_LLAMA)), name=f"w{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = tmp_path / "models" / "tiny-llama"
    assert results == [final, final]
    assert (final / "config.json").read_text() in {"w0", "w1"}
    assert [p.name for p in final.parent.iterdir()] == ["tiny-llama"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_model_matches_cpu_with_cpu_index_tensors(
        checkpoint: tuple[Path, torch.nn.Module], tokens: torch.Tensor) -> None:
    """The default CUDA backend (paged decode kernel when CuPy is installed) gives the CPU
    logits, with the batch's index tensors left on the CPU."""
    cpu = load_model(str(checkpoint[0]), device="cpu")
    gpu = load_model(str(checkpoint[0]), dtype="float32", device="cuda")
    results = []
    for lm, device in ((cpu, "cpu"), (gpu, "cuda")):
        pool = DeviceKVPool(POOL_PAGES, PAGE_SIZE, lm.config.num_hidden_layers,
                            lm.config.num_key_value_heads, lm.config.head_dim, torch.float32,
                            device)
        a, b = pool.alloc(48)[:SEQ_LEN], pool.alloc(32)[:CHUNK_PREFIX]  # CPU tensors
        run(lm, pool, tokens[:DECODE_PREFIX], a[:DECODE_PREFIX], prefix=0)
        run(lm, pool, tokens[:CHUNK_PREFIX - 1], b[:CHUNK_PREFIX - 1], prefix=0)
        decode = extend_batch([(tokens[:DECODE_PREFIX + 1], a[:DECODE_PREFIX + 1], DECODE_PREFIX),
                               (tokens[:CHUNK_PREFIX], b, CHUNK_PREFIX - 1)])
        results.append(lm.model(decode, pool).cpu())
    torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-4)


def test_make_attention_backend_on_cpu_is_torch() -> None:
    assert isinstance(make_attention_backend("cpu"), TorchAttention)


def test_forward_batch_validates() -> None:
    ids = torch.arange(3)
    with pytest.raises(ValueError, match="seq_slots\\[0\\] must hold 5"):
        ForwardBatch(ids, ids, ids, [torch.arange(4)], [2], [3])
    with pytest.raises(ValueError, match="extend_len >= 1"):
        ForwardBatch(ids, ids, ids, [torch.arange(3), torch.arange(1)], [0, 1], [3, 0])
    b = ForwardBatch(ids, ids, ids, [torch.arange(2), torch.arange(3)], [1, 1], [1, 2])
    assert (b.num_seqs, b.num_tokens, b.is_decode, b.extend_starts) == (2, 3, False, [0, 1])
    table, lens = b.slot_table()
    assert table.tolist() == [[0, 1, 0], [0, 1, 2]] and lens.tolist() == [2, 3]


@pytest.mark.parametrize("rows", [1, 8, ONEDNN_MAX_ROWS, ONEDNN_MAX_ROWS + 1, 300])
def test_small_batches_through_onednn_match_f_linear(rows: int) -> None:
    """Decode-sized batches go through oneDNN on the CPU (where it runs), larger ones
    through F.linear, bit for bit."""
    gen = torch.Generator().manual_seed(SEED)
    x, w = torch.randn(rows, 512, generator=gen), torch.randn(768, 512, generator=gen)
    b = torch.randn(768, generator=gen)
    want = torch.nn.functional.linear(x, w, b)
    got = linear(x, w, b, onednn=onednn_linear_works(torch.float32))
    if rows > ONEDNN_MAX_ROWS:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(linear(x, w, b, onednn=False), want)


needs_packing = pytest.mark.skipif(not onednn_packing_works(torch.float32),
                                   reason="oneDNN weight packing does not run here")


@needs_packing
@pytest.mark.parametrize("rows", [1, 8, ONEDNN_MAX_ROWS + 1, 256, 257, 2048])
@pytest.mark.parametrize("in_features", [512, 1536])
def test_packed_linear_matches_f_linear_and_ignores_its_batch(rows: int,
                                                              in_features: int) -> None:
    """A packed Linear gives F.linear's result within float rounding, each row the same bits
    whatever rows share its call (a token computes alike in any decode batch, and whether its
    prompt was prefilled whole or extended a cached prefix). 1,536 inputs: the embedded
    model's down_proj, where oneDNN's one-row kernel alone would differ."""
    gen = torch.Generator().manual_seed(SEED)
    lin = Linear(in_features, [512, 256], True, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        lin.weight.copy_(torch.randn(768, in_features, generator=gen))
        lin.bias.copy_(torch.randn(768, generator=gen))
    lin.pack()
    assert lin.packed is not None and torch.equal(lin.packed.to_dense(), lin.weight)
    x = torch.randn(rows, in_features, generator=gen)
    with torch.inference_mode():
        got = lin(x)
        want = torch.nn.functional.linear(x, lin.weight, lin.bias)
        # sums of in_features products of unit normals: the rounding grows with their count
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * in_features / 512)
        for a, b in [(0, 1), (rows // 2, rows // 2 + 1), (rows - 1, rows),
                     (0, max(rows // 2, 1)), (rows // 4, rows)]:
            assert torch.equal(lin(x[a:b]), got[a:b])


@needs_packing
@pytest.mark.parametrize("choice", CPU_LINEAR_CHOICES)
def test_loaded_cpu_model_is_packed_and_reloads(checkpoint: tuple[Path, torch.nn.Module],
                                               tokens: torch.Tensor, choice: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """load_model leaves every CPU Linear with its packed copy (the C kernel's panels where
    it builds, unless HICACHE_CPU_LINEAR=onednn; else oneDNN's layout, one copy only);
    loading again (it drops the copies, writes, packs) gives the same logits."""
    monkeypatch.setenv(CPU_LINEAR_ENV, choice)
    lm = load_model(str(checkpoint[0]), device="cpu")
    linears = [m for m in lm.model.modules() if isinstance(m, Linear)]
    on_kernel = choice == "kernel" and cpu_linear.supported()
    assert lm.model.linear_backend == ("CpuLinearKernel" if on_kernel else "oneDNN")

    def packed_once() -> bool:  # on the kernel, a oneDNN copy only where it matches
        return all((m.panels is not None) == on_kernel and (
            (m.packed is not None) == onednn_matches_kernel(m.kernel, *m.weight.shape,
                                                             m.bias is not None)
            if on_kernel else m.packed is not None) for m in linears)

    assert linears and packed_once()
    pool = make_pool(lm.config)
    slots = pool.alloc(48)[:SEQ_LEN]
    before = run(lm, pool, tokens, slots, prefix=0)
    lm.model.load_weights(checkpoint[1].state_dict().items())
    assert packed_once()
    assert torch.equal(run(lm, pool, tokens, slots, prefix=0), before)
    assert_rel_close(before[-1:], hf_logits(checkpoint[1], tokens)[-1:])


@pytest.mark.parametrize("hidden", [64, 512, 2048])
@pytest.mark.parametrize("rows", [1, 8, 257])
def test_float32_rms_norm_is_transformers_bit_for_bit(hidden: int, rows: int) -> None:
    """float32 takes torch's fused rms_norm: the very bits of transformers' LlamaRMSNorm."""
    gen = torch.Generator().manual_seed(SEED)
    norm = RMSNorm(hidden, 1e-5, torch.float32, torch.device("cpu"))
    hf = transformers.models.llama.modeling_llama.LlamaRMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        w = torch.randn(hidden, generator=gen) * 0.1 + 1
        norm.weight.copy_(w)
        hf.weight.copy_(w)
    x = torch.randn(rows, hidden, generator=gen) * 3
    assert torch.equal(norm(x), hf(x))
