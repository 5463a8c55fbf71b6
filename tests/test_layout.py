"""The package layout's rules, checked on the source: dependencies run one way
(server -> hicache -> kernels; inside hicache, storage -> tree, never back), the public
contracts import from their packages, and the serving side never asks which tree it holds."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# package prefix -> prefixes it must never import (directly, at any depth of the module)
FORBIDDEN = {
    "kernels": ("hicache", "server"),
    "hicache": ("server",),
    "hicache.tree": ("hicache.storage", "hicache.stack", "hicache.stats", "hicache.metrics"),
    "hicache.memory": ("hicache.tree", "hicache.transfer", "hicache.storage", "hicache.stack"),
    "hicache.transfer": ("hicache.tree", "hicache.storage", "hicache.stack"),
    "hicache.storage": ("hicache.stack", "hicache.stats", "hicache.metrics"),
    "hicache.policies": ("hicache", "kernels", "server"),
    "kernels.layouts": ("hicache", "kernels", "server"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
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
    return sorted(p for pkg in ("hicache", "kernels", "server") for p in (ROOT / pkg).rglob("*.py"))


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


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
