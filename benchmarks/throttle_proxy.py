"""A TCP proxy that limits bandwidth and adds latency: a real redis-server on a slow network.

    python -m benchmarks.throttle_proxy --target 127.0.0.1:6379 --listen-port 6390 \
        --bandwidth-mb-s 5 --latency-ms 1          # until Ctrl-C; clients use port 6390

    with ThrottleProxy("127.0.0.1", server.port, 100e6, 0.5e-3) as proxy:
        RedisStore(f"redis://127.0.0.1:{proxy.port}/0", codec)

Each direction (up: client -> server, down: server -> client) is ONE link shared by every
connection, on the virtual timeline of `SharedLink`: a chunk (at most `CHUNK_BYTES`, what
one read returns) books its transfer on its direction's link from max(now, the link's free
time), and is delivered at the end of that transfer plus the latency, in order per
connection. The latency is one way: a request and its reply pay it twice. Latency overlaps between chunks and connections (it is propagation, not
occupancy); at most `MAX_IN_FLIGHT_CHUNKS` chunks per connection and direction are read and
not yet delivered (the proxy's own window, so a fast sender cannot book the link for ever).

Threads: one background thread runs the asyncio loop with the listener and every
connection; `start`, `stop` and the counters are for any other thread. `stop` closes the
listener and every connection, and joins the thread: nothing is left running.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any

from typing_extensions import Self

from hicache.storage.backends.throttled import SharedLink, check_latency

CHUNK_BYTES = 64 * 1024  # the most one chunk carries (one read of a connection's socket)
# Chunks read and not yet delivered, per connection and direction: 1 MiB, far above the
# bandwidth-delay product of the links this emulates (5 MB/s x 1 ms = 5 KB).
MAX_IN_FLIGHT_CHUNKS = 16
START_TIMEOUT_S = 10.0  # the loop thread binds a loopback port within milliseconds
THREAD_NAME = "throttle-proxy"  # the loop thread; its executor's threads start with it
DEFAULT_LISTEN_HOST = "127.0.0.1"  # loopback only unless asked
BYTES_PER_MB = 1e6  # --bandwidth-mb-s is in decimal megabytes
S_PER_MS = 1e-3


class ThrottleProxy:
    """A throttling TCP proxy to `target_host:target_port` on `listen_host:listen_port`
    (port 0: a free one, read back from `port`); see the module docstring.

    Counters (written by the loop thread, read by any): `bytes_up` (delivered to the
    target), `bytes_down` (delivered to clients), `connections` (accepted so far).
    `up_link` and `down_link` are the two directions' `SharedLink`s (time.monotonic).
    """

    def __init__(self, target_host: str, target_port: int,
                 bandwidth_bytes_per_s: float | None, latency_s: float = 0.0,
                 listen_host: str = DEFAULT_LISTEN_HOST, listen_port: int = 0) -> None:
        self.target_host, self.target_port = target_host, target_port
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self.latency_s = check_latency(latency_s)
        self.listen_host, self._listen_port = listen_host, listen_port
        self.up_link = SharedLink(bandwidth_bytes_per_s)  # validates the bandwidth
        self.down_link = SharedLink(bandwidth_bytes_per_s)
        self.bytes_up = self.bytes_down = self.connections = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None  # set (in the loop) by stop()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._port: int | None = None
        self._tasks: set[asyncio.Task[Any]] = set()  # open connections (loop thread only)

    # ------------------------------------------------------------------ lifecycle

    @property
    def port(self) -> int:
        """The listening port (after `start`)."""
        if self._port is None:
            raise RuntimeError("ThrottleProxy is not started: call start() or use `with`")
        return self._port

    def start(self) -> Self:
        """Listen and serve on the background thread; returns once the port is bound."""
        if self._thread is not None:
            raise RuntimeError("ThrottleProxy.start() called twice")
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            self.stop()
            raise RuntimeError(f"proxy did not listen within {START_TIMEOUT_S} s")
        if self._start_error is not None:
            self.stop()
            raise self._start_error
        return self

    def stop(self) -> None:
        """Close the listener and every connection, join the thread; idempotent."""
        loop, stopping, thread = self._loop, self._stopping, self._thread
        if loop is not None and stopping is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed since the check
                loop.call_soon_threadsafe(stopping.set)
        if thread is not None:
            thread.join()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # ------------------------------------------------------------------ the loop thread

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        # Named threads for anything run in the executor (address lookups), shut down below.
        loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix=THREAD_NAME))
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()
            self._started.set()  # a start that failed must not wait out the timeout

    async def _serve(self) -> None:
        self._stopping = asyncio.Event()
        try:
            server = await asyncio.start_server(self._connection, self.listen_host,
                                                self._listen_port)
        except OSError as error:  # the port is taken, the host is not ours
            self._start_error = error
            return
        self._port = server.sockets[0].getsockname()[1]
        self._started.set()
        try:
            await self._stopping.wait()
        finally:
            server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await server.wait_closed()

    async def _connection(self, client_reader: asyncio.StreamReader,
                          client_writer: asyncio.StreamWriter) -> None:
        """One client connection: its upstream connection and the two directions."""
        task = asyncio.current_task()
        assert task is not None  # start_server runs each connection in a task
        assert self._stopping is not None  # set before the listener accepts
        if self._stopping.is_set():  # accepted just before stop(): _serve is not waiting
            client_writer.close()
            return
        self._tasks.add(task)
        self.connections += 1
        upstream_writer: asyncio.StreamWriter | None = None
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(
                self.target_host, self.target_port)
            await _all_or_none(
                self._direction(client_reader, upstream_writer, self.up_link, up=True),
                self._direction(upstream_reader, client_writer, self.down_link, up=False))
        except OSError:  # the target refused, or either end reset: the connection ends
            return
        except asyncio.CancelledError:
            # stop() ends the connection here. Ending normally, not cancelled, because
            # Python 3.11's start_server logs a cancelled connection task as an error.
            return
        finally:
            self._tasks.discard(task)
            for writer in (client_writer, upstream_writer):
                if writer is not None:
                    writer.close()
                    with contextlib.suppress(OSError):  # the peer reset it first
                        await writer.wait_closed()

    async def _direction(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         link: SharedLink, up: bool) -> None:
        """Move `reader`'s bytes to `writer` over `link` until `reader`'s EOF, then pass
        the EOF on (a half-close: the other direction runs on)."""
        window = asyncio.Semaphore(MAX_IN_FLIGHT_CHUNKS)
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def read() -> None:
            while True:
                await window.acquire()
                data = await reader.read(CHUNK_BYTES)
                if not data:
                    queue.put_nowait(None)
                    return
                queue.put_nowait((link.reserve(len(data)).end_s + self.latency_s, data))

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                due_s, data = item
                await asyncio.sleep(max(0.0, due_s - time.monotonic()))  # the link's clock
                # counted before the write: a reader that has the bytes sees them counted
                # (counted after `drain`, a client could read the reply first)
                if up:
                    self.bytes_up += len(data)
                else:
                    self.bytes_down += len(data)
                writer.write(data)
                await writer.drain()
                window.release()
            if writer.can_write_eof():
                writer.write_eof()

        await _all_or_none(read(), deliver())


async def _all_or_none(*coros: Coroutine[Any, Any, None]) -> None:
    """Run `coros` concurrently until all end; when one raises (or this is cancelled),
    cancel the rest, wait for them, and raise that."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---------------------------------------------------------------------- CLI


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT, e.g. 127.0.0.1:6379")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=_address, required=True, help="HOST:PORT to proxy")
    parser.add_argument("--listen-host", default=DEFAULT_LISTEN_HOST)
    parser.add_argument("--listen-port", type=int, default=0, help="0: a free port")
    parser.add_argument("--bandwidth-mb-s", type=float, default=None,
                        help="per direction, in MB/s (10^6 bytes); omitted: unlimited")
    parser.add_argument("--latency-ms", type=float, default=0.0,
                        help="one way, added to every chunk in each direction")
    args = parser.parse_args(argv)
    bandwidth = None if args.bandwidth_mb_s is None else args.bandwidth_mb_s * BYTES_PER_MB
    try:
        proxy = ThrottleProxy(*args.target, bandwidth, args.latency_ms * S_PER_MS,
                              args.listen_host, args.listen_port)
    except ValueError as error:  # the message names the value in bytes/s or seconds
        parser.error(f"--bandwidth-mb-s / --latency-ms: {error}")
    rate = "unlimited" if bandwidth is None else f"{args.bandwidth_mb_s:g} MB/s"
    with proxy:
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: the way to stop it
            print(f"proxying {args.listen_host}:{proxy.port} -> {args.target[0]}:"
                  f"{args.target[1]} (bandwidth {rate} per direction, latency "
                  f"{args.latency_ms:g} ms one way); Ctrl-C stops", flush=True)
            threading.Event().wait()
        print(f"stopped: {proxy.connections} connections, {proxy.bytes_up} bytes up, "
              f"{proxy.bytes_down} bytes down", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
