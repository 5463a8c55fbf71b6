"""Parts, not mixins, and files a reader can hold (issue 52, STYLE 22 and 24), checked on the
source of `hicache/` and `server/`:

- a class of this tree that exactly one other class inherits is a contract (an ABC, a
  Protocol, or a class with abstract methods) or a class that stands on its own (constructed
  somewhere, or handed on as a factory): a base of one class that is never built alone exists
  only to split that class, and shares all of one object's state. (A base several classes
  share, such as the config sections' `Section`, generalises them.)
- no source file is past `MAX_LINES`.

On the tree before issue 52 the first check names nine: CacheStack(RequestCalls),
StorageTier(HeadRace), RadixCache(TreeEvents), RadixCache(Retention), HiRadixCache(HostWrites),
HiRadixCache(HostLoads), LmdbStore(LmdbEnvironment), RedisStore(RedisClient) and
Scheduler(RequestEndings); the second lmdb_env.py (450), storage/tier.py (438), tree/radix.py
(444). `test_layout.test_no_class_of_the_cache_is_made_of_mixins` reads the same rule from the
other side (a base that names state it never makes).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hicache", "server")
# "A file past ~400 lines is a sign it holds two" (docs/architecture.md): the tilde is this
# margin.
MAX_LINES = 420
CONTRACT_BASES = {"ABC", "Protocol", "NamedTuple", "Exception", "Enum"}
# Bases of one class kept on purpose, with why.
KEPT = {"EventBatch": "vLLM's KV event schema, mirrored field for field (hicache.events.schema)"}


def sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def classes() -> dict[str, tuple[Path, ast.ClassDef]]:
    found = {}
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                found[node.name] = (path, node)
    return found


def base_names(node: ast.ClassDef) -> list[str]:
    names = []
    for base in node.bases:
        if isinstance(base, ast.Name):
            names.append(base.id)
        elif isinstance(base, ast.Attribute):
            names.append(base.attr)
    return names


def is_contract(name: str, tree: dict[str, tuple[Path, ast.ClassDef]]) -> bool:
    """An ABC or Protocol (directly or through its bases), or a class with an abstract
    method: what a base class is for."""
    if name not in tree:
        return name in CONTRACT_BASES
    _, node = tree[name]
    abstract = any(isinstance(d, ast.Name) and d.id == "abstractmethod"
                   or isinstance(d, ast.Attribute) and d.attr == "abstractmethod"
                   for item in node.body if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                   for d in item.decorator_list)
    return abstract or any(is_contract(b, tree) for b in base_names(node))


def constructed() -> set[str]:
    """Every name called anywhere in the tree, its tests and benchmarks (`Name(...)` or
    `module.Name(...)`), or assigned as a value (`node_cls = TreeNode`)."""
    names = set()
    for path in [*sources(), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                if isinstance(node.func, ast.Name):
                    names.add(node.func.id)
                elif isinstance(node.func, ast.Attribute):
                    names.add(node.func.attr)
            elif (isinstance(node, ast.Assign | ast.AnnAssign)
                  and isinstance(node.value, ast.Name)):
                names.add(node.value.id)
    return names


def test_every_base_class_is_a_contract_or_stands_on_its_own() -> None:
    tree, built = classes(), constructed()
    heirs: dict[str, int] = {}
    for _, node in tree.values():
        for base in base_names(node):
            heirs[base] = heirs.get(base, 0) + 1
    mixins = []
    for name, (path, node) in tree.items():
        for base in base_names(node):
            if (base in tree and heirs[base] == 1 and not is_contract(base, tree)
                    and base not in built and base not in KEPT):
                mixins.append(f"{path.relative_to(ROOT)}: {name}({base})")
    assert not mixins, ("base classes never built alone (make them parts the class holds): "
                        + "; ".join(sorted(mixins)))


def test_the_check_finds_a_mixin() -> None:
    """The rule above on a made-up pair: a base never constructed is caught, an ABC is not."""
    source = ("from abc import ABC, abstractmethod\n"
              "class Half:\n    def a(self): ...\n"
              "class Whole(Half):\n    def b(self): ...\n"
              "class Door(ABC):\n    @abstractmethod\n    def c(self): ...\n"
              "class Room(Door):\n    def c(self): ...\n")
    nodes = {n.name: (Path("x.py"), n) for n in ast.walk(ast.parse(source))
             if isinstance(n, ast.ClassDef)}
    assert not is_contract("Half", nodes) and is_contract("Door", nodes)
    assert is_contract("Room", nodes)  # through its base


def test_no_source_file_is_past_the_line_bound() -> None:
    long = {str(p.relative_to(ROOT)): n for p in sources()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files past {MAX_LINES} lines (split them by what they hold): {long}"
