"""KV cache events in vLLM's schema: what each tier of this server holds, for cache-aware
routers (llm-d, NVIDIA Dynamo, or a small subscriber). See docs/events.md."""

from hicache.events.publisher import (
    EventCounters,
    EventPublisher,
    NullEventPublisher,
    ZmqEventPublisher,
)
from hicache.events.recorder import EventRecorder
from hicache.events.schema import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    REASON_DEMOTED,
    REASON_EVICTED,
    REASON_FLUSHED,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

__all__ = [
    "MEDIUM_CPU", "MEDIUM_DISK", "MEDIUM_GPU", "REASON_DEMOTED", "REASON_EVICTED",
    "REASON_FLUSHED", "AllBlocksCleared", "BlockRemoved", "BlockStored", "EventCounters",
    "EventPublisher", "EventRecorder", "KVEventBatch", "NullEventPublisher",
    "ZmqEventPublisher",
]
