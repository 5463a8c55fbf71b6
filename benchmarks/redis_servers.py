"""Real Redis servers on loopback, for the benchmarks that need one (and the tests'
fixtures, tests/redis_fixtures.py): one node, or a 3-node Cluster.

    with RedisServer.start(folder) as server:          server.url, server.stop(), .restart()
    with RedisClusterNodes.start(folder) as nodes:     nodes.url (any node), nodes.servers

Every server is a child `redis-server --daemonize no` without persistence, bound to
127.0.0.1 on a free port, and is stopped (terminate, then kill) when its block ends; on
Linux it also dies with the process that started it, so a killed run leaves none.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from typing_extensions import Self

from benchmarks.run_multiturn import _die_with_parent

INSTALL_HINT = ("install the Debian package redis-server (apt-get install -y redis-server; "
                ".ci/run does)")
START_TIMEOUT_S = 10.0  # a redis-server on loopback answers PING within milliseconds
STOP_TIMEOUT_S = 5.0  # after SIGTERM; then SIGKILL
POLL_S = 0.02
CLUSTER_NODES = 3  # the smallest cluster redis-cli --cluster create accepts
CLUSTER_BUS_OFFSET = 10000  # Redis Cluster's bus port is the client port + 10000
PORT_RANGE = (20000, 50000)  # ports tried for servers: + 10000 stays a valid port
PORT_TRIES = 200


class RedisMissing(RuntimeError):
    """No redis-server or redis-cli on PATH."""


def redis_server_binary() -> str:
    """The redis-server path; RedisMissing, saying how to install it, without one (or
    without the redis-cli a cluster is created with)."""
    path = shutil.which("redis-server")
    if path is None or shutil.which("redis-cli") is None:
        raise RedisMissing(f"redis-server / redis-cli not found on PATH: {INSTALL_HINT}")
    return path


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(exclude: Sequence[int] = ()) -> int:
    """A loopback port free now, whose cluster bus port (+10000) is free too."""
    rng = random.Random()
    for _ in range(PORT_TRIES):
        port = rng.randrange(*PORT_RANGE)
        if port not in exclude and _port_free(port) and _port_free(port + CLUSTER_BUS_OFFSET):
            return port
    raise RuntimeError(f"no free port pair in {PORT_RANGE} after {PORT_TRIES} tries")


def _answers_ping(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:  # not listening yet
        return False


class RedisServer:
    """One child redis-server on 127.0.0.1:`port`, its files in `folder`; `password`: the
    server requires it (`--requirepass`)."""

    def __init__(self, folder: Path, port: int, extra_args: Sequence[str] = (),
                 password: str | None = None) -> None:
        self.folder, self.port, self.extra_args = folder, port, tuple(extra_args)
        self.password = password
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(cls, folder: Path, port: int | None = None, extra_args: Sequence[str] = (),
              password: str | None = None) -> Self:
        server = cls(folder, port or free_port(), extra_args, password)
        server.restart()
        return server

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """A raw client (no retries: a test sees every fault)."""
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                           socket_timeout=START_TIMEOUT_S, retry=Retry(NoBackoff(), 0))

    def restart(self) -> None:
        """Start the server (again, on the same port) and wait until it answers PING."""
        if self.proc is not None:
            raise RuntimeError(f"redis-server on port {self.port} is already running")
        binary = redis_server_binary()
        self.folder.mkdir(parents=True, exist_ok=True)
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--daemonize", "no",
                "--save", "", "--appendonly", "no", "--dir", str(self.folder),
                *(("--requirepass", self.password) if self.password else ()), *self.extra_args]
        log = open(self.folder / f"redis-{self.port}.log", "ab")  # noqa: SIM115 - child's
        try:
            # preexec_fn is safe here: it calls one preloaded C function and takes no lock.
            self.proc = subprocess.Popen(args, cwd=self.folder, stdout=log,
                                         stderr=subprocess.STDOUT,
                                         preexec_fn=_die_with_parent)  # noqa: PLW1509
        finally:
            log.close()
        self._wait_for_ping()

    def _wait_for_ping(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        client = self.client()
        try:
            while not _answers_ping(client):
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} exited with "
                                       f"{self.proc.returncode}: {self.log_tail()}")
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} did not answer "
                                       f"PING within {START_TIMEOUT_S} s: {self.log_tail()}")
                time.sleep(POLL_S)
        finally:
            client.close()

    def log_tail(self, lines: int = 20) -> str:
        path = self.folder / f"redis-{self.port}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """Terminate the server and wait for it (kill after `STOP_TIMEOUT_S`); idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class RedisClusterNodes:
    """`CLUSTER_NODES` primaries (no replicas) on loopback, slots spread by redis-cli."""

    def __init__(self, servers: list[RedisServer]) -> None:
        self.servers = servers

    @classmethod
    def start(cls, folder: Path) -> Self:
        ports: list[int] = []
        for _ in range(CLUSTER_NODES):
            ports.append(free_port(exclude=[p + d for p in ports for d in (0, CLUSTER_BUS_OFFSET,
                                                                          -CLUSTER_BUS_OFFSET)]))
        nodes = cls([RedisServer(folder / str(port), port, (
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", "5000")) for port in ports])
        try:
            for server in nodes.servers:
                server.restart()
            nodes._create()
        except BaseException:
            nodes.stop()
            raise
        return nodes

    @property
    def url(self) -> str:
        return self.servers[0].url

    def _create(self) -> None:
        addresses = [f"127.0.0.1:{s.port}" for s in self.servers]
        subprocess.run(["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas",
                        "0", "--cluster-yes"], check=True, capture_output=True,
                       timeout=START_TIMEOUT_S)
        deadline = time.monotonic() + START_TIMEOUT_S
        for server in self.servers:
            client = server.client()
            try:
                while client.cluster("INFO").get("cluster_state") != "ok":
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"cluster not ok within {START_TIMEOUT_S} s")
                    time.sleep(POLL_S)
            finally:
                client.close()

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
