"""Model folders: the embedded test model, named and GGUF models, safetensors loading, dtype
and device choice.

A model path is one of: `embedded:tiny-llama`; a model name (`smollm2-135m-instruct`, see
`server/models/named.py`); a `.gguf` file, or a folder holding one (`server/models/gguf.py`:
served through a companion folder of its metadata, weights dequantised from the file); a
local Hugging Face folder holding `config.json` and `model.safetensors` (or shards listed in
`model.safetensors.index.json`).
The embedded model is written once under `hicache_home()/models/tiny-llama` as an ordinary
Hugging Face folder (transformers loads it too, model and tokenizer); its weights come from a
fixed seed, so every machine generates byte-identical files (for a given torch version).
A folder written by an older version is kept (its weights and config.json key every stored
page); only its tokenizer files are brought up to date when it is opened.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from hicache.memory.device import resolve_device
from hicache_server.models import registry
from hicache_server.models.attention_choice import make_attention_backend
from hicache_server.models.causal_lm import CausalLM
from hicache_server.models.config import ModelArchConfig
from hicache_server.models.cpu_kernels import make_layer_kernel, make_linear_kernel
from hicache_server.models.fingerprint import model_fingerprint
from hicache_server.models.folders import hicache_home, write_folder
from hicache_server.models.gguf import companion_folder, find_gguf, iter_gguf_tensors
from hicache_server.models.named import named_model_file
from hicache_server.tokenizer import (
    BOS_ID,
    BYTE_VOCAB_SIZE,
    EMBEDDED_MARKER_KEY,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    byte_tokenizer_json,
)

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_NAME = "tiny-llama"
EMBEDDED_TINY_LLAMA = EMBEDDED_PREFIX + EMBEDDED_NAME
KERNELS_DIR = "kernels"  # under hicache_home(): compiled CPU kernels, keyed by source
EMBEDDED_SEED = 20250101  # any fixed value; changing it changes every page hash of the model
EMBEDDED_WEIGHT_STD = 0.02  # transformers' initializer_range default

# docs/architecture.md, "Models". rms_norm_eps is Llama 2/3's.
EMBEDDED_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": BYTE_VOCAB_SIZE,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
    EMBEDDED_MARKER_KEY: EMBEDDED_NAME,
}
# tokenizer_config.json of the embedded folder, so that transformers' AutoTokenizer loads
# tokenizer.json with the special tokens the server uses (ids 256..259). The tokenizer adds
# no BOS (tokenizer.json has no post-processor) and decoding must not touch spaces.
EMBEDDED_TOKENIZER_CONFIG: dict[str, Any] = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": SPECIAL_TOKENS[0],
    "eos_token": SPECIAL_TOKENS[1],
    "pad_token": SPECIAL_TOKENS[2],
    "unk_token": SPECIAL_TOKENS[3],
    "clean_up_tokenization_spaces": False,
    "model_max_length": EMBEDDED_CONFIG["max_position_embeddings"],
}
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
logger = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_WEIGHTS_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"


class LoadedModel(NamedTuple):
    model: CausalLM
    config: ModelArchConfig
    path: Path  # the resolved folder
    dtype: torch.dtype
    device: torch.device
    fingerprint: str  # the weights' identity (`model_fingerprint`): the L3 page keys' root


class ModelSource(NamedTuple):
    folder: Path  # config.json, tokenizer, chat template (a GGUF file's companion folder)
    gguf: Path | None  # the GGUF file the weights come from; None: the folder's safetensors


def resolve_model_path(path: str) -> Path:
    """The folder of `path` (see `resolve_model`)."""
    return resolve_model(path).folder


def resolve_model(path: str) -> ModelSource:
    """Where `path`'s config and weights are; the embedded model's folder and a GGUF file's
    companion folder are written on first use.

    FileNotFoundError for a path that does not exist or a named model not installed;
    ValueError for an unknown embedded name or a GGUF file the engine cannot serve.
    """
    models_dir = hicache_home() / "models"
    if path.startswith(EMBEDDED_PREFIX):
        if path != EMBEDDED_TINY_LLAMA:
            raise ValueError(f"unknown embedded model {path!r}; available: {EMBEDDED_TINY_LLAMA}")
        return ModelSource(_ensure_embedded(models_dir / EMBEDDED_NAME), None)
    local = named_model_file(path) or Path(path).expanduser()
    gguf = find_gguf(local)
    if gguf is not None:
        return ModelSource(companion_folder(gguf, models_dir), gguf)
    if not local.is_dir():
        raise FileNotFoundError(f"no model folder: {local} does not exist or is not a folder "
                                "(a model path is a Hugging Face folder, a .gguf file, "
                                f"{EMBEDDED_TINY_LLAMA} or a model name)")
    return ModelSource(local, None)


def _ensure_embedded(final: Path) -> Path:
    """The embedded folder, written when missing; its tokenizer files brought up to date."""
    if not final.is_dir():
        _write_embedded_folder(final)
    refresh_embedded_tokenizer(final)
    return final


def _write_embedded_folder(final: Path) -> None:
    """Write the embedded model whole (`write_folder`): a process that sees `final` sees it
    whole, and of two writers one wins."""
    write_folder(final, write_embedded_model)


def embedded_tokenizer_files() -> dict[str, str]:
    """File name -> text of the embedded folder's tokenizer files."""
    config = json.dumps(EMBEDDED_TOKENIZER_CONFIG, indent=2, sort_keys=True) + "\n"
    return {TOKENIZER_FILE: byte_tokenizer_json(), TOKENIZER_CONFIG_FILE: config}


def refresh_embedded_tokenizer(folder: Path) -> None:
    """Rewrite the tokenizer files of an embedded folder that lacks them or holds an older
    version (a folder written before tokenizer_config.json existed, or before the printable
    decoding). Each file is replaced atomically, so a reader never sees half of one and two
    processes doing this at once both leave the same text. A folder that cannot be written
    (a read-only $HICACHE_HOME) still serves: the server's own tokenizer is built in, only
    other tools loading the folder would see the old files, which the warning says."""
    for name, text in embedded_tokenizer_files().items():
        path = folder / name
        try:
            if path.is_file() and path.read_text(encoding="utf-8") == text:
                continue
            _replace_text(path, text)
        except OSError as e:
            logger.warning("cannot update %s (%s); tools that load the embedded folder's "
                           "tokenizer may disagree with the server", path, e)


def _replace_text(path: Path, text: str) -> None:
    """Write a uniquely named sibling, then rename it over `path` (atomic). Not mkstemp: its
    0600 mode would hide the file from the other users of a shared $HICACHE_HOME."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def embedded_weights(seed: int = EMBEDDED_SEED,
                     config: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The embedded model's float32 tensors under transformers' names, from `seed`; another
    Llama `config` (same keys) gives random weights of its geometry."""
    c = EMBEDDED_CONFIG if config is None else config
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, q),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in tqdm(shapes.items(), desc="Generating weights", unit="tensor",
                            file=sys.stderr):
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape)
        else:
            out[name] = torch.randn(shape, generator=gen) * EMBEDDED_WEIGHT_STD
    return out


def write_embedded_model(directory: str | Path) -> None:
    """Write the embedded model's Hugging Face folder (config, weights, tokenizer) into
    `directory` (created if missing). The same seed gives byte-identical files."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(embedded_weights(), str(directory / _WEIGHTS_FILE), metadata={"format": "pt"})
    _write_json(directory / "config.json", EMBEDDED_CONFIG)
    _write_json(directory / "generation_config.json",
                {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID})
    for name, text in embedded_tokenizer_files().items():
        (directory / name).write_text(text, encoding="utf-8")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def load_model(path: str, dtype: str = "auto", device: str = "auto") -> LoadedModel:
    """Build the model of `path` on `device` in `dtype` and load its weights.

    dtype "auto": the checkpoint's dtype on CUDA, float32 on CPU. FileNotFoundError names a
    missing folder, config.json or weights file.
    """
    folder, gguf = resolve_model(path)
    config = ModelArchConfig.from_file(folder)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, config, dev)
    kernel_dir = hicache_home() / KERNELS_DIR
    model: CausalLM = registry.architecture(config.architecture).model_class(
        config, make_attention_backend(dev, kernel_dir=kernel_dir), torch_dtype, dev)
    model.use_linear_kernel(make_linear_kernel(dev, torch_dtype, kernel_dir))
    model.use_layer_kernel(make_layer_kernel(dev, torch_dtype, kernel_dir))
    if gguf is not None:
        model.load_weights(iter_gguf_tensors(gguf, config.num_attention_heads,
                                             config.num_key_value_heads))
    else:
        model.load_weights(iter_safetensors(folder))
    return LoadedModel(model.eval(), config, folder, torch_dtype, dev, model_fingerprint(folder))


def resolve_dtype(dtype: str, config: ModelArchConfig, device: torch.device) -> torch.dtype:
    """The model dtype for a `--dtype` value (auto | float32 | bfloat16 | float16)."""
    if dtype == "auto":
        return config.torch_dtype if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(_DTYPES)}")
    if device.type == "cpu" and dtype == "bfloat16" and not cpu_has_bfloat16():
        logger.warning("this CPU has no bfloat16 instructions (AVX512-BF16 or AMX): bfloat16 "
                       "matmuls are emulated and slower than float32; --dtype float32 is faster "
                       "here")
    return _DTYPES[dtype]


def cpu_has_bfloat16() -> bool:
    """Whether oneDNN runs bfloat16 matmuls natively on this CPU (AVX512-BF16 or AMX)."""
    return bool(torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def weight_files(folder: Path) -> dict[str, list[str]]:
    """Safetensors file -> tensor names, from the shard index or the single file."""
    index = folder / _INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files: dict[str, list[str]] = {}
        for name, file in sorted(weight_map.items()):
            files.setdefault(file, []).append(name)
        return files
    single = folder / _WEIGHTS_FILE
    if not single.is_file():
        raise FileNotFoundError(f"no weights: neither {single} nor {index} exists")
    with safe_open(str(single), framework="pt") as f:
        return {_WEIGHTS_FILE: sorted(f.keys())}


def iter_safetensors(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every weight of the folder, one shard open at a time."""
    folder = Path(folder)
    files = weight_files(folder)
    total = sum(len(names) for names in files.values())
    with tqdm(total=total, desc="Loading weights", unit="tensor", file=sys.stderr) as bar:
        for file, names in files.items():
            if not (folder / file).is_file():
                raise FileNotFoundError(f"no weights: shard {folder / file} does not exist")
            with safe_open(str(folder / file), framework="pt") as f:
                for name in names:
                    yield name, f.get_tensor(name)
                    bar.update()
