"""GGUF checkpoints (llama.cpp's format): the architecture, tokenizer and chat template from the
file's metadata, and its tensors dequantised with the `gguf` package, llama.cpp's own reader.

A GGUF file is served through a *companion folder*, written once under
`hicache_home()/models/gguf/<stem>-<identity>-v<COMPANION_VERSION>/`: an ordinary Hugging Face folder without the
weights (`config.json`, `generation_config.json`, `tokenizer.json`, `tokenizer_config.json`
with the chat template) built from the metadata, so the tokenizer, the chat template and
transformers' AutoTokenizer all read it as they read any model folder, and the weights are
streamed from the GGUF file itself at every load (`iter_gguf_tensors`).

What must stay true:
- `config.json` carries `hicache_gguf` with the file's identity (`gguf_identity`: its size,
  its header, i.e. every metadata value and every tensor's name, type, shape and offset,
  and samples of its data), so page hashes of two quantisations, or of two fine-tunes, never
  meet; the file's path is not part of it (two machines share pages of the same file).
- The tokenizer is built from the metadata by `server/models/gguf_tokenizer.py`.
- Tensors come out under transformers' names and layout: llama.cpp stores a Llama's q and k
  rows permuted for its RoPE (`convert_hf_to_gguf.py`'s `permute`), undone here
  (`_unpermute`); Qwen2 and Gemma 3 files are not permuted. Gemma's norm weights are stored
  as `1 + w` (the converter's `norm_shift`); the 1 is taken off in float32 as transformers'
  GGUF loader does, so the model's `1 + w` gives transformers' bits.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import xxhash
from tqdm import tqdm

from hicache_server.models.config import GEMMA3_LAYER_PATTERN
from hicache_server.models.fingerprint import GGUF_IDENTITY_KEY
from hicache_server.models.folders import write_folder
from hicache_server.models.gguf_tokenizer import GGUFError, tokenizer_config, tokenizer_json

GGUF_SUFFIX = ".gguf"
COMPANION_DIR = "gguf"  # under hicache_home()/models
# A GGUF header holds the whole vocabulary: ~2 MB for SmolLM2's 49k tokens and merges, ~8 MB
# for Qwen2's 152k; 32 MiB covers any of them and the start of the data, read in ~10 ms.
_IDENTITY_HEAD_BYTES = 32 << 20
# Then 4 KiB at 256 evenly spaced offsets (1 MiB read): a fine-tune that changed only some
# layers' weights changes some of them whatever the file's size (every tensor of a 7B Q4 file
# is 3-100 MB, samples fall every ~16 MB).
_IDENTITY_SAMPLES = 256
_IDENTITY_SAMPLE_BYTES = 4096
# Bumped when the companion folder's files change meaning: folders of another version are
# written anew (a new name), never reused.
COMPANION_VERSION = 1


# GGUF tensor name -> transformers name; `{}` is the layer index.
_LLAMA_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_q.bias": "model.layers.{}.self_attn.q_proj.bias",
    "blk.{}.attn_k.bias": "model.layers.{}.self_attn.k_proj.bias",
    "blk.{}.attn_v.bias": "model.layers.{}.self_attn.v_proj.bias",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
}
# Gemma 3's four norms a layer and q/k norms (gguf-py's tensor map): its `ffn_norm` is the
# norm before the MLP, the one after attention has a name of its own.
_GEMMA3_TENSOR_NAMES = {
    **{k: v for k, v in _LLAMA_TENSOR_NAMES.items() if ".bias" not in k},
    "blk.{}.ffn_norm.weight": "model.layers.{}.pre_feedforward_layernorm.weight",
    "blk.{}.post_attention_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.post_ffw_norm.weight": "model.layers.{}.post_feedforward_layernorm.weight",
    "blk.{}.attn_q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "blk.{}.attn_k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
}
# What llama.cpp assumes of every gemma3 file, which the metadata does not say
# (llama-model.cpp, `llama_load_hparams_gemma3`): every 6th layer full (GEMMA3_LAYER_PATTERN),
# the sliding layers' RoPE base, and q.k scaled by 1/sqrt(head dim) except in the 27B model
# (62 layers), by 1/sqrt(hidden / heads) as its config.json's query_pre_attn_scalar (168).
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_LAYERS = 62


class _Architecture(NamedTuple):
    hf_class: str  # the transformers class this engine runs it as
    model_type: str
    permuted_qk: bool  # q/k rows stored permuted for llama.cpp's RoPE (undone at load)
    tensor_names: dict[str, str]
    norm_shift: float = 0.0  # added to every norm weight by the converter (taken off here)


# Mistral's GGUFs say "llama" (the same decoder).
_ARCHITECTURES = {
    "llama": _Architecture("LlamaForCausalLM", "llama", True, _LLAMA_TENSOR_NAMES),
    "qwen2": _Architecture("Qwen2ForCausalLM", "qwen2", False, _LLAMA_TENSOR_NAMES),
    "gemma3": _Architecture("Gemma3ForCausalLM", "gemma3_text", False, _GEMMA3_TENSOR_NAMES,
                            norm_shift=1.0),
}
logger = logging.getLogger(__name__)


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: itself when it is a `.gguf` file, the one `.gguf` in a folder
    without a config.json; None for anything else. GGUFError for a folder of several."""
    if path.is_file():
        return path if path.suffix == GGUF_SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*" + GGUF_SUFFIX))
    if len(files) > 1:
        raise GGUFError(f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files)})"
                        "; name one: --model-path " + str(files[0]))
    return files[0] if files else None


def companion_folder(file: Path, models_dir: Path) -> Path:
    """`file`'s companion folder under `models_dir`, written when missing."""
    identity = gguf_identity(file)
    folder = models_dir / COMPANION_DIR / f"{file.stem}-{identity[:16]}-v{COMPANION_VERSION}"
    if not _companion_of(folder, identity):
        _write_companion(_reader(file), file, identity, folder)
    return folder


def _companion_of(folder: Path, identity: str) -> bool:
    """Whether `folder` is a whole companion folder of the file of `identity` (a prefix of the
    identity names it: the full one is checked)."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    recorded = config.get(GGUF_IDENTITY_KEY)
    if not isinstance(recorded, dict) or recorded.get("identity") != identity:
        raise GGUFError(f"{folder} belongs to another GGUF file (an identity collision on its "
                        "name's prefix); remove it and start again")
    return True


def _reader(file: Path) -> Any:
    import gguf  # here, not at import: only GGUF models need it

    try:
        return gguf.GGUFReader(str(file))
    except (ValueError, OSError) as e:  # a bad magic, a truncated file
        raise GGUFError(f"{file} is not a readable GGUF file: {e}") from None


def gguf_identity(file: Path) -> str:
    """Hex xxh3_128 of the file's size, its first `_IDENTITY_HEAD_BYTES` (the header: every
    metadata value and every tensor's name, type, shape and offset, for any vocabulary
    llama.cpp writes today) and `_IDENTITY_SAMPLES` data samples spread evenly over the
    file: milliseconds for any size, no parse, distinct for two quantisations or two
    fine-tunes."""
    size = file.stat().st_size
    digest = xxhash.xxh3_128(str(size).encode())
    with file.open("rb") as f:
        digest.update(f.read(_IDENTITY_HEAD_BYTES))
        span = max(0, size - _IDENTITY_SAMPLE_BYTES)
        for i in range(_IDENTITY_SAMPLES + 1):
            f.seek(span * i // _IDENTITY_SAMPLES)
            digest.update(f.read(_IDENTITY_SAMPLE_BYTES))
    return digest.hexdigest()


def _write_companion(reader: Any, file: Path, identity: str, final: Path) -> None:
    """Write the companion folder into a temporary sibling, then rename it into place (atomic:
    of two processes writing it at once one wins, and both see it whole)."""
    meta = _metadata(reader)
    files = {"config.json": hf_config(meta, reader, file, identity),
             "generation_config.json": _generation_config(meta),
             "tokenizer_config.json": tokenizer_config(meta)}
    tokenizer = tokenizer_json(meta, file)

    def fill(tmp: Path) -> None:
        for name, data in files.items():
            (tmp / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n",
                                    encoding="utf-8")
        (tmp / "tokenizer.json").write_text(tokenizer, encoding="utf-8")

    write_folder(final, fill)
    logger.info("GGUF %s: config, tokenizer and chat template written to %s", file, final)


def _metadata(reader: Any) -> dict[str, Any]:
    """Every metadata key -> its Python value (strings, numbers, lists)."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the header's own counts, not metadata
            continue
        out[key] = field.contents()
    return out


def hf_config(meta: dict[str, Any], reader: Any, file: Path, identity: str) -> dict[str, Any]:
    """config.json (transformers' keys) of a GGUF file's metadata; GGUFError for an
    architecture or a feature the engine does not run."""
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise GGUFError(f"{file}: GGUF architecture {arch!r} is not supported; supported: "
                        f"{', '.join(_ARCHITECTURES)} (Llama, Mistral, Qwen2, Gemma 3)")
    hf_arch, model_type = _ARCHITECTURES[arch].hf_class, _ARCHITECTURES[arch].model_type
    names = {t.name for t in reader.tensors}
    _refuse_unsupported(meta, names, arch, file)

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise GGUFError(f"{file}: metadata {arch}.{name} is missing")
        return value

    heads, hidden = int(key("attention.head_count")), int(key("embedding_length"))
    head_dim = int(key("attention.key_length", hidden // heads))
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        raise GGUFError(f"{file}: partial rotary embeddings (rope.dimension_count "
                        f"{key('rope.dimension_count')} < head dim {head_dim}) are not supported")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config = {
        "architectures": [hf_arch], "model_type": model_type,
        "hidden_size": hidden, "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)), "head_dim": head_dim,
        "vocab_size": int(meta.get(f"{arch}.vocab_size", len(tokens))),
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, arch, file),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "torch_dtype": _checkpoint_dtype(reader),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        GGUF_IDENTITY_KEY: {"identity": identity, "version": COMPANION_VERSION,
                            "name": meta.get("general.name"),
                          "tensor_types": _tensor_types(reader)},
    }
    if model_type == "qwen2":
        config["use_sliding_window"] = False
    if arch == "gemma3":
        config |= _gemma3_config(meta, key, head_dim, file)
    return config


def _gemma3_config(meta: dict[str, Any], key: Callable[..., Any], head_dim: int,
                   file: Path) -> dict[str, Any]:
    """Gemma 3's config.json keys beyond the Llama ones: its window from the file, the rest
    as llama.cpp assumes them (GEMMA3_LOCAL_ROPE_BASE's comment); softcapping, should a file
    carry it, is passed on for the config to refuse."""
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise GGUFError(f"{file}: gemma3 value_length {key('attention.value_length')} differs "
                        f"from key_length {head_dim}")
    layers, hidden = int(key("block_count")), int(key("embedding_length"))
    scalar = (hidden // int(key("attention.head_count")) if layers == GEMMA3_27B_LAYERS
              else head_dim)
    return {"sliding_window": int(key("attention.sliding_window")),
            "sliding_window_pattern": GEMMA3_LAYER_PATTERN,
            "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE, "query_pre_attn_scalar": scalar,
            "hidden_activation": "gelu_pytorch_tanh",
            "attn_logit_softcapping": meta.get("gemma3.attn_logit_softcapping"),
            "final_logit_softcapping": meta.get("gemma3.final_logit_softcapping")}


def _refuse_unsupported(meta: dict[str, Any], names: set[str], arch: str, file: Path) -> None:
    """GGUFError, before any weight is read, for what a Llama/Qwen2 file may hold that this
    engine does not run."""
    refused = {
        "a split GGUF (split.count > 1; merge it with llama-gguf-split --merge)":
            int(meta.get("split.count", 1)) > 1,
        f"mixture of experts ({arch}.expert_count)": int(meta.get(f"{arch}.expert_count", 0)) > 0,
        "per-frequency RoPE factors (rope_freqs, Llama 3.1's rope scaling)":
            "rope_freqs.weight" in names,
        "attention biases in a Llama file": arch == "llama" and any(
            n.endswith(("attn_q.bias", "attn_output.bias")) for n in names),
    }
    for what, present in refused.items():
        if present:
            raise GGUFError(f"{file}: {what} is not supported in GGUF files; serve the "
                            "model's Hugging Face folder instead")


def _rope_scaling(meta: dict[str, Any], arch: str, file: Path) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor is not None:
        return {"rope_type": "linear", "factor": float(factor)}
    raise GGUFError(f"{file}: rope scaling {kind!r} (factor {factor}) is not supported; "
                    "supported: none, linear with a factor")


def _tensor_types(reader: Any) -> dict[str, int]:
    """Quantisation type name -> how many tensors use it (the file's quantisation mix)."""
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return dict(sorted(counts.items()))


def _checkpoint_dtype(reader: Any) -> str:
    """The dtype `--dtype auto` picks on a GPU: float32 for an all-F32 file, float16 for F16
    weights, else bfloat16 (what a quantised model is served in there)."""
    kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) > 1}
    if kinds == {"F32"}:
        return "float32"
    return "float16" if kinds == {"F16"} else "bfloat16"


def _generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    if meta.get("general.architecture") == "gemma3":
        # A Gemma 3 chat turn ends at <end_of_turn>, which its GGUF names nowhere (no eot
        # id): an eos beside <eos>, as its generation_config.json has it ([1, 106]).
        tokens = list(meta.get("tokenizer.ggml.tokens") or [])
        eos += [i for i, t in enumerate(tokens) if t == "<end_of_turn>"]
    eos_ids = sorted({int(e) for e in eos if e is not None})
    return {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            # None, not []: load_tokenizer then falls back on tokenizer_config's eos_token
            "eos_token_id": (eos_ids[0] if len(eos_ids) == 1 else eos_ids) or None,
            "pad_token_id": meta.get("tokenizer.ggml.padding_token_id")}


def iter_gguf_tensors(file: str | Path, heads: int, kv_heads: int
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers name, float32 CPU tensor) of every weight of a GGUF file, dequantised one
    at a time (`gguf.quants.dequantize`: F32, F16, BF16, Q4_0 ... Q8_0, the K-quants, ...);
    GGUFError for a tensor of no known name or of a type the reader cannot dequantise.
    `heads`, `kv_heads`: the model's query and KV heads (the q/k rows' un-permute)."""
    from gguf.quants import dequantize  # here, not at import: only GGUF models need it

    file = Path(file)
    reader = _reader(file)
    arch = _ARCHITECTURES[str(reader.fields["general.architecture"].contents())]
    for t in tqdm(reader.tensors, desc="Dequantising GGUF", unit="tensor", file=sys.stderr):
        name = _hf_name(t.name, arch.tensor_names, file)
        try:
            values = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise GGUFError(f"{file}: tensor {t.name} is {t.tensor_type.name}, which the gguf "
                            "package cannot dequantise") from None
        values = np.ascontiguousarray(values, dtype=np.float32).reshape(
            [int(d) for d in reversed(t.shape)])  # GGUF lists dims innermost first
        if not values.flags.writeable:  # an F32 tensor is a view of the read-only map
            values = values.copy()
        if arch.permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            values = _unpermute(values, heads if "q_proj" in name else kv_heads)
        if arch.norm_shift and t.name.endswith("norm.weight"):
            values = values - np.float32(arch.norm_shift)  # float32, as transformers
        yield name, torch.from_numpy(values)


def _hf_name(name: str, names: dict[str, str], file: Path) -> str:
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit():
        template = ".".join(["blk", "{}", *parts[2:]])
        if template in names:
            return names[template].format(parts[1])
    elif name in names:
        return names[name]
    raise GGUFError(f"{file}: tensor {name!r} has no place in the file's architecture")


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of q/k rows: per head, [half of pairs, 2] -> [2, half]."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def export_hf_folder(file: Path, companion: Path, dest: Path) -> Path:
    """`dest` as an ordinary Hugging Face folder of the GGUF's model (its companion folder's
    files and the dequantised weights as float32 `model.safetensors`), for engines that do
    not read GGUF on this platform (vLLM's CPU build); written once, atomically. Holds every
    float32 weight in memory at once (4 bytes a parameter: 0.54 GB for SmolLM2-135M)."""
    from safetensors.torch import save_file

    if dest.is_dir():
        return dest
    config = json.loads((companion / "config.json").read_text(encoding="utf-8"))
    config.pop(GGUF_IDENTITY_KEY)
    config["torch_dtype"] = "float32"

    def fill(tmp: Path) -> None:
        weights = dict(iter_gguf_tensors(file, config["num_attention_heads"],
                                         config["num_key_value_heads"]))
        for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(companion / name, tmp / name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n",
                                         encoding="utf-8")
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    write_folder(dest, fill)
    return dest
