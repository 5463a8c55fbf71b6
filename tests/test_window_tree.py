"""hicache/tree/window_kv.py through RadixCache over a WindowedKVPool: a hybrid model's tree,
whose nodes keep their window layers' KV on L1 (`window`) or only their full layers' (a
tombstone), and whose hits never serve a window with a hole.

Plain cases first (one request's early tokens left the window before its insert; the hit's
window boundary for windows on and off page boundaries; LRU tombstoning around a lock, which
keeps only the window its queries read; a later request's window KV reviving a tombstone;
eviction giving the window pages back), then a stateful model against a brute force of the
hit rule computed from the tree's own slots and the pool's page map, checking the very K/V
the hit would read. Every value written is a function of the token's whole prefix (as real
KV is), so a slot or window page that went to another sequence shows up as wrong data.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from hicache.memory.device import PADDING_PAGE
from hicache.memory.windowed import WindowedKVPool
from hicache.pages import pages_down
from hicache.stack_slots import SlotCalls
from hicache.tree.base import MatchResult
from hicache.tree.node import TreeNode
from hicache.tree.radix import RadixCache

PAGE = 4
# more window tokens than any test pool frees: `tombstone_until(EVERY)` drops every candidate
EVERY = 1 << 40
# each test pool's widest window, from its layers as given (the hit rule's W)
WIDEST: weakref.WeakKeyDictionary[WindowedKVPool, int] = weakref.WeakKeyDictionary()


def make_pool(num_pages: int = 64, window_pages: int = 24,
              layer_windows: tuple[int | None, ...] = (None, 8, 8)) -> WindowedKVPool:
    pool = WindowedKVPool(num_pages=num_pages, window_pages=window_pages, page_size=PAGE,
                          layer_windows=layer_windows, kv_heads=1, head_dim=2,
                          dtype=torch.float32, device="cpu")
    WIDEST[pool] = max(w for w in layer_windows if w is not None)
    return pool


def make_tree(pool: WindowedKVPool) -> RadixCache:
    tree = RadixCache(pool, page_size=PAGE)
    assert tree.windows is not None
    return tree


def kv_values(key: list[int]) -> torch.Tensor:
    """One value per token that depends on its whole prefix and its position (exact in
    float32): what a real model's K/V of that token would depend on."""
    out, h = [], 0
    for i, t in enumerate(key):
        h = (h * 31 + t + 1) % 9973
        out.append(h * 1000 + i % 1000)
    return torch.tensor(out, dtype=torch.float32)


def write_kv(pool: WindowedKVPool, key: list[int], slots: torch.Tensor) -> None:
    """Write `key`'s values at `slots` in every layer (a window layer through the page map),
    K positive and V negative."""
    vals = kv_values(key[:slots.numel()])[:, None, None]
    for layer in range(pool.num_layers):
        idx = (pool.window_slots(slots, pool.kv_group(layer) - 1) if pool.is_window_layer(layer)
               else slots)
        pool.k_buffers[layer][idx] = vals
        pool.v_buffers[layer][idx] = -vals


def read_ok(pool: WindowedKVPool, key: list[int], slots: torch.Tensor, first_window: int
            ) -> None:
    """The full layers hold `key`'s values at `slots`, the window layers from token
    `first_window` on."""
    want = kv_values(key[:slots.numel()])
    for layer in range(pool.num_layers):
        if pool.is_window_layer(layer):
            idx = pool.window_slots(slots[first_window:], pool.kv_group(layer) - 1)
            exp = want[first_window:]
        else:
            idx, exp = slots, want
        assert torch.equal(pool.k_buffers[layer][idx][:, 0, 0], exp), f"layer {layer} K"
        assert torch.equal(pool.v_buffers[layer][idx][:, 0, 1], -exp), f"layer {layer} V"


def put(tree: RadixCache, pool: WindowedKVPool, key: list[int], live_from: int = 0
        ) -> tuple[int, torch.Tensor]:
    """A request's end as hicache/stack.py `_insert` runs it (shared=0): slots for the key's
    whole pages, its values written, the window pages of its first `live_from` tokens (whole
    pages) dropped as they left the window while it ran, the insert, the duplicates freed.
    Returns (present, slots)."""
    end = pages_down(len(key), PAGE)
    slots = pool.alloc(end)
    assert slots is not None, "the test's pool is too small"
    write_kv(pool, key, slots)
    pool.drop_window(slots[:pages_down(min(live_from, end), PAGE)])
    present = tree.insert(key, slots)
    if present:
        pool.free(slots[:present])
    return present, slots


def cached_slots(tree: RadixCache, key: list[int]) -> torch.Tensor:
    """The slots of `key`'s longest cached page-aligned prefix, by a page-by-page walk of the
    tree (no split, no touch)."""
    node, pos, out = tree.root, 0, []
    while pos + PAGE <= len(key):
        child = next((c for c in node.children.values()
                      if c.extra_key is None and tuple(c.key[:PAGE]) == tuple(key[pos:pos + PAGE])),
                     None)
        if child is None:
            break
        n = 0
        while (n < len(child.key) and pos + n + PAGE <= len(key)
               and tuple(child.key[n:n + PAGE]) == tuple(key[pos + n:pos + n + PAGE])):
            n += PAGE
        out.append(child.value[:n])
        pos += n
        if n < len(child.key):
            break
        node = child
    return torch.cat(out) if out else torch.empty(0, dtype=torch.int64)


def needed_from(end: int, window: int) -> int:
    return pages_down(max(0, end - window + 1), PAGE)


def brute_hit(pool: WindowedKVPool, slots: torch.Tensor) -> int:
    """The largest page-aligned P <= len(slots) whose pages [needed_from(P), P) all hold
    window KV (0 always qualifies)."""
    live = (pool.window_pages_of(slots) != PADDING_PAGE).tolist()
    for p in range(len(live) * PAGE, 0, -PAGE):
        if all(live[needed_from(p, WIDEST[pool]) // PAGE:p // PAGE]):
            return p
    return 0


def hit(tree: RadixCache, pool: WindowedKVPool, key: list[int]) -> int:
    """Match `key`; check its slots and data against the brute force; the hit's length."""
    return match_checked(tree, pool, key).device_indices.numel()


def match_checked(tree: RadixCache, pool: WindowedKVPool, key: list[int]) -> MatchResult:
    """`tree.match_prefix(key)`, its slots and data checked against the brute force."""
    want = cached_slots(tree, key)
    expected = brute_hit(pool, want)
    m = tree.match_prefix(key)
    got = m.device_indices
    assert got.numel() == expected, f"hit {got.numel()} != brute force {expected}"
    assert torch.equal(got, want[:expected])
    read_ok(pool, key, got, needed_from(expected, WIDEST[pool]) if expected else 0)
    assert m.last_device_node.end == expected
    tree.check_integrity()
    return m


def node_of(tree: RadixCache, key: list[int]) -> TreeNode:
    path = tree.peek_path(key)
    assert sum(len(n.key) for n in path) == pages_down(len(key), PAGE)
    return path[-1]


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# ---------------------------------------------------------------------------- plain cases


def test_a_live_insert_is_one_window_node_and_a_whole_hit() -> None:
    pool = make_pool()
    tree = make_tree(pool)
    key = seq(100, 24)
    assert put(tree, pool, key)[0] == 0
    tree.check_integrity()
    (node,) = tree.peek_path(key)
    assert node.has_window and len(node.key) == 24
    assert tree.windows.live == 24 == pool.window_used()
    assert hit(tree, pool, key) == 24
    assert hit(tree, pool, key + [7, 7]) == 24  # a partial last page is never looked at
    assert hit(tree, pool, key[:9]) == 8        # splits: window still whole


def test_tokens_that_left_the_window_join_as_a_tombstone() -> None:
    """W = 8: a query at P reads [pages_down(P - 7), P)."""
    pool = make_pool()
    tree = make_tree(pool)
    key = seq(100, 24)
    put(tree, pool, key, live_from=12)
    tree.check_integrity()
    tomb, live = tree.peek_path(key)
    assert (len(tomb.key), tomb.has_window, len(live.key), live.has_window) == (12, False, 12, True)
    assert tree.windows.live == 12 == pool.window_used()
    assert pool.allocator.used_size() == tree.total_size() == 24
    assert hit(tree, pool, key) == 24      # needed_from(24) = 16 >= 12
    assert hit(tree, pool, key[:20]) == 20  # needed_from(20) = 12
    assert hit(tree, pool, key[:16]) == 0   # needed_from(16) = 8: [8, 12) tombstoned
    assert hit(tree, pool, key[:12]) == 0   # [4, 12) tombstoned
    assert hit(tree, pool, key[:8]) == 0
    # keys that diverge from it: the hit ends at the divergence, if that end is whole
    assert hit(tree, pool, key[:16] + seq(900, 8)) == 0
    assert hit(tree, pool, key[:20] + seq(900, 4)) == 20
    assert hit(tree, pool, key[:4] + seq(900, 20)) == 0
    assert hit(tree, pool, seq(900, 24)) == 0
    # a second request that kept its window KV from token 8 on revives the tombstones there
    present, _ = put(tree, pool, key + seq(200, 8), live_from=8)
    assert present == 24
    tree.check_integrity()
    assert [(n.end, n.has_window) for n in tree.peek_path(key)] == [
        (4, False), (8, False), (12, True), (16, True), (20, True), (24, True)]
    assert tree.windows.live == 24 == pool.window_used()
    assert hit(tree, pool, key + seq(200, 8)) == 32
    assert hit(tree, pool, key[:16]) == 16
    assert hit(tree, pool, key[:12]) == 0  # reads [4, 12)


@pytest.mark.parametrize(("layer_windows", "first_hit"), [
    ((None, 5), 12),       # a query at P reads from P - 4: [8, 12) for P = 12
    ((None, 8, 8), 16),    # from P - 7, page-aligned down: [8, 16)
    ((None, 6, None, 9), 16),  # the widest window: from P - 8
    ((12, None), 20),      # from P - 11: [8, 20)
])
def test_the_hit_reads_back_exactly_one_window(layer_windows, first_hit: int) -> None:
    """[0, 8) a tombstone, [8, 24) live: a prefix hits whole from the first P whose window
    starts at 8 or later, nothing before."""
    pool = make_pool(layer_windows=layer_windows)
    tree = make_tree(pool)
    key = seq(100, 24)
    put(tree, pool, key, live_from=8)
    for end in range(4, 25, 4):
        assert hit(tree, pool, key[:end]) == (end if end >= first_hit else 0), end


def test_tombstoning_is_lru_and_spares_what_a_lock_reads() -> None:
    pool = make_pool()
    tree = make_tree(pool)
    a, b, c = seq(100, 8), seq(200, 8), seq(300, 8)
    for key in (a, b, c):
        put(tree, pool, key)
    assert hit(tree, pool, a) == 8  # a is now the most recent
    m = tree.match_prefix(c)
    tree.inc_lock_ref(m.last_device_node)
    tree.check_integrity()
    na, nb, nc = node_of(tree, a), node_of(tree, b), node_of(tree, c)
    avail = pool.window_available()
    # least recently used first: b, then a; never c
    assert tree.windows.tombstone_until(avail + 1) == 8
    tree.check_integrity()
    assert (na.has_window, nb.has_window, nc.has_window) == (True, False, True)
    assert pool.window_available() == avail + 8
    assert tree.windows.tombstone_until(EVERY) == 8
    tree.check_integrity()
    assert (na.has_window, nb.has_window, nc.has_window) == (False, False, True)
    assert tree.windows.live == 8 == pool.window_used() and tree.windows.tombstonable == 0
    assert tree.windows.tombstoned_tokens == 16
    assert hit(tree, pool, a) == 0 and hit(tree, pool, b) == 0 and hit(tree, pool, c) == 8
    # the full layers stay until evicted: tombstones go first, then c once unlocked
    before = pool.free_pages()
    assert tree.evict(1000) == 16
    tree.check_integrity()  # four full pages, no window pages
    assert pool.free_pages() == before + 4 and pool.allocator.used_size() == 8
    tree.dec_lock_ref(m.last_device_node)
    assert tree.evict(8) == 8
    tree.check_integrity()
    assert pool.free_pages() == pool.num_pages and tree.windows.live == 0
    assert pool.allocator.used_size() == tree.total_size() == 0


def lock_and_tombstone(tree: RadixCache, pool: WindowedKVPool, key: list[int],
                       dropped: int) -> MatchResult:
    """Lock the match of `key`, then tombstone all that may go: `dropped` tokens."""
    m = tree.match_prefix(key)
    tree.inc_lock_ref(m.last_device_node)
    tree.check_integrity()
    assert tree.windows.tombstonable == dropped
    assert tree.windows.tombstone_until(EVERY) == dropped
    tree.check_integrity()
    return m


def test_tombstoning_a_shared_prefix_leaves_no_hole_in_a_hit() -> None:
    """x = [0, 24); y = x[:12] + 12 others: nodes u = [0, 12), x' and y' below it."""
    pool = make_pool()
    tree = make_tree(pool)
    x = seq(100, 24)
    y = x[:12] + seq(500, 12)
    put(tree, pool, x)
    assert put(tree, pool, y)[0] == 12
    tree.check_integrity()
    u = node_of(tree, x[:12])
    xt, yt = node_of(tree, x), node_of(tree, y)
    assert u.has_window and xt.has_window and yt.has_window and tree.windows.live == 36
    # x' is the oldest (y's insert touched u and y')
    avail = pool.window_available()
    assert tree.windows.tombstone_until(avail + 1) == 12
    tree.check_integrity()
    assert not xt.has_window and u.has_window and yt.has_window
    assert hit(tree, pool, x) == 12   # the window of x ends at u
    assert hit(tree, pool, x[:20]) == 12
    # u's window dropped too: y still hits whole (its window reads [16, 24)), not its prefixes
    assert tree.windows.tombstone(u) == 12
    tree.check_integrity()
    assert pool.window_used() == tree.windows.live == 12
    assert hit(tree, pool, y) == 24
    assert hit(tree, pool, y[:20]) == 20  # reads [12, 20)
    assert hit(tree, pool, y[:16]) == 0   # would read [8, 16): u's half is gone
    assert hit(tree, pool, x) == 0 and hit(tree, pool, x[:12]) == 0
    # a lock ending at 24 keeps what its queries read, [16, 24); [12, 16) may go
    yt = node_of(tree, y)
    mid = node_of(tree, y[:20])
    low = node_of(tree, y[:16])
    assert [n.end for n in tree.peek_path(y)] == [12, 16, 20, 24]
    m = lock_and_tombstone(tree, pool, y, 4)
    assert not low.has_window and mid.has_window and yt.has_window
    assert hit(tree, pool, y) == 24
    assert hit(tree, pool, y[:20]) == 0  # would read [12, 20)
    tree.dec_lock_ref(m.last_device_node)
    tree.check_integrity()
    assert tree.windows.tombstonable == 8
    assert tree.windows.tombstone_until(EVERY) == 8
    tree.check_integrity()
    assert hit(tree, pool, y) == 0 and pool.window_used() == tree.windows.live == 0


def test_a_lock_keeps_only_the_window_its_queries_read() -> None:
    """A lock ending at 32 (W = 8) keeps the window KV of the nodes reaching into [24, 32):
    the node [16, 28) whole, not [0, 16), though all of them stay locked on the full
    layers; a split of the kept node hands the lock to the half that still reaches in."""
    pool = make_pool()
    tree = make_tree(pool)
    key = seq(100, 32)
    put(tree, pool, key[:16])
    put(tree, pool, key[:28])
    put(tree, pool, key)
    assert [n.end for n in tree.peek_path(key)] == [16, 28, 32]
    top, kept, leaf = tree.peek_path(key)
    m = lock_and_tombstone(tree, pool, key, 16)
    assert not top.has_window and kept.has_window and leaf.has_window
    assert tree.evict(1000) == 0 and tree.total_size() == 32  # the full layers stay locked
    # split [16, 28) at 20: [16, 20) no longer reaches into [24, 32)
    assert hit(tree, pool, key[:20]) == 0
    upper = node_of(tree, key[:20])
    assert upper is not kept and upper.has_window and kept.end == 28
    assert tree.windows.tombstonable == 4
    assert tree.windows.tombstone_until(EVERY) == 4
    tree.check_integrity()
    assert not upper.has_window and kept.has_window and hit(tree, pool, key) == 32
    # split at 24: a query at 32 reads from 25, page [24, 28) on: [20, 24) may go
    assert hit(tree, pool, key[:24]) == 0
    assert tree.windows.tombstonable == 4
    assert tree.windows.tombstone_until(EVERY) == 4
    tree.check_integrity()
    assert hit(tree, pool, key) == 32
    tree.dec_lock_ref(m.last_device_node)
    tree.check_integrity()
    assert tree.windows.tombstonable == tree.windows.live == 8
    assert tree.windows.tombstone_until(EVERY) == 8
    tree.check_integrity()
    assert pool.window_used() == 0 and hit(tree, pool, key) == 0


def test_evicting_a_live_leaf_gives_its_window_pages_back() -> None:
    pool = make_pool()
    tree = make_tree(pool)
    key = seq(100, 16)
    put(tree, pool, key, live_from=8)  # 4 full pages, the last 2 with a page of each group
    assert pool.free_pages() == pool.num_pages - 4 - 2 * pool.groups
    assert tree.evict(1) == 8  # the leaf [8, 16): its window pages go with it
    tree.check_integrity()
    assert pool.free_pages() == pool.num_pages - 2 and tree.windows.live == 0
    assert tree.evict(8) == 8
    tree.check_integrity()
    assert pool.allocator.used_size() == tree.total_size() == 0


def test_a_pool_full_of_full_layer_kv_makes_room_for_a_request_s_windows() -> None:
    """Full and window layers share the pool: tombstoned nodes (full-layer KV only) may
    fill every page. A request still fits (`SlotCalls`): admission counts the pages
    eviction gives back, and its allocation drops window KV first, then whole nodes."""
    pool = make_pool(num_pages=32, window_pages=8)  # 48 pages of one layer
    tree = make_tree(pool)
    slots = SlotCalls(tree, pool)
    keys = [seq(100 * (i + 1), 32) for i in range(4)]  # 8 pages each, window KV of the last 2
    for key in keys[:3]:
        put(tree, pool, key, live_from=24)
    assert pool.free_pages() == 48 - 3 * (8 + 2 * pool.groups)
    assert tree.windows.tombstone_until(EVERY) == 3 * 8  # full-layer KV only now
    bare = pool.alloc(pool.free_pages() * PAGE, window=False)  # a request's own, no window
    assert bare is not None and pool.free_pages() == 0 and pool.window_available() == 0
    assert tree.windows.tombstonable == 0
    assert slots.window_fits(16)  # the tree's 24 evictable pages
    got = slots.alloc(16)  # 4 full pages and 8 window pages: evicted, oldest first
    assert got is not None and pool.window_used() == 16
    tree.check_integrity()
    assert tree.total_size() == 32  # the two oldest keys went whole
    assert pool.allocator.used_size() == 32 + len(bare) + 16
    assert cached_slots(tree, keys[0]).numel() == 0 and cached_slots(tree, keys[2]).numel() == 32
    # window KV goes before any node: a live tail is tombstoned, its full-layer KV kept
    pool.free(got)
    pool.free(bare)
    put(tree, pool, keys[3], live_from=24)
    filler = pool.alloc(pool.free_pages() * PAGE, window=False)
    assert filler is not None
    before = tree.total_size()
    # one node's window pages: 4 pages, a token's page and its two window pages once over
    assert slots.evict(PAGE) == PAGE and pool.free_pages() == 2 * pool.groups
    assert tree.total_size() == before and hit(tree, pool, keys[3]) == 0


def test_a_tombstone_takes_the_window_kv_of_a_later_request() -> None:
    """A request that computed a tombstoned prefix again, with its window KV from some page
    on, hands those window pages to the tree (split there) and frees only its full slots."""
    pool = make_pool()
    tree = make_tree(pool)
    key = seq(100, 16)
    put(tree, pool, key, live_from=16)
    assert pool.window_used() == 0 and hit(tree, pool, key) == 0
    before = pool.allocator.used_size()
    assert put(tree, pool, key, live_from=8)[0] == 16
    tree.check_integrity()
    assert pool.allocator.used_size() == before == tree.total_size()
    assert [(n.end, n.has_window) for n in tree.peek_path(key)] == [(8, False), (16, True)]
    assert pool.window_used() == tree.windows.live == 8
    assert hit(tree, pool, key) == 16  # the moved window pages hold this key's KV
    assert hit(tree, pool, key[:8]) == 0
    assert put(tree, pool, key)[0] == 16
    tree.check_integrity()
    assert pool.window_used() == tree.windows.live == 16
    assert hit(tree, pool, key[:8]) == 8


def test_spare_window_pages_join_the_tree_or_go_first_when_the_pool_is_short() -> None:
    """A running request's window pages no query reads any more are spare: counted free,
    kept mapped, so its prompt joins the tree with them (a prompt diverging inside it hits);
    an allocation the free pages cannot meet takes the oldest spare pages back."""
    pool = make_pool(num_pages=64, window_pages=8)
    tree = make_tree(pool)
    key = seq(100, 24)  # 6 pages
    slots = pool.alloc(24)
    write_kv(pool, key, slots)
    free = pool.window_available()
    assert pool.spare_window(slots[:16]) == 16  # its first 4 pages left every window
    assert pool.window_available() == free + 16 and pool.window_used() == 24 - 16
    filler = pool.alloc((pool.free_pages() - 1) * PAGE, window=False)
    assert filler is not None and pool.free_pages() == 1
    other = pool.alloc(PAGE)  # a page of each kind, one free: the oldest spare one's
    assert other is not None
    assert (pool.window_pages_of(slots) == PADDING_PAGE).tolist() == [True] + [False] * 5
    assert tree.insert(key, slots) == 0
    tree.check_integrity()
    assert [(n.end, n.has_window) for n in tree.peek_path(key)] == [(4, False), (24, True)]
    assert tree.windows.live == 20 and pool.window_available() == 0  # none spare now
    assert hit(tree, pool, key[:12]) == 12  # inside the prompt: its window was kept
    assert hit(tree, pool, key) == 24
    pool.spare_window(other[:PAGE])
    pool.free(other)  # a freed request's spare pages leave the spare list with it
    assert pool.window_available() == other.numel() and pool.window_used() == 20
    tree.check_integrity()


# A node whose eviction key changes outside a match or an insert (a pin, a session), or
# that a split outside them creates (`node_at`), re-enters WindowKV's heap: `tombstone_until`
# never stops while `tombstonable` says there is window KV left to drop.

def _one_live_node(n: int) -> tuple[WindowedKVPool, RadixCache, list[int]]:
    pool = make_pool()
    tree = make_tree(pool)
    key = seq(100, n)
    put(tree, pool, key)
    return pool, tree, key


def test_a_split_by_node_at_stays_tombstonable() -> None:
    pool, tree, key = _one_live_node(24)
    assert tree.node_at(tree.root, key[:12]) is not None
    tree.check_integrity()
    tree.windows.tombstone_until(EVERY)
    assert tree.windows.tombstonable == 0 and pool.window_used() == 0


@pytest.mark.parametrize("how", ["pin", "own"])
def test_a_pinned_or_owned_node_stays_tombstonable(how: str) -> None:
    pool, tree, key = _one_live_node(8)
    node = node_of(tree, key)
    if how == "pin":
        tree.retention.pin(node)
    else:
        tree.retention.own(node, "session")
    tree.windows.tombstone_until(EVERY)
    assert tree.windows.tombstonable == 0 and pool.window_used() == 0


# ------------------------------------------------------------------------- stateful model


def page_strategy() -> st.SearchStrategy[list[int]]:
    """Pages from a few patterns, two of which differ in their last token only."""
    return st.sampled_from([[0] * PAGE, [0] * (PAGE - 1) + [1], [2] * PAGE])


class WindowTreeModel(RuleBasedStateMachine):
    """Requests insert keys whose early tokens left the window; matches, locks, tombstoning
    and eviction interleave; every hit is checked against `brute_hit` and its data."""

    layer_windows: tuple[int | None, ...] = (None, 8, 8)
    num_pages, window_pages = 24, 12  # 48 pages: a key takes up to 30 with its windows

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(self.num_pages, self.window_pages, self.layer_windows)
        self.tree = make_tree(self.pool)
        # (the locked node, the key it ends, [the nodes reaching into what its queries read])
        self.locks: list[tuple[TreeNode, list[int], list[TreeNode]]] = []
        self.keys: list[list[int]] = []  # the keys inserted, for matches that share them

    def _key(self, data, min_pages: int = 0) -> list[int]:
        """Pages from `page_strategy`, often after a prefix of a key inserted before."""
        head: list[int] = []
        if self.keys and data.draw(st.booleans()):
            old = data.draw(st.sampled_from(self.keys))
            head = old[:data.draw(st.integers(0, len(old)))]
        pages = data.draw(st.lists(page_strategy(), min_size=min_pages,
                                   max_size=max(min_pages, 10 - len(head) // PAGE)))
        tail = data.draw(st.lists(st.integers(0, 2), max_size=PAGE - 1))
        return head[:pages_down(len(head), PAGE)] + [t for p in pages for t in p] + tail

    def _alloc(self, n: int) -> torch.Tensor | None:
        """Slots for `n` tokens, making room as `SlotCalls.alloc` does: tombstones first,
        then eviction of what the shared pool still lacks; None when the locks leave too
        little."""
        slots = self.pool.alloc(n)
        if slots is None:
            self.tree.windows.tombstone_until(n)
            short = self.pool.pages_short(n)
            if short > 0:
                self.tree.evict(short * PAGE)
            slots = self.pool.alloc(n)
        if slots is None:
            self.tree.check_integrity()
        return slots

    @initialize(data=st.data(), kept=st.lists(st.integers(0, 44), min_size=2, max_size=2))
    def seed(self, data, kept) -> None:
        """Two requests first, so that the rules rarely meet an empty tree."""
        for k in kept:
            self._insert(self._key(data, min_pages=4), k)

    @rule(data=st.data(), kept=st.integers(0, 44))
    def insert(self, data, kept) -> None:
        """A request ends with the window KV of its last `kept` tokens (from a page start)."""
        self._insert(self._key(data), kept)

    def _insert(self, key: list[int], kept: int, squeeze: int | None = None) -> None:
        """`kept`: see `insert`; `squeeze` (None: none): the early pages are spare rather
        than dropped, and another request takes `squeeze` tokens before the insert."""
        self.keys.append(key)
        end = pages_down(len(key), PAGE)
        slots = self._alloc(end)
        if slots is None:
            return
        present_before = cached_slots(self.tree, key).numel()
        write_kv(self.pool, key, slots)
        dropped = pages_down(max(0, end - kept), PAGE)
        other = None
        if squeeze is None:
            self.pool.drop_window(slots[:dropped])
        else:
            self.pool.spare_window(slots[:dropped])
            other = self.pool.alloc(pages_down(squeeze, PAGE))
        present = self.tree.insert(key, slots)
        assert present == present_before
        if present:
            self.pool.free(slots[:present])
        if other is not None:
            self.pool.free(other)
        # the new nodes: window KV exactly where the request still had it (spare pages: as
        # far as the squeeze left them)
        path_slots = cached_slots(self.tree, key)
        assert torch.equal(path_slots[present:], slots[present:end])
        live = (self.pool.window_pages_of(path_slots) != PADDING_PAGE).tolist()
        assert all(live[dropped // PAGE:]), "window KV the request had is missing"
        if squeeze is None:
            assert not any(live[present // PAGE:dropped // PAGE]), "a tombstone holds window"
        # no spare: the free pages are all the window layers can take
        assert self.pool.window_available() == self.pool.free_pages() // self.pool.groups * PAGE
        pos = 0
        for node in self.tree.peek_path(key):  # every node whole: window or tombstone
            assert all(live[p // PAGE] == node.has_window for p in range(pos, node.end, PAGE))
            pos = node.end

    @rule(data=st.data(), kept=st.integers(0, 44), squeeze=st.integers(0, 40))
    def insert_after_spare(self, data, kept, squeeze) -> None:
        """A request marks its early window pages spare; another request's `squeeze` tokens
        may take some back before the first one inserts: the spare pages still mapped join
        the tree with their window KV, the ones taken back as tombstones."""
        self._insert(self._key(data), kept, squeeze)

    @rule(data=st.data(), lock=st.booleans())
    def match(self, data, lock) -> None:
        key = self._key(data)
        node = match_checked(self.tree, self.pool, key).last_device_node
        if lock and node is not self.tree.root:
            self.tree.inc_lock_ref(node)
            cut, kept, n = needed_from(node.end, WIDEST[self.pool]), [], node
            while n is not self.tree.root and n.end > cut:
                assert n.has_window, "a hit read a tombstone"
                kept.append(n)
                n = n.parent
            self.locks.append((node, key[:node.end], kept))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i) -> None:
        node, _, _ = self.locks.pop(i % len(self.locks))
        self.tree.dec_lock_ref(node)

    @rule(k=st.integers(1, 24))
    def tombstone(self, k) -> None:
        before = self.pool.window_available()
        dropped = self.tree.windows.tombstone_until(before + k)
        assert self.pool.window_available() == before + dropped
        assert self.pool.window_available() >= before + k or self.tree.windows.tombstonable == 0

    @rule(k=st.integers(0, 12))
    def evict(self, k) -> None:
        evictable = self.tree.evictable_size()
        used = self.pool.allocator.used_size()
        freed = self.tree.evict(k)
        assert freed >= min(k, evictable)
        assert self.pool.allocator.used_size() == used - freed

    @invariant()
    def consistent(self) -> None:
        tree, pool = self.tree, self.pool
        tree.check_integrity()
        assert pool.window_used() == tree.windows.live
        assert pool.allocator.used_size() == tree.total_size()
        # every page of the shared pool: free, a full page of the tree's, or a window page
        assert (pool.free_pages() + tree.total_size() // PAGE
                + tree.windows.live // PAGE * pool.groups) == pool.num_pages
        owned = tree.all_values()
        assert owned.unique().numel() == owned.numel(), "a slot is owned twice"
        wpages = pool.window_pages_of(owned)
        wpages = wpages[wpages != PADDING_PAGE]
        assert wpages.unique().numel() == wpages.numel(), "a window page is mapped twice"
        for node, key, kept in self.locks:  # a lock's hit stays whole
            assert node.parent is not None and node.end == len(key), "a locked node moved"
            assert all(n.has_window for n in kept), "a lock lost window KV its queries read"
            assert brute_hit(pool, cached_slots(tree, key)) == len(key)

    def teardown(self) -> None:
        while self.locks:
            self.tree.dec_lock_ref(self.locks.pop()[0])
        self.tree.evict(self.tree.total_size())
        self.tree.check_integrity()
        assert self.tree.total_size() == self.pool.allocator.used_size() == 0
        assert self.pool.window_used() == self.tree.windows.live == 0


class WindowTreeModelW9(WindowTreeModel):
    """Windows of 6 and 9 tokens beside two full layers: the hit rule takes the widest, and
    a query at P reads from P - 8, a page boundary when P is."""

    layer_windows = (None, 6, None, 9)


MACHINE_SETTINGS = settings(max_examples=80, stateful_step_count=40, derandomize=True,
                            deadline=None)
TestWindowTreeW8 = WindowTreeModel.TestCase
TestWindowTreeW8.settings = MACHINE_SETTINGS
TestWindowTreeW9 = WindowTreeModelW9.TestCase
TestWindowTreeW9.settings = MACHINE_SETTINGS


def test_the_window_bytes_bench_floor_is_what_hits_at_node_ends_read() -> None:
    from benchmarks.bench_window_bytes import boundary_window_tokens

    pool = make_pool()
    tree = make_tree(pool)
    put(tree, pool, seq(0, 24), live_from=12)  # nodes [0, 12) and [12, 24)
    # a hit at 12 reads [4, 12), one at 24 reads [16, 24) (windows of 8, pages of 4)
    assert boundary_window_tokens(tree) == 16
