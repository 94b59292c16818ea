"""The engine process: a ZeroMQ ROUTER owned by an I/O thread, and the busy loop.

Threads:
- I/O thread: owns the ROUTER socket. Decodes frontend frames onto the input queue (answers
  Hello and ping itself, so liveness does not wait for a long step), and sends the frames the
  encoder thread hands it over an inproc socket. A frame that does not decode is logged and
  dropped.
- encoder thread: output queue -> msgpack frames, off the busy loop.
- main thread, the busy loop: 1. take new/aborted requests, 2. step the engine, 3. queue the
  outputs per frontend. With nothing to do it blocks on the input queue; it never spins.

Frontends' latency reports (MetricsReport) are added up here and returned with "stats", so a
scrape of any frontend shows the whole server (engine_core/metrics.py).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading

import msgspec
import zmq

from engine_core.engine import EngineCore
from engine_core.metrics import HistogramTotals
from shared.messages import (
    AbortRequest,
    AddRequest,
    EngineInput,
    EngineOutput,
    FinishReason,
    Hello,
    MetricsReport,
    Ready,
    StopRequest,
    UtilityRequest,
    UtilityResult,
    read_ints,
)
from shared.transport import InputCodec, OutputCodec, configure

log = logging.getLogger(__name__)
_OUT_ADDR = "inproc://tandem-engine-out"


class EngineProcess:
    def __init__(self, core: EngineCore, listen: str, ready: Ready) -> None:
        self.core = core
        self.listen = listen
        self.ready = ready
        self.ctx = zmq.Context()
        self.inputs: queue.Queue[tuple[bytes, EngineInput] | None] = queue.Queue()
        self.outputs: queue.Queue[tuple[bytes, EngineOutput]] = queue.Queue()
        self.stopping = threading.Event()
        self.histograms = HistogramTotals()
        self.router = self.ctx.socket(zmq.ROUTER)
        configure(self.router)
        self.router.bind(listen)
        self.out_pull = self.ctx.socket(zmq.PULL)
        self.out_pull.bind(_OUT_ADDR)

    def run(self) -> None:
        threading.Thread(target=self._io_loop, name="engine-io", daemon=True).start()
        threading.Thread(target=self._encode_loop, name="engine-encode", daemon=True).start()
        log.info("engine listening on %s", self.listen)
        while not self.stopping.is_set():
            self._take_inputs(block=not self.core.has_work)
            if self.core.has_work:
                for owner, out in self.core.step().items():
                    self.outputs.put((owner, out))

    def stop(self) -> None:
        self.stopping.set()
        self.inputs.put(None)

    # -- busy-loop side ---------------------------------------------------------------------
    def _take_inputs(self, block: bool) -> None:
        try:
            item = self.inputs.get(block=block)
            while True:
                if item is None:
                    return
                self._handle(*item)
                item = self.inputs.get_nowait()
        except queue.Empty:
            pass

    def _handle(self, owner: bytes, msg: EngineInput) -> None:
        if isinstance(msg, AddRequest):
            self.core.add_request(msg.request_id, read_ints(msg.prompt_token_ids),
                                  msg.params, owner)
        elif isinstance(msg, AbortRequest):
            self.core.abort(msg.request_ids)
        elif isinstance(msg, StopRequest):
            self.core.abort(msg.request_ids, reason=FinishReason.STOP)
        elif isinstance(msg, MetricsReport):
            self.histograms.add(msg)
        elif isinstance(msg, UtilityRequest):
            self.outputs.put((owner, self._utility(msg)))

    def _utility(self, msg: UtilityRequest) -> UtilityResult:
        if msg.method == "stats":
            stats = self.core.stats()
            stats.histograms = self.histograms.snapshot()
            return UtilityResult(msg.call_id, stats)
        return UtilityResult(msg.call_id, error=f"unknown utility method {msg.method!r}")

    # -- I/O side ---------------------------------------------------------------------------
    def _io_loop(self) -> None:
        codec = InputCodec()
        out_codec = OutputCodec()
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.out_pull, zmq.POLLIN)
        while True:
            for sock, _ in poller.poll():
                if sock is self.out_pull:
                    self.router.send_multipart(self.out_pull.recv_multipart(copy=False), copy=False)
                    continue
                frames = self.router.recv_multipart(copy=False)
                owner = frames[0].bytes
                try:
                    msg = codec.decode(frames[-1].buffer)
                except msgspec.DecodeError as e:
                    log.warning("dropped a frame from %r that does not decode: %s", owner, e)
                    continue
                if isinstance(msg, Hello):
                    self.router.send_multipart([owner, out_codec.encode(self.ready)])
                elif isinstance(msg, UtilityRequest) and msg.method == "ping":
                    pong = out_codec.encode(UtilityResult(msg.call_id))
                    self.router.send_multipart([owner, pong])
                else:
                    self.inputs.put((owner, msg))

    def _encode_loop(self) -> None:
        codec = OutputCodec()
        push = self.ctx.socket(zmq.PUSH)
        configure(push)
        push.connect(_OUT_ADDR)
        while True:
            owner, msg = self.outputs.get()
            push.send_multipart([owner, codec.encode(msg)], copy=False)


def serve(core: EngineCore, listen: str, ready: Ready) -> None:
    """Run the engine until SIGINT/SIGTERM."""
    proc = EngineProcess(core, listen, ready)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: proc.stop())
    proc.run()
    log.info("engine %d stopping", os.getpid())
