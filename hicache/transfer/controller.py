"""The write and load queues between the tiers, and the acks the scheduler drains.

    write(node)  : allocate host pages, queue D->H now        -> ack via poll_writes()
    load(node)   : allocate device pages, queue H->D           -> launched by start_loading()
                                                               -> ack via poll_loads()

Loads queued while a batch is being scheduled are launched together by `start_loading()` as
one transfer whose layers land in order; the model runner calls `wait_layer(i)` on the
returned handle before layer i's attention (the last load in flight when none was queued:
one the loop launched with no forward to wait on it).

Threading: every method is called on the scheduler thread. Copies run on the transfer
engine's worker/streams; completion is observed by polling handles, never by callbacks, so
the tree is only ever touched on the scheduler thread.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch

from hicache.kernels.transfer_kv import h2d_pages
from hicache.memory.device import DeviceKVPool
from hicache.memory.host import HostKVPool
from hicache.transfer.engines import TransferEngine, TransferHandle


class Ack(NamedTuple):
    node_id: int
    ok: bool  # False: the copy raised; its destination bytes must not be used


class _Pending(NamedTuple):
    handle: TransferHandle
    node_ids: list[int]


class HiCacheController:
    """Owns the queues of copies in flight between L1 and L2 (units: slot indices)."""

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool,
                 transfer: TransferEngine) -> None:
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.transfer = transfer
        self._writes: deque[_Pending] = deque()
        self._loads: deque[_Pending] = deque()
        self._queued_loads: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self.current_load: TransferHandle | None = None

    # -------------------------------------------------------------------------- writes

    def write(self, device_indices: torch.Tensor, node_id: int) -> torch.Tensor | None:
        """Allocate host slots and queue the D->H copy; None when L2 has no room."""
        host_indices = self.host_pool.alloc(len(device_indices))
        if host_indices is None:
            return None
        handle = self.transfer.copy_d2h(device_indices, host_indices)
        self._writes.append(_Pending(handle, [node_id]))
        return host_indices

    def poll_writes(self) -> list[Ack]:
        """Acks of the D->H copies that have finished, in queue order."""
        return _drain(self._writes)

    # --------------------------------------------------------------------------- loads

    def load(self, host_indices: torch.Tensor, node_id: int) -> torch.Tensor | None:
        """Allocate device slots for a H->D copy launched by the next `start_loading`."""
        # no window pages: the tree gives them to the pages whose window KV it loads
        device_indices = self.device_pool.alloc(len(host_indices), window=False)
        if device_indices is None:
            return None
        self._queued_loads.append((host_indices, device_indices, node_id))
        return device_indices

    def load_windows_now(self, host_indices: torch.Tensor, device_indices: torch.Tensor
                         ) -> None:
        """Copy the window layers of host slots into the window pages of device slots (a
        `WindowedKVPool`'s, group by group), on the calling thread: on the CPU done on return, on CUDA
        queued on the current stream, ahead of the forward that reads them. Whole pages."""
        pool, host = self.device_pool, self.host_pool
        ps = pool.page_size
        window = pool.group_pages_of(device_indices)  # [pages, groups]
        for g, layers in enumerate(pool.group_layers):
            h2d_pages(host.buffer, host.layout, pool.k_buffers, pool.v_buffers,
                      host_indices[::ps] // ps, window[:, g], ps, layers=layers,
                      backend="cuda" if pool.device.type == "cuda" else "reference")

    def start_loading(self) -> TransferHandle | None:
        """Launch every queued load as one transfer. Returns the handle a forward pass waits
        on, layer by layer (also `current_load`): this transfer's, or, with none queued, the
        last one still in flight, for a forward may read the pages of a load the loop
        launched while no forward ran; copies land in FIFO order (one worker, one H->D
        stream), so the last load's layers land after every earlier one's. None when no
        load is queued or in flight."""
        if not self._queued_loads:
            self.current_load = self._loads[-1].handle if self._loads else None
            return self.current_load
        host = torch.cat([h for h, _, _ in self._queued_loads])
        dev = torch.cat([d for _, d, _ in self._queued_loads])
        ids = [i for _, _, i in self._queued_loads]
        self._queued_loads = []
        handle = self.transfer.copy_h2d(host, dev)
        self._loads.append(_Pending(handle, ids))
        self.current_load = handle
        return handle

    def poll_loads(self) -> list[Ack]:
        """Acks of the H->D copies that have finished, in queue order."""
        return _drain(self._loads)

    # ---------------------------------------------------------------------------- misc

    def has_pending(self) -> bool:
        return bool(self._writes or self._loads or self._queued_loads)

    def wait_writes(self) -> None:
        """Block until every D->H copy in flight has finished."""
        for pending in self._writes:
            pending.handle.wait_quietly()

    def wait_loads(self) -> None:
        """Launch queued loads and block until every H->D copy has finished."""
        if self._queued_loads:
            self.start_loading()
        for pending in self._loads:
            pending.handle.wait_quietly()

    def wait_all(self) -> None:
        self.wait_writes()
        self.wait_loads()

    def close(self) -> None:
        self.wait_all()
        self.transfer.close()


def _drain(pending: deque[_Pending]) -> list[Ack]:
    acks: list[Ack] = []
    while pending and pending[0].handle.done():
        handle, node_ids = pending.popleft()
        acks.extend(Ack(i, not handle.failed()) for i in node_ids)
    return acks
