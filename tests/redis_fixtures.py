"""Redis for the tests: the servers of benchmarks/redis_servers.py (one node, or a 3-node
Cluster) as session fixtures, a redis-server missing failing the test under CI (which installs
it, see .ci/run) and skipping it otherwise, a count of round trips, and a peer that answers
junk.

    with RedisServer.start(tmp_path) as server:        server.url, server.stop(), .restart()
    redis_server, redis_cluster                        session fixtures
"""

from __future__ import annotations

import selectors
import socket
import socketserver
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import Any, NamedTuple

import pytest
import redis
import redis.connection
from conftest import missing_tool
from typing_extensions import Self

from benchmarks import redis_servers
from benchmarks.redis_servers import RedisClusterNodes, RedisMissing, free_port

__all__ = ["JunkRedis", "RedisClusterNodes", "RedisServer", "count_sends", "free_port",
           "redis_cluster", "redis_server", "require_redis_server"]


def require_redis_server() -> str:
    """The redis-server path; fail (CI) or skip (locally) the calling test without one."""
    try:
        return redis_servers.redis_server_binary()
    except RedisMissing as e:
        missing_tool(str(e))


class RedisServer(redis_servers.RedisServer):
    """A loopback redis-server whose start, without one installed, fails the test under CI
    and skips it elsewhere (`require_redis_server`)."""

    def restart(self) -> None:
        require_redis_server()
        super().restart()


def count_sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on (until `monkeypatch` undoes it), the server port of every command or
    pipeline any redis-py client sends: one entry per round trip."""
    sends: list[int] = []
    send = redis.connection.AbstractConnection.send_packed_command

    def counted(self: redis.connection.AbstractConnection, *args: Any, **kw: Any) -> None:
        sends.append(self.port)
        send(self, *args, **kw)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)
    return sends


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the session (tests use their own key prefixes)."""
    require_redis_server()
    with RedisServer.start(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    """A 3-primary Redis Cluster for the session."""
    require_redis_server()
    with RedisClusterNodes.start(tmp_path_factory.mktemp("redis-cluster")) as nodes:
        yield nodes


# ----------------------------------------------------------------- a peer that answers junk

# Replies a misbehaving peer gives to every command (a proxy that says OK to anything,
# another service on the port): valid RESP, of the wrong type for most commands.
JUNK_OK = b"+OK\r\n"
JUNK_ONE = b":1\r\n"
JUNK_NIL = b"$-1\r\n"
JUNK_EMPTY_ARRAY = b"*0\r\n"
JUNK_REPLIES = (JUNK_OK, JUNK_ONE, JUNK_NIL, JUNK_EMPTY_ARRAY)
# A greeting peer answers redis-py's connection handshake as Redis 7 does (HELLO 3: a map
# holding the protocol; CLIENT SETINFO: OK), so the junk reaches the data commands.
GREETING = {b"HELLO": b"%1\r\n$5\r\nproto\r\n:3\r\n", b"CLIENT": JUNK_OK}
PROXY_CHUNK_BYTES = 1 << 16  # bytes moved per recv; any size works, this one is cheap
SERVE_POLL_S = 0.05  # how soon the accept loop notices stop()
_CRLF = b"\r\n"


def split_commands(buffer: bytes) -> tuple[list[list[bytes]], bytes]:
    """(the complete commands at the start of `buffer`, each its arguments; the incomplete
    rest). A command is a RESP array of bulk strings, as clients send them (a pipeline sends
    several per packet, and one may span packets), or, without a leading '*', one inline
    line of space-separated words."""
    commands: list[list[bytes]] = []
    at = 0
    while (parsed := _command_at(buffer, at)) is not None:
        command, at = parsed
        commands.append(command)
    return commands, buffer[at:]


def _command_at(buffer: bytes, at: int) -> tuple[list[bytes], int] | None:
    """(the arguments of the command starting at `at`, where it ends); None while it is
    incomplete."""
    header_end = buffer.find(_CRLF, at)
    if header_end < 0:
        return None
    end = header_end + len(_CRLF)
    if buffer[at:at + 1] != b"*":
        return buffer[at:header_end].split(), end  # an inline command
    args = []
    for _ in range(int(buffer[at + 1:header_end])):
        length_end = buffer.find(_CRLF, end)  # "$<length>" of the next argument
        if length_end < 0:
            return None
        start = length_end + len(_CRLF)
        end = start + int(buffer[end + 1:length_end]) + len(_CRLF)
        if end > len(buffer):
            return None
        args.append(buffer[start:end - len(_CRLF)])
    return args, end


class _Mode(NamedTuple):
    """How a `JunkRedis` treats a connection, fixed when it is accepted."""

    reply: bytes  # the answer to every command (unless proxied or greeted)
    greet: bool  # answer the handshake (`GREETING`) properly
    upstream_port: int | None  # proxy to the redis-server on this port; None: junk


class JunkRedis:
    """A fake Redis on 127.0.0.1 (an ephemeral port), served by threads of this process.

        with JunkRedis.start(JUNK_OK) as peer:   peer.url, peer.behave(real.port),
                                                 peer.misbehave(JUNK_ONE), peer.accepted,
                                                 peer.open_connections

    A connection takes the mode in force when it is accepted and keeps it: a junk one
    answers every command with the same `reply`, exactly one per command, pipelined or not
    (with `greet`, the handshake's commands get `GREETING` instead); a behaving one is a byte
    proxy to the redis-server on 127.0.0.1:`upstream_port`. So a client gets good answers
    after `behave` only once it reconnects. `stop` (the end of the block) closes the
    listener and every open connection and joins every thread.
    """

    def __init__(self, reply: bytes, greet: bool = False) -> None:
        self._lock = threading.Lock()
        self._mode = _Mode(reply, greet, None)
        self._sockets: set[socket.socket] = set()  # open ones, both sides of a proxy
        self._stopping = False  # set by stop(): a socket opened later is shut at once
        self.accepted = 0  # connections accepted so far
        self._open = 0  # client connections accepted and not yet ended
        self._server = _PeerServer(self)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        args=(SERVE_POLL_S,), name="junk-redis", daemon=True)

    @classmethod
    def start(cls, reply: bytes, greet: bool = False) -> Self:
        peer = cls(reply, greet)
        peer._thread.start()
        return peer

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def misbehave(self, reply: bytes, greet: bool = False) -> None:
        """Connections accepted from now on answer `reply` to every command."""
        with self._lock:
            self._mode = _Mode(reply, greet, None)

    def behave(self, upstream_port: int) -> None:
        """Connections accepted from now on are proxied to the real server on that port."""
        with self._lock:
            self._mode = self._mode._replace(upstream_port=upstream_port)

    @property
    def open_connections(self) -> int:
        """Client connections open now (a client's close is seen a moment later)."""
        with self._lock:
            return self._open

    def accept(self, sock: socket.socket) -> _Mode:
        """(Connection threads) Track `sock`, an accepted connection; its mode."""
        self.track(sock, is_open=True)
        with self._lock:
            self.accepted += 1
            self._open += 1
            return self._mode

    def ended(self, sock: socket.socket) -> None:
        """(Connection threads) The client connection `sock` has ended."""
        self.track(sock, is_open=False)
        with self._lock:
            self._open -= 1

    def track(self, sock: socket.socket, is_open: bool) -> None:
        """(Connection threads) `sock` opened or closed: `stop` shuts the open ones down,
        and one opened while it runs at once (its thread then ends)."""
        with self._lock:
            if not is_open:
                self._sockets.discard(sock)
                return
            self._sockets.add(sock)
            if self._stopping:
                _shut(sock)

    def stop(self) -> None:
        """Stop listening, end every connection, join the threads; idempotent."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        with self._lock:
            self._stopping = True
            for sock in self._sockets:
                _shut(sock)
        self._server.server_close()  # joins the connection threads

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _shut(sock: socket.socket) -> None:
    """Shut `sock` down both ways, which wakes a thread in its recv or select."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # the other end has closed it already
        return


class _PeerServer(socketserver.ThreadingTCPServer):
    daemon_threads = False  # joined by server_close: a test leaves no thread behind
    block_on_close = True

    def __init__(self, peer: JunkRedis) -> None:
        self.peer = peer
        super().__init__(("127.0.0.1", 0), _PeerConnection)


class _PeerConnection(socketserver.BaseRequestHandler):
    """One client connection of a `JunkRedis`, in its own thread."""

    server: _PeerServer
    request: socket.socket

    def handle(self) -> None:
        peer = self.server.peer
        mode = peer.accept(self.request)
        try:
            if mode.upstream_port is None:
                self._answer(mode)
            else:
                self._proxy(mode.upstream_port)
        except OSError:  # either end went away (the client disconnected, or stop())
            return
        finally:
            peer.ended(self.request)

    def _answer(self, mode: _Mode) -> None:
        pending = b""
        while data := self.request.recv(PROXY_CHUNK_BYTES):
            commands, pending = split_commands(pending + data)
            greeting = GREETING if mode.greet else {}
            self.request.sendall(b"".join(
                greeting.get(command[0].upper(), mode.reply) if command else mode.reply
                for command in commands))

    def _proxy(self, upstream_port: int) -> None:
        peer = self.server.peer
        with socket.create_connection(("127.0.0.1", upstream_port)) as upstream, \
                selectors.DefaultSelector() as selector:
            peer.track(upstream, is_open=True)
            try:
                selector.register(self.request, selectors.EVENT_READ, upstream)
                selector.register(upstream, selectors.EVENT_READ, self.request)
                while True:
                    for key, _ in selector.select():
                        data = key.fileobj.recv(PROXY_CHUNK_BYTES)
                        if not data:
                            return
                        key.data.sendall(data)
            finally:
                peer.track(upstream, is_open=False)
