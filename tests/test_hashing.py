"""Page hash chain and namespaces: deterministic across processes (the model fingerprint
they are rooted in: test_fingerprint.py)."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash

from hicache.storage import hashing
from hicache.storage.hashing import (
    DIGEST_BYTES,
    HASH_DOMAIN,
    MAX_TOKEN_ID,
    PageHasher,
    namespace,
)
from hicache.storage.page_seal import FleetKeys

REPO = Path(__file__).resolve().parents[1]
FIELDS = {"page_size": 2, "model_fingerprint": "f00d", "dtype": "float32", "num_layers": 2,
          "kv_heads": 1, "head_dim": 4}
TOKENS = [1, 2, 3, 4, 5, 6, 7]  # three full pages of 2, and one token that is never hashed


def make_hasher(**changes: object) -> PageHasher:
    return PageHasher(**{**FIELDS, **changes})  # type: ignore[arg-type]


def test_golden_chain_by_hand() -> None:
    ns = (b'{"dtype":"float32","extra_key":null,"head_dim":4,"kv_heads":1,'
          b'"model_fingerprint":"f00d","num_layers":2,"page_size":2,"tp_rank":0,"tp_size":1}')
    assert namespace("f00d", "float32", 2, 2, 1, 4) == ns
    h0 = xxhash.xxh3_128_digest(b"hicache/v3" + ns)
    h1 = xxhash.xxh3_128_digest(h0 + struct.pack("<2I", 1, 2))
    h2 = xxhash.xxh3_128_digest(h1 + struct.pack("<2I", 3, 4))
    h3 = xxhash.xxh3_128_digest(h2 + struct.pack("<2I", 5, 6))
    hasher = make_hasher()
    assert hasher.root() == h0
    assert hasher.hash_pages(TOKENS) == [h1, h2, h3]
    assert all(len(h) == DIGEST_BYTES for h in (h0, h1, h2, h3))


def test_golden_vector_is_pinned() -> None:
    # Frozen once: a change here means every stored L3 page of every user is orphaned.
    last = make_hasher().hash_pages(TOKENS)[-1]
    assert last == make_hasher().hash_pages(torch.tensor(TOKENS))[-1]
    assert last.hex() == GOLDEN_LAST_HEX


GOLDEN_LAST_HEX = "f377b51f6fe1b078dee6a97bb605119f"  # re-frozen with page format v3 (older pages are misses)


def test_chaining_from_prev_equals_whole_sequence() -> None:
    hasher = make_hasher()
    tokens = list(range(100, 120))  # 10 pages
    whole = hasher.hash_pages(tokens, extra_key="salt")
    head = hasher.hash_pages(tokens[:6], extra_key="salt")
    tail = hasher.hash_pages(tokens[6:], prev=head[-1])
    assert head + tail == whole
    assert hasher.hash_pages(tokens[6:], prev=head[-1], extra_key="ignored") == tail


def test_partial_last_page_is_ignored() -> None:
    hasher = make_hasher(page_size=4)
    assert hasher.hash_pages(list(range(11))) == hasher.hash_pages(list(range(8)))
    assert len(hasher.hash_pages(list(range(11)))) == 2
    assert hasher.hash_pages([1, 2, 3]) == [] and hasher.hash_pages([]) == []


@pytest.mark.parametrize("as_input", [list, tuple, lambda t: torch.tensor(t, dtype=torch.int32),
                                      lambda t: torch.tensor(t, dtype=torch.int64)])
def test_input_types_agree(as_input: object) -> None:
    hasher = make_hasher()
    assert hasher.hash_pages(as_input(TOKENS)) == hasher.hash_pages(TOKENS)  # type: ignore


@pytest.mark.parametrize("bad", [-1, MAX_TOKEN_ID + 1, 2**70])
def test_tokens_outside_uint32_raise(bad: int) -> None:
    hasher = make_hasher()
    with pytest.raises(ValueError, match="token|integer"):
        hasher.hash_pages([1, bad, 3, 4])
    assert len(hasher.hash_pages([0, MAX_TOKEN_ID])) == 1


def test_same_hashes_in_another_process_with_another_hash_seed() -> None:
    code = (
        "from hicache.storage.hashing import PageHasher\n"
        f"h = PageHasher(**{FIELDS!r})\n"
        "print(h.root('x').hex(), *[k.hex() for k in h.hash_pages(list(range(40)), "
        "extra_key='x')])\n"
    )
    here = make_hasher()
    expected = [here.root("x").hex()] + [k.hex() for k in here.hash_pages(list(range(40)),
                                                                          extra_key="x")]
    # This process runs with a random hash seed (or the one pytest was given): another one.
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    assert out == expected


@pytest.mark.parametrize("change", [
    {"extra_key": "tenant-a"}, {"dtype": "bfloat16"}, {"page_size": 4}, {"tp_rank": 1},
    {"tp_size": 2}, {"model_fingerprint": "beef"}, {"num_layers": 3}, {"kv_heads": 2},
    {"head_dim": 8},
])
def test_each_namespace_field_changes_the_root(change: dict[str, object]) -> None:
    extra_key = change.pop("extra_key", None)
    if change.get("tp_rank"):
        change["tp_size"] = 2
    base = make_hasher()
    other = make_hasher(**change)
    assert other.root(extra_key) != base.root()
    assert other.hash_pages([1, 2, 3, 4], extra_key=extra_key)[0] != base.hash_pages([1, 2])[0]


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="page_size"):
        make_hasher(page_size=0)
    with pytest.raises(ValueError, match="tp_rank"):
        make_hasher(tp_rank=1, tp_size=1)
    with pytest.raises(ValueError, match="16-byte"):
        make_hasher().hash_pages([1, 2], prev=b"short")


# ------------------------------------------------------------------------- the fleet secret


def test_a_keyed_chain_is_a_keyed_blake2b_and_differs_per_secret() -> None:
    """Without the secret no key can be computed: the root and every link are keyed, so
    a key listed in the store does not give the next page's."""
    plain = make_hasher()
    keyed_a = make_hasher(root_key=FleetKeys(b"a" * 32).root_key)
    keyed_b = make_hasher(root_key=FleetKeys(b"b" * 32).root_key)
    encrypted_a = make_hasher(root_key=FleetKeys(b"a" * 32, encrypt=True).root_key)
    roots = {h.root("x") for h in (plain, keyed_a, keyed_b, encrypted_a)}
    assert len(roots) == 4
    expected = hashlib.blake2b(HASH_DOMAIN + namespace(**FIELDS, extra_key="x"),
                               key=FleetKeys(b"a" * 32).root_key,
                               digest_size=DIGEST_BYTES).digest()
    assert keyed_a.root("x") == expected
    first = keyed_a.hash_pages(list(range(FIELDS["page_size"])), extra_key="x")[0]
    tokens = struct.pack(f"<{FIELDS['page_size']}I", *range(FIELDS["page_size"]))
    assert first == hashlib.blake2b(expected + tokens, key=FleetKeys(b"a" * 32).root_key,
                                    digest_size=DIGEST_BYTES).digest()
    assert first != xxhash.xxh3_128_digest(expected + tokens)  # the unkeyed link
    second = keyed_a.hash_pages(list(range(2 * FIELDS["page_size"])), extra_key="x")[1]
    assert second != xxhash.xxh3_128_digest(first + struct.pack(
        f"<{FIELDS['page_size']}I", *range(FIELDS["page_size"], 2 * FIELDS["page_size"])))
    assert keyed_a.hash_pages([1] * 8) != plain.hash_pages([1] * 8)
    assert "a" * 32 not in repr(FleetKeys(b"a" * 32))


def test_the_root_cache_is_bounded_and_a_long_salt_costs_one_entry(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "MAX_CACHED_ROOTS", 8)
    hasher = make_hasher()
    first = hasher.root("salt-0")
    for i in range(20):
        hasher.root(f"salt-{i}" + "x" * (100_000 if i % 2 else 0))
    assert hasher.cached_roots() == 8
    # every entry is a fixed-size digest, whatever the salt's length
    assert all(len(slot) == hashing.SALT_DIGEST_BYTES for slot in hasher._roots)
    # an evicted salt is recomputed to the same root; the recent ones stay cached
    assert hasher.root("salt-0") == first == make_hasher().root("salt-0")
    assert hasher.cached_roots() == 8
    hasher.root(None)
    assert None in hasher._roots
