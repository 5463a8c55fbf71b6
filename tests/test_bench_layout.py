"""How benchmarks/ and tests/ import: as packages, never by editing `sys.path`. A benchmark
only measures: what it needs of the product it imports from `hicache` / `hicache_server`,
what it shares with other benchmarks from `benchmarks.*` (run as `python -m benchmarks.x`),
and nothing from tests/ (the tests may import the benchmarks they test, not the reverse)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_layout import import_cycles, imported

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS, TESTS = ROOT / "benchmarks", ROOT / "tests"


def python_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def module_names(folder: Path) -> set[str]:
    """The bare names a module of `folder` could be imported by with the folder on sys.path."""
    return {p.stem for p in python_files(folder) if p.stem != "__init__"}


def path_edits(path: Path) -> list[int]:
    """Lines that touch `sys.path` (insert, append, assignment, slice assignment...)."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Attribute) and node.attr == "path"
            and isinstance(node.value, ast.Name) and node.value.id == "sys"]


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("path", python_files(BENCHMARKS) + python_files(TESTS), ids=rel)
def test_no_sys_path_edits(path: Path) -> None:
    lines = path_edits(path)
    assert not lines, (f"{rel(path)}:{lines} edits sys.path; import `benchmarks.*` as a "
                       "package (the repository root is pytest's pythonpath; benchmarks run "
                       "as `python -m benchmarks.x`)")


@pytest.mark.parametrize("path", python_files(BENCHMARKS), ids=rel)
def test_benchmarks_import_no_tests_and_each_other_as_a_package(path: Path) -> None:
    test_modules, bench_modules = module_names(TESTS), module_names(BENCHMARKS)
    for name in sorted(imported(path)):
        top = name.split(".")[0]
        assert top != "tests" and top not in test_modules, (
            f"{rel(path)} imports {name} from tests/: what it needs belongs in the product "
            "or in a benchmarks module")
        assert top not in bench_modules, (
            f"{rel(path)} imports {name} by its bare name: `from benchmarks import {top}`")


def test_the_benchmarks_import_no_cycle() -> None:
    graph = {f"benchmarks.{p.stem}": {n for n in imported(p) if n.startswith("benchmarks.")}
             for p in python_files(BENCHMARKS) if p.stem != "__init__"}
    graph = {m: {n if n in graph else n.rpartition(".")[0] for n in edges} & set(graph)
             for m, edges in graph.items()}
    assert import_cycles(graph) == []


def test_the_checks_find_what_they_forbid(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import sys\nimport redis_fixtures\nsys.path.insert(0, '..')\n"
                     "from benchmarks import bench_multiturn\n")
    assert path_edits(probe) == [3]
    assert imported(probe) == {"sys", "redis_fixtures", "benchmarks",
                              "benchmarks.bench_multiturn"}
    assert "redis_fixtures" in module_names(TESTS)
