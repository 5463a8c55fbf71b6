"""L3 attach and detach on a running engine (SGLang's `/hicache/storage-backend` routes).

Every method runs on the scheduler thread between steps (`Engine._call`), and only when no
request runs or waits: a busy engine refuses at once (StorageChangeRefused) rather than
holding the caller until traffic stops, as SGLang does. The attachment owns the running
config from then on: each change replaces `config` (never mutates it), and the engine reads
it back; other threads read whichever whole Config they find. What an attach may open is
bounded by the start-up configuration (`attach_targets`: LMDB under `storage.attach_roots`,
Redis at the start-up endpoint only), checked before anything is opened or created.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from typing import Any

from hicache.config import ConfigError
from hicache.config_storage import STORAGE_BACKENDS, TIERED_BACKEND, TIERED_PARTS, StorageConfig
from hicache.door import CacheDoor
from hicache.model_kv import ModelKV
from hicache_server.args import extra_overrides, parse_extra
from hicache_server.attach_targets import AttachTargets, StorageChangeRefused, redact_urls
from hicache_server.config import Config, apply_overrides, config_to_dict

logger = logging.getLogger(__name__)


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _extra_object(extra: object) -> dict[str, Any]:
    """An extra config as sent: an object, its JSON text (SGLang sends text), or nothing."""
    if extra is None or extra == "":
        return {}
    if isinstance(extra, str):
        return parse_extra(extra)
    if not isinstance(extra, dict):
        raise ConfigError("storage.extra_config", f"expected a JSON object (or its JSON "
                          f"text), got {type(extra).__name__}")
    return extra


def _sections(overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`extra_overrides`' answer by part name: {"storage.lmdb": {...}} -> {"lmdb": {...}}."""
    return {key.removeprefix("storage."): value for key, value in overrides.items()
            if isinstance(value, dict)}


def _open_failure(error: OSError | ValueError, config: Config) -> str:
    """Why a store did not open, as a client may read it: the OS's reason alone when there
    is one (not the path it resolved), else the message with the LMDB path as configured
    (never `~`-expanded) and no password in any URL."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = str(error)
    lmdb = config.storage.lmdb
    expanded = str(lmdb.resolved_path)
    if expanded != lmdb.path:
        text = text.replace(expanded, lmdb.path)
    return redact_urls(text)


class StorageAttachment:
    """Attach, detach and describe L3 over one cache (scheduler thread only). `pending`
    tells the requests running and waiting (a change needs none)."""

    def __init__(self, config: Config, cache: CacheDoor, model: ModelKV,
                 pending: Callable[[], tuple[int, int]]) -> None:
        self.config = config
        self.cache = cache
        self.model = model
        self.pending = pending
        # The storage section the engine was started with: every attach merges over it,
        # every detach returns to it (backend "none"); it also bounds what an attach may
        # open (`AttachTargets`).
        self._launch_storage = config.storage
        self._targets = AttachTargets(config.storage)

    def attach(self, backend: str, extra_config: dict | str | None,
                    prefetch_policy: str | None, write_policy: str | None) -> dict:
        if "host" not in self.cache.admin.tiers():
            raise StorageChangeRefused("L3 needs the host tier (L2), which this server was "
                                       "started without: restart it with "
                                       "--enable-hierarchical-cache")
        config = self._config_with(backend, extra_config, prefetch_policy, write_policy)
        self._require_idle("attach")
        if "storage" in self.cache.admin.tiers():
            return self._reattach(config, prefetch_policy is not None)
        try:
            self.cache.admin.attach_storage(config, self.model)
        except (OSError, ValueError) as e:
            logger.error("attaching L3 (%s) failed; serving without L3: %s", backend,
                         redact_urls(str(e)))
            raise StorageChangeRefused(f"could not open L3 ({backend}): "
                                       f"{_open_failure(e, config)}; the server goes on "
                                       "without L3") from None
        self.config = config
        logger.info("L3 (%s) attached at runtime", backend)
        return {"success": True, "message": f"L3 ({backend}) attached",
                **self.view()}

    def _reattach(self, config: Config, new_policy: bool) -> dict:
        """An attach while L3 is attached: the same backend and section update the
        prefetch policy (`new_policy`: one was given); anything else is refused."""
        now, new = self.config.storage, config.storage
        if not new_policy:
            new = dataclasses.replace(new, prefetch_policy=now.prefetch_policy)
            config = dataclasses.replace(config, storage=new)
        if dataclasses.replace(new, prefetch_policy=now.prefetch_policy) != now:
            raise StorageChangeRefused(f"L3 is attached already ({now.backend}: "
                                       f"{json.dumps(self._section(self.config))}); detach "
                                       f"it first, then attach {new.backend}")
        self.cache.l3.set_policy(new.prefetch_policy)
        self.config = config
        return {"success": True,
                "message": f"L3 ({now.backend}) was attached already with this "
                           f"configuration; prefetch policy {new.prefetch_policy}",
                **self.view()}

    def detach(self) -> dict:
        self._require_idle("detach")
        name, launch = self.config.storage.backend, self._launch()
        try:
            detached = self.cache.admin.detach_storage()
        finally:  # the stack has dropped its tier even if closing it failed
            self.config = dataclasses.replace(
                self.config, storage=dataclasses.replace(launch, backend="none"))
        if detached:
            logger.info("L3 (%s) detached at runtime", name)
        message = (f"L3 ({name}) detached; its pages stay in the store" if detached
                   else "no L3 was attached; nothing changed")
        return {"success": True, "message": message, **self.view()}

    def _config_with(self, backend: str, extra_config: dict | str | None,
                        prefetch_policy: str | None, write_policy: str | None) -> Config:
        """The config with `backend` attached, validated; no side effects."""
        allowed = [b for b in STORAGE_BACKENDS if b != "none"]
        if not isinstance(backend, str) or backend not in allowed:
            hint = "; to detach, use detach_storage" if backend == "none" else ""
            raise StorageChangeRefused(f"storage.backend: {backend!r} is not one of "
                                       f"{', '.join(allowed)}{hint}")
        current = self.config.host.write_policy
        if write_policy is not None and write_policy != current:
            raise StorageChangeRefused(
                f"host.write_policy: {write_policy!r} asks for a change the running server "
                f"cannot make (the L2 write policy is fixed at start, now {current!r}); "
                f"restart with --hicache-write-policy {write_policy}, or leave it out")
        overrides: dict[str, object] = {"storage.backend": backend}
        if prefetch_policy is not None:
            overrides["storage.prefetch_policy"] = prefetch_policy
        base = dataclasses.replace(self.config, storage=self._launch())
        try:
            sent = extra_overrides(backend, _extra_object(extra_config))
            config = apply_overrides(base, {**overrides, **sent})
        except ConfigError as e:  # it may quote a URL the request sent, password and all
            raise StorageChangeRefused(redact_urls(str(e))) from None
        self._targets.check(backend, _sections(sent), config.storage)
        return config

    def _launch(self) -> StorageConfig:
        """The launch storage section."""
        return self._launch_storage

    def _require_idle(self, action: str) -> None:
        """Scheduler thread: refuse unless no request runs or waits."""
        running, waiting = self.pending()
        if running or waiting:
            raise StorageChangeRefused(
                f"cannot {action} L3: the server is not idle: "
                f"{_plural(running, 'request')} running, {waiting} waiting; retry once they "
                "have finished (drain the traffic first)")

    def view(self) -> dict:
        attached = "storage" in self.cache.admin.tiers()
        section = self._section(self.config) if attached else None
        s = self.config.storage
        return {"hicache_storage_backend": s.backend if attached else None,
                "hicache_storage_backend_extra_config":
                    None if section is None else json.dumps(section),
                "hicache_storage_prefetch_policy": s.prefetch_policy if attached else None,
                "hicache_write_policy": self.config.host.write_policy
                if "host" in self.cache.admin.tiers() else None,
                "backend_config": section}

    @staticmethod
    def _section(config: Config) -> dict:
        """The chosen backend's section(s) as plain data, the Redis password redacted."""
        storage = config_to_dict(config, redact=True)["storage"]
        if config.storage.backend == TIERED_BACKEND:
            return {part: storage[part] for part in TIERED_PARTS}
        return storage[config.storage.backend]
