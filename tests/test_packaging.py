"""What the wheel installs: `hicache` and `hicache_server` (the `server/` folder under a name of
its own), never a top-level `server` that would collide with any other in vLLM's or SGLang's
environment; and the `hicache-server` command still points at the launcher."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
FOLDER_OF_PACKAGE = {"hicache": "hicache", "hicache_server": "server"}


def declared() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_declared() -> None:
    """pyproject lists the packages by hand (a mapped folder cannot be found by `find:`), so a
    new subpackage left out of the list would be missing from the wheel."""
    found = set()
    for package, folder in FOLDER_OF_PACKAGE.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *rel)))
    assert set(declared()["packages"]) == found
    assert declared()["package-dir"] == {"hicache_server": "server"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built from a copy of what the wheel is made of: the checkout's build/ keeps every
    file an earlier build copied there, moved or deleted since, and setuptools ships it."""
    out, src = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in FOLDER_OF_PACKAGE.values():
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(src)], check=True, capture_output=True)
    (path,) = out.glob("hicache-*.whl")
    return path


def test_the_wheel_holds_no_top_level_server(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"hicache", "hicache_server"}
    assert "hicache_server/launch.py" in names
    assert "hicache_server/http/app.py" in names
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "hicache-server = hicache_server.launch:main" in zipfile.ZipFile(wheel).read(
        entry).decode()


def test_each_kernel_package_ships_its_own_sources(wheel: Path) -> None:
    """The cache's transfer kernel in `hicache.kernels`, the model's kernels (headers
    included: the C kernels include them) in `hicache_server.models.kernels`, none in both."""
    names = set(zipfile.ZipFile(wheel).namelist())
    for package, folder in (("hicache", ROOT / "hicache" / "kernels" / "src"),
                            ("hicache_server", ROOT / "server" / "models" / "kernels" / "src")):
        inside = folder.relative_to(ROOT / FOLDER_OF_PACKAGE[package])
        shipped = {n for n in names if n.startswith(f"{package}/{inside.as_posix()}/")}
        assert shipped == {f"{package}/{inside.as_posix()}/{f.name}" for f in folder.iterdir()}
    assert not {n for n in names if n.startswith("hicache/kernels/src/cpu_")}


def test_import_server_fails_in_a_fresh_venv(wheel: Path, tmp_path: Path) -> None:
    """Installed into a venv of its own (no dependencies: only what the wheel itself puts
    there is looked at), `hicache_server` is found and `server` is not."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True)
    probe = ("import importlib.util as u; "
             "print(u.find_spec('hicache_server') is not None, "
             "u.find_spec('hicache_server.launch') is not None, u.find_spec('server') is None)")
    got = subprocess.run([py, "-I", "-c", probe], cwd=tmp_path, check=True,
                         capture_output=True, text=True).stdout.split()
    assert got == ["True", "True", "True"]
