"""The one door is small (issue 52, STYLE 20 and 25): `hicache.door.CacheDoor` holds the request
path in a handful of calls, everything else is a part reached as one attribute
(`cache.slots`, `.retention`, `.steps`, `.l3`, `.admin`), and the server calls nothing else
on a cache. Checked on the classes and on the server's source."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from hicache.door import CacheDoor
from hicache.stack import CacheStack
from hicache.stack_admin import AdminCalls
from hicache.stack_l3 import L3Calls
from hicache.stack_retention import RetentionCalls
from hicache.stack_slots import SlotCalls
from hicache.stack_steps import StepCalls

ROOT = Path(__file__).resolve().parent.parent
# mini-sglang's `BasePrefixCache` has 7; the door had 46 before issue 52's last step
MAX_DOOR_METHODS = 8
PARTS = {"slots": SlotCalls, "retention": RetentionCalls, "steps": StepCalls,
         "l3": L3Calls, "admin": AdminCalls}
DOOR_TYPES = ("CacheStack", "CacheDoor")


def _public(cls: type) -> set[str]:
    return {n for n, _ in inspect.getmembers(cls) if not n.startswith("_")}


def _door_methods() -> set[str]:
    return set(CacheDoor.__abstractmethods__)


def _door_names() -> set[str]:
    """What the server may read off a cache: the door's methods, attributes and parts."""
    return _door_methods() | set(CacheDoor.__annotations__)


def _part_calls(part: str) -> set[str]:
    return _public(PARTS[part])


def test_the_door_is_small() -> None:
    methods = _door_methods()
    assert len(methods) <= MAX_DOOR_METHODS, f"the door has {len(methods)}: {sorted(methods)}"
    assert set(PARTS) <= set(CacheDoor.__annotations__), "each part is named on the door"


def test_the_stack_defines_the_door_and_holds_the_parts() -> None:
    """No forwarding shims: the stack's own public calls are the door's (and the tests'
    `check_integrity`); each part is an object of its class, with its own docstring."""
    own = {n for n, v in vars(CacheStack).items() if not n.startswith("_") and callable(v)}
    assert own == _door_methods() | {"check_integrity"}, sorted(own)
    stack = _stack()
    for name, cls in PARTS.items():
        assert isinstance(getattr(stack, name), cls), name
        assert cls.__doc__ and "Threading" in inspect.getmodule(cls).__doc__, cls.__name__


def test_no_call_is_defined_on_two_parts() -> None:
    seen: dict[str, str] = {}
    for owner, names in [("door", _door_methods())] + [
            (p, _part_calls(p)) for p in PARTS]:
        for n in names:
            assert n not in seen, f"{n} is both {seen[n]}'s and {owner}'s"
            seen[n] = owner


def _stack() -> CacheStack:
    from tests.conftest import cpu_stack
    return cpu_stack(page_size=4, l1_tokens=64)


def _bound(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Names and `self.` attributes that hold the cache: parameters annotated with the door's
    type, and what they are assigned to (`self.cache = cache`, tuples too)."""
    names, attrs = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None and any(
                t in ast.unparse(node.annotation) for t in DOOR_TYPES):
            names.add(node.arg)
    for node in ast.walk(tree):
        pairs = []
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs += zip(target.elts, node.value.elts, strict=False)
                else:
                    pairs.append((target, node.value))
        elif isinstance(node, ast.AnnAssign) and any(
                t in ast.unparse(node.annotation) for t in DOOR_TYPES):
            if isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node.target, ast.Attribute):  # `self.cache: CacheStack = ...`
                attrs.add(node.target.attr)
        for target, value in pairs:
            if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                    and isinstance(value, ast.Name) and value.id in names):
                attrs.add(target.attr)
    return names, attrs


def door_calls(source: str) -> list[tuple[int, str]]:
    """Every `cache.x` and `cache.part.y` the source reads off a cache it holds, as
    (line, "x") or (line, "part.y")."""
    tree = ast.parse(source)
    names, attrs = _bound(tree)

    def is_cache(e: ast.expr) -> bool:
        return ((isinstance(e, ast.Name) and e.id in names)
                or (isinstance(e, ast.Attribute) and e.attr in attrs
                    and isinstance(e.value, ast.Name) and e.value.id == "self"))

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_cache(node.value):
            found.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
              and is_cache(node.value.value) and node.value.attr in PARTS):
            found.append((node.lineno, f"{node.value.attr}.{node.attr}"))
    return found


def _not_allowed(call: str) -> bool:
    head, _, rest = call.partition(".")
    return head not in _door_names() or bool(rest) and rest not in _part_calls(head)


def test_the_check_finds_a_call_past_the_door() -> None:
    src = ("class K:\n    def __init__(self, cache: CacheStack) -> None:\n"
           "        self.cache = cache\n    def f(self) -> None:\n"
           "        self.cache.poll(); self.cache.steps.poll(); self.cache.l3.backup([])\n")
    bad = [c for _, c in door_calls(src) if _not_allowed(c)]
    assert bad == ["poll", "l3.backup"]


def server_sources() -> list[Path]:
    return sorted((ROOT / "server").rglob("*.py"))


def test_the_server_calls_only_the_door_and_its_parts() -> None:
    seen, bad = 0, []
    for path in server_sources():
        for line, call in door_calls(path.read_text()):
            seen += 1
            if _not_allowed(call):
                bad.append(f"{path.relative_to(ROOT)}:{line} cache.{call}")
    assert seen > 40, f"the check saw only {seen} calls: does it still find the cache?"
    assert not bad, f"calls past the door (ask it, or one of {sorted(PARTS)}): {bad}"


@pytest.mark.parametrize("part", sorted(PARTS))
def test_each_part_is_a_handful(part: str) -> None:
    calls = _part_calls(part)
    assert len(calls) <= 10, f"cache.{part} has {len(calls)}: {sorted(calls)}"
