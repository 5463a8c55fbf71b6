"""hicache.config: documented defaults, shipped YAML files, precedence, immutability, every error."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from hicache.config import CacheConfig, ConfigError, HostConfig
from hicache.config_storage import LmdbConfig, RedisConfig, StorageConfig, redact_url
from hicache_server.config import (
    Config,
    ModelConfig,
    ServerConfig,
    apply_overrides,
    config_to_dict,
    load_config,
)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

# configs/default.yaml and docs/configuration.md, copied by hand: a change to a default must change both.
DESIGN_DEFAULTS: dict[str, Any] = {
    "model": {"path": "embedded:tiny-llama", "dtype": "auto", "device": "auto"},
    "server": {"host": "127.0.0.1", "port": 30000, "admin_api_key": None, "api_key": None,
               "api_keys_file": None,
               "served_model_name": None, "schedule_policy": "lpm",
               "max_queued_requests": 1024, "stream_write_timeout_s": 30.0,
               "max_prompt_logprobs": 262144},
    "cache": {"enable_radix_cache": True, "hierarchical": False, "page_size": 16,
              "max_total_tokens": None, "kv_cache_memory_bytes": None,
              "eviction_policy": "lru",
              "session_retention": False, "session_timeout_s": 600.0,
              "max_pinned_tokens": None},
    "host": {"ratio": 2.0, "size_gb": None, "write_policy": "write_through",
             "io_backend": "kernel", "mem_layout": "page_first", "write_through_threshold": 2},
    "storage": {
        "backend": "none", "prefetch_policy": "timeout", "prefetch_threshold": 256,
        "prefetch_timeout_base": 2.0, "prefetch_timeout_per_ki_token": 0.1,
        "prefetch_timeout_max": 30.0, "fetch_workers": 4, "cost_model": True,
        "overlap": True,
        "prefill_warmup_s": 1.0,
        "lmdb": {"path": "~/.cache/hicache/lmdb", "max_size_gb": 32, "prefault_gb": 0.0},
        "redis": {"url": "redis://127.0.0.1:6379/0", "cluster": False,
                  "key_prefix": "hicache:", "ttl_seconds": None},
        "throttle": {"bandwidth_mb_s": None, "latency_ms": 0.0},
        "secret_file": None, "encrypt": False, "attach_roots": (),
    },
    "events": {"publisher": None, "enable_kv_cache_events": None,
               "endpoint": "tcp://*:5557", "replay_endpoint": None, "topic": "",
               "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000},
}


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def raises(overrides: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    return info.value


def leaf_keys(d: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in d.items():
        path = f"{prefix}{key}"
        out += leaf_keys(value, path + ".") if isinstance(value, dict) else [path]
    return out


# --- defaults and shipped files ------------------------------------------------------------


def test_defaults_equal_design_schema() -> None:
    assert config_to_dict(Config()) == DESIGN_DEFAULTS
    assert load_config() == Config()
    assert isinstance(Config().storage.lmdb.max_size_gb, float)


def test_default_yaml_is_design_defaults_except_four_keys() -> None:
    expected = apply_overrides(Config(), {
        "model.path": "smollm2-135m-instruct",
        "cache.hierarchical": True,
        "storage.backend": "lmdb",
        "storage.lmdb.path": "./.hicache/lmdb",
    })
    assert load_config(CONFIGS / "default.yaml") == expected


def test_default_yaml_documents_every_key() -> None:
    """Every leaf key has a comment on its own line or on the line(s) just above it."""
    documented: dict[str, bool] = {}
    stack: list[tuple[int, str]] = []
    previous = ""
    for line in (CONFIGS / "default.yaml").read_text().splitlines():
        text = line.strip()
        if text and not text.startswith("#"):
            indent = len(line) - len(line.lstrip())
            key = text.split(":", 1)[0]
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = ".".join([k for _, k in stack] + [key])
            documented[path] = " #" in line or previous.startswith("#")
            stack.append((indent, key))
        previous = text or previous
    keys = leaf_keys(config_to_dict(Config()))
    assert [k for k in keys if not documented.get(k)] == []


SHIPPED = sorted(CONFIGS.glob("*.yaml"))


def test_shipped_configs_exist() -> None:
    names = {p.name for p in SHIPPED}
    assert {"default.yaml", "cpu-small.yaml", "llama3-8b-h200.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_yaml_loads_and_round_trips(path: Path) -> None:
    cfg = load_config(path)
    assert Config.from_dict(config_to_dict(cfg)) == cfg


def test_cpu_small_yaml() -> None:
    cfg = load_config(CONFIGS / "cpu-small.yaml")
    assert (cfg.model.is_embedded, cfg.model.device) == (True, "cpu")
    assert (cfg.cache.page_size, cfg.cache.max_total_tokens) == (16, 4096)
    assert (cfg.host.ratio, cfg.storage.backend, cfg.storage.lmdb.max_size_gb) == (4.0, "lmdb", 2)


def test_llama3_8b_h200_yaml() -> None:
    cfg = load_config(CONFIGS / "llama3-8b-h200.yaml")
    assert cfg.model == ModelConfig("/models/Meta-Llama-3-8B-Instruct", "bfloat16", "cuda")
    assert (cfg.cache.page_size, cfg.host.size_gb) == (64, 200.0)
    assert cfg.storage.lmdb == LmdbConfig("/var/cache/hicache/lmdb", 1000.0)
    assert cfg.storage.prefetch_policy == "timeout"


# --- precedence --------------------------------------------------------------------------


YAML = """
cache:
  page_size: 32
  eviction_policy: lfu
storage:
  backend: lmdb
  lmdb:
    path: /data/l3
    max_size_gb: 8
"""


def test_yaml_over_defaults_keeps_unset_keys(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, YAML))
    assert (cfg.cache.page_size, cfg.cache.eviction_policy) == (32, "lfu")
    assert cfg.cache.enable_radix_cache is True and cfg.cache.max_total_tokens is None
    assert cfg.storage.lmdb == LmdbConfig("/data/l3", 8.0)
    assert cfg.storage.prefetch_threshold == 256 and cfg.host == HostConfig()


@pytest.mark.parametrize("overrides", [
    {"cache": {"page_size": 64}, "storage": {"lmdb": {"path": "/fast"}}},
    {"cache.page_size": 64, "storage.lmdb.path": "/fast"},
    {"cache": {"page_size": 64}, "storage.lmdb": {"path": "/fast"}},
    {"storage": {"lmdb.path": "/fast"}, "cache.page_size": 64},
])
def test_overrides_over_yaml_nested_or_dotted(tmp_path: Path, overrides: dict[str, Any]) -> None:
    cfg = load_config(write(tmp_path, YAML), overrides)
    assert cfg.cache.page_size == 64
    assert cfg.cache.eviction_policy == "lfu"  # same section, from the YAML
    assert cfg.storage.lmdb == LmdbConfig("/fast", 8.0)  # max_size_gb from the YAML
    assert cfg.storage.backend == "lmdb"


def test_overrides_without_file() -> None:
    cfg = load_config(overrides={"server.port": 0, "host": {"ratio": 3}})
    assert (cfg.server.port, cfg.server.host) == (0, "127.0.0.1")
    assert cfg.host.ratio == 3.0 and isinstance(cfg.host.ratio, float)


@pytest.mark.parametrize("text", ["", "# only a comment\n", "\n\n"])
def test_empty_file_is_all_defaults(tmp_path: Path, text: str) -> None:
    assert load_config(write(tmp_path, text)) == Config()


def test_apply_overrides_returns_new_validated_config() -> None:
    base = load_config(CONFIGS / "cpu-small.yaml")
    cfg = apply_overrides(base, {"cache.page_size": 32, "storage": {"lmdb": {"max_size_gb": 4}}})
    assert (cfg.cache.page_size, cfg.cache.max_total_tokens) == (32, 4096)
    assert cfg.storage.lmdb == LmdbConfig("./.hicache/lmdb-cpu-small", 4.0)
    assert base.cache.page_size == 16  # the original is untouched
    with pytest.raises(ConfigError, match=r"^cache.max_total_tokens: must be >= page_size"):
        apply_overrides(base, {"cache.page_size": 8192})


# --- immutability and replace ------------------------------------------------------------


def test_frozen() -> None:
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cache.page_size = 32  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.storage = StorageConfig()  # type: ignore[misc]
    assert cfg.cache.page_size == 16


def test_replace_revalidates() -> None:
    cache = dataclasses.replace(CacheConfig(), page_size=64)
    assert cache.page_size == 64
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(cache, page_size=0)
    assert info.value.key == "cache.page_size"
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(Config().storage.lmdb, max_size_gb=-1)
    assert str(info.value) == "storage.lmdb.max_size_gb: must be > 0, got -1"


# --- derived values ----------------------------------------------------------------------


def test_prefetch_timeout() -> None:
    storage = StorageConfig()
    assert storage.prefetch_timeout(0) == 2.0
    assert storage.prefetch_timeout(10 * 1024) == pytest.approx(3.0)
    assert storage.prefetch_timeout(10**9) == 30.0


def test_storage_enabled_and_backend_config() -> None:
    assert not StorageConfig().enabled and StorageConfig().backend_config is None
    lmdb = StorageConfig(backend="lmdb")
    assert lmdb.enabled and lmdb.backend_config == LmdbConfig()
    assert StorageConfig(backend="redis").backend_config == RedisConfig()
    assert StorageConfig(backend="lmdb+redis").backend_config == {"lmdb": LmdbConfig(),
                                                                  "redis": RedisConfig()}


def test_paths_and_sizes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("HICACHE_HOME", "/srv/hc")
    assert LmdbConfig().resolved_path == tmp_path / ".cache/hicache/lmdb"
    assert LmdbConfig(path="$HICACHE_HOME/l3").resolved_path == Path("/srv/hc/l3")
    assert LmdbConfig(max_size_gb=1.5).max_size_bytes == 1_500_000_000
    assert HostConfig().size_bytes is None and HostConfig(size_gb=2).size_bytes == 2 * 10**9
    assert ModelConfig().is_embedded and not ModelConfig(path="/models/x").is_embedded


# Server keys with an SGLang flag: the default, a value set by override, one in the YAML, one
# on the command line, and one the flag refuses.
@pytest.mark.parametrize(("key", "flag", "default", "overridden", "in_yaml", "flagged",
                          "refused"), [
    ("served_model_name", "--served-model-name", None, "by-override", "from-yaml",
     "org/llama-3", ""),
    ("schedule_policy", "--schedule-policy", "lpm", "dfs-weight", "random", "fcfs", "sjf"),
])
def test_server_flag_over_yaml(tmp_path: Path, key: str, flag: str, default: str | None,
                               overridden: str, in_yaml: str, flagged: str,
                               refused: str) -> None:
    """`--served-model-name` (SGLang's and vLLM's flag) and `--schedule-policy` set their
    server key over the YAML; left out, it keeps its default (a null name is derived from
    the model); a refused value exits as argparse does, with 2."""
    from hicache_server.args import parse_config

    yaml = write(tmp_path, f"server:\n  {key}: {in_yaml}\n")
    assert getattr(load_config().server, key) == default
    assert getattr(parse_config([])[0].server, key) == default
    assert getattr(load_config(None, {f"server.{key}": overridden}).server, key) == overridden
    assert getattr(parse_config(["--config", str(yaml)])[0].server, key) == in_yaml
    cfg, _ = parse_config(["--config", str(yaml), flag, flagged])
    assert getattr(cfg.server, key) == flagged
    with pytest.raises(SystemExit) as exit_info:
        parse_config([flag, refused])
    assert exit_info.value.code == 2


@pytest.mark.parametrize(("flag", "key", "value"), [
    ("--max-queued-requests", "max_queued_requests", 8),
    ("--stream-write-timeout", "stream_write_timeout_s", 2.5),
    ("--max-prompt-logprobs", "max_prompt_logprobs", 4096),
])
def test_bound_flags_over_yaml(tmp_path: Path, flag: str, key: str, value: float) -> None:
    """The bounds' flags (SGLang's --max-queued-requests, ours beside it) set their server
    key over the YAML; a value the key refuses exits with 2, as a bad flag does."""
    from hicache_server.args import parse_config

    yaml = write(tmp_path, f"server:\n  {key}: {value * 2}\n")
    assert getattr(parse_config(["--config", str(yaml)])[0].server, key) == value * 2
    cfg, _ = parse_config(["--config", str(yaml), flag, str(value)])
    assert getattr(cfg.server, key) == value
    for refused in ("0", "many"):
        with pytest.raises(SystemExit) as exit_info:
            parse_config([flag, refused])
        assert exit_info.value.code == 2


def test_config_to_dict_redacts_secrets_on_request() -> None:
    cfg = load_config(overrides={"server.admin_api_key": "s3cret",
                                 "storage.redis.url": "redis://user:pw@db:6379/1"})
    assert config_to_dict(cfg)["server"]["admin_api_key"] == "s3cret"
    shown = config_to_dict(cfg, redact=True)
    assert shown["server"]["admin_api_key"] == "***"
    assert shown["storage"]["redis"]["url"] == "redis://user:***@db:6379/1"
    assert config_to_dict(Config(), redact=True) == DESIGN_DEFAULTS  # nothing to hide


# --- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "key", "message"), [
    ({"cache.page_sise": 1}, "cache.page_sise",
     "cache.page_sise: unknown key; did you mean 'page_size'?"),
    ({"cache.zzz": 1}, "cache.zzz", "cache.zzz: unknown key"),
    ({"storage.lmdb.pth": "/x"}, "storage.lmdb.pth",
     "storage.lmdb.pth: unknown key; did you mean 'path'?"),
    ({"cahce": {}}, "cahce", "cahce: unknown key; did you mean 'cache'?"),
    ({"telemetry": {}}, "telemetry", "telemetry: unknown key"),
])
def test_unknown_keys(overrides: dict[str, Any], key: str, message: str) -> None:
    err = raises(overrides)
    assert (err.key, str(err)) == (key, message)


@pytest.mark.parametrize(("key", "allowed"), [
    ("model.dtype", "auto, float32, bfloat16, float16"),
    ("model.device", "auto, cuda, cpu"),
    ("cache.eviction_policy", "lru, lfu, priority"),
    ("host.write_policy", "write_through, write_through_selective, write_back"),
    ("host.io_backend", "kernel, direct"),
    ("host.mem_layout", "page_first, layer_first"),
    ("storage.backend", "none, lmdb, redis, lmdb+redis"),
    ("storage.prefetch_policy", "best_effort, wait_complete, timeout"),
    ("server.schedule_policy", "lpm, fcfs, random, dfs-weight"),
])
def test_bad_enum_value(key: str, allowed: str) -> None:
    err = raises({key: "eventualy"})
    assert (err.key, str(err)) == (key, f"{key}: 'eventualy' is not one of {allowed}")


@pytest.mark.parametrize(("key", "value", "message"), [
    ("cache.page_size", "16", "expected an integer, got '16' (str)"),
    ("cache.page_size", True, "expected an integer, got True (bool)"),
    ("cache.page_size", 16.0, "expected an integer, got 16.0 (float)"),
    ("cache.max_total_tokens", 4096.5, "expected an integer or null, got 4096.5 (float)"),
    ("host.ratio", "two", "expected a number, got 'two' (str)"),
    ("host.ratio", False, "expected a number, got False (bool)"),
    ("host.size_gb", [1], "expected a number or null, got [1] (list)"),
    ("host.ratio", float("inf"), "must be a finite number, got inf"),
    ("storage.prefetch_timeout_max", float("nan"), "must be a finite number, got nan"),
    ("cache.hierarchical", "yes", "expected a boolean, got 'yes' (str)"),
    ("storage.redis.cluster", 1, "expected a boolean, got 1 (int)"),
    ("model.path", 5, "expected a string, got 5 (int)"),
    ("server.admin_api_key", 1234, "expected a string or null, got 1234 (int)"),
    ("server.served_model_name", ["m"], "expected a string or null, got ['m'] (list)"),
    ("storage", [1, 2], "expected a mapping, got list"),
    ("storage.lmdb", "/data", "expected a mapping, got str"),
    ("cache", 16, "expected a mapping, got int"),
])
def test_wrong_type(key: str, value: object, message: str) -> None:
    err = raises({key: value})
    assert (err.key, str(err)) == (key, f"{key}: {message}")


@pytest.mark.parametrize(("key", "message"), [
    ("cache.page_size", "expected an integer, got null"),
    ("host.ratio", "expected a number, got null"),
    ("model.path", "expected a string, got null"),
    ("cache.enable_radix_cache", "expected a boolean, got null"),
    ("storage.lmdb.max_size_gb", "expected a number, got null"),
    ("storage", "expected a mapping, got null"),
])
def test_null_where_not_allowed(key: str, message: str) -> None:
    err = raises({key: None})
    assert (err.key, str(err)) == (key, f"{key}: {message}")


def test_null_where_allowed() -> None:
    nulls = {"server.admin_api_key": None, "server.served_model_name": None,
             "cache.max_total_tokens": None,
             "host.size_gb": None, "storage.redis.ttl_seconds": None}
    assert load_config(overrides=nulls) == Config()


@pytest.mark.parametrize(("key", "bad", "message", "good"), [
    ("cache.page_size", 0, "must be >= 1, got 0", 1),
    ("cache.max_total_tokens", 15, "must be >= page_size (16), got 15", 16),
    ("server.port", -1, "must be between 0 and 65535, got -1", 0),
    ("server.port", 65536, "must be between 0 and 65535, got 65536", 65535),
    ("host.ratio", 0, "must be > 0, got 0.0", 0.5),
    ("host.ratio", -1, "must be > 0, got -1.0", 16),
    ("host.size_gb", 0, "must be > 0, got 0.0", 0.5),
    ("host.write_through_threshold", 0, "must be >= 1, got 0", 1),
    ("storage.prefetch_threshold", -1, "must be >= 0, got -1", 0),
    ("storage.prefetch_timeout_base", -0.5, "must be >= 0, got -0.5", 0),
    ("storage.prefetch_timeout_base", 31, "must be <= prefetch_timeout_max (30.0), got 31.0", 30),
    ("storage.prefetch_timeout_per_ki_token", -1, "must be >= 0, got -1.0", 0),
    ("storage.prefetch_timeout_max", -1, "must be >= 0, got -1.0", 2.0),
    ("storage.lmdb.max_size_gb", 0, "must be > 0, got 0.0", 0.001),
    ("storage.redis.ttl_seconds", 0, "must be >= 1, got 0", 1),
    ("model.path", "", "must be a non-empty string, got ''", "/models/m"),
    ("server.host", " ", "must be a non-empty string, got ' '", "0.0.0.0"),
    ("server.admin_api_key", "", "must be a non-empty string, got ''", "k"),
    ("server.served_model_name", " ", "must be a non-empty string, got ' '", "my-model"),
    ("server.max_queued_requests", 0, "must be >= 1, got 0", 1),
    ("server.stream_write_timeout_s", 0, "must be > 0, got 0.0", 0.01),
    ("server.max_prompt_logprobs", 0, "must be >= 1, got 0", 1),
    ("storage.lmdb.path", "", "must be a non-empty string, got ''", "l3"),
    ("storage.redis.url", "", "must be a non-empty string, got ''", "unix:///tmp/redis.sock"),
    ("storage.redis.url", "127.0.0.1:6379",
     "'127.0.0.1:6379' must start with one of redis://, rediss://, unix://",
     "rediss://cache.internal:6380/0"),
])
def test_out_of_range(key: str, bad: object, message: str, good: object) -> None:
    err = raises({key: bad})
    assert (err.key, str(err)) == (key, f"{key}: {message}")
    value = config_to_dict(load_config(overrides={key: good}))  # the boundary is allowed
    for part in key.split("."):
        value = value[part]
    assert value == good


def test_max_total_tokens_follows_page_size() -> None:
    assert load_config(overrides={"cache": {"page_size": 4, "max_total_tokens": 4}})
    err = raises({"cache": {"page_size": 64, "max_total_tokens": 32}})
    assert str(err) == "cache.max_total_tokens: must be >= page_size (64), got 32"


def test_sections_built_in_python_name_their_own_path() -> None:
    cases: list[tuple[Any, str, str]] = [
        (lambda: CacheConfig(page_size=0), "cache.page_size", "must be >= 1, got 0"),
        (lambda: HostConfig(ratio="two"), "host.ratio", "expected a number, got 'two' (str)"),
        (lambda: ServerConfig(port=70000), "server.port",
         "must be between 0 and 65535, got 70000"),
        (lambda: LmdbConfig(max_size_gb=0), "storage.lmdb.max_size_gb", "must be > 0, got 0"),
        (lambda: RedisConfig(ttl_seconds=0), "storage.redis.ttl_seconds", "must be >= 1, got 0"),
        (lambda: StorageConfig(lmdb={"path": "/x"}), "storage.lmdb",
         "expected a LmdbConfig, got {'path': '/x'} (dict)"),
        (lambda: Config(cache=CacheConfig), "cache",
         "expected a CacheConfig, got <class 'hicache.config.CacheConfig'> (type)"),
    ]
    for build, key, problem in cases:
        with pytest.raises(ConfigError) as info:
            build()
        assert (info.value.key, str(info.value)) == (key, f"{key}: {problem}")
        assert info.value.problem == problem and isinstance(info.value, ValueError)


def test_error_from_yaml_file_names_key(tmp_path: Path) -> None:
    path = write(tmp_path, "host:\n  write_policy: write_around\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == ("host.write_policy: 'write_around' is not one of "
                               "write_through, write_through_selective, write_back")


# --- file errors -------------------------------------------------------------------------


def file_error(path: Path) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == "config"
    return info.value


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    assert str(file_error(path)) == f"config: cannot read {path}: No such file or directory"


def test_unreadable_file(tmp_path: Path) -> None:
    assert str(file_error(tmp_path)) == f"config: cannot read {tmp_path}: Is a directory"
    binary = tmp_path / "b.yaml"
    binary.write_bytes(b"cache:\n  page_size: \xff\xfe\n")
    assert str(file_error(binary)).startswith(f"config: cannot read {binary}: 'utf-8' codec")


@pytest.mark.parametrize(("text", "problem"), [
    ("cache: [1, 2", "expected ',' or ']', but got '<stream end>' (line 1, column 13)"),
    ("cache:\n  page_size: 1\n page: 2",
     "expected <block end>, but found '<block mapping start>' (line 3, column 2)"),
    ("a: b: c", "mapping values are not allowed here (line 1, column 5)"),
])
def test_invalid_yaml(tmp_path: Path, text: str, problem: str) -> None:
    path = write(tmp_path, text)
    assert str(file_error(path)) == f"config: invalid YAML in {path}: {problem}"


@pytest.mark.parametrize(("text", "kind"), [("- 1\n- 2\n", "list"), ("hello\n", "str"),
                                            ("42\n", "int")])
def test_top_level_not_a_mapping(tmp_path: Path, text: str, kind: str) -> None:
    path = write(tmp_path, text)
    assert str(file_error(path)) == (
        f"config: {path}: expected a mapping at the top level, got {kind}")


def test_from_dict_rejects_non_mapping() -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_dict([])  # type: ignore[arg-type]
    assert (info.value.key, str(info.value)) == ("config", "config: expected a mapping, got list")


def test_kv_cache_memory_bytes_is_vllms_flag() -> None:
    from hicache_server.args import parse_config

    cfg, _ = parse_config(["--kv-cache-memory-bytes", "1048576"])
    assert (cfg.cache.kv_cache_memory_bytes, cfg.cache.max_total_tokens) == (1048576, None)
    err = raises({"cache.kv_cache_memory_bytes": 4096, "cache.max_total_tokens": 4096})
    assert err.key == "cache.kv_cache_memory_bytes" and "not both" in str(err)
    assert raises({"cache.kv_cache_memory_bytes": 0}).key == "cache.kv_cache_memory_bytes"


# --- keys from the environment, lists of strings ---------------------------------------------


def test_keys_come_from_the_environment_when_not_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHE_API_KEY", "from-env")
    monkeypatch.setenv("HICACHE_ADMIN_API_KEY", "admin-from-env")
    cfg = load_config()
    assert (cfg.server.api_key, cfg.server.admin_api_key) == ("from-env", "admin-from-env")
    assert load_config(overrides={"server.api_key": "flag"}).server.api_key == "flag"
    shown = config_to_dict(cfg, redact=True)["server"]
    assert (shown["api_key"], shown["admin_api_key"]) == ("***", "***")


def test_an_empty_environment_key_is_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHE_API_KEY", "")
    assert load_config().server.api_key is None


def test_attach_roots_is_a_list_of_absolute_paths() -> None:
    cfg = load_config(overrides={"storage.attach_roots": ["/data/lmdb", "~/stores"]})
    assert cfg.storage.attach_roots == ("/data/lmdb", "~/stores")
    with pytest.raises(ConfigError, match="storage.attach_roots: each root must be an absolute"):
        load_config(overrides={"storage.attach_roots": ["relative/dir"]})
    with pytest.raises(ConfigError, match="storage.attach_roots: expected a list of strings"):
        load_config(overrides={"storage.attach_roots": "/data"})


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://user:pw@host:1/0", "redis://user:***@host:1/0"),
    ("redis://host:1/0?password=abc&db=2", "redis://host:1/0?password=***&db=2"),
    ("rediss://:p%40ss@host/0?ssl_cert_reqs=none", "rediss://:***@host/0?ssl_cert_reqs=none"),
    ("unix:///tmp/r.sock?db=0&password=x", "unix:///tmp/r.sock?db=0&password=***"),
    ("redis://host/0?Password=a&auth_token=b", "redis://host/0?Password=***&auth_token=***"),
])
def test_redact_url_hides_every_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown
