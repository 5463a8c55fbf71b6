"""The package layout's rules, checked on the source: dependencies run one way
(server -> hicache -> hicache.kernels; inside hicache, storage -> tree, never back), the public
contracts import from their packages, and the serving side never asks which tree it holds."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# folder -> the package name it installs as (pyproject's package-dir)
PACKAGE_OF_FOLDER = {"server": "hicache_server"}

# The cache holds no model and no HTTP: the model's layers, its weight files and tokenizer,
# the HTTP server and its Prometheus families live in hicache_server.
MODEL_AND_HTTP = ("torch.nn", "safetensors", "gguf", "transformers", "tokenizers", "jinja2",
                  "aiohttp", "prometheus_client")

# package prefix -> prefixes it must never import (directly, at any depth of the module)
FORBIDDEN = {
    "hicache.kernels": ("hicache", "hicache_server"),
    "hicache": ("hicache_server", *MODEL_AND_HTTP),
    "hicache.tree": ("hicache.storage", "hicache.stack", "hicache.stats"),
    "hicache.memory": ("hicache.tree", "hicache.transfer", "hicache.storage", "hicache.stack"),
    "hicache.transfer": ("hicache.tree", "hicache.storage", "hicache.stack"),
    "hicache.storage": ("hicache.stack", "hicache.stats"),
    "hicache.policies": ("hicache", "hicache_server"),
    "hicache.pages": ("hicache", "hicache_server"),
    "hicache.events": ("hicache.storage", "hicache.tree", "hicache.memory", "hicache.transfer",
                       "hicache.stack"),
    "hicache_server.http": ("hicache_server.launch",),
    "hicache.kernels.layouts": ("hicache", "hicache_server"),
    # the model's kernels, like the cache's, stand alone: CUDA loading is all they share
    "hicache_server.models.kernels": ("hicache_server", "hicache.tree", "hicache.storage",
                                      "hicache.memory", "hicache.transfer", "hicache.stack"),
}


def module_name(path: Path) -> str:
    """The importable name of a source file: the `server/` folder installs as `hicache_server`."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = (PACKAGE_OF_FOLDER.get(parts[0], parts[0]), *parts[1:])
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every module `path` imports, TYPE_CHECKING blocks included (a cycle in types is
    still a cycle in the design)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def sources() -> list[Path]:
    return sorted(p for folder in ("hicache", "server") for p in (ROOT / folder).rglob("*.py"))


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of this tree it imports (any depth of the file, TYPE_CHECKING
    blocks and relative imports included): `from pkg import name` is the submodule
    `pkg.name` when there is one, else `pkg` (its `__init__`)."""
    paths = {module_name(p): p for p in sources()}

    def known(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in paths.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    edges.add(full if full in paths else known(base))
        graph[mod] = {e for e in edges if e is not None and e != mod}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start, edges in graph.items():
        if start in index:
            continue
        work = [(start, iter(sorted(edges)))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycles() -> None:
    """No module of hicache/ or server/ reaches itself through its imports (a
    cycle in types, or through a function's import, is still a cycle in the design)."""
    assert import_cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_dependencies_run_one_way(path: Path) -> None:
    mod = module_name(path)
    for pkg, banned in FORBIDDEN.items():
        if not within(mod, pkg):
            continue
        bad = sorted(n for n in imported(path) for b in banned
                     if within(n, b) and not within(n, pkg))
        assert not bad, f"{mod} ({pkg}) imports {bad}"


def test_the_contracts_import_from_their_packages() -> None:
    from hicache.build import build_stack  # noqa: F401
    from hicache.handles import Hit, Lease  # noqa: F401
    from hicache.memory import DeviceKVPool, HostKVPool  # noqa: F401
    from hicache.stack import CacheStack  # noqa: F401
    from hicache.storage import PageHasher, StorageController, StorageTier  # noqa: F401
    from hicache.storage.backends import create_backend, register_backend  # noqa: F401
    from hicache.storage.backends.base import StorageBackend  # noqa: F401
    from hicache.transfer import HiCacheController, TransferEngine  # noqa: F401
    from hicache.tree import HiRadixCache, MatchResult, PrefixCache, RadixCache

    assert issubclass(RadixCache, PrefixCache) and issubclass(HiRadixCache, RadixCache)
    assert MatchResult._fields == ("device_indices", "last_device_node", "last_host_node",
                                   "host_hit_length")


def test_the_server_never_asks_which_tree_it_holds() -> None:
    for path in (ROOT / "server").rglob("*.py"):
        text = path.read_text()
        assert "HiRadixCache" not in text and "RadixCache" not in text, (
            f"{path.relative_to(ROOT)} names a tree class; call the PrefixCache interface")


def test_the_server_never_imports_the_tree() -> None:
    """One door: the server reaches the cache through `hicache.stack.CacheStack` and its
    opaque handles (`hicache.handles`); no tree node, class or table crosses into it."""
    for path in sorted((ROOT / "server").rglob("*.py")):
        bad = sorted(n for n in imported(path) if within(n, "hicache.tree"))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}; call hicache.stack.CacheStack"


# What the server may import of hicache: the door (its contract `door`, `stack`, `build`, its
# `handles`), and the shared vocabulary (config, stats, policies, pages, the model's KV shape,
# kernels).
SERVER_MAY_IMPORT = ("hicache.build", "hicache.config", "hicache.config_storage",
                     "hicache.door", "hicache.handles",
                     "hicache.kernels", "hicache.model_kv", "hicache.pages", "hicache.policies",
                     "hicache.stack", "hicache.stats")
# The data plane besides: the model's forward reads and writes the L1 buffers
# (`cache.slots.device_kv`), and the engine keeps freed memory for them; the router (a
# process of its own, no cache) indexes the servers' KV events. Folders end in "/".
SERVER_DATA_PLANE = {"hicache.memory": ("server/models/", "server/model_runner.py",
                                        "server/engine.py"),
                     "hicache.events": ("server/router.py",)}
# What the door keeps behind it: the server never reads these off a cache (`cache.storage`,
# `engine.cache.device_pool`); it asks the door (`admin.tiers()`, `stats()`, `l3.estimates()`).
CACHE_PARTS = {"tree", "device_pool", "host_pool", "storage", "controller", "pins",
               "sessions", "events", "publisher", "l3_link"}


def server_sources() -> list[Path]:
    return sorted((ROOT / "server").rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _allowed_import(name: str, rel: str) -> bool:
    if not within(name, "hicache"):
        return True
    if any(within(name, door) for door in SERVER_MAY_IMPORT):
        return True
    return any(within(name, pkg) and any(rel == w or (w.endswith("/") and rel.startswith(w))
                                         for w in where)
               for pkg, where in SERVER_DATA_PLANE.items())


@pytest.mark.parametrize("path", server_sources(), ids=_rel)
def test_the_server_imports_only_the_door(path: Path) -> None:
    """No `hicache.storage.tier_state.Resume` in admission: what the server passes back to
    the cache is a handle of the door's (`hicache.handles`)."""
    bad = sorted(n for n in imported(path) if not _allowed_import(n, _rel(path)))
    assert not bad, f"{_rel(path)} imports {bad}; ask hicache.stack.CacheStack"


def _is_cache(node: ast.expr) -> bool:
    """`cache`, `self.cache`, `engine.cache`, `stack`: an expression naming the door."""
    name = (node.id if isinstance(node, ast.Name)
            else node.attr if isinstance(node, ast.Attribute) else None)
    return name in ("cache", "stack")


@pytest.mark.parametrize("path", server_sources(), ids=_rel)
def test_the_server_reads_no_part_behind_the_door(path: Path) -> None:
    """`cache.storage.estimates()` (warm-up), `engine.cache.device_pool.size_bytes`
    (discovery), `cache.host_pool is None` (L3 attach): each is a question for the door."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in CACHE_PARTS:
            assert not _is_cache(node.value), (
                f"{_rel(path)}:{node.lineno} reads {ast.unparse(node)}; ask the door "
                "(cache.admin.tiers(), cache.stats(), cache.l3.estimates())")


@pytest.mark.parametrize("path", server_sources(), ids=_rel)
def test_the_server_computes_no_page_bytes(path: Path) -> None:
    """The bytes of a page are the cache's: `StorageStats` carries them and turns stored
    pages into tokens (`capacity_tokens`); the HTTP layer computed them in three places."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        name = (node.attr if isinstance(node, ast.Attribute)
                else node.arg if isinstance(node, ast.keyword)
                else node.id if isinstance(node, ast.Name) else "")
        assert "page_bytes" not in (name or ""), (
            f"{_rel(path)}:{node.lineno} handles page bytes ({name}); read hicache.stats")


def _node_slots() -> set[str]:
    from hicache.tree.node import HiTreeNode, TreeNode

    return set(TreeNode.__slots__) | set(HiTreeNode.__slots__)


# Node fields whose names say what they are wherever they appear; the generic ones (`value`,
# `key`, `priority`, `parent`...) count only on a variable named like a node.
GENERIC_SLOTS = {"children", "extra_key", "id", "key", "parent", "priority", "value"}
NODE_NAMES = {"node", "n", "leaf", "child", "parent", "end", "last", "anchor"}


@pytest.mark.parametrize("path", [p for p in sources() if not within(module_name(p),
                                                                       "hicache.tree")],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_tree_writes_node_fields(path: Path) -> None:
    slots = _node_slots()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                   else [])
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if not isinstance(t, ast.Attribute) or t.attr not in slots:
                    continue
                named_node = isinstance(t.value, ast.Name) and t.value.id in NODE_NAMES
                assert t.attr in GENERIC_SLOTS and not named_node, (
                    f"{path.relative_to(ROOT)}:{t.lineno} writes the node field {t.attr!r}; "
                    "only hicache/tree writes node fields (add a tree method)")


def test_hicache_installs_no_top_level_kernels_package() -> None:
    """`kernels` is the registry name of the package transformers (>= 5.25) imports its hub
    kernels from; hicache's kernel bindings live in `hicache.kernels` (the model's in
    `hicache_server.models.kernels`), each with its C and CUDA sources in its src/."""
    import importlib.metadata
    import importlib.util

    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert not list((ROOT / "kernels").glob("*.py"))
    assert "hicache" not in importlib.metadata.packages_distributions().get("kernels", [])
    spec = importlib.util.find_spec("kernels")
    assert spec is None or spec.origin is None or ROOT / "kernels" not in Path(spec.origin).parents


# Bases that make a contract or a record, not a share of another class's state.
CONTRACT_BASES = {"ABC", "Protocol", "NamedTuple", "Enum", "IntEnum", "Exception",
                  "RuntimeError", "ValueError", "OSError", "TypedDict", "Generic", "Struct"}


# Shared behaviour over one named field, not a class split by size: the two KV pools hand
# out pages through their `allocator` the same way.
MIXINS_ALLOWED = {"PagedSlots"}


def _classes(folder: str) -> dict[str, tuple[Path, ast.ClassDef]]:
    out = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                out[node.name] = (path, node)
    return out


def _base_names(cls: ast.ClassDef) -> list[str]:
    return [ast.unparse(b).rpartition(".")[2].split("[")[0] for b in cls.bases]


def _is_contract(cls: ast.ClassDef, classes: dict[str, tuple[Path, ast.ClassDef]]) -> bool:
    return any(b in CONTRACT_BASES or (b in classes and _is_contract(classes[b][1], classes))
               for b in _base_names(cls))


def _is_mixin(cls: ast.ClassDef, classes: dict[str, tuple[Path, ast.ClassDef]]) -> bool:
    """A class that names the state it works on (`tree: PrefixCache`, `_owned: dict`) but
    makes none (no `__init__`) and is no contract: another class's `__init__` makes it."""
    if _is_contract(cls, classes):
        return False
    has_init = (any(isinstance(n, ast.FunctionDef) and n.name == "__init__" for n in cls.body)
                or any("dataclass" in ast.unparse(d) for d in cls.decorator_list))
    names_state = any(isinstance(n, ast.AnnAssign) and n.value is None
                      and "ClassVar" not in ast.unparse(n.annotation) for n in cls.body)
    return names_state and not has_init


def test_no_class_of_the_cache_is_made_of_mixins() -> None:
    """Parts, not mixins (issue 52): `CacheStack(RequestCalls)`, `StorageTier(HeadRace)`,
    `RadixCache(TreeEvents, Retention, ...)`, `HiRadixCache(HostWrites, HostLoads, ...)`
    shared one object's state; each part is now an object the owner holds."""
    classes = _classes("hicache")
    bad = [f"{_rel(path)}: {name}({b})" for name, (path, cls) in classes.items()
           for b in _base_names(cls)
           if b in classes and b not in MIXINS_ALLOWED and _is_mixin(classes[b][1], classes)]
    assert not bad, f"mixins that share their class's state (make each a part it holds): {bad}"
