"""The worker side of `HiCacheConnector`: pages between vLLM's per-layer KV caches, the L2
host pool and L3. Torch and hicache's stores only (no vLLM), so it runs in a test on plain
tensors shaped as vLLM's CPU backend lays them out.

A page is one block of every layer, each layer's block copied whole (its bytes in vLLM's own
order: the layout is the backend's, and the namespace names it). Loads are synchronous and
checked: a page from L3 is copied into its block only after its checksum passed; one that
fails is reported (`take_load_errors`) and its block left for vLLM to recompute. Saves copy
the step's blocks into their L2 slots and queue a copy for the L3 writer thread; a store
fault there costs the pages, never the step.
"""

from __future__ import annotations

import logging
import queue
import threading

import torch

from hicache.integrations.vllm_scheduler import PageLoad, PageSave
from hicache.integrations.vllm_settings import ConnectorSpace, store_key
from hicache.storage.page_format import PageCodec
from hicache.threads import background_priority

logger = logging.getLogger("vllm.hicache")  # under vLLM's logger: its handlers and level
WORD_BYTES = 8  # host copies move 8-byte words (a byte-wise index_copy is ~3x slower)


class ConnectorWorker:
    """The worker side: vLLM's per-layer caches, the L2 host pool, L3 reads and writes."""

    def __init__(self, c: ConnectorSpace, tp_rank: int) -> None:
        self.c = c
        self.tp_rank = tp_rank
        self.layers: list[torch.Tensor] = []  # each layer's cache, blocks at dim 0
        self.host: torch.Tensor | None = None  # [slots, layers, layer block bytes] uint8
        self.load_errors: set[int] = set()
        self.counters = {"l2_loaded_pages": 0, "l3_loaded_pages": 0, "load_errors": 0,
                         "l2_saved_pages": 0, "l3_written_pages": 0, "l3_skipped_pages": 0}
        self._writes: queue.Queue[tuple[list[bytes], torch.Tensor] | None] = queue.Queue()
        self._pending = 0  # pages queued for L3, not yet written
        self._lock = threading.Lock()
        self._writer: threading.Thread | None = None
        self._pin = False

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's per-layer caches, in layer order: each a tensor whose dim 0 is the block
        (`[num_blocks, ...]`), one block of one layer `layer_block_bytes` long."""
        names = sorted(kv_caches, key=_layer_order)
        layers = [kv_caches[n] for n in names]
        want = self.c.geometry.layer_block_bytes
        for name, kv in zip(names, layers):
            got = kv[0].numel() * kv.element_size()
            if got != want:
                raise ValueError(f"hicache connector: layer {name}'s block is {got} bytes "
                                 f"({tuple(kv.shape)}), the KV cache spec says {want}: a "
                                 "layout it cannot copy whole blocks of")
        if want % WORD_BYTES:
            raise ValueError(f"hicache connector: a layer's block is {want} bytes, not a "
                             f"multiple of {WORD_BYTES}")
        if len(layers) != self.c.geometry.num_layers:
            raise ValueError(f"hicache connector: {len(layers)} KV layers registered, the KV "
                             f"cache config has {self.c.geometry.num_layers}")
        self.layers = layers
        self._pin = layers[0].is_cuda  # host buffers pinned for the copies to and from CUDA
        self.host = torch.empty((self.c.slots, len(layers), want), dtype=torch.uint8,
                                pin_memory=self._pin) if self.c.slots else None
        if self.c.settings.has_storage:
            self.c.open_store()
            self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                            name="hicache-l3-writer")
            self._writer.start()

    def _pages(self, n: int) -> torch.Tensor:
        """A CPU buffer of `n` pages: [n, layers, layer block bytes] uint8."""
        return torch.empty((n, len(self.layers), self.c.geometry.layer_block_bytes),
                           dtype=torch.uint8, pin_memory=self._pin)

    def _gather(self, block_ids: list[int]) -> torch.Tensor:
        """Blocks `block_ids` of every layer as pages (a new CPU buffer). Each layer's rows
        are copied in its own dtype (a byte-wise copy of a strided view is many times
        slower)."""
        n = len(block_ids)
        pages = self._pages(n)
        for layer, kv in enumerate(self.layers):
            index = torch.tensor(block_ids, dtype=torch.long, device=kv.device)
            pages[:, layer].view(kv.dtype).copy_(kv.index_select(0, index).reshape(n, -1))
        return pages

    def _scatter(self, block_ids: list[int], pages: torch.Tensor) -> None:
        """`pages` ([n, layers, bytes] uint8, CPU) into blocks `block_ids` of every layer."""
        n = len(block_ids)
        for layer, kv in enumerate(self.layers):
            index = torch.tensor(block_ids, dtype=torch.long, device=kv.device)
            rows = pages[:, layer].view(kv.dtype).view(n, *kv.shape[1:])
            kv.index_copy_(0, index, rows.to(kv.device, non_blocking=True))

    # ------------------------------------------------------------------ loads

    def load(self, loads: list[PageLoad]) -> None:
        if not loads or not self.layers:
            return
        from_l2 = [x for x in loads if x.slot is not None]
        from_l3 = [x for x in loads if x.slot is None]
        if from_l2:
            slots = torch.tensor([x.slot for x in from_l2], dtype=torch.long)
            pages = _words(self.host).index_select(0, slots).view(torch.uint8)
            self._scatter([x.block_id for x in from_l2], pages)
            self.counters["l2_loaded_pages"] += len(from_l2)
        if from_l3:
            self._load_l3(from_l3)

    def _load_l3(self, loads: list[PageLoad]) -> None:
        """L3's pages into their blocks through a host buffer, each checked (header and
        checksum) before it is copied; a page L3 cannot give is a load error (vLLM
        recomputes its block and those after it)."""
        store = self.c.store
        n = len(loads)
        staging = self._pages(n)
        ok = [False] * n
        if store is not None:
            ok = store.get_values([store_key(x.page_hash, self.tp_rank) for x in loads],
                                  lambda i, value: _take(self.c.codec, value, staging[i]))
        good = [i for i in range(n) if ok[i]]
        bad = [loads[i].block_id for i in range(n) if not ok[i]]
        if good:
            self._scatter([loads[i].block_id for i in good],
                          staging if len(good) == n else staging[good])
        self.counters["l3_loaded_pages"] += len(good)
        if bad:
            self.counters["load_errors"] += len(bad)
            self.load_errors.update(bad)
            logger.warning("hicache connector: %d of %d L3 pages could not be loaded (missing "
                           "or failed their checksum): vLLM recomputes them", len(bad), n)

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    # ------------------------------------------------------------------ saves

    def save(self, saves: list[PageSave]) -> None:
        """The step's filled blocks into their L2 slots, then queued for L3 (a copy: a later
        step may reassign the slot before the write)."""
        if not saves or not self.layers:
            return
        rows = self._gather([x.block_id for x in saves])  # [n, layers, bytes]
        in_l2 = [i for i, x in enumerate(saves) if x.slot is not None]
        if in_l2 and self.host is not None:
            slots = torch.tensor([saves[i].slot for i in in_l2], dtype=torch.long)
            src = rows if len(in_l2) == len(saves) else rows[in_l2]
            _words(self.host).index_copy_(0, slots, _words(src))
            self.counters["l2_saved_pages"] += len(in_l2)
        if self._writer is None:
            return
        with self._lock:
            room = self.c.settings.max_pending_writes - self._pending
            take = min(room, len(saves))
            self._pending += take
        if take < len(saves):
            self.counters["l3_skipped_pages"] += len(saves) - take
        if take:
            keys = [store_key(x.page_hash, self.tp_rank) for x in saves[:take]]
            self._writes.put((keys, rows[:take]))

    def _write_loop(self) -> None:
        background_priority()  # the forward pass keeps the cores; L3 takes what it leaves
        while True:
            item = self._writes.get()
            if item is None:
                return
            keys, rows = item
            try:
                stored = self.c.store.put_values(keys, lambda i, rows=rows: [_bytes(rows[i])])
                self.counters["l3_written_pages"] += sum(stored)
            except Exception:  # a store fault costs the pages, never the server
                logger.exception("hicache connector: an L3 write failed")
            finally:
                with self._lock:
                    self._pending -= len(keys)

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join()
            self._writer = None


def _take(codec: PageCodec, value: memoryview | bytes, page: torch.Tensor) -> bool:
    """Copy a stored value's payload into `page` if its header and checksum pass."""
    payload = codec.check(value)
    if payload is None:
        return False
    _bytes(page)[:] = payload
    return True


def _words(pages: torch.Tensor) -> torch.Tensor:
    """A [n, layers, bytes] uint8 buffer as 8-byte words (`register` checks that a layer's
    block is a whole number of them)."""
    return pages.view(torch.int64)


def _bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, writable, without a copy."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def _layer_order(name: str) -> tuple[int, str]:
    """vLLM's layer names carry their index ("model.layers.11.self_attn.attn")."""
    digits = [int(part) for part in name.split(".") if part.isdigit()]
    return (digits[0] if digits else -1, name)
