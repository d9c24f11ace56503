"""KVEventPublisher: sends the engine's KV cache events over ZMQ as vLLM does.

Threads: `submit` runs on the engine thread and only queues (a bounded queue; when
it is full the batch is dropped and counted, so a slow network never stalls
generation). One publisher thread owns both sockets, encodes (kv_event_wire.py) and
sends; subscribers that miss messages ask the replay socket.

    PUB socket (`endpoint`), one multipart message per engine step with events:
        [topic, sequence number (8 bytes, big-endian, from 0), KVEventBatch payload]
    ROUTER socket (`replay_endpoint`), one request from a DEALER or REQ client:
        [empty frame, start sequence number (8 bytes, big-endian)]
      answered with every buffered batch at or after it, one message each, then an
      end marker:
        [empty frame, sequence number, payload] ... [empty frame, -1 (8 bytes), b""]

The last `buffer_steps` payloads are kept for replay.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Iterator

import zmq
from prometheus_client.core import CounterMetricFamily, Metric

from engine.kv_cache.kv_events import KVCacheEvent

from .kv_event_wire import encode_batch
from .kv_events_config import KVEventsConfig

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
POLL_S = 0.1
"""How long the thread waits for a batch before looking at replay requests again."""
CLOSE_TIMEOUT_S = 2.0


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._queue: queue.Queue[tuple[float, list[KVCacheEvent]]] = queue.Queue(
            maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._next_seq = 0
        self.num_published = 0
        self.num_dropped = 0
        self._closing = threading.Event()
        self._context = zmq.Context()
        self._pub, self._replay = self._open_sockets()
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher",
                                        daemon=True)
        self._thread.start()

    def _open_sockets(self) -> tuple[zmq.Socket, zmq.Socket | None]:
        """Created here so that a taken port stops the server at start; used by the
        publisher thread only from then on (its start orders the hand-over)."""
        config = self.config
        pub = self._context.socket(zmq.PUB)
        pub.set_hwm(config.hwm)
        replay = None
        try:
            where, address = "endpoint", config.endpoint
            if config.binds:
                pub.bind(config.endpoint)
            else:
                pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                where, address = "replay_endpoint", config.replay_endpoint
                replay = self._context.socket(zmq.ROUTER)
                replay.bind(config.replay_endpoint)
        except zmq.ZMQError as error:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            self._context.term()
            raise RuntimeError(f"kv_events_config.{where}: cannot open {address}: "
                               f"{error}") from None
        return pub, replay

    # -- engine thread ------------------------------------------------------------------
    def submit(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events, stamped now; never blocks."""
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning("KV event queue full: %d batches dropped so far",
                               self.num_dropped)

    # -- publisher thread ---------------------------------------------------------------
    def _run(self) -> None:
        while not (self._closing.is_set() and self._queue.empty()):
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._answer_replay()
                except zmq.ZMQError:
                    logger.exception("KV event replay failed")
            try:
                ts, events = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            payload = encode_batch(events, ts)
            seq = self._next_seq
            self._next_seq += 1
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                logger.exception("KV event batch %d not sent", seq)
            self._buffer.append((seq, payload))
            self.num_published += 1

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignored a malformed KV event replay request (%d frames)",
                           len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))

    # -- any thread ---------------------------------------------------------------------
    def close(self) -> None:
        """Send what is queued (for at most CLOSE_TIMEOUT_S), then close the sockets."""
        self._closing.set()
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("KV event publisher: %d batches unsent at shutdown",
                           self._queue.qsize())
            return               # (a daemon thread: it ends with the process)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()


class PublisherCollector:
    """/metrics counters of the publisher, read at scrape time."""

    def __init__(self, publisher: KVEventPublisher, model_name: str) -> None:
        self._publisher = publisher
        self._labels = [model_name]

    def collect(self) -> Iterator[Metric]:
        for name, documentation, value in (
                ("kvserve:kv_event_batches_published", "KV event batches sent.",
                 self._publisher.num_published),
                ("kvserve:kv_event_batches_dropped",
                 "KV event batches dropped because the publisher's queue was full.",
                 self._publisher.num_dropped)):
            family = CounterMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric(self._labels, value)
            yield family


def open_publisher(setting: str | None) -> KVEventPublisher | None:
    """The publisher the `kv_events_config` setting asks for; None when events are
    off (no setting, disabled, or the "null" publisher)."""
    config = KVEventsConfig.from_any(setting)
    return KVEventPublisher(config) if config is not None and config.publishes else None
