"""L1 <-> L2 movement: the transfer engines (CPU threads, or CuPy streams and kernels on a
GPU) and `HiCacheController`, which queues the tree's writes and loads on them."""

from hicache.transfer.controller import Ack, HiCacheController
from hicache.transfer.engines import (
    CpuTransferEngine,
    CudaTransferEngine,
    TransferEngine,
    TransferHandle,
    make_transfer_engine,
)

__all__ = ["Ack", "CpuTransferEngine", "CudaTransferEngine", "HiCacheController",
           "TransferEngine", "TransferHandle", "make_transfer_engine"]
