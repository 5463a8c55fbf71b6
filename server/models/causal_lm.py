"""`CausalLM`: what the engine holds of a decoder-only model, whatever its architecture.

An architecture's file (llama.py, gemma3.py) builds the body, `model`, with the parts read
here: `embed_tokens.weight` and `layers[i].self_attn` holding the attention `backend` and a
stacked `qkv_proj`, and names the modules its layer kernel may run. Everything else is
shared: the LM head (tied or not), the forward's contract, the CPU kernels' choice and
`load_weights`. q/k/v and gate/up are stored stacked (`qkv_proj`, `gate_up_proj`) so each is
one matmul; `load_weights` maps transformers' separate names onto the stacked rows.

Threading: `forward` runs on the scheduler thread, which owns the KV pool it writes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
from torch import nn

from hicache.memory.device import DeviceKVPool
from hicache_server.models.attention import AttentionBackend
from hicache_server.models.config import ModelArchConfig
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.models.head_screen import HeadScreen, screen_wanted
from hicache_server.models.kernels import cpu_head
from hicache_server.models.kernels.cpu_layer import CpuLayerKernel
from hicache_server.models.kernels.cpu_linear import CpuLinearKernel
from hicache_server.models.linear import Linear, linear, onednn_linear_works

# transformers' separate projections -> (our stacked parameter, shard index within it)
_STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
# Checkpoint entries that are not weights (buffers some exporters save).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CausalLM(nn.Module, ABC):
    """`forward` -> float32 logits of each sequence's last new token (or of
    `batch.output_rows`); K/V of the new tokens land in `kv_pool` at `batch.out_slots`,
    every layer."""

    @property
    def screens_head(self) -> bool:
        """Whether a row's argmax may come from the head screen: only where the logits are
        the head's as they are (an architecture whose `_logits` reshapes them says so)."""
        return type(self)._logits is CausalLM._logits

    def __init__(self, config: ModelArchConfig, model: nn.Module, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = device
        self.model = model
        # a tied LM head is the embedding table: on the linear kernel, a packed copy of the
        # table (`_pack_head`); else oneDNN, its choice made once
        self._onednn_head = self.device.type == "cpu" and onednn_linear_works(dtype)
        self._head_kernel: CpuLinearKernel | None = None
        self._head_panels: torch.Tensor | None = None
        # the head's greedy screen, on the linear kernel's head once weights are loaded
        # (`_pack_head`)
        self._screen: HeadScreen | None = None
        self._weights_loaded = False
        if config.tie_word_embeddings:
            self.lm_head = nn.Module()
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = Linear(config.hidden_size, [config.vocab_size], False, dtype,
                                  self.device)

    @abstractmethod
    def _layer_kernel_modules(self) -> list[nn.Module]:
        """The modules whose `kernel` the layer kernel may be (each computes on it the very
        arithmetic of its transformers counterpart)."""

    def _refresh_derived(self) -> None:
        """Rebuild what is derived from the weights and kernels the model has now (Llama's
        lean path, Gemma's folded norm weights); nothing by default. Weights change only
        through `load_weights`, which calls this (as it repacks the Linears)."""

    @property
    def attn_backend(self) -> AttentionBackend:
        """The attention backend (every layer shares one)."""
        return self.model.layers[0].self_attn.backend

    @property
    def linear_backend(self) -> str:
        """What the Linears run on: CpuLinearKernel (in bfloat16 with its path, e.g.
        `CpuLinearKernel (amx)`), oneDNN (packed) or torch."""
        first = self.model.layers[0].self_attn.qkv_proj
        if first.panels is not None:
            name = type(first.kernel).__name__
            if self.dtype == torch.bfloat16:  # which of its bfloat16 paths: amx, ...
                return f"{name} ({first.kernel.bf16_path})"
            return name
        return "oneDNN" if first.packed is not None else "torch"

    @property
    def layer_ops(self) -> str:
        """What a layer's ops but its matmuls and attention run on: CpuLayerKernel (every
        architecture runs all of them there) or torch."""
        kernel = self._layer_kernel_modules()[0].kernel
        return "torch" if kernel is None else type(kernel).__name__

    def use_layer_kernel(self, kernel: CpuLayerKernel | None) -> None:
        """Run the layer kernel's ops on `kernel` (None: torch ops), on the CPU."""
        for m in self._layer_kernel_modules():
            m.kernel = kernel if self.device.type == "cpu" else None
        self._refresh_derived()

    @torch.no_grad()
    def use_linear_kernel(self, kernel: CpuLinearKernel | None) -> None:
        """Run the Linears on `kernel` (None: back to oneDNN), repacking loaded weights."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.kernel = kernel if m.weight.device.type == "cpu" else None
                if m.packed is not None or m.panels is not None:
                    m.unpack()
                    m.pack()
        self._head_kernel = kernel if self.device.type == "cpu" else None
        self._pack_head()
        self._refresh_derived()

    def _pack_head(self) -> None:
        """A tied LM head on the linear kernel: the table packed once (one more copy of it:
        113 MB for SmolLM2 in float32, 56 in bfloat16). The kernel gives a row's logits the
        same bits in any batch, as oneDNN does not promise, and streams the table faster
        for decode batches (SmolLM2's float32 head, from memory: 1 row 3.30 -> 2.64 ms,
        8 rows 5.39 -> 3.05 against oneDNN)."""
        self._head_panels = self._screen = None
        if self._head_kernel is None:
            return
        if self.config.tie_word_embeddings:
            self._head_panels = self._head_kernel.pack(self.model.embed_tokens.weight)
            weight, panels = self.model.embed_tokens.weight, self._head_panels
        else:
            weight, panels = self.lm_head.weight, self.lm_head.panels
        if (panels is not None and self._weights_loaded and self.screens_head
                and screen_wanted()):
            kernel = cpu_head.load(self._head_kernel.path.parent)
            if kernel is not None:
                self._screen = HeadScreen.build(weight.detach(), kernel, self._head_kernel,
                                                panels)
                self._screen.calibrate(weight.detach())

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_pool: DeviceKVPool) -> torch.Tensor:
        """`[num_seqs, vocab]` float32 logits of each sequence's last new token, or
        `[len(output_rows), vocab]` of those rows when the batch names them. Only the rows
        returned go through the LM head."""
        batch = batch.to(kv_pool.device)
        h = self.model(batch, kv_pool)  # [T, hidden]
        h = h.index_select(0, batch.logit_rows())
        if batch.argmax_only is not None and self._screen is not None:
            return self._screened_logits(h, batch.argmax_only)
        return self._logits(h)

    @torch.inference_mode()
    def forward_all_logits(self, batch: ForwardBatch, kv_pool: DeviceKVPool) -> torch.Tensor:
        """`[T, vocab]` float32 logits of every new token (tests, scoring)."""
        return self._logits(self.model(batch.to(kv_pool.device), kv_pool))

    def _screened_logits(self, h: torch.Tensor, argmax_only: torch.Tensor) -> torch.Tensor:
        """`_logits(h)`, except that the rows marked `argmax_only` may be the head screen's
        (exact only where the argmax can be: models/head_screen.py)."""
        picked = argmax_only.nonzero().flatten()
        screened = self._screen.logits(h[picked]) if picked.numel() else None
        if screened is None:
            return self._logits(h)
        if picked.numel() == h.shape[0]:
            return screened
        out = torch.empty((h.shape[0], self.config.vocab_size), dtype=torch.float32)
        out[picked] = screened
        rest = (~argmax_only).nonzero().flatten()
        out[rest] = self._logits(h[rest])
        return out

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        if isinstance(self.lm_head, Linear):
            return self.lm_head(h).float()
        if self._head_panels is not None:
            return self._head_kernel(h.contiguous(), self._head_panels,
                                     self.config.vocab_size).float()
        return linear(h, self.lm_head.weight, onednn=self._onednn_head).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformers-named tensors in (cast to the model's dtype and device).

        ValueError for an unknown name, a shape mismatch, or a weight missing at the end.
        The CPU Linears' packed copies are dropped while loading and rebuilt after.
        """
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        for m in linears:
            m.unpack()
        try:
            self._load_all(weights)
            self._weights_loaded = True
        finally:
            for m in linears:
                m.pack()
            self._pack_head()
            self._refresh_derived()

    def _load_all(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        pending = self._expected_keys()
        for name, tensor in weights:
            key = self._load_one(name, tensor, params)
            if key is not None:
                pending.discard(key)
        if pending:
            missing = sorted(n if i is None else f"{n}[shard {i}]" for n, i in pending)
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:5]}")

    def _expected_keys(self) -> set[tuple[str, int | None]]:
        """(parameter, shard) pairs a complete checkpoint fills; shard None = the whole."""
        keys: set[tuple[str, int | None]] = set()
        for mod_name, mod in self.named_modules():
            shards = len(mod.out_sizes) if isinstance(mod, Linear) else 1
            for p_name, _ in mod.named_parameters(recurse=False):
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                keys |= {(full, None)} if shards == 1 else {(full, i) for i in range(shards)}
        if self.config.tie_word_embeddings:
            keys.discard(("lm_head.weight", None))
        return keys

    def _load_one(self, name: str, tensor: torch.Tensor,
                  params: dict[str, nn.Parameter]) -> tuple[str, int | None] | None:
        if name.endswith(_IGNORED_SUFFIXES):
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # some tied checkpoints still store the copy
        target_name, shard = _stacked_name(name)
        if target_name not in params:
            raise ValueError(f"checkpoint weight {name!r} has no place in {type(self).__name__}")
        target = params[target_name]
        if shard is not None:
            owner = self.get_submodule(target_name.rsplit(".", 1)[0])
            target = owner.shard(target, shard)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint weight {name!r} has shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(target.shape)}")
        target.copy_(tensor)
        return target_name, shard


def _stacked_name(name: str) -> tuple[str, int | None]:
    """`...self_attn.k_proj.weight` -> (`...self_attn.qkv_proj.weight`, 1); others unchanged."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _STACKED:
        stacked, shard = _STACKED[parts[-2]]
        return ".".join([*parts[:-2], stacked, parts[-1]]), shard
    return name, None
