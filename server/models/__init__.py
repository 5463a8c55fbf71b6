"""The model side of the engine: decoders over the paged KV pool, one file per architecture
(`registry.py` lists them; `CausalLM` is what the engine holds of any), their loader and the
ForwardBatch contract with the model runner. docs/models.md says what runs and how each is
tested."""

from __future__ import annotations

from hicache_server.models.attention import (
    AttentionBackend,
    CpuKernelAttention,
    CudaPagedAttention,
    ReferenceAttention,
    TorchAttention,
)
from hicache_server.models.attention_choice import make_attention_backend
from hicache_server.models.causal_lm import CausalLM
from hicache_server.models.config import ModelArchConfig
from hicache_server.models.forward_batch import ForwardBatch
from hicache_server.models.gemma3 import Gemma3ForCausalLM
from hicache_server.models.llama import LlamaForCausalLM
from hicache_server.models.loader import (
    EMBEDDED_TINY_LLAMA,
    LoadedModel,
    hicache_home,
    load_model,
    resolve_model_path,
    write_embedded_model,
)

__all__ = [
    "EMBEDDED_TINY_LLAMA",
    "AttentionBackend",
    "CausalLM",
    "CpuKernelAttention",
    "CudaPagedAttention",
    "ForwardBatch",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelArchConfig",
    "ReferenceAttention",
    "TorchAttention",
    "hicache_home",
    "load_model",
    "make_attention_backend",
    "resolve_model_path",
    "write_embedded_model",
]
