"""The engine's KV-cache event publisher: vLLM's ZeroMQ PUB socket and replay ROUTER, run by a
thread of its own so that no subscriber, slow or gone, ever slows a step.

The busy loop hands each step's events to `publish`, which only numbers them and puts them on
a bounded queue (`max_queue_size` batches): when the thread falls that far behind, a batch is
dropped and counted, and its sequence number stays unused, so a subscriber sees the gap. The
thread encodes each batch once, sends `[topic, seq, payload]` (a PUB socket drops for a
subscriber past its high-water mark rather than wait), keeps the last `buffer_steps` payloads,
and answers replay requests from them (wire format, either of the two: `shared/kv_events.py`).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import zmq

from shared.curve import serve_curve
from shared.kv_events import (
    KvEvent,
    KVEventBatch,
    KvEventsConfig,
    KvEventsFormat,
    KvEventWire,
    binds,
    rank_endpoint,
    read_seq,
    seq_bytes,
)

log = logging.getLogger(__name__)
POLL_S = 0.05  # how long the thread waits for a batch before it looks at the replay socket


class KvEventPublisher:
    """Create (binds at once: a taken port fails the start), `publish` from one thread, `close`."""

    def __init__(self, config: KvEventsConfig, rank: int, ctx: zmq.Context,  # type: ignore[type-arg]
                 curve_keys: str | Path | None = None, form: KvEventsFormat = "map",
                 clock: Callable[[], float] = time.time) -> None:
        """`ctx`: the engine's context (its CURVE authenticator, when `curve_keys` is given,
        admits subscribers as it admits frontends). `form`: vLLM 0.32's maps or the older
        positional arrays. `clock`: each batch's ts."""
        self.rank = rank
        self._wire = KvEventWire(form)
        self._clock = clock
        self.endpoint = rank_endpoint(config.endpoint, rank)
        self.replay_endpoint = (None if config.replay_endpoint is None
                                else rank_endpoint(config.replay_endpoint, rank))
        self.dropped = 0  # batches the queue had no room for
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(
            maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = itertools.count()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None  # type: ignore[type-arg]
        if curve_keys is not None:
            serve_curve(self._pub, curve_keys)
        if binds(self.endpoint):
            self._pub.bind(self.endpoint)
        else:
            self._pub.connect(self.endpoint)
        if self.replay_endpoint is not None:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            if curve_keys is not None:
                serve_curve(self._replay, curve_keys)
            self._replay.bind(self.replay_endpoint)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info("publishing KV-cache events on %s%s", self.endpoint,
                 f" (replay on {self.replay_endpoint})" if self.replay_endpoint else "")

    @property
    def bound(self) -> str | None:
        """The PUB address subscribers connect to, when this side binds it."""
        return self.endpoint if binds(self.endpoint) else None

    def publish(self, events: list[KvEvent]) -> None:
        """Queue one step's events (nothing when empty); never blocks."""
        if not events:
            return
        seq = next(self._seq)
        try:
            self._queue.put_nowait((seq, KVEventBatch(self._clock(), events, self.rank)))
        except queue.Full:
            self.dropped += 1
            if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:
                log.warning("the KV-event publisher is behind: %d batch(es) dropped so far",
                            self.dropped)

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for at most `timeout_s`), then close the sockets."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._answer_replay(self._replay)
                try:
                    item = self._queue.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                if item is None:
                    return
                seq, batch = item
                payload = self._wire.encode(batch)
                self._pub.send_multipart((self._topic, seq_bytes(seq), payload))
                self._buffer.append((seq, payload))
        except Exception:  # a publisher that fails must not take the engine with it
            log.exception("the KV-event publisher stopped")
        finally:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()

    def _answer_replay(self, replay: zmq.Socket) -> None:  # type: ignore[type-arg]
        """`[identity, b"", start]` (a REQ or DEALER client) -> every buffered batch from
        `start` on, then the end marker, in the wire's layout."""
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignored a replay request of %d frame(s)", len(frames))
            return
        client, start = frames[0], read_seq(frames[2])
        for seq, payload in list(self._buffer):
            if seq >= start:
                replay.send_multipart((client, b"", *self._wire.replayed(self._topic, seq,
                                                                         payload)))
        replay.send_multipart((client, b"", *self._wire.replay_end()))
