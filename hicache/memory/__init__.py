"""KV memory: the device pool (L1) with its page allocator, and the host pool (L2) in one of
the layouts named in `hicache.kernels.layouts`. Sizes are tokens unless a name says pages or bytes."""

from hicache.memory.device import INDEX_DTYPE, DeviceKVPool, PageAllocator, resolve_device
from hicache.memory.host import HostKVPool, available_memory_bytes

__all__ = ["INDEX_DTYPE", "DeviceKVPool", "HostKVPool", "PageAllocator",
           "available_memory_bytes", "resolve_device"]
