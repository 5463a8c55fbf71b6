"""A request's device slots: allocated ahead of each step, handed to the tree when its prompt
is prefilled and when it finishes, released on the way out. The regions and who frees each
are drawn on `server.request.Request`.

Threading: scheduler thread (it owns the tree and the pools).
"""

from __future__ import annotations

import torch

from hicache.stack import CacheStack
from server.request import Request


def pages_up(tokens: int, page_size: int) -> int:
    """`tokens` rounded up to whole pages, in tokens."""
    return -(-tokens // page_size) * page_size


def cache_key(req: Request) -> list[int]:
    """What the tree is asked for (match, prefetch, LPM rank): at least one prompt token is
    computed, for its logits; a request that wants prompt logprobs from position k asks for
    its first k tokens only (`Request.cacheable_len`). A longer cached prefix stays the
    tree's: the request computes its own copies, which `_insert` frees as duplicates."""
    return req.input_ids[:req.cacheable_len]


class RequestKV:
    def __init__(self, cache: CacheStack) -> None:
        self.tree = cache.tree
        self.pool = cache.device_pool
        self.page_size = cache.page_size

    def ensure_slots(self, req: Request, upto: int) -> None:
        """Allocate `req`'s slots up to position `upto` (whole pages) from its reservation."""
        missing = pages_up(upto - len(req.kv_slots), self.page_size)
        if missing <= 0:
            return
        slots = self.pool.alloc(missing)  # reserved at admission, so this cannot fail
        assert slots is not None, "L1 reservation broken"
        req.reserved -= missing
        req.kv_slots = torch.cat([req.kv_slots, slots])

    def cache_prompt(self, req: Request) -> None:
        """Give the prompt's KV to the tree as soon as its prefill is done, not when the
        request finishes: requests sharing the prompt hit it in L1 while this one decodes,
        and its pages start down to L2 and L3 (where another server may look for them)
        before the answer is out. The request keeps the path locked and reads the tree's
        slots from here on (where the tree already had some, its own copies are freed)."""
        aligned = req.num_computed // self.page_size * self.page_size
        if self.tree.disable or aligned <= req.tree_len:
            return
        tokens = self._insert(req, aligned, count_hit=False)  # `release` counts the use
        path = self.tree.peek_path(tokens, req.extra_key)  # no second hit for the policies
        slots = torch.cat([node.value for node in path])
        assert slots.numel() == aligned, "an inserted key is whole nodes on the device"
        self.tree.inc_lock_ref(path[-1])
        self.tree.dec_lock_ref(req.last_node)
        req.kv_slots = torch.cat([slots, req.kv_slots[aligned:]])
        req.last_node, req.tree_len = path[-1], aligned

    def _insert(self, req: Request, aligned: int, count_hit: bool = True) -> list[int]:
        """Insert the request's first `aligned` tokens with its slots; the request's copies
        of pages the tree already held (beyond `[0, tree_len)`, which it shares) are freed.
        Returns the tokens inserted."""
        tokens = req.all_ids[:aligned]
        present = self.tree.insert(tokens, req.kv_slots[:aligned], req.extra_key,
                                   count_hit=count_hit)
        if present > req.tree_len:  # the tree had these pages: ours are duplicates
            self.pool.free(req.kv_slots[req.tree_len:present])
        return tokens

    def release(self, req: Request, keep_cache: bool) -> None:
        """Give the request's KV to the tree (keep_cache) or back to the pool; unlock."""
        if req.last_node is None:
            return
        aligned = req.num_computed // self.page_size * self.page_size if keep_cache else 0
        if aligned > req.cache_hit_tokens:  # pages new since admission, maybe cached at
            self._insert(req, aligned)  # prefill (again): one use, and a fresh access time
        rest = req.kv_slots[max(aligned, req.tree_len):]  # never the tree's
        if rest.numel():
            self.pool.free(rest)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node, req.reserved = None, 0
        req.kv_slots = req.kv_slots[:0]
