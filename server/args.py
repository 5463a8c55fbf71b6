"""Command-line flags (SGLang's names) merged over the YAML config into one `Config`.

Precedence: built-in defaults < `--config FILE` < flags. A flag left out does not override
anything. A bad flag or config value exits with code 2 and a message naming the key.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from hicache.config import MEM_LAYOUTS, ConfigError
from hicache.config_storage import STORAGE_BACKENDS, TIERED_BACKEND, TIERED_PARTS
from hicache.policies import EVICTION_POLICIES, IO_BACKENDS, PREFETCH_POLICIES, WRITE_POLICIES
from hicache_server.config import DEVICES, DTYPES, SCHEDULE_POLICIES, Config, load_config

EXIT_BAD_CONFIG = 2  # argparse's own exit code for bad usage


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_BAD_CONFIG, f"{self.prog}: error: {message}\n")


# (flag, dotted config key, argparse kwargs, help). `store_true` flags set the value shown.
_FLAGS: list[tuple[str, str, dict[str, Any], str]] = [
    ("--model-path", "model.path", {},
     ("model: a name (smollm2-135m-instruct), a .gguf file, a local HF folder, or "
      "`embedded:tiny-llama`")),
    ("--dtype", "model.dtype", {"choices": DTYPES}, "weight and KV dtype"),
    ("--device", "model.device", {"choices": DEVICES}, "where the model and L1 live"),
    ("--host", "server.host", {}, "address to bind (default 127.0.0.1)"),
    ("--port", "server.port", {"type": int}, "TCP port (0 = any free port)"),
    ("--admin-api-key", "server.admin_api_key", {},
     ("bearer token for /admin routes, or HICACHE_ADMIN_API_KEY (without one they answer "
      "loopback clients only)")),
    ("--api-key", "server.api_key", {},
     ("bearer token of the inference routes, as vLLM's (or HICACHE_API_KEY); health and "
      "metrics stay open")),
    ("--api-keys-file", "server.api_keys_file", {},
     ("JSON object of tenant name to key; each tenant's cached prefixes are its own in "
      "every tier")),
    ("--served-model-name", "server.served_model_name", {},
     ("model id of OpenAI responses and /v1/models (default: --model-path as given; for "
      "the embedded model its local folder)")),
    ("--schedule-policy", "server.schedule_policy", {"choices": SCHEDULE_POLICIES},
     ("order of the waiting requests: lpm (longest cached prefix first), fcfs, random, "
      "dfs-weight (requests sharing a prefix back to back)")),
    ("--max-queued-requests", "server.max_queued_requests", {"type": int},
     ("requests handed in and not yet admitted past which a new one is answered 429 "
      "with Retry-After (default 1024)")),
    ("--stream-write-timeout", "server.stream_write_timeout_s", {"type": float},
     ("seconds a stream's write may wait for its reader before the reader is dropped and "
      "its request aborted (default 30)")),
    ("--max-prompt-logprobs", "server.max_prompt_logprobs", {"type": int},
     ("prompt-logprob entries a request may ask for: prompt positions x (top entries + 1) "
      "x n (default 262144)")),
    ("--disable-radix-cache", "cache.enable_radix_cache", {"action": "store_const",
                                                           "const": False},
     "recompute every prompt (no prefix reuse)"),
    ("--enable-hierarchical-cache", "cache.hierarchical", {"action": "store_const",
                                                           "const": True},
     "add the L2 host tier (and L3 storage when a backend is set) below L1"),
    ("--page-size", "cache.page_size", {"type": int}, "tokens per KV page"),
    ("--radix-eviction-policy", "cache.eviction_policy", {"choices": EVICTION_POLICIES},
     ("which unlocked prefix leaves the cache first: lru, lfu, priority (lowest request "
     "priority, then LRU)")),
    ("--enable-session-radix-cache", "cache.session_retention",
     {"action": "store_const", "const": True},
     "evict the prefixes of live sessions (`session_id`) after all others"),
    ("--max-total-tokens", "cache.max_total_tokens", {"type": int},
     "L1 capacity in tokens (default: sized from free memory)"),
    ("--kv-cache-memory-bytes", "cache.kv_cache_memory_bytes", {"type": int},
     "L1 capacity in bytes of KV, as vLLM's flag (instead of --max-total-tokens)"),
    ("--hicache-ratio", "host.ratio", {"type": float}, "L2 size as a multiple of L1"),
    ("--hicache-size", "host.size_gb", {"type": float}, "L2 size in GB (overrides the ratio)"),
    ("--hicache-write-policy", "host.write_policy", {"choices": WRITE_POLICIES},
     "when L1 pages are copied to L2"),
    ("--hicache-io-backend", "host.io_backend", {"choices": IO_BACKENDS},
     "kernel: CUDA gather/scatter kernels; direct: torch copies"),
    ("--hicache-mem-layout", "host.mem_layout", {"choices": MEM_LAYOUTS}, "L2 memory layout"),
    ("--hicache-storage-backend", "storage.backend", {"choices": STORAGE_BACKENDS},
     "L3 backend"),
    ("--hicache-storage-prefetch-policy", "storage.prefetch_policy",
     {"choices": PREFETCH_POLICIES}, "how long admission waits for an L3 prefetch"),
]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hicache-server", description=(
        "Serve an LLM with a hierarchical KV cache (GPU, host memory, disk). Flags override "
        "the YAML file given with --config, which overrides the built-in defaults."))
    p.add_argument("--config", help="YAML tier configuration (see configs/default.yaml)")
    for flag, key, kwargs, help_text in _FLAGS:
        p.add_argument(flag, dest=key, default=None, help=f"{help_text} [{key}]", **kwargs)
    p.add_argument("--hicache-storage-backend-extra-config", dest="extra_config",
                   help="JSON object merged into the chosen backend's section, e.g. "
                        "'{\"path\": \"/data/lmdb\"}'; for lmdb+redis one object per "
                        "section: '{\"lmdb\": {...}, \"redis\": {...}}'")
    p.add_argument("--kv-events-config", dest="kv_events_config",
                   help="KV cache events as vLLM's flag takes them, a JSON object of the "
                        "`events:` keys, e.g. '{\"publisher\": \"zmq\", \"endpoint\": "
                        "\"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}' [events]")
    p.add_argument("--log-level", default="info",
                   choices=("debug", "info", "warning", "error"), help="logging level")
    return p


def config_from_args(ns: argparse.Namespace) -> Config:
    """Merge parsed flags over the YAML file; raises ConfigError."""
    overrides = {key: getattr(ns, key) for _, key, _, _ in _FLAGS
                 if getattr(ns, key) is not None}
    if ns.kv_events_config:
        overrides["events"] = _parse_json_object("events", ns.kv_events_config)
    cfg = load_config(ns.config, overrides)
    if ns.extra_config:
        extra = parse_extra(ns.extra_config)
        backend = overrides.get("storage.backend", cfg.storage.backend)
        if backend == "none":
            raise ConfigError("storage.backend", "--hicache-storage-backend-extra-config "
                              "needs a storage backend (lmdb, redis or lmdb+redis)")
        cfg = load_config(ns.config, {**overrides, **extra_overrides(backend, extra)})
    return cfg


def extra_overrides(backend: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The extra config as overrides: the backend's own section, or for `lmdb+redis` (which
    reads two sections) `{"lmdb": {...}, "redis": {...}}`, each part optional."""
    if backend != TIERED_BACKEND:
        return {f"storage.{backend}": extra}
    for key, value in extra.items():
        if key not in TIERED_PARTS or not isinstance(value, dict):
            raise ConfigError(f"storage.extra_config.{key}", f"{TIERED_BACKEND} takes "
                              f'{{"lmdb": {{...}}, "redis": {{...}}}}, got {key!r}: {value!r}')
    return {f"storage.{key}": value for key, value in extra.items()}


def parse_extra(text: str) -> dict[str, Any]:
    return _parse_json_object("storage.extra_config", text)


def _parse_json_object(key: str, text: str) -> dict[str, Any]:
    """A flag's JSON object; ConfigError naming `key` when it is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(key, f"not valid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(value, dict):
        raise ConfigError(key, f"expected a JSON object, got {type(value).__name__}")
    return value


def parse_config(argv: Sequence[str]) -> tuple[Config, argparse.Namespace]:
    """Parse flags into a Config; on a bad flag or value print it and exit with code 2."""
    parser = build_parser()
    ns = parser.parse_args(list(argv))
    try:
        return config_from_args(ns), ns
    except ConfigError as e:
        parser.exit(EXIT_BAD_CONFIG, f"hicache-server: config error: {e}\n")
