"""`HiCacheConnector`: hicache's L2 (host memory) and L3 (LMDB, Redis, both tiered) behind vLLM,
as a v1 KV connector loaded by module path, with no vLLM change::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "HiCacheConnector",
        "kv_connector_module_path": "hicache.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"host_size_gb": 4, "storage_backend": "lmdb"}}'

A page is one vLLM block of every layer, keyed by hicache's page hash of the block's tokens
(chained from the first block) under a namespace of the model, its KV geometry and layout, the
platform and the salt (`vllm_settings`). vLLM builds the connector twice: once beside its
scheduler, once in each worker; they may be different processes and share nothing but the
metadata the scheduler sends each step.

    scheduler side                              worker side
    get_num_new_matched_tokens: the leading     handle_preemptions (the metadata arrives):
      blocks in L2 (its own index of the          the step's L3 pages queued for the loader
      worker's slots) or in L3 (batch_exists);    thread, ahead of every other read
      asynchronous when L3 has more than        start_load_kv: L2 slots into the request's
      l3_step_load_mb of them                     blocks, each layer's as the forward
    update_state_after_alloc: the load plan       reaches it (wait_for_layer_load); the
    build_connector_meta: loads; saves of         step's L3 pages placed before its first
      every block this step fills, each to an     layer; a page L3 cannot give (missing,
      L2 slot (least recently used evicted)       failed checksum, store down) is reported
    request_finished: forget the request          through get_block_ids_with_load_errors:
      (saves end within their step: no block      vLLM recomputes it (kv_load_failure_policy
      is held past it)                            "recompute"), never serves it
                                                get_finished: requests whose asynchronous
                                                  L3 pages are all placed
                                                wait_for_save: the step's filled blocks
                                                  copied into their L2 slots, then queued
                                                  for L3 (a writer thread, from a copy)

A hit loads within the request's own step: `start_load_kv` starts its L2 pages, each layer's
landing before `wait_for_layer_load` lets that layer's attention read them (on a GPU the
copies run on a stream of their own, layer i+1 copied while layer i computes), and every
layer is in place before the step's saves (`vllm_layers`). Its L3 pages are read and checked
by the worker's loader thread from the moment the step's metadata arrives, while vLLM
prepares the step's inputs, and placed before the forward's first layer reads its cache (by
vLLM's thread if the loader is busy: a step never waits for another request's read). A
failed page is reported in that same step: vLLM drops the step's output for the request and
computes from that block on, and the blocks the step computed over it are not saved. A hit
of more than `l3_step_load_mb` of L3 pages loads asynchronously instead, so that other
requests' steps do not wait for it: vLLM holds the request back (WAITING_FOR_REMOTE_KVS)
while the loader reads it beside their steps; a later step's `start_load_kv` places its
pages, and `get_finished` hands the request back, its failed blocks reported in the same
step. Saves are copies into host memory at the end of the step; the L3 write runs beside the
next steps. The scheduler's index of L2 follows the slots it assigns, so both sides agree
without talking: a slot is reassigned only by a later step's save, after this step's loads
have read it.

With vLLM's hybrid KV cache manager (the connector is `SupportsHMA`) a model with sliding
windows has several KV cache groups: the unit is then one group's block of a page, a hit
follows hicache's rule by kind (`vllm_groups`), L3 hits load asynchronously and a failed
one fails its request's load (vLLM takes no block ids of several groups).

Imports vLLM: load this module only inside vLLM (hicache itself never imports it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from hicache.integrations.vllm_groups import KVGroup, KVGroups
from hicache.integrations.vllm_layers import layer_order
from hicache.integrations.vllm_scheduler import ConnectorScheduler, StepPlan
from hicache.integrations.vllm_settings import (
    BlockGeometry,
    ConnectorSettings,
    ConnectorSpace,
    namespace_fingerprint,
)
from hicache.integrations.vllm_worker import ConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["HiCacheConnector", "HiCacheMetadata"]

logger = logging.getLogger("vllm.hicache")  # under vLLM's logger: its handlers and level

@dataclass
class HiCacheMetadata(KVConnectorMetadata):
    """What the scheduler side sends the workers each step."""

    plan: StepPlan = field(default_factory=StepPlan)


class HiCacheConnector(KVConnectorBase_V1, SupportsHMA):
    """hicache's tiers as a vLLM v1 KV connector (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = ConnectorSettings.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config)
        geometry, groups = _geometry(vllm_config, kv_cache_config)
        self.space = ConnectorSpace(settings, geometry, _fingerprint(
            vllm_config, geometry, groups, settings.namespace), groups)
        self._scheduler = (ConnectorScheduler(self.space)
                           if role == KVConnectorRole.SCHEDULER else None)
        self._worker = None if self._scheduler else ConnectorWorker(self.space, _tp_rank())
        logger.info("hicache connector (%s): L2 %d pages of %d bytes, L3 %s, %d KV cache "
                    "group(s)", role.name, self.space.slots, geometry.page_bytes,
                    settings.backend, len(groups.groups) if groups else 1)

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return HiCacheMetadata(self._scheduler.step(scheduler_output))

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.finished(request.request_id)
        return False, None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.finished(request.request_id)  # (vLLM's call with its hybrid manager)
        return False, None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # the step's metadata, as it arrives: its L3 reads start while vLLM prepares inputs
        assert isinstance(kv_connector_metadata, HiCacheMetadata)
        self._worker.prefetch(kv_connector_metadata.plan)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HiCacheMetadata)
        self._worker.load(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # wait_for_save copies the step's blocks, every layer at once

    def wait_for_save(self) -> None:
        self._worker.finish_loads()  # the step's L2 loads all placed, before its saves
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, HiCacheMetadata)
        self._worker.save(meta.plan.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # no save outlives its step; loads: the requests whose L3 pages are in place
        return None, self._worker.take_finished_loads() or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # a hybrid model's failed L3 loads, by request (their blocks are of several groups)
        _, finished = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_recving=set(finished or ()),
                                          failed_recving=self._worker.take_failed_loads())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        self.space.close_store()

    def stats(self) -> dict[str, int]:
        """This side's counters (hits by tier and tokens; saves, L3 writes, load errors)."""
        side = self._scheduler or self._worker
        return dict(side.counters)


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    try:
        return get_tensor_model_parallel_rank()
    except (AssertionError, AttributeError):  # not initialised: one rank
        return 0


def _geometry(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None
              ) -> tuple[BlockGeometry, KVGroups | None]:
    """One unit's geometry (a block of every layer; with several groups, a block of one
    group's layers) and the groups, from vLLM's KV cache config."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        raise ValueError("hicache connector: needs vLLM's KV cache config")
    groups, specs = [], []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        full = isinstance(spec, FullAttentionSpec) and window is None
        if not (full or type(spec) is SlidingWindowSpec) or (
                window is not None and len(kv_cache_config.kv_cache_groups) == 1):
            raise ValueError(f"hicache connector: {type(spec).__name__} layers (sliding "
                             f"window {window}) are not supported: full attention, or "
                             "sliding windows with vLLM's hybrid KV cache manager (start "
                             "vLLM with --disable-hybrid-kv-cache-manager to serve such a "
                             "model's layers as full attention)")
        names = tuple(sorted(group.layer_names, key=layer_order))
        groups.append(KVGroup(names, tuple(layer_order(n)[0] for n in names), window))
        specs.append(spec)
    spec = specs[0]
    if len({(s.num_kv_heads, s.head_size, s.block_size, s.dtype, s.page_size_bytes)
            for s in specs}) != 1:
        raise ValueError("hicache connector: KV cache groups of different layer shapes "
                         "are not supported")
    layers = max(len(x.names) for x in groups)
    kinds = KVGroups(tuple(groups), spec.block_size)
    return (BlockGeometry(layers, spec.num_kv_heads, spec.head_size, spec.block_size,
                          str(spec.dtype).removeprefix("torch."), spec.page_size_bytes),
            kinds if kinds.hybrid else None)


def _fingerprint(vllm_config: VllmConfig, geometry: BlockGeometry, groups: KVGroups | None,
                 salt: str) -> str:
    import vllm
    from vllm.platforms import current_platform
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    layout = {"vllm": vllm.__version__, "attention_backend": str(backend or "auto"),
              "cache_dtype": str(vllm_config.cache_config.cache_dtype)}
    if groups is not None:  # a hybrid layout never shares keys with a non-hybrid one
        layout["kv_groups"] = groups.layout()
    tp = (0, vllm_config.parallel_config.tensor_parallel_size)
    return namespace_fingerprint(vllm_config.model_config.model, geometry, layout,
                                 current_platform.device_type, tp, salt)
