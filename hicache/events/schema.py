"""The KV event wire format: vLLM's (`vllm/distributed/kv_events.py`, v0.32), field for field.

A subscriber written for vLLM (llm-d's KV cache manager, NVIDIA Dynamo's router, vLLM's own
example) decodes our batches unchanged. msgspec encodes each batch as msgpack:

    KVEventBatch   array_like: [ts, [event, ...], data_parallel_rank?]
    event          a map tagged with its class name: {"type": "BlockStored", ...}

One addition, a trailing optional field, which vLLM's decoder skips (msgspec ignores unknown
fields of a map): `BlockRemoved.reason`, one of `REASONS`. A hybrid model's events carry
vLLM's KV group fields (`GROUP_FULL`, `GROUP_WINDOW`).

Hashes are hicache's L3 page hashes (`hicache.storage.hashing`): 16-byte xxh3_128 digests,
chained from the model's namespace, so every server of one model names a page the same way
(vLLM's `ExternalBlockHash` is `bytes | int`).
"""

from __future__ import annotations

from typing import Any

import msgspec

# The tier names routers know (vLLM's MEDIUM_GPU / MEDIUM_CPU). L1 is "GPU" whatever the
# device (a CPU torch tensor included): it is the tier that attention reads. L3 (LMDB or
# Redis) is "DISK"; vLLM's own offloading connectors call that tier "STORAGE".
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"
MEDIUMS = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK)

# Why pages left a tier (`BlockRemoved.reason`).
REASON_EVICTED = "evicted"  # freed for room; no lower tier of this server keeps them
REASON_DEMOTED = "demoted"  # left this tier, still held in a lower one (L1 -> L2)
REASON_FLUSHED = "flushed"  # an operator's flush of this tier (POST /flush_cache)
REASONS = (REASON_EVICTED, REASON_DEMOTED, REASON_FLUSHED)

BlockHash = bytes | int  # vLLM's ExternalBlockHash; we send bytes

# A hybrid model's KV groups (`BlockStored.group_idx`) and vLLM's names of their kinds.
GROUP_FULL, GROUP_WINDOW = 0, 1
KIND_FULL, KIND_WINDOW = "full_attention", "sliding_window"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # time.time() at the end of the scheduler step
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged events: encoded as a map with `"type": <class name>`."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]       # one per page, in prefix order
    parent_block_hash: BlockHash | None  # the page before the first one; None at the root
    token_ids: list[int]                # the pages' tokens, len == block_size * len(hashes)
    block_size: int                     # tokens per page (cache.page_size)
    lora_id: int | None                 # always None: namespaces are inside the hash
    medium: str | None                  # one of MEDIUMS
    lora_name: str | None               # always None, as lora_id
    extra_keys: list[Any] | None = None  # always None: namespaces are inside the hash
    # A hybrid model's events say which kind of layer's KV the pages are of, as vLLM's
    # hybrid manager does: group 0 its full layers ("full_attention"), group 1 its window
    # layers ("sliding_window", their window). None for a model with one kind.
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None        # vLLM's optional fields, never set here, kept so
    locality: str | None = None         # that `reason` comes after them
    ownership: str | None = None
    reason: str | None = None           # hicache's: one of REASONS


class AllBlocksCleared(KVCacheEvent):
    """Forget every page of this server (a restart, or a flush of every tier)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVEvent]
