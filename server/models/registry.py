"""The architectures the engine runs: one table from config.json's architecture (or its
`model_type`) and from a GGUF file's `general.architecture` to what the architecture's file
declares (`Architecture`: its model class, its config.json fields, its GGUF form).

Adding an architecture is one file under server/models/ that declares `ARCHITECTURES` (a
tuple of `Architecture`) and one line in `_MODULES`. config.py, gguf.py and loader.py look
architectures up here and know none by name.

What must stay true: the architecture files import this module (for the types below) and
config.py, which imports this module; so, as vLLM's registry does, this module names them
(`_MODULES`) and imports them only when the table is first read (`_table`), never at its
own import. They never import loader.py.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from torch import nn

from hicache_server.models.gguf_tokenizer import GGUFError

# The architecture files under server/models/, each declaring `ARCHITECTURES`; one a line.
_MODULES = (
    "llama",  # Llama, Mistral, Qwen2
    "gemma3",
    "gemma2",  # Gemma 2: Gemma 3's body, soft-capped
    "phi3",  # Phi-3, Phi-4-mini
    "qwen3",  # Qwen3 dense
)


class GGUFSource(NamedTuple):
    """What a `GGUFForm.config` reads of a file: its metadata and its tensors."""

    file: Path
    meta: Mapping[str, Any]  # every metadata key -> its Python value
    tensor_names: frozenset[str]
    read: Callable[[str], np.ndarray]  # a tensor's float32 values, dequantised, GGUF's shape

    @property
    def arch(self) -> str:
        return str(self.meta["general.architecture"])

    def key(self, name: str, default: Any = None) -> Any:
        """Metadata `<arch>.<name>`, else `default`; GGUFError when both are missing."""
        value = self.meta.get(f"{self.arch}.{name}", default)
        if value is None:
            raise GGUFError(f"{self.file}: metadata {self.arch}.{name} is missing")
        return value


def _no_keys(source: GGUFSource) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class GGUFForm:
    """How llama.cpp's converter (convert_hf_to_gguf.py) writes an architecture."""

    name: str  # `general.architecture`
    # GGUF tensor name -> transformers name; `{}` is the layer index
    tensor_names: Mapping[str, str]
    permuted_qk: bool = False  # q/k rows stored permuted for llama.cpp's RoPE (undone at load)
    norm_shift: float = 0.0  # added to every norm weight by the converter (taken off at load)
    # config.json keys beyond the ones every file gives (`gguf.hf_config`); GGUFError or
    # ValueError for what the engine does not run
    config: Callable[[GGUFSource], dict[str, Any]] = _no_keys
    config_tensors: tuple[str, ...] = ()  # tensors read by `config`, not weights
    eos_tokens: tuple[str, ...] = ()  # tokens that end a turn beside the file's eos ids
    # `rope.dimension_count` below the head dim is read by `config` (partial rotary); a form
    # without it refuses such a file
    partial_rotary: bool = False


@dataclass(frozen=True)
class Architecture:
    """One architecture: what its file declares."""

    name: str  # config.json's `architectures[0]` (transformers' class name)
    # a CausalLM (causal_lm.py, which this module may not import: it imports config.py)
    model_class: type[nn.Module]
    # its own ModelArchConfig fields from a config.json (defaults applied); ValueError for
    # what the model does not compute
    config_fields: Callable[[Mapping[str, Any]], dict[str, Any]]
    model_types: tuple[str, ...] = ()  # config.json `model_type`s naming it (no architectures)
    # its transformers config class's defaults, for keys a config.json may leave out
    config_defaults: Mapping[str, Any] = field(default_factory=dict)
    gguf: GGUFForm | None = None  # llama.cpp's form of it, when it has one


class _Table(NamedTuple):
    by_name: dict[str, Architecture]
    by_model_type: dict[str, Architecture]
    by_gguf: dict[str, Architecture]


@functools.cache
def _table() -> _Table:
    table = _Table({}, {}, {})
    for module in _MODULES:
        for arch in importlib.import_module(f"hicache_server.models.{module}").ARCHITECTURES:
            keys = [(table.by_name, arch.name)] + [(table.by_model_type, t)
                                                   for t in arch.model_types]
            if arch.gguf is not None:
                keys.append((table.by_gguf, arch.gguf.name))
            for index, key in keys:
                if key in index:
                    raise RuntimeError(f"{module}.py: {key!r} is already registered by "
                                       f"{index[key].name}")
                index[key] = arch
    return table


def supported() -> list[str]:
    """The architecture names config.json may give, in registry order."""
    return list(_table().by_name)


def architecture(name: str) -> Architecture:
    """The architecture of config.json's name `name`; ValueError listing the supported."""
    arch = _table().by_name.get(name)
    if arch is None:
        raise ValueError(f"config.json: architecture {name!r} is not supported; supported: "
                         f"{', '.join(supported())}")
    return arch


def architecture_of_config(d: Mapping[str, Any]) -> Architecture:
    """The architecture a config.json dict names: `architectures[0]`, or, for a config saved
    from a bare config object, its `model_type`."""
    names = d.get("architectures") or []
    if names:
        return architecture(str(names[0]))
    arch = _table().by_model_type.get(str(d.get("model_type")))
    if arch is None:
        types = ", ".join(_table().by_model_type)
        raise ValueError(f"config.json: no architectures and model_type {d.get('model_type')!r} "
                         f"is not supported; supported: {types} (architectures: "
                         f"{', '.join(supported())})")
    return arch


def architecture_of_gguf(name: Any, file: Path) -> Architecture:
    """The architecture of a GGUF file's `general.architecture`; GGUFError listing the
    supported."""
    arch = _table().by_gguf.get(str(name))
    if arch is None:
        forms = ", ".join(f"{n} ({a.name})" for n, a in _table().by_gguf.items())
        raise GGUFError(f"{file}: GGUF architecture {name!r} is not supported; supported: "
                        f"{forms}")
    return arch
