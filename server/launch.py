"""`hicache-server` / `python -m hicache_server.launch`: build the engine, serve the HTTP API.

    hicache-server --config configs/default.yaml --port 30000

Exit codes: 0 after a clean shutdown (SIGINT or SIGTERM), 1 when start-up fails (the model
folder is missing, the storage backend cannot open, not enough memory, the port is taken,
the --api-keys-file cannot be read or is not a JSON object of tenant name to key),
2 for a bad flag or config value (`hicache_server.args`), 70 when the scheduler thread died (a bug,
logged with its traceback; one request's fault fails only that request and never gets
here), 130 after a second signal cut the drain short.

Shutdown: on the first SIGINT/SIGTERM /health turns 503 and new requests are refused (503);
requests in flight finish and their responses are sent; then the engine writes its pending
backups and closes the storage tier.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hicache.config import BYTES_PER_GB
from hicache_server.api_keys import ApiKeys, ApiKeysError, load_api_keys
from hicache_server.args import parse_config
from hicache_server.config import Config

# The engine, the HTTP app and torch (seconds to import) load only once the flags are known
# good, so a bad flag or --help answers at once: hence the imports inside functions below.
if TYPE_CHECKING:
    from aiohttp import web

    from hicache_server.engine import Engine

logger = logging.getLogger("hicache.server")

EXIT_OK = 0
EXIT_STARTUP_FAILED = 1
EXIT_FORCED = 130  # the shell's code for an interrupted process (128 + SIGINT)
EXIT_SCHEDULER_DIED = 70  # sysexits.h EX_SOFTWARE: an internal error; a supervisor restarts
# What a bad environment raises while the engine is built: missing files and LMDB faults
# (OSError), the host-memory check (MemoryError), unusable model folders (ValueError), torch
# without the requested device (RuntimeError), a backend's missing client library
# (ImportError). Anything else is a bug and keeps its traceback.
STARTUP_ERRORS = (OSError, MemoryError, ValueError, RuntimeError, ImportError)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# After the engine has drained, aiohttp waits at most this long (seconds) for handlers to
# finish writing their responses.
HTTP_SHUTDOWN_TIMEOUT_S = 30.0
SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# A connection that sends no complete request within this long (seconds), at its start or
# between keep-alive requests, is closed: idle and trickling clients cannot hold sockets
# forever (aiohttp's own default is an hour; uvicorn's keep-alive is 5 s, nginx's 75 s).
IDLE_CONNECTION_TIMEOUT_S = 75.0


def main(argv: Sequence[str] | None = None) -> int:
    config, ns = parse_config(sys.argv[1:] if argv is None else argv)  # exits 2 when bad
    setup_logging(ns.log_level)
    api_keys = read_api_keys(config)  # before the model loads: a bad file fails at once
    if api_keys is None:
        return EXIT_STARTUP_FAILED
    engine = build_engine(config)
    if engine is None:
        return EXIT_STARTUP_FAILED
    try:
        return asyncio.run(serve(engine, config, api_keys))
    finally:
        engine.shutdown()  # idempotent: a no-op after a graceful shutdown


def read_api_keys(config: Config) -> ApiKeys | None:
    """The inference routes' keys (`--api-key`, the tenants of `--api-keys-file`, read now),
    or None after logging in one line why they cannot be used."""
    try:
        keys = load_api_keys(config.server.api_key, config.server.api_keys_file)
    except ApiKeysError as e:
        logger.error("hicache-server cannot start: %s", e)
        return None
    tenants = len(keys.tenant_names)
    logger.info("inference routes: %s", "open to every client (no --api-key)"
                if not keys.required else "bearer key required" + (
                    f"; {tenants} tenant(s), each its own cache namespace" if tenants else ""))
    return keys


def build_engine(config: Config) -> Engine | None:
    """The engine, or None after logging in one line why it cannot start."""
    from hicache_server.engine import Engine

    try:
        return Engine(config)
    except STARTUP_ERRORS as e:
        logger.error("hicache-server cannot start: %s", e)
        return None


def setup_logging(level: str) -> None:
    """One line per record on stderr (flushed per record, so a supervisor sees it at once)."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)


async def serve(engine: Engine, config: Config, api_keys: ApiKeys | None = None) -> int:
    """Serve until SIGINT/SIGTERM, then shut down gracefully; the exit code. `api_keys`:
    those `read_api_keys` read (None: read from `config` now; ApiKeysError when bad).

    The signal handlers go in before the listener opens: a SIGTERM sent the moment /health
    first answers (a supervisor's quick restart) drains and exits 0 like any other."""
    from aiohttp import web

    from hicache_server.http import add_admin_routes, attach_metrics, create_app

    stop = Stop(asyncio.get_running_loop())
    engine.on_fatal = stop.fatal
    if engine.fatal_error is not None:  # died before the handler was in place
        stop.fatal(engine.fatal_error)
    if api_keys is None:
        api_keys = load_api_keys(config.server.api_key, config.server.api_keys_file)
    app = create_app(engine, metrics=attach_metrics(engine), api_keys=api_keys)
    add_admin_routes(app, engine, config.server.admin_api_key)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=HTTP_SHUTDOWN_TIMEOUT_S,
                           keepalive_timeout=IDLE_CONNECTION_TIMEOUT_S)
    await runner.setup()
    try:
        host, port = config.server.host, config.server.port
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as e:
            logger.error("hicache-server cannot listen on %s:%d: %s", host, port, e)
            return EXIT_STARTUP_FAILED
        try:
            await asyncio.get_running_loop().run_in_executor(None, log_startup, engine, runner)
        except Exception:
            if engine.fatal_error is None:
                raise
        await stop.wait()
        if stop.error is not None:
            logger.critical("hicache-server exits: its scheduler thread died (%s: %s); the "
                            "traceback is above", type(stop.error).__name__, stop.error)
            return EXIT_SCHEDULER_DIED
        stop.force_on_next_signal()
        await drain(app, engine)
    finally:
        await runner.cleanup()
    if engine.fatal_error is not None:  # died while draining
        logger.critical("hicache-server exits: its scheduler thread died while draining")
        return EXIT_SCHEDULER_DIED
    logger.info("hicache-server stopped")
    return EXIT_OK


def log_startup(engine: Engine, runner: web.AppRunner) -> None:
    """The listening line (with the real port when 0 was asked for), the model, the tiers."""
    from hicache_server.http.discovery import tier_sizes

    host, port = runner.addresses[0][:2]
    shown = f"[{host}]" if ":" in host else host
    logger.info("hicache-server listening on http://%s:%d", shown, port)
    logger.info("model: %s (%s)", engine.config.model.path, engine.loaded.path)
    loaded = engine.loaded
    logger.info("%s on %s, attention: %s, linear: %s, norm/rope/activation: %s",
                str(loaded.dtype).removeprefix("torch."), loaded.device,
                type(loaded.model.attn_backend).__name__, loaded.model.linear_backend,
                loaded.model.layer_ops)
    if getattr(loaded.model, "_screen", None) is not None:
        logger.info("LM head screen: %s", loaded.model._screen.describe())
    for tier, (tokens, size) in tier_sizes(engine).items():
        logger.info("tier %-7s %d tokens, %.2f GB", tier, tokens, size / BYTES_PER_GB)
    for handler in logging.getLogger().handlers:
        handler.flush()


class Stop:
    """Why serving ends: the first SIGINT/SIGTERM (handlers installed at construction), or
    the scheduler thread's death (`fatal`, callable from any thread). After
    `force_on_next_signal`, another signal ends the process at once (undrained)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._event = asyncio.Event()
        self.error: BaseException | None = None
        for sig in SHUTDOWN_SIGNALS:
            loop.add_signal_handler(sig, self._event.set)

    async def wait(self) -> None:
        await self._event.wait()

    def fatal(self, error: BaseException) -> None:
        def record() -> None:
            self.error = error
            self._event.set()

        try:
            self._loop.call_soon_threadsafe(record)
        except RuntimeError:  # the loop has closed: the process is exiting already
            logger.debug("scheduler died after the event loop closed")

    def force_on_next_signal(self) -> None:
        for sig in SHUTDOWN_SIGNALS:
            self._loop.add_signal_handler(sig, _force_exit)


def _force_exit() -> None:
    logger.warning("second signal: exiting without finishing in-flight requests")
    logging.shutdown()
    os._exit(EXIT_FORCED)


async def drain(app: web.Application, engine: Engine) -> None:
    """Refuse new work, let running requests finish, then close the engine (backups and
    storage) off the event loop, which keeps streaming the last tokens meanwhile."""
    from hicache_server.http import begin_shutdown

    logger.info("shutting down: refusing new requests, finishing the ones in flight")
    begin_shutdown(app)
    await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)


if __name__ == "__main__":
    sys.exit(main())
