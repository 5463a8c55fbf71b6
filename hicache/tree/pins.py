"""Pinned prefixes (POST /admin/pin): a path of the tree kept cached until a TTL runs out.

A pinned node is evicted from L1 after every other node, and only by demotion to L2 (never
deleted); L2 never evicts it. `max_tokens` caps the tokens pinned (each node once), so
pins never starve running requests of L1 or L2. One pin per (whole-page prefix, extra_key):
pinning it again renews its TTL.

Threading: scheduler thread only (it owns the tree); times are `time.monotonic()`.
"""

from __future__ import annotations

from typing import NamedTuple

from hicache.tree.base import PrefixCache
from hicache.tree.node import Key, TreeNode

PinKey = tuple[Key, str | None]  # (whole pages of token ids, extra_key)


class Pin(NamedTuple):
    node: TreeNode       # the pinned path's last node (the tree counts its pins)
    tokens: int
    extra_key: str | None
    expires_at: float    # monotonic seconds


class PinInfo(NamedTuple):
    tokens: int
    extra_key: str | None
    expires_in_s: float


class PinRefused(ValueError):
    """A pin over the cap (an HTTP 400); the message says how much is pinned and the cap."""


class PinTable:
    def __init__(self, tree: PrefixCache, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_pinned_tokens must be >= 0, got {max_tokens}")
        self.tree = tree
        self.max_tokens = max_tokens
        self._pins: dict[PinKey, Pin] = {}

    def __len__(self) -> int:
        return len(self._pins)

    def pinned_tokens(self, extra: TreeNode | None = None) -> int:
        """Tokens the pins cover, each node once (with `extra`'s path pinned too)."""
        seen: set[int] = set()
        total = 0
        for node in [p.node for p in self._pins.values()] + ([extra] if extra else []):
            while node is not self.tree.root and node.id not in seen:
                seen.add(node.id)
                total += len(node.key)
                node = node.parent
        return total

    def check(self, key: PinKey, node: TreeNode) -> None:
        """PinRefused unless pinning `node`'s path (for `key`) stays within the cap."""
        old = self._pins.get(key)
        if old is not None and old.node is node:
            return  # a renewal pins nothing new
        now, after = self.pinned_tokens(), self.pinned_tokens(extra=node)
        if after > self.max_tokens:
            raise PinRefused(f"pinning {len(key[0])} tokens would pin {after}; "
                             f"{now} are pinned and the cap (cache.max_pinned_tokens) is "
                             f"{self.max_tokens}: unpin some first, or pin a shorter prefix")

    def pin(self, key: PinKey, node: TreeNode, ttl_s: float, now: float) -> Pin:
        """Pin `node`'s path (spelling `key`) until `now + ttl_s`; renews an existing pin.
        Call `check` first."""
        old = self._pins.pop(key, None)
        self.tree.retention.pin(node)
        if old is not None:
            self.tree.retention.unpin(old.node)
        pin = Pin(node, len(key[0]), key[1], now + ttl_s)
        self._pins[key] = pin
        return pin

    def unpin(self, key: PinKey) -> bool:
        """Release one pin; False when there was none."""
        pin = self._pins.pop(key, None)
        if pin is None:
            return False
        self.tree.retention.unpin(pin.node)
        return True

    def clear(self) -> int:
        """Release every pin; how many there were."""
        n = len(self._pins)
        for key in list(self._pins):
            self.unpin(key)
        return n

    def expire(self, now: float) -> int:
        """Release the pins whose TTL has run out; how many (O(pins): there are few)."""
        due = [k for k, p in self._pins.items() if p.expires_at <= now]
        for key in due:
            self.unpin(key)
        return len(due)

    def infos(self, now: float) -> list[PinInfo]:
        return [PinInfo(p.tokens, p.extra_key, round(max(0.0, p.expires_at - now), 3))
                for p in self._pins.values()]
