"""The invariants of a tree's nodes, each node checked against its parent (what every
tree's `check_integrity` asserts of each node, beside its own counts). A broken one raises
AssertionError naming the node.

Threading: scheduler thread only, like the tree.
"""

from __future__ import annotations

from typing import Any

from hicache.tree.node import HiTreeNode, TreeNode
from hicache.tree.walk import child_key


def check_node(node: TreeNode, root: TreeNode, page_size: int) -> None:
    """Linked under its first page, whole pages, no more locked, pinned, owned or urgent
    than its parent, in its parent's namespace."""
    parent = node.parent
    assert parent is not None, f"{node!r} has no parent"
    ck = child_key(node.key, 0, node.extra_key, page_size)
    assert parent.children.get(ck) is node, f"{node!r} not linked under its first page"
    assert len(node.key) > 0, f"empty non-root node {node!r}"
    assert len(node.key) % page_size == 0, f"{node!r} not page-aligned"
    assert node.end == parent.end + len(node.key), f"{node!r} ends at {node.end}"
    assert node.lock_ref >= 0, f"negative lock_ref on {node!r}"
    assert node.lock_ref <= parent.lock_ref or parent is root, (
        f"{node!r} locked more than its parent")
    if parent is not root:
        assert node.extra_key == parent.extra_key, f"{node!r} crosses a namespace"
        assert node.priority <= parent.priority, (
            f"{node!r} has priority {node.priority} above its parent's {parent.priority}")
    if node.value is not None:
        assert len(node.value) == len(node.key), f"{node!r} value/key length mismatch"
    assert parent is root or node.pin_ref <= parent.pin_ref, (
        f"{node!r} pinned more than its parent")
    assert parent is root or node.owners <= parent.owners, (
        f"{node!r} is owned by sessions its parent is not: {node.owners - parent.owners}")


def check_hi_node(node: HiTreeNode) -> None:
    """On some tier; L1 and L2 each a prefix-closed set; host-protected no more than its
    parent; a locked node on L1."""
    parent = node.parent
    assert node.host_ref_counter >= 0, f"negative host_ref_counter on {node!r}"
    assert node.host_ref_counter <= parent.host_ref_counter, (
        f"{node!r} host-protected more than its parent")
    if node.evicted:
        assert node.lock_ref == 0, f"locked node {node!r} is not on the device"
        assert node.backuped, f"{node!r} is on no tier"
    else:
        assert not parent.evicted, f"device node {node!r} under an evicted parent"
    if node.backuped:
        assert parent.backuped, f"backup hole: {node!r} backed up, its parent not"
        assert len(node.host_value) == len(node.key), f"{node!r} host length mismatch"


def check_tree(tree: Any) -> None:
    """A `RadixCache`'s counts against its nodes: the node count, the evictable and
    protected device tokens, the root's lock, its retention's and its window layers'."""
    evictable = protected = count = 0
    seen = []
    for node in tree.iter_nodes():
        count += 1
        seen.append(node)
        tree._check_node(node)
        n = tree._device_len(node)
        if node.lock_ref > 0:
            protected += n
        else:
            evictable += n
    assert count + 1 == tree._num_nodes, f"node count {count + 1} != {tree._num_nodes}"
    assert evictable == tree._evictable, f"evictable {evictable} != {tree._evictable}"
    assert protected == tree._protected, f"protected {protected} != {tree._protected}"
    assert tree.root.lock_ref >= 1, "the root lost its lock"
    tree.retention.check()
    if tree.windows is not None:
        tree.windows.check(seen)
