"""GGUF checkpoints (llama.cpp's format): the architecture, tokenizer and chat template from the
file's metadata, and its tensors dequantised with the `gguf` package, llama.cpp's own reader.

A GGUF file is served through a *companion folder*, written once under
`hicache_home()/models/gguf/<stem>-<identity>-v<COMPANION_VERSION>/`: an ordinary Hugging
Face folder without the weights (`config.json`, `generation_config.json`, `tokenizer.json`,
`tokenizer_config.json` with the chat template) built from the metadata, so the tokenizer,
the chat template and transformers' AutoTokenizer all read it as they read any model folder,
and the weights are streamed from the GGUF file itself at every load (`iter_gguf_tensors`).

What must stay true:
- `config.json` carries `hicache_gguf` with the file's identity (`gguf_identity`: its size,
  its header, i.e. every metadata value and every tensor's name, type, shape and offset,
  and samples of its data), so page hashes of two quantisations, or of two fine-tunes, never
  meet; the file's path is not part of it (two machines share pages of the same file).
- The tokenizer is built from the metadata by `server/models/gguf_tokenizer.py`.
- Tensors come out under transformers' names and layout, as the architecture's `GGUFForm`
  (registry.py, declared in its file) says: llama.cpp stores a Llama's q and k rows permuted
  for its RoPE (`convert_hf_to_gguf.py`'s `permute`), undone here (`_unpermute`); a
  `norm_shift` the converter added to every norm weight (Gemma's `1 + w`) is taken off in
  float32 as transformers' GGUF loader does, so the model's `1 + w` gives its bits.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from tqdm import tqdm

from hicache_server.models import registry
from hicache_server.models.fingerprint import GGUF_IDENTITY_KEY
from hicache_server.models.folders import write_folder
from hicache_server.models.gguf_header import check_gguf_header
from hicache_server.models.gguf_tokenizer import GGUFError, tokenizer_config, tokenizer_json
from hicache_server.models.registry import GGUFSource

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
    """gguf-py's reader of `file`, once its header's counts and lengths are checked against
    the file's size (`gguf_header`: gguf-py loops over whatever a header claims)."""
    import gguf  # here, not at import: only GGUF models need it

    try:
        check_gguf_header(file)
        return gguf.GGUFReader(str(file))
    except GGUFError:
        raise
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
             "generation_config.json": _generation_config(meta, file),
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
    """config.json (transformers' keys) of a GGUF file's metadata: the keys every file gives,
    then its architecture's own (`GGUFForm.config`); GGUFError for an architecture or a
    feature the engine does not run."""
    arch = registry.architecture_of_gguf(meta.get("general.architecture"), file)
    tensors = {t.name: t for t in reader.tensors}
    source = GGUFSource(file, meta, frozenset(tensors),
                        read=lambda name: dequantise(tensors[name], file))
    _refuse_unsupported(source)
    key = source.key
    heads, hidden = int(key("attention.head_count")), int(key("embedding_length"))
    head_dim = int(key("attention.key_length", hidden // heads))
    if not arch.gguf.partial_rotary and int(key("rope.dimension_count", head_dim)) != head_dim:
        raise GGUFError(f"{file}: partial rotary embeddings (rope.dimension_count "
                        f"{key('rope.dimension_count')} < head dim {head_dim}) are not supported")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config = {
        "architectures": [arch.name], "model_type": arch.model_types[0],
        "hidden_size": hidden, "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)), "head_dim": head_dim,
        "vocab_size": int(key("vocab_size", len(tokens))),
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(source),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "torch_dtype": _checkpoint_dtype(reader),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        GGUF_IDENTITY_KEY: {"identity": identity, "version": COMPANION_VERSION,
                            "name": meta.get("general.name"),
                            "tensor_types": _tensor_types(reader)},
    }
    return config | arch.gguf.config(source)


def _refuse_unsupported(source: GGUFSource) -> None:
    """GGUFError, before any weight is read, for what a file of any architecture may hold
    that this engine does not run (its architecture's `config` refuses its own)."""
    refused = {
        "a split GGUF (split.count > 1; merge it with llama-gguf-split --merge)":
            int(source.meta.get("split.count", 1)) > 1,
        f"mixture of experts ({source.arch}.expert_count)":
            int(source.key("expert_count", 0)) > 0,
    }
    for what, present in refused.items():
        if present:
            raise GGUFError(f"{source.file}: {what} is not supported in GGUF files; serve the "
                            "model's Hugging Face folder instead")


def _rope_scaling(source: GGUFSource) -> dict[str, Any] | None:
    kind = source.key("rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = source.meta.get(f"{source.arch}.rope.scaling.factor")
    if kind == "linear" and factor is not None:
        return {"rope_type": "linear", "factor": float(factor)}
    raise GGUFError(f"{source.file}: rope scaling {kind!r} (factor {factor}) is not supported; "
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


def _generation_config(meta: dict[str, Any], file: Path) -> dict[str, Any]:
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    # tokens that end a turn which the file names nowhere (Gemma 3's <end_of_turn>: an eos
    # beside <eos>, as its generation_config.json has it, [1, 106])
    ends = registry.architecture_of_gguf(meta.get("general.architecture"), file).gguf.eos_tokens
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    eos += [i for i, t in enumerate(tokens) if t in ends]
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
    file = Path(file)
    reader = _reader(file)
    form = registry.architecture_of_gguf(reader.fields["general.architecture"].contents(),
                                         file).gguf
    for t in tqdm(reader.tensors, desc="Dequantising GGUF", unit="tensor", file=sys.stderr):
        if t.name in form.config_tensors:  # read into config.json, not a weight
            continue
        name = _hf_name(t.name, form.tensor_names, file)
        values = dequantise(t, file)
        if form.permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            values = _unpermute(values, heads if "q_proj" in name else kv_heads)
        if form.norm_shift and t.name.endswith("norm.weight"):
            values = values - np.float32(form.norm_shift)  # float32, as transformers
        yield name, torch.from_numpy(values)


def dequantise(t: Any, file: Path) -> np.ndarray:
    """A reader tensor's values as a writable float32 array of its transformers shape (GGUF
    lists dims innermost first); GGUFError for a type the gguf package cannot dequantise."""
    from gguf.quants import dequantize  # here, not at import: only GGUF models need it

    try:
        values = dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise GGUFError(f"{file}: tensor {t.name} is {t.tensor_type.name}, which the gguf "
                        "package cannot dequantise") from None
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(
        [int(d) for d in reversed(t.shape)])
    if not values.flags.writeable:  # an F32 tensor is a view of the read-only map
        values = values.copy()
    return values


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
