"""The engine process: a ZeroMQ ROUTER owned by an I/O thread, and the busy loop.

Threads:
- I/O thread: owns the ROUTER socket. Decodes frontend frames onto the input queue (answers
  Hello and ping itself, so liveness does not wait for a long step; the ping answer carries the
  busy loop's progress, so a stuck loop is still seen), and sends the frames the encoder thread
  hands it over an inproc socket. A frame that does not decode, or that fails in any other way,
  is logged and dropped: no input ends the thread.
- encoder thread: output queue -> msgpack frames, off the busy loop.
- main thread, the busy loop: 1. take new/aborted requests, 2. queue their refusals (a full
  waiting queue, a bad request) at once, 3. step the engine, 4. queue the outputs per
  frontend, 5. now and then, abort the requests of frontends gone silent. With nothing to do
  it waits on the input queue; it never spins. Each frontend's messages leave in the order
  they were queued: a refused request has no other output to pass.

Frontends' latency reports (MetricsReport) are added up here and returned with "stats", so a
scrape of any frontend shows the whole server (engine_core/metrics.py).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time

import msgspec
import zmq

from engine_core.engine import EngineCore
from engine_core.liveness import TICK_S, FrontendLiveness, LoopProgress, RunningClock
from engine_core.lora.adapters import LoRAError
from engine_core.lora.manager import LoRANotFoundError
from engine_core.metrics import HistogramTotals, StatsLog
from shared.curve import secure_server, warn_if_open
from shared.kv_events import KvEventsConfig, KvEventsFormat
from shared.kv_publisher import KvEventPublisher
from shared.memory import MemoryTrimmer
from shared.messages import (
    AbortRequest,
    AddRequest,
    EngineInput,
    EngineLoad,
    EngineOutput,
    FinishReason,
    Hello,
    MetricsReport,
    Ready,
    StepOutputs,
    StopRequest,
    UtilityRequest,
    UtilityResult,
)
from shared.transport import InputCodec, OutputCodec, configure

log = logging.getLogger(__name__)
_OUT_ADDR = "inproc://tandem-engine-out"
IDLE_POLL_S = 0.5  # how often an idle loop looks at the stop flag (it blocks on the queue)
REAP_EVERY_S = 1.0  # how often the loop looks for frontends gone silent
TRIM_EVERY_S = 10.0  # how often a busy loop gives the heap's free pages back (and on going idle)
FLUSH_S = 2.0  # how long a failed engine waits for its last outputs to go, and for a killed worker


class EngineProcess:
    def __init__(self, core: EngineCore, listen: str, ready: Ready,
                 frontend_timeout_s: float = 5.0, curve_keys: str | None = None,
                 kv_events: KvEventsConfig | None = None,
                 kv_events_format: KvEventsFormat = "map", log_stats: bool = True) -> None:
        """`frontend_timeout_s`: a frontend that pinged and then stays silent this long is
        gone, and its requests are aborted. `curve_keys`: a key folder (shared/curve.py); only
        clients holding a listed keypair then reach the socket (and the KV-event sockets).
        `kv_events`: publish the prefix cache's changes (vLLM's format, or its older array
        form with `kv_events_format`; `ready` then names where, for the frontends' routers).
        `log_stats`: the periodic stats line (metrics.py, `StatsLog`; --disable-log-stats)."""
        self.core = core
        self.listen = listen
        self.ready = ready
        self.ctx = zmq.Context()
        self.inputs: queue.Queue[tuple[bytes, EngineInput] | None] = queue.Queue()
        self.outputs: queue.Queue[tuple[bytes, EngineOutput]] = queue.Queue()
        # A plain flag, not an Event or a queue item: a signal handler may set it safely.
        self.stop_requested = False
        self.histograms = HistogramTotals()
        self.clock = RunningClock()  # time this process could run: pauses are nobody's doing
        self.progress = LoopProgress(self.clock)
        self.frontends = FrontendLiveness(self.clock, frontend_timeout_s)
        self._next_reap = time.monotonic() + REAP_EVERY_S
        # glibc keeps what a step frees at the heap's high-water mark, which moves with the
        # largest steps: trimmed now and then, RSS is what the engine holds (docs/reliability.md)
        self.trimmer = MemoryTrimmer()
        self._next_trim = time.monotonic() + TRIM_EVERY_S
        self._stepped_since_trim = False
        self.stats_log = StatsLog() if log_stats else None
        self.router = self.ctx.socket(zmq.ROUTER)
        configure(self.router)
        if curve_keys is None:
            warn_if_open(listen)
        else:
            secure_server(self.ctx, self.router, curve_keys)
        self.router.bind(listen)
        self.out_pull = self.ctx.socket(zmq.PULL)
        self.out_pull.bind(_OUT_ADDR)
        self.kv_events: KvEventPublisher | None = None
        if kv_events is not None and kv_events.enabled:
            self.kv_events = KvEventPublisher(kv_events, ready.data_parallel_rank, self.ctx,
                                              curve_keys, kv_events_format)
            core.blocks.record_events()
            self.ready = msgspec.structs.replace(
                ready, kv_events_endpoint=self.kv_events.bound,
                kv_events_replay=self.kv_events.replay_endpoint)

    def run(self) -> None:
        threading.Thread(target=self._io_loop, name="engine-io", daemon=True).start()
        threading.Thread(target=self._encode_loop, name="engine-encode", daemon=True).start()
        log.info("engine listening on %s", self.listen)
        while not self.stop_requested:
            self._turn()

    def _turn(self) -> None:
        """One turn of the busy loop. A refusal is queued as soon as its request is taken,
        not with the next step's outputs: a 503 then waits at most for the rest of the step
        running when its request came, never for a whole step more."""
        if not self.core.has_work:
            self._trim_heap(idle=True)
        self._take_inputs(block=not self.core.has_work)
        self._send(self.core.take_refusals())
        if self.core.has_work:
            self._step()
            self._trim_heap(idle=False)
            self._log_stats()
        self._reap_lost_frontends()

    def _log_stats(self) -> None:
        now = time.monotonic()
        if self.stats_log is not None and self.stats_log.due(now):
            line = self.stats_log.line(self.core.stats(), now)
            if line is not None:
                log.info("%s", line)

    def stop(self) -> None:
        """Ask the loop to end (safe from a signal handler: it only sets a flag)."""
        self.stop_requested = True

    # -- busy-loop side ---------------------------------------------------------------------
    def _step(self) -> None:
        self.progress.step_started()
        try:
            outputs = self.core.step()
        except Exception:  # EngineCore.step fails its own requests; this is the last resort
            log.exception("an engine step failed outside the step's own error handling")
            self.core.counts.step_errors += 1
            outputs = {}
        self.progress.step_finished()
        self._send(outputs)
        self._publish_kv_events()
        if self.core.failed is not None:
            self._stop_failed(self.core.failed)

    def _stop_failed(self, why: str) -> None:
        """The engine cannot go on (`EngineCore.failed`): its requests' error rows are sent, its
        tensor-parallel workers killed (a hung or stopped one heeds nothing else, and would
        keep the exit waiting on it), and the loop ends."""
        log.error("%s", why)
        deadline = time.monotonic() + FLUSH_S
        while not self.outputs.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # the I/O thread's last sends
        workers = self.core.runner.workers
        if workers is not None:
            workers.stopping = True  # their deaths are no news to its watcher thread
            for p in workers.procs:
                p.kill()
                p.join(timeout=FLUSH_S)
        self.stop_requested = True

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.core.blocks.take_events())

    def _send(self, outputs: dict[bytes, StepOutputs]) -> None:
        for owner, out in outputs.items():
            self.outputs.put((owner, out))

    def _take_inputs(self, block: bool) -> None:
        if block:
            self.progress.waiting()
        try:
            item = self.inputs.get(block=block, timeout=IDLE_POLL_S if block else None)
            self.progress.took_input()
            while item is not None:
                self._handle_safely(*item)
                item = self.inputs.get_nowait()
        except queue.Empty:
            pass

    def _handle_safely(self, owner: bytes, msg: EngineInput) -> None:
        try:
            self._handle(owner, msg)
        except Exception:  # a message the checks missed must not end the loop
            log.exception("failed to handle a %s from %r", type(msg).__name__, owner)

    def _handle(self, owner: bytes, msg: EngineInput) -> None:
        if isinstance(msg, AddRequest):
            self.core.add_request(msg.request_id, msg.prompt_token_ids, msg.params, owner)
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
            stats.block_size = self.core.blocks.block_size
            stats.kv_events_dropped = self.kv_events.dropped if self.kv_events else 0
            return UtilityResult(msg.call_id, stats)
        if msg.method == "reset_prefix_cache":
            self.core.blocks.reset_prefix_cache()
            self._publish_kv_events()
            return UtilityResult(msg.call_id)
        if msg.method in ("add_lora", "remove_lora", "loras"):
            return self._lora_utility(msg)
        return UtilityResult(msg.call_id, error=f"unknown utility method {msg.method!r}")

    def _lora_utility(self, msg: UtilityRequest) -> UtilityResult:
        """Load or unload an adapter (then answer the adapters served), or only answer them.
        A failure carries the status vLLM answers it with: 404 for a folder without an
        adapter or an unknown name, 400 for an adapter that cannot be served."""
        try:
            if msg.method != "loras" and msg.lora is None:
                raise LoRAError(f"{msg.method} names no adapter")
            if msg.method == "add_lora" and msg.lora is not None:
                self.core.add_lora(msg.lora)
                self._publish_kv_events()  # a name served again cleared the prefix cache
            elif msg.method == "remove_lora" and msg.lora is not None:
                self.core.remove_lora(msg.lora.name)
        except LoRAError as exc:
            status = 404 if isinstance(exc, LoRANotFoundError) else 400
            return UtilityResult(msg.call_id, error=str(exc), status=status)
        return UtilityResult(msg.call_id, loras=self.core.served_loras())

    def _trim_heap(self, idle: bool) -> None:
        """Every TRIM_EVERY_S of steps, and when the loop goes idle after steps (2-25 ms a
        trim measured here, so not after every step)."""
        now = time.monotonic()
        if not idle:
            self._stepped_since_trim = True
        if self._stepped_since_trim and (idle or now >= self._next_trim):
            self.trimmer.trim()
            self._stepped_since_trim = False
            self._next_trim = now + TRIM_EVERY_S

    def _reap_lost_frontends(self) -> None:
        """Abort the requests of frontends gone silent: nobody is left to read them."""
        now = time.monotonic()
        if now < self._next_reap:
            return
        self._next_reap = now + REAP_EVERY_S
        lost = set(self.frontends.lost())
        if not lost:
            return
        orphans = [rid for rid, req in self.core.scheduler.requests.items() if req.owner in lost]
        log.warning("%d frontend(s) silent for %.0f s: aborting their %d request(s)",
                    len(lost), self.frontends.timeout_s, len(orphans))
        self.core.counts.frontends_lost += len(lost)
        self.core.abort(orphans)

    # -- I/O side ---------------------------------------------------------------------------
    def _io_loop(self) -> None:
        codec = InputCodec()
        out_codec = OutputCodec()
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.out_pull, zmq.POLLIN)
        while True:
            events = poller.poll(int(TICK_S * 1000))
            self.clock.tick()
            for sock, _ in events:
                if sock is self.out_pull:
                    self.router.send_multipart(self.out_pull.recv_multipart(copy=False), copy=False)
                    continue
                frames = self.router.recv_multipart(copy=False)
                try:
                    self._on_frame(frames, codec, out_codec)
                except Exception:  # whatever a frame holds, the socket keeps being served
                    log.exception("dropped a frame that failed on the I/O thread")

    def _on_frame(self, frames: list[zmq.Frame], codec: InputCodec,
                  out_codec: OutputCodec) -> None:
        owner = frames[0].bytes
        try:
            msg = codec.decode(frames[-1].buffer)
        except msgspec.DecodeError as e:
            log.warning("dropped a frame from %r that does not decode: %s", owner, e)
            return
        ping = isinstance(msg, UtilityRequest) and msg.method == "ping"
        self.frontends.heard(owner, ping)
        if isinstance(msg, Hello):
            self.router.send_multipart([owner, out_codec.encode(self.ready)])
        elif isinstance(msg, UtilityRequest) and ping:
            pong = UtilityResult(msg.call_id, progress=self.progress.snapshot(),
                                 load=self._load())
            self.router.send_multipart([owner, out_codec.encode(pong)])
        else:
            self.inputs.put((owner, msg))

    def _load(self) -> EngineLoad:
        """The queue's lengths, read from the I/O thread (a len() is atomic under the GIL)."""
        scheduler = self.core.scheduler
        return EngineLoad(len(scheduler.running), len(scheduler.waiting))

    def _encode_loop(self) -> None:
        codec = OutputCodec()
        push = self.ctx.socket(zmq.PUSH)
        configure(push)
        push.connect(_OUT_ADDR)
        while True:
            owner, msg = self.outputs.get()
            try:
                frame = codec.encode(msg)
            except Exception:  # e.g. a value msgpack cannot hold: lose one message, not all
                log.exception("failed to encode a %s for %r", type(msg).__name__, owner)
                continue
            push.send_multipart([owner, frame], copy=False)


def serve(core: EngineCore, listen: str, ready: Ready, curve_keys: str | None = None,
          kv_events: KvEventsConfig | None = None,
          kv_events_format: KvEventsFormat = "map", log_stats: bool = True) -> int:
    """Run the engine until SIGINT/SIGTERM (then 0), or until it cannot go on (then 3,
    `EngineCore.failed`, as when a tensor-parallel worker dies)."""
    proc = EngineProcess(core, listen, ready, curve_keys=curve_keys, kv_events=kv_events,
                         kv_events_format=kv_events_format, log_stats=log_stats)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: proc.stop())
    proc.run()
    if proc.kv_events is not None:
        proc.kv_events.close()
    log.info("engine %d stopping", os.getpid())
    return 0 if core.failed is None else 3
