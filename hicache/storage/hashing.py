"""Page hashes: the keys under which KV pages are stored in L3, identical in every process.

The chain (docs/architecture.md, "Page hash")::

    no fleet secret:  h_0 = xxh3_128(b"hicache/v3" + namespace)
                      h_i = xxh3_128(h_{i-1} + tokens of page i as little-endian uint32)
    with one:         h_0 = BLAKE2b-128(b"hicache/v3" + namespace, key = root key)
                      h_i = BLAKE2b-128(h_{i-1} + tokens of page i, key = root key)

With the fleet secret's root key (`FleetKeys`) every link is keyed: no one without it can
compute a key, not even the next page's from a key they listed in the store, nor test by
looking one up whether a guessed prompt (or its continuation) was ever stored. The domain
names the page format (v3): servers of an older format sharing a store never meet its keys.

`namespace` is the canonical JSON of everything that makes two KV pages of the same tokens
differ: the model's identity (a fingerprint string its caller computes from the weights, the
server's in hicache_server.models.fingerprint), the KV dtype, page size and geometry, the
tensor-parallel rank and size, and the request's `extra_key` (cache salt, LoRA id, ...).

Nothing here depends on the process: no random seed, no Python `hash`, no path. Two servers
of the same model agree on every key; two different models (or geometries) never share one.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xxhash

HASH_DOMAIN = b"hicache/v3"  # bump with any change to the chain, the namespace or the page format
DIGEST_BYTES = 16  # xxh3_128 digest: one page key
MAX_TOKEN_ID = 2**32 - 1  # tokens are hashed as uint32
_TOKEN_DTYPE = np.dtype("<u4")
# Roots kept per hasher, least recently used dropped first: one per live salt (tenant, LoRA,
# cache_salt); a miss costs one hash of the namespace (~1 us), so the bound is about memory
# under a stream of unique salts, not speed. ~100 bytes each.
MAX_CACHED_ROOTS = 4096
SALT_DIGEST_BYTES = 32  # the root cache's key: a BLAKE2b of the salt, whatever its length


def canonical_json(value: Any) -> bytes:
    """One byte string per value: sorted keys, no spaces, ASCII only, UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def namespace(
    model_fingerprint: str,
    dtype: str,
    page_size: int,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    extra_key: str | None = None,
) -> bytes:
    """Canonical JSON (UTF-8) of every field that makes two pages of equal tokens differ."""
    fields = {
        "model_fingerprint": model_fingerprint, "dtype": dtype, "page_size": page_size,
        "num_layers": num_layers, "kv_heads": kv_heads, "head_dim": head_dim,
        "tp_rank": tp_rank, "tp_size": tp_size, "extra_key": extra_key,
    }
    return canonical_json(fields)


def _tokens_as_uint32(tokens: Sequence[int] | torch.Tensor) -> np.ndarray:
    """`tokens` as a 1-D little-endian uint32 array; ValueError outside 0..2**32-1."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().to("cpu").numpy()
    try:
        values = np.asarray(tokens)
    except OverflowError as err:
        raise ValueError(f"token ids must be in [0, {MAX_TOKEN_ID}]: {err}") from err
    if values.size == 0:
        return np.empty(0, dtype=_TOKEN_DTYPE)
    if values.ndim != 1 or values.dtype.kind not in "iu":
        raise ValueError("tokens must be a 1-D sequence of integer token ids, got "
                         f"shape {values.shape} dtype {values.dtype}")
    low, high = int(values.min()), int(values.max())
    if low < 0 or high > MAX_TOKEN_ID:
        bad = low if low < 0 else high
        raise ValueError(f"token id {bad} is outside [0, {MAX_TOKEN_ID}] (hashed as uint32)")
    return values.astype(_TOKEN_DTYPE, copy=False)


class PageHasher:
    """Hashes token sequences into page keys for one model, geometry and TP rank.

    `root_key`: the fleet secret's key for the chain's root (`page_seal.FleetKeys.root_key`);
    None, the unkeyed root anyone can compute.

    Threading: immutable after construction except the cache of roots per `extra_key` (an
    LRU of MAX_CACHED_ROOTS under one lock); any thread may call it.
    """

    def __init__(
        self,
        page_size: int,
        model_fingerprint: str,
        dtype: str,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        root_key: bytes | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size={tp_size}), got {tp_rank}")
        self.page_size = page_size
        self._fields: dict[str, Any] = {
            "model_fingerprint": model_fingerprint, "dtype": dtype, "page_size": page_size,
            "num_layers": num_layers, "kv_heads": kv_heads, "head_dim": head_dim,
            "tp_rank": tp_rank, "tp_size": tp_size,
        }
        self._root_key = root_key
        # salt digest (None: no salt) -> root; a long salt costs what a short one does
        self._roots: OrderedDict[bytes | None, bytes] = OrderedDict()
        self._roots_lock = threading.Lock()

    @property
    def namespace(self) -> bytes:
        """The namespace of this model and geometry without a salt: what a stored page's
        seal binds (`page_format.PageCodec`)."""
        return namespace(**self._fields)

    def root(self, extra_key: str | None = None) -> bytes:
        """`h_0` of the namespace with `extra_key`: the hash before the first page."""
        slot = None if extra_key is None else hashlib.blake2b(
            extra_key.encode("utf-8", "surrogatepass"), digest_size=SALT_DIGEST_BYTES).digest()
        with self._roots_lock:
            found = self._roots.get(slot)
            if found is not None:
                self._roots.move_to_end(slot)
                return found
        found = self._link(HASH_DOMAIN + namespace(**self._fields, extra_key=extra_key))
        with self._roots_lock:
            self._roots[slot] = found
            if len(self._roots) > MAX_CACHED_ROOTS:
                self._roots.popitem(last=False)
        return found

    def cached_roots(self) -> int:
        """How many roots the cache holds now (at most MAX_CACHED_ROOTS)."""
        with self._roots_lock:
            return len(self._roots)

    def hash_pages(
        self,
        tokens: Sequence[int] | torch.Tensor,
        prev: bytes | None = None,
        extra_key: str | None = None,
    ) -> list[bytes]:
        """Keys of the full pages of `tokens` (a partial last page is not hashed).

        `prev` is the key of the page just before `tokens[0]` (so a long sequence can be
        hashed in pieces); None starts at the root of `extra_key`. When `prev` is given,
        `extra_key` is not used: it is already folded into `prev`.
        """
        if prev is not None and len(prev) != DIGEST_BYTES:
            raise ValueError(f"prev must be a {DIGEST_BYTES}-byte page hash, got {len(prev)} bytes")
        raw = _tokens_as_uint32(tokens).tobytes()
        page_bytes = self.page_size * _TOKEN_DTYPE.itemsize
        num_pages = len(raw) // page_bytes
        h = self.root(extra_key) if prev is None else bytes(prev)
        keys: list[bytes] = []
        link = self._link
        for start in range(0, num_pages * page_bytes, page_bytes):
            h = link(h + raw[start : start + page_bytes])
            keys.append(h)
        return keys

    def _link(self, data: bytes) -> bytes:
        """One link of the chain: xxh3_128, or a BLAKE2b keyed by the root key."""
        if self._root_key is None:
            return xxhash.xxh3_128_digest(data)
        return hashlib.blake2b(data, key=self._root_key, digest_size=DIGEST_BYTES).digest()
