"""What ties a stored page to its key: a seal over key, header and payload (`page_format` v3).

    protection  tag (16 bytes after the payload)                     stops
    CHECKSUM    xxh3_128(payload, seed=xxh3_64(domain+ns+key+header)) accidents: a value moved,
                no secret                                            swapped or torn
    MAC         GMAC(subkey, payload): AES-GCM, empty plaintext      anyone without the
                                                                     secret forging a page
    ENCRYPTED   AES-GCM(subkey, payload): the payload is ciphertext  ... and reading one

    subkey = BLAKE2b-256(key = seal_key(namespace), salt + page key + header fields)
    seal_key(namespace) = HKDF-SHA256(fleet secret, info = domain + protection + namespace)

`salt` is 16 random bytes drawn per write and stored in the header: each subkey seals exactly
one value, so AES-GCM's fixed zero nonce is never reused under a key (a random nonce under one
key per namespace would be safe for only ~2^32 pages, which a busy fleet writes in days), and
the page key, the namespace (through the seal key) and the header are bound without being
hashed with the payload. A value under any other key, namespace, geometry or secret derives
another subkey, so its tag fails: a miss.

Why GMAC and not a keyed BLAKE3, BLAKE2b or HMAC-SHA256 for the MAC: on 128 KiB pages on this
project's 2-core Xeon (AES-NI, PCLMULQDQ), one thread, GMAC ran at ~20-37 GB/s, keyed BLAKE3
~7-8, HMAC-SHA256 ~0.8-1.9, keyed BLAKE2b ~0.9-1.1 (`benchmarks/bench_page_trust.py`); an L3
read is a ~4 us copy of a page, so only GMAC keeps reads >= 0.8x (measured 0.93-0.94x, the
tag checked over the copy). It is OpenSSL's, through `cryptography` (the library encryption
needs anyway), and releases the GIL like the copy and the checksum.

Threading: immutable once built; any thread may call any method.
"""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from enum import IntEnum

import numpy as np
import xxhash
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

SEAL_DOMAIN = b"hicache/page/v3"  # bump with any change to what a seal covers
TAG_BYTES = 16  # xxh3_128 digest; the AES-GCM tag
SALT_BYTES = 16  # per-write randomness: 2^-128 that two writes share a subkey
KEY_BYTES = 32  # AES-256 and BLAKE2b keys
ZERO_NONCE = bytes(12)  # safe: every subkey seals one value (module docstring)


class Protection(IntEnum):
    """What a stored page's tag proves; header byte 23. Append only: a code, once written,
    keeps its meaning."""

    CHECKSUM = 0
    MAC = 1
    ENCRYPTED = 2


class FleetKeys:
    """The keys derived from the fleet secret (`hicache.config_storage.storage_secret`).

    Holds derived keys only, never the secret; its repr shows neither. `encrypt`: pages are
    ENCRYPTED, else MAC'd. The protection is part of every derived key, so servers of one
    secret that disagree on `encrypt` never share a key or a page (a cold L3 each).
    """

    def __init__(self, secret: bytes, encrypt: bool = False) -> None:
        if len(secret) < KEY_BYTES:
            raise ValueError(f"the fleet secret must be >= {KEY_BYTES} bytes, got "
                             f"{len(secret)}")
        self.protection = Protection.ENCRYPTED if encrypt else Protection.MAC
        self._secret = secret

    def derive(self, purpose: bytes) -> bytes:
        """A 32-byte key for `purpose` (HKDF-SHA256, RFC 5869)."""
        info = SEAL_DOMAIN + bytes([self.protection]) + b"\0" + purpose
        return HKDF(hashes.SHA256(), KEY_BYTES, salt=None, info=info).derive(self._secret)

    @property
    def root_key(self) -> bytes:
        """The key of the page hash chain's root (`hashing.PageHasher`)."""
        return self.derive(b"page-hash-root")

    def __repr__(self) -> str:
        return f"FleetKeys(<hidden>, protection={self.protection.name})"


class Seal(ABC):
    """One protection's seal of a value laid out as `page_format` v3: fields (32 bytes),
    salt, payload, tag. `binding` is everything but the payload the tag covers: the page
    key and the header fields (the namespace is in the seal's own key or seed)."""

    protection: Protection

    def salt(self) -> bytes:
        """The salt stored with a new value."""
        return os.urandom(SALT_BYTES)

    @abstractmethod
    def seal(self, binding: bytes, salt: bytes, payload: memoryview, out: memoryview) -> None:
        """Write the sealed payload and its tag into `out` (`len(payload) + TAG_BYTES`)."""

    @abstractmethod
    def open_into(self, binding: bytes, salt: bytes, sealed: memoryview,
                  parts: Sequence[memoryview]) -> bool:
        """The payload of `sealed` (sealed payload + tag) into `parts`, in order; False when
        the tag fails (the parts then hold undefined bytes)."""


class ChecksumSeal(Seal):
    """No secret: xxh3 seeded by the key and header. Stops accidents, not attackers (anyone
    can compute it). `copy_into` checks what the parts received, as v2 did."""

    protection = Protection.CHECKSUM

    def __init__(self, namespace: bytes) -> None:
        self._prefix = SEAL_DOMAIN + xxhash.xxh3_128_digest(namespace)

    def salt(self) -> bytes:
        return bytes(SALT_BYTES)  # nothing random to add: the tag is public anyway

    def tag(self, binding: bytes, salt: bytes, parts: Sequence[memoryview]) -> bytes:
        """xxh3_128 of the payload `parts`, seeded by all the rest (every byte of a value
        is covered)."""
        seed = xxhash.xxh3_64_intdigest(self._prefix + binding + salt)
        if len(parts) == 1:  # one-shot: hashed with the GIL released
            return xxhash.xxh3_128_digest(parts[0], seed=seed)
        hasher = xxhash.xxh3_128(seed=seed)
        for part in parts:
            hasher.update(part)
        return hasher.digest()

    def seal(self, binding: bytes, salt: bytes, payload: memoryview, out: memoryview) -> None:
        copy_bytes(out[:len(payload)], payload)
        out[len(payload):] = self.tag(binding, salt, (out[:len(payload)],))

    def open_into(self, binding: bytes, salt: bytes, sealed: memoryview,
                  parts: Sequence[memoryview]) -> bool:
        copy_parts(sealed[:-TAG_BYTES], parts)
        return self.tag(binding, salt, parts) == bytes(sealed[-TAG_BYTES:])


class AeadSeal(Seal):
    """With the fleet secret: MAC (GMAC over the payload) or ENCRYPTED (AES-GCM), under a
    subkey per value (module docstring)."""

    def __init__(self, keys: FleetKeys, namespace: bytes) -> None:
        self.protection = keys.protection
        self._key = keys.derive(b"page-seal\0" + namespace)

    def _aead(self, binding: bytes, salt: bytes) -> AESGCM:
        subkey = hashlib.blake2b(salt + binding, key=self._key, digest_size=KEY_BYTES)
        return AESGCM(subkey.digest())

    def seal(self, binding: bytes, salt: bytes, payload: memoryview, out: memoryview) -> None:
        aead, size = self._aead(binding, salt), len(payload)
        if self.protection == Protection.ENCRYPTED:
            aead.encrypt_into(ZERO_NONCE, payload, None, out)
            return
        copy_bytes(out[:size], payload)
        out[size:] = aead.encrypt(ZERO_NONCE, b"", out[:size])  # the tag alone

    def open_into(self, binding: bytes, salt: bytes, sealed: memoryview,
                  parts: Sequence[memoryview]) -> bool:
        aead = self._aead(binding, salt)
        try:
            if self.protection == Protection.MAC and len(parts) == 1:
                # Copied, then the copy checked (what is served is what was checked, and the
                # check reads the page from cache: reading the stored value twice cost 15%)
                copy_parts(sealed[:-TAG_BYTES], parts)
                aead.decrypt(ZERO_NONCE, bytes(sealed[-TAG_BYTES:]), parts[0])
            elif self.protection == Protection.MAC:  # checked, then scattered
                aead.decrypt(ZERO_NONCE, bytes(sealed[-TAG_BYTES:]), sealed[:-TAG_BYTES])
                copy_parts(sealed[:-TAG_BYTES], parts)
            elif len(parts) == 1:
                aead.decrypt_into(ZERO_NONCE, sealed, None, parts[0])
            else:  # decrypted whole, then scattered: AES-GCM writes one buffer
                copy_parts(memoryview(aead.decrypt(ZERO_NONCE, sealed, None)), parts)
        except InvalidTag:
            return False
        return True


def make_seal(namespace: bytes, keys: FleetKeys | None) -> Seal:
    """The seal of pages in `namespace`: a checksum without keys, else the keys' AEAD."""
    return ChecksumSeal(namespace) if keys is None else AeadSeal(keys, namespace)


def copy_bytes(dst: memoryview | bytearray | np.ndarray, src: memoryview | bytes) -> None:
    """`dst[:] = src` with the GIL released: numpy drops it for a copy this large (a memoryview
    slice assignment holds it for the whole memcpy), so fetch threads copying pages at once
    run in parallel."""
    to, frm = np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8)
    if to.size != frm.size:  # np.copyto would broadcast a 1-byte source
        raise ValueError(f"copy of {frm.size} bytes into a buffer of {to.size}")
    np.copyto(to, frm)


def copy_parts(src: memoryview, parts: Sequence[memoryview]) -> None:
    """`src` scattered over `parts`, in order (their lengths sum to its length)."""
    start = 0
    for part in parts:
        copy_bytes(part, src[start:start + part.nbytes])
        start += part.nbytes
