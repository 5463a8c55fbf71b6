"""A step's loads from L2, placed layer by layer as vLLM's forward reaches each layer, as
hicache's own load-back is: vLLM calls `wait_for_layer_load(layer)` just before that layer's
attention reads its cache, and only that layer's pages must have landed by then.

    HostLayerLoads   caches in host memory (vLLM's CPU backend): layer i's pages are copied
                     from L2 on vLLM's thread when the forward reaches layer i. The copy and
                     the forward share the cores, so nothing overlaps; a layer's rows are
                     gathered and scattered while they are still in the CPU's caches.
    CudaLayerLoads   caches on a GPU: at `start` every layer's pages are gathered from L2
                     into pinned staging (layer-major) and their copies queued on a load
                     stream of their own, an event recorded after each layer; `wait(i)` makes
                     the forward's stream wait on layer i's event, so copying layer i+1
                     overlaps computing layer i, and the CPU never blocks.

`LayerGate` decides which steps' loads wait for the layers' waits (only once vLLM has shown
that its forward waits on every layer); the others are started and finished at once, the
same copies before the forward. The loads are driven on vLLM's thread, in its order:
`start` (start_load_kv, before the forward), `wait(layer)` (each layer's attention),
`finish` (wait_for_save, after the forward: every layer placed or ordered before the
stream's later work, the staging buffers back; the layers the forward never waited for are
returned, so the worker can tell). What must stay true: the L2 slots read here are not
reassigned before `finish` (the scheduler's `keep`, and the step's saves run after it), and
the blocks written are the request's own, which no other request of the step reads.

Torch streams and events, not CuPy's: the connector runs inside vLLM's environment, which
brings torch and not CuPy.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from enum import Enum

import numpy as np
import torch

from hicache.integrations.vllm_buffers import Staging, words

logger = logging.getLogger("vllm.hicache")  # under vLLM's logger: its handlers and level


class ByLayer(Enum):
    """Whether a step's L2 loads wait for the forward's per-layer waits (`LayerGate`)."""

    UNPROVEN = "unproven"  # placed before the forward, until a forward waits on every layer
    ON = "on"  # a forward waited on every layer: loads started before a forward are deferred
    OFF = "off"  # a forward skipped a layer it had loads for: before the forward, for good


class LayerGate:
    """Which steps' L2 loads are deferred to the forward's per-layer waits, and those waits.

    Deferring is safe only if vLLM waits on every layer: until a forward has (`ByLayer`),
    and in a step whose loads start after its forward (vLLM's order when no request of
    the step loads synchronously) or that runs no forward, the caller copies them at once.
    Per step, on vLLM's thread: `begin` (start_load_kv), `load` (its L2 loads), `wait`
    (each layer's attention), `finish` (wait_for_save)."""

    def __init__(self, names: list[str], loads: LayerLoads | None) -> None:
        self.layer_of = {name: i for i, name in enumerate(names)}
        self.loads = loads
        self.state = ByLayer.UNPROVEN
        self._waited: set[int] = set()  # the layers this step's forward waited on so far
        self._idle = False  # this step runs no forward
        self._deferred = False  # this step's loads wait for the forward's waits

    def begin(self, idle: bool) -> None:
        self._idle = idle

    @property
    def defers(self) -> bool:
        """Whether the step's loads may wait for the forward's layer waits: the forward is
        still to come and vLLM has shown it waits on every layer."""
        return self.state is ByLayer.ON and not self._idle and not self._waited

    def turn_off(self, why: str) -> None:
        """Loads before the forward from now on, for good (a forward skipped its waits)."""
        self.state = ByLayer.OFF
        logger.error("hicache connector: %s; loads are copied before the forward from now on",
                     why)

    def load(self, slots: list[int], block_ids: list[int]) -> bool:
        """The step's L2 loads: left to land at each layer's wait where that is safe
        (`defers`), else placed now; whether they were left to the waits."""
        assert self.loads is not None, "L2 loads need an L2"
        self._deferred = self.defers
        self.loads.start(slots, block_ids)
        if not self._deferred:
            self.loads.finish()
        return self._deferred

    def wait(self, name: str) -> None:
        """Before layer `name`'s attention: its deferred pages in place."""
        layer = self.layer_of.get(name)
        if layer is None:
            return  # not one of this worker's layers (a draft model's)
        self._waited.add(layer)
        if self.loads is not None:
            self.loads.wait(layer)

    def finish(self) -> None:
        """After the forward: every deferred page placed. A forward that waited on every
        layer proves deferring safe; one that skipped a layer it had deferred pages for
        read that layer without them: said loudly, and never deferred again."""
        missed = self.loads.finish() if self.loads is not None else []
        if missed and self._deferred:
            self.turn_off(f"vLLM's forward did not wait for layers {missed} of this step's "
                          "loads (wait_for_layer_load)")
        elif (self.state is ByLayer.UNPROVEN and not self._idle and self.layer_of
              and len(self._waited) == len(self.layer_of)):
            self.state = ByLayer.ON
            logger.info("hicache connector: vLLM's forward waits on every layer: loads "
                        "land layer by layer from now on")
        self._waited, self._deferred = set(), False


class LayerLoads(ABC):
    """One step's L2 loads into vLLM's per-layer caches, placed layer by layer.

    `layers`: vLLM's caches in layer order; `block_dims`: each one's block dim (0, or 1 after
    K / V); `host`: L2, [slots, layers, layer block bytes] uint8; `staging`: the worker's
    staging buffers. Called on vLLM's thread only."""

    def __init__(self, layers: list[torch.Tensor], block_dims: list[int], host: torch.Tensor,
                 staging: Staging) -> None:
        self.layers, self.block_dims, self.host, self.staging = layers, block_dims, host, staging
        self._todo: set[int] = set()  # layers started and not yet waited for

    def start(self, slots: list[int], block_ids: list[int]) -> None:
        """The step's loads: L2 slot `slots[k]` into block `block_ids[k]` of every layer.
        Once a step (an earlier step's loads never finished are finished first)."""
        if self._todo:
            self.finish()
        if slots:
            self._start(slots, block_ids)
            self._todo = set(range(len(self.layers)))

    @abstractmethod
    def _start(self, slots: list[int], block_ids: list[int]) -> None:
        """The loads under way: copied at `wait` (host), or queued (CUDA)."""

    def wait(self, layer: int) -> None:
        """Layer `layer`'s pages in place for the forward's next read of that layer."""
        if layer in self._todo:
            self._todo.discard(layer)
            self._place(layer)

    @abstractmethod
    def _place(self, layer: int) -> None:
        """Layer `layer`'s pages in place (or ordered before the forward's next read)."""

    def finish(self) -> list[int]:
        """Every layer placed, the step's buffers given back; the layers the forward did not
        wait for (placed now)."""
        missed = sorted(self._todo)
        for layer in missed:
            self.wait(layer)
        self._release()
        return missed

    @abstractmethod
    def _release(self) -> None:
        """The step's buffers back, once nothing reads them."""


class HostLayerLoads(LayerLoads):
    """Caches in host memory: each layer copied from L2 when the forward reaches it, through
    one staging buffer lent for the step (a layer of up to its bytes' worth of pages at a
    time)."""

    def __init__(self, layers: list[torch.Tensor], block_dims: list[int], host: torch.Tensor,
                 staging: Staging) -> None:
        super().__init__(layers, block_dims, host, staging)
        self._scratch: torch.Tensor | None = None  # lent from `start` to `finish`
        self._slots = self._index = torch.empty(0, dtype=torch.long)

    def _start(self, slots: list[int], block_ids: list[int]) -> None:
        self._scratch = self.staging.take()
        self._slots = torch.tensor(slots, dtype=torch.long)
        self._index = torch.tensor(block_ids, dtype=torch.long)

    def _place(self, layer: int) -> None:
        kv, dim = self.layers[layer], self.block_dims[layer]
        host = words(self.host)[:, layer]  # [slots, layer block words], strided
        assert self._scratch is not None
        scratch = words(self._scratch).view(-1)
        per = scratch.numel() // host.shape[1]  # pages of one layer the buffer holds
        for start in range(0, len(self._slots), per):
            slots = self._slots[start:start + per]
            rows = scratch[:len(slots) * host.shape[1]].view(len(slots), host.shape[1])
            torch.index_select(host, 0, slots, out=rows)
            scatter_layer(kv, dim, self._index[start:start + per], rows)

    def _release(self) -> None:
        scratch, self._scratch = self._scratch, None
        if scratch is not None:
            self.staging.give(scratch)


class CudaLayerLoads(LayerLoads):
    """Caches on a GPU: every layer's copy queued at `start` on a load stream, one event
    per layer, which `wait` puts before the forward's stream's next work."""

    def __init__(self, layers: list[torch.Tensor], block_dims: list[int], host: torch.Tensor,
                 staging: Staging) -> None:
        super().__init__(layers, block_dims, host, staging)
        self.device = layers[0].device
        self.stream = torch.cuda.Stream(self.device)
        self._events: list[torch.cuda.Event] = []
        self._chunks: list[torch.Tensor] = []  # pinned staging, read by the load stream

    def _start(self, slots: list[int], block_ids: list[int]) -> None:
        runs = []
        host = words(self.host)
        for first in range(0, len(slots), self.staging.pages):
            run = torch.tensor(slots[first:first + self.staging.pages], dtype=torch.long)
            chunk = self.staging.take()
            self._chunks.append(chunk)
            # layer-major, so that each layer's rows are one contiguous pinned copy
            rows = words(chunk).view(-1)[:len(self.layers) * len(run) * host.shape[2]]
            rows = rows.view(len(self.layers), len(run), host.shape[2])
            for layer in range(len(self.layers)):
                torch.index_select(host[:, layer], 0, run, out=rows[layer])
            index = torch.tensor(block_ids[first:first + len(run)], dtype=torch.long)
            runs.append((rows, index.pin_memory()))
        # the blocks' earlier writers (vLLM zeroes new blocks on its stream) come first
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            runs = [(rows, index.to(self.device, non_blocking=True)) for rows, index in runs]
            for layer, (kv, dim) in enumerate(zip(self.layers, self.block_dims)):
                for rows, index in runs:
                    scatter_layer(kv, dim, index, rows[layer])
                event = torch.cuda.Event()
                event.record(self.stream)
                self._events.append(event)

    def _place(self, layer: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self._events[layer])

    def _release(self) -> None:
        if self._events:
            self._events[-1].synchronize()  # the last copy read the staging buffers
        for chunk in self._chunks:
            self.staging.give(chunk)
        self._events, self._chunks = [], []


def layer_loads(layers: list[torch.Tensor], block_dims: list[int], host: torch.Tensor,
                staging: Staging) -> LayerLoads:
    """The kind of `LayerLoads` for where vLLM's caches are."""
    kind = CudaLayerLoads if layers[0].is_cuda else HostLayerLoads
    return kind(layers, block_dims, host, staging)


def block_bytes(layers: list[torch.Tensor], block_dims: list[int], groups: list[list[int]]
                ) -> Callable[[int, int], list[np.ndarray]] | None:
    """For caches in host memory: (a block id, a KV cache group) -> that block's bytes in
    each of the group's layers (`groups`: per group, its layers' indices), in the order a
    page stores them (per layer its block, or its K block then its V block), as views any
    thread may copy into without a torch op; None for caches on a GPU."""
    if not layers or layers[0].is_cuda:
        return None
    arrays = [kv.view(torch.uint8).numpy() for kv in layers]  # made here, on vLLM's thread

    def parts(block: int, group: int) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        for i in groups[group]:
            arr = arrays[i]
            out += [arr[block]] if block_dims[i] == 0 else [arr[0, block], arr[1, block]]
        return out

    return parts


def scatter_layer(kv: torch.Tensor, dim: int, index: torch.Tensor, rows: torch.Tensor) -> None:
    """`rows` ([n, layer block bytes] of any dtype, CPU or `kv`'s device) into blocks `index`
    of one layer's cache `kv`, whose blocks are along `dim`; on the current stream."""
    n = index.numel()
    rows = rows.view(kv.dtype).view(n, *block_shape(kv, dim))
    kv.index_copy_(dim, index.to(kv.device, non_blocking=True),
                   rows.movedim(0, dim).to(kv.device, non_blocking=True))


def block_shape(kv: torch.Tensor, dim: int) -> tuple[int, ...]:
    """One block of `kv` as a page stores it: `kv.shape[1:]`, or `(2, *kv.shape[2:])` for a
    `[2, blocks, ...]` layer (its K block, then its V block)."""
    return tuple(kv.shape[1:]) if dim == 0 else (2, *kv.shape[2:])


def layer_order(name: str) -> tuple[int, str]:
    """vLLM's layer names carry their index ("model.layers.11.self_attn.attn")."""
    digits = [int(part) for part in name.split(".") if part.isdigit()]
    return (digits[0] if digits else -1, name)


def block_dim(name: str, kv: torch.Tensor, block_bytes: int) -> int:
    """0 where `kv` is `[num_blocks, ...]`, 1 where it is `[2, num_blocks, ...]` (K, V), by
    where a block of `block_bytes` fits; ValueError for a layout it fits neither way, or
    both ways (`[2, 2, ...]`: two blocks, or K and V of two: nothing in the shape tells)."""
    fits = []
    if kv.dim() >= 2 and kv[0].numel() * kv.element_size() == block_bytes:
        fits.append(0)
    if kv.dim() >= 3 and kv.shape[0] == 2 and kv[:, 0].numel() * kv.element_size() == block_bytes:
        fits.append(1)
    if len(fits) != 1:
        why = "both" if fits else "neither"
        raise ValueError(f"hicache connector: layer {name}'s cache {tuple(kv.shape)} has "
                         f"blocks of {block_bytes} bytes (the KV cache spec) at {why} of dim 0 "
                         "([num_blocks, ...]) and dim 1 ([2, num_blocks, ...]): a layout it "
                         "cannot copy whole blocks of")
    return fits[0]
