"""Publishers of KV event batches: `NullEventPublisher` (events off) and `ZmqEventPublisher`,
vLLM's wire protocol re-implemented:

    PUB     endpoint          multipart (topic, seq: 8-byte big-endian, msgpack KVEventBatch)
    ROUTER  replay_endpoint   a request (a DEALER's [b"", start seq]) is answered with every
                              buffered batch from that seq, (b"", topic, seq, payload) each,
                              then (b"", b"", END_SEQ, b"")

Sequence numbers start at 0 with each publisher (each server start) and grow by one per
batch. The last `buffer_steps` batches are kept for replay.

Threading: `publish` is called by the scheduler thread and never blocks it: batches go to a
bounded queue (the oldest dropped, and counted, when full) that one background thread encodes
and sends; only that thread touches the sockets (ZMQ sockets are not thread-safe). A socket
that fails loses events, never the server: the error is logged once and counted.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq

from hicache.events.schema import KVEvent, KVEventBatch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker
SEQ_BYTES = 8
# How long the publisher thread waits on its queue before it checks the replay socket.
POLL_S = 0.05
# How long `shutdown` waits for queued batches to be sent before closing the sockets.
SHUTDOWN_TIMEOUT_S = 2.0


@dataclass
class EventCounters:
    """Totals since start. `batches`/`events` are sent ones; `dropped_*` were lost to a full
    queue or a failing socket. Written by the publisher's two threads, read by anyone
    (ints: a stale read is the worst that happens)."""

    batches: int = 0
    events: int = 0
    dropped_batches: int = 0
    dropped_events: int = 0


class EventPublisher(ABC):
    counters: EventCounters

    @abstractmethod
    def publish(self, events: list[KVEvent]) -> None:
        """Send `events` (one scheduler step's, non-empty) as one batch; never blocks."""

    @abstractmethod
    def shutdown(self) -> None:
        """Send what is queued (for a short while), stop the thread, close the sockets."""


class NullEventPublisher(EventPublisher):
    """Events off: nothing is recorded, nothing is sent."""

    def __init__(self) -> None:
        self.counters = EventCounters()

    def publish(self, events: list[KVEvent]) -> None:
        return

    def shutdown(self) -> None:
        return


class ZmqEventPublisher(EventPublisher):
    """PUB (+ optional ROUTER replay) publisher; see the module docstring.

    `endpoint`/`replay_endpoint`: a `*` host (or ipc://, inproc://) binds, any other host
    connects (PUB only, as vLLM). `hwm` is the PUB socket's high-water mark (messages),
    `max_queue_size` the batches waiting for the thread, `buffer_steps` the batches kept
    for replay.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000,
                 max_queue_size: int = 100_000, data_parallel_rank: int | None = None) -> None:
        self.counters = EventCounters()
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._failed = False  # logged once
        self._ctx = zmq.Context()  # our own: terminating it cannot close anyone else's
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(hwm)
            self._replay: zmq.Socket | None = None
            self.endpoint = self._open(self._pub, endpoint)
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self.replay_endpoint = self._open(self._replay, replay_endpoint, bind=True)
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name="hicache-kv-events",
                                        daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s (replay %s)", self.endpoint,
                    self.replay_endpoint)

    @staticmethod
    def _open(sock: zmq.Socket, endpoint: str, bind: bool = False) -> str:
        """Bind (or connect) `sock`; the endpoint as bound (`tcp://*:0`: the port the OS
        chose)."""
        if bind or "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            sock.bind(endpoint)
            return sock.getsockopt_string(zmq.LAST_ENDPOINT)
        sock.connect(endpoint)
        return endpoint

    # ------------------------------------------------------------------- scheduler side

    def publish(self, events: list[KVEvent]) -> None:
        self._put(KVEventBatch(time.time(), events, self._rank))

    def _put(self, item: KVEventBatch | None) -> None:
        """Queue `item` without waiting, dropping the oldest batches while the queue is full."""
        while True:
            try:
                self._queue.put_nowait(item)
                return
            except queue.Full:
                self._drop_oldest()

    def _drop_oldest(self) -> None:
        try:
            old = self._queue.get_nowait()
        except queue.Empty:
            return
        if old is not None:
            self.counters.dropped_batches += 1
            self.counters.dropped_events += len(old.events)

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._put(None)  # the stop sign, after every batch queued before it
            self._thread.join(SHUTDOWN_TIMEOUT_S)
        if not self._ctx.closed:
            self._ctx.destroy(linger=0)  # closes both sockets

    # ---------------------------------------------------------------------- the thread

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        while True:
            if self._replay is not None:
                self._serve_replays()
            try:
                batch = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                return
            self._send(self._seq, encode(batch), len(batch.events))
            self._seq += 1

    def _send(self, seq: int, payload: bytes, num_events: int) -> None:
        self._buffer.append((seq, payload))  # replayable even if this send fails
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(SEQ_BYTES, "big"), payload))
        except zmq.ZMQError as err:
            self.counters.dropped_batches += 1
            self.counters.dropped_events += num_events
            self._fail_once(err)
            return
        self.counters.batches += 1
        self.counters.events += num_events

    def _serve_replays(self) -> None:
        """Answer every replay request waiting on the ROUTER socket."""
        assert self._replay is not None
        try:
            while self._replay.poll(0):
                frames = self._replay.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != SEQ_BYTES:
                    logger.warning("KV events: ignored a malformed replay request (%d frames)",
                                   len(frames))
                    continue
                client, _, start = frames
                first = int.from_bytes(start, "big")
                for seq, payload in list(self._buffer):
                    if seq >= first:
                        self._replay.send_multipart(
                            (client, b"", self._topic, seq.to_bytes(SEQ_BYTES, "big"), payload))
                self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
        except zmq.ZMQError as err:
            self._fail_once(err)

    def _fail_once(self, err: zmq.ZMQError) -> None:
        if not self._failed:
            self._failed = True
            logger.error("KV events: a ZMQ socket failed (%s); events are lost while it "
                         "does, the server goes on", err)
