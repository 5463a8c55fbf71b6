"""The server's whole configuration file: its own sections (model, server) beside the
cache's (`hicache.config`: cache, host, storage, events), loading and validation.

Precedence: built-in defaults (the dataclass defaults) < the YAML file < overrides (the CLI
flags). Every error is a `hicache.config.ConfigError` whose message starts with the dotted
key path, then says what was wrong with the offending value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from hicache.config import (
    REDACTED,
    CacheConfig,
    EventsConfig,
    HostConfig,
    Section,
    build_section,
    merge,
    nest,
    read_yaml,
)
from hicache.config_storage import StorageConfig, redact_url

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cuda", "cpu")
# The order waiting requests are admitted in (`hicache_server.scheduler.policy`), SGLang's
# --schedule-policy names: lpm (longest cached prefix first) is its default with a cache.
SCHEDULE_POLICIES = ("lpm", "fcfs", "random", "dfs-weight")
MAX_PORT = 65535
# Requests handed in and not yet admitted (SGLang's --max-queued-requests, unbounded there):
# 16 full batches of the scheduler's 64 running requests. Past it a request is a 429: a
# queue that long already waits minutes, and each waiting request holds its prompt (up to
# the 8 MiB body limit) and an L3 prefetch.
DEFAULT_MAX_QUEUED_REQUESTS = 1024
# How long one write of a stream may wait for its reader (seconds) before the reader is
# dropped and its request aborted: the body timeout's 30 s (a client that takes no byte for
# as long as a whole body may take to arrive is gone; nginx's send_timeout, the same rule,
# is 60 s).
DEFAULT_STREAM_WRITE_TIMEOUT_S = 30.0
# Prompt-logprob entries one request may ask for: prompt positions x (top entries + 1) x n.
# 2^18 = a 128 Ki-token prompt with its top-1 (lm-eval's loglikelihood asks `echo` with
# `logprobs: 1`); ~50 MB of answer at ~200 bytes an entry (top-20 with text measured
# 4.3 KB a position in issue 55).
DEFAULT_MAX_PROMPT_LOGPROBS = 1 << 18
# server keys read from the environment when not configured
KEY_ENVIRONMENT = {"admin_api_key": "HICACHE_ADMIN_API_KEY", "api_key": "HICACHE_API_KEY"}


@dataclass(frozen=True)
class ModelConfig(Section):
    SECTION: ClassVar[str] = "model"
    path: str = "embedded:tiny-llama"  # or a model name, a .gguf file, a Hugging Face folder
    dtype: str = "auto"
    device: str = "auto"

    def _validate(self) -> None:
        self._non_empty("path")
        self._choice("dtype", DTYPES)
        self._choice("device", DEVICES)

    @property
    def is_embedded(self) -> bool:
        return self.path.startswith("embedded:")


@dataclass(frozen=True)
class ServerConfig(Section):
    SECTION: ClassVar[str] = "server"
    host: str = "127.0.0.1"
    port: int = 30000  # 0 = let the OS pick a free port
    admin_api_key: str | None = None  # None: admin routes answer loopback clients only
    # Bearer key of the inference routes (vLLM's --api-key); None: they are open
    api_key: str | None = None
    # A JSON object of tenant name to key: each tenant's prefixes are its own in every tier
    api_keys_file: str | None = None
    # The model id of every OpenAI response and of /v1/models (SGLang's and vLLM's
    # --served-model-name). None: derived from model.path (hicache_server.http.discovery).
    served_model_name: str | None = None
    schedule_policy: str = "lpm"  # the order waiting requests are admitted in
    # Past this many requests handed in and not yet admitted, a new one is a 429
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    # A stream whose reader takes nothing for this long is dropped, its request aborted
    stream_write_timeout_s: float = DEFAULT_STREAM_WRITE_TIMEOUT_S
    # Prompt positions x (top entries + 1) x n a request may ask logprobs of (else a 400)
    max_prompt_logprobs: int = DEFAULT_MAX_PROMPT_LOGPROBS

    def _validate(self) -> None:
        self._non_empty("host")
        if not 0 <= self.port <= MAX_PORT:
            self._fail("port", f"must be between 0 and {MAX_PORT}, got {self.port}")
        self._non_empty("admin_api_key")
        self._non_empty("api_key")
        self._non_empty("api_keys_file")
        self._non_empty("served_model_name")
        self._choice("schedule_policy", SCHEDULE_POLICIES)
        self._at_least("max_queued_requests", 1)
        self._at_least("stream_write_timeout_s", 0, strict=True)
        self._at_least("max_prompt_logprobs", 1)


@dataclass(frozen=True)
class Config(Section):
    SECTION: ClassVar[str] = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    host: HostConfig = field(default_factory=HostConfig)  # L2, used when cache.hierarchical
    storage: StorageConfig = field(default_factory=StorageConfig)  # L3
    events: EventsConfig = field(default_factory=EventsConfig)  # KV events for routers

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Config:
        """Build from the YAML shape; missing keys take their defaults."""
        return build_section(cls, data)


def load_config(path: str | os.PathLike[str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> Config:
    """Built-in defaults < the YAML file at `path` < `overrides` (nested or dotted keys)."""
    data = read_yaml(Path(path)) if path is not None else {}
    return keys_from_environment(build_section(Config, merge(data, nest(overrides or {}))))


def keys_from_environment(cfg: Config) -> Config:
    """Keys from the environment (so they stay out of `ps` and of the YAML) where neither the
    file nor a flag set one."""
    keys = {name: os.environ.get(env) for name, env in KEY_ENVIRONMENT.items()
            if getattr(cfg.server, name) is None and os.environ.get(env)}
    return dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, **keys)) if keys else cfg


def apply_overrides(cfg: Config, overrides: Mapping[str, Any]) -> Config:
    """A new, re-validated Config with `overrides` (nested or dotted keys) on top of `cfg`."""
    return build_section(Config, merge(config_to_dict(cfg), nest(overrides)))


def config_to_dict(cfg: Config, *, redact: bool = False) -> dict[str, Any]:
    """The YAML shape of `cfg`; `redact=True` hides the keys and the Redis password."""
    data = dataclasses.asdict(cfg)
    if redact:
        for name in KEY_ENVIRONMENT:
            if data["server"][name] is not None:
                data["server"][name] = REDACTED
        data["storage"]["redis"]["url"] = redact_url(cfg.storage.redis.url)
    return data
