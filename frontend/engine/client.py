"""The frontend's connection to the engine core: one ZeroMQ DEALER, read by one callback.

`EngineClient.start()` connects, sends Hello and waits for Ready. From then on every engine frame
is decoded and its StepOutputs rows routed into per-request `OutputStream`s by one reader
callback on the socket's file descriptor (a plain ZeroMQ socket driven by the event loop: no
future or task per frame or per send). A heartbeat task pings the engine every
`heartbeat_interval` and, when nothing at all has been heard for `silence_timeout` and the
engine's process is gone too, marks the engine unhealthy and fails every in-flight request with
`EngineDeadError` (the HTTP layer answers 503). Hearing from the engine again marks it healthy.

Silence alone does not tell a dead engine from a busy one: the pings are answered by a Python
thread, which any C call holding the engine's GIL holds back (a tokenizer loaded for the first
grammar compile: seconds on a loaded machine). An `EngineLink` beside the socket, kept up by
ZeroMQ's own heartbeats that libzmq answers without the GIL, says whether the process still runs
and is reachable. Killed, stopped or cut off, it falls within `silence_timeout` and the silence
is death as before; while it stands, the engine is busy and is given the stall bound
(`stall_timeout`) to answer again before it counts as dead.

A socket that answers is not enough: the engine's I/O thread answers pings, not the loop that
does the work. Each ping answer carries the busy loop's progress, and an engine that has work
and has finished no step within the stall bound (`shared.transport.stall_bound`: five times its
slowest step, at least `stall_timeout`) counts as dead too, until a step finishes again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from typing import cast

import msgspec
import zmq

from frontend.engine.latency import LatencyRecorder
from frontend.engine.link import EngineLink
from frontend.engine.stream import OutputStream, StepItem
from shared import messages as wire
from shared.curve import ClientKeys, secure_client
from shared.messages import FinishReason
from shared.step_outputs import TokenLogprob, prompt_rows, token_logprobs
from shared.transport import (
    DEFAULT_STALL_FLOOR_S,
    InputCodec,
    OutputCodec,
    configure,
    is_stalled,
    new_identity,
)

logger = logging.getLogger(__name__)
# Engine frames routed in one go before the loop lets the streams' consumers and the HTTP
# handlers run (waiting frames are routed first so that a lagging stream merges them).
MAX_DRAIN = 256


class EngineUnavailableError(RuntimeError):
    """The engine did not answer the handshake."""


class EngineDeadError(RuntimeError):
    """The engine stopped answering (or the client closed): in-flight requests cannot finish."""


class EngineOverloadedError(EngineDeadError):
    """The engine refused a request because its waiting queue is full: a 503 for this request
    only (the HTTP layer maps EngineDeadError to 503); the client may retry after a while."""


class UtilityError(RuntimeError):
    """The engine answered a utility call with an error; `status`: the HTTP status it means
    (0: a server error)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class EngineClient:
    """Async client of one engine core; create, `await start()`, use, `await close()`."""

    def __init__(
        self,
        address: str,
        *,
        handshake_timeout: float = 30.0,
        heartbeat_interval: float = 0.25,
        silence_timeout: float = 1.25,
        stall_timeout: float = DEFAULT_STALL_FLOOR_S,
        curve: ClientKeys | None = None,
    ) -> None:
        """`silence_timeout`: unanswered pings for this long mean death when the engine's
        process is gone too (`EngineLink`). `stall_timeout`: the least time a busy engine may go
        without finishing a step, or, its process up, without answering a ping.
        `curve`: keys to connect with when the engine requires CURVE (shared/curve.py)."""
        self.address = address
        self.identity = new_identity()
        self._handshake_timeout = handshake_timeout
        self._heartbeat_interval = heartbeat_interval
        self._silence_timeout = silence_timeout
        self._stall_timeout = stall_timeout
        self._stalled = False  # the engine answers but its loop makes no progress
        self._curve = curve
        self._ctx = zmq.Context()
        self._sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        self._link: EngineLink | None = None  # the process's own heartbeat, once connected
        self._busy_said = False  # this silence was logged as a busy engine's
        self._reading = False  # the socket's descriptor is watched by the event loop
        self._drain_soon = False  # a drain is scheduled (frames may wait unsignalled)
        self._handshake: asyncio.Future[wire.Ready] | None = None
        self._in = InputCodec()
        self._out = OutputCodec()
        self._requests: dict[str, tuple[OutputStream, int]] = {}
        self._news: list[OutputStream] = []  # streams routed to since the last notify
        self._calls: dict[int, asyncio.Future[wire.UtilityResult]] = {}
        self._call_ids = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._unanswered_since: float | None = None
        self._unanswered_ticks = 0  # heartbeat ticks, on time, since then
        self._healthy = False
        self._ready: wire.Ready | None = None
        self._load: wire.EngineLoad | None = None
        self.latency = LatencyRecorder(self._send)  # TTFT/ITL/e2e, reported to the engine

    @property
    def ready(self) -> wire.Ready:
        """The engine's model facts (available after `start()`)."""
        if self._ready is None:
            raise RuntimeError("EngineClient.start() has not completed")
        return self._ready

    @property
    def healthy(self) -> bool:
        """True while the engine answers within `silence_timeout` and its loop makes progress."""
        return self._healthy

    @property
    def num_in_flight(self) -> int:
        """Engine requests sent and not yet finished or aborted."""
        return len(self._requests)

    @property
    def load(self) -> wire.EngineLoad | None:
        """The engine's queue as its latest ping answer gave it (a new object each time)."""
        return self._load

    def holds(self, request_id: str) -> bool:
        """The request was sent here and has neither finished nor been aborted."""
        return request_id in self._requests

    async def start(self) -> wire.Ready:
        """Connect, say Hello and wait for Ready; raises EngineUnavailableError on timeout."""
        self._sock.setsockopt(zmq.IDENTITY, self.identity)
        configure(self._sock)
        if self._curve is not None:
            secure_client(self._sock, self._curve)
        self._sock.connect(self.address)
        # the link falls within silence_timeout of a PONG gone missing (a ping interval, then
        # the timeout), so a stopped engine is found as soon as its silence is
        self._link = EngineLink(self._ctx, self.address, self._heartbeat_interval,
                                max(self._heartbeat_interval,
                                    self._silence_timeout - self._heartbeat_interval),
                                self._curve)
        loop = asyncio.get_running_loop()
        self._handshake = loop.create_future()
        loop.add_reader(self._sock.fileno(), self._drain)
        self._reading = True
        self._send(wire.Hello(client_id=self.identity.decode()))
        try:
            self._ready = await asyncio.wait_for(self._handshake, self._handshake_timeout)
        except TimeoutError:
            self._close_socket()
            raise EngineUnavailableError(
                f"No answer from the engine at {self.address} within "
                f"{self._handshake_timeout:g} s (sent HELLO, expected READY). "
                "Is the engine running and listening on that address"
                + (", and are its --curve-keys and ours from one `tandem keys` folder?"
                   if self._curve else "? (If it has --curve-keys, pass ours too.)")
            ) from None
        finally:
            self._handshake = None
        self._heard()
        self._tasks = [loop.create_task(self._heartbeat())]
        self._drain_soon = True  # whatever came after Ready
        loop.call_soon(self._drain)
        return self._ready

    async def close(self) -> None:
        """Abort what is still running, fail its streams, stop the tasks, close the socket."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.latency.flush()
        if self._requests and self._healthy:
            self._send(wire.AbortRequest(list(self._requests)))
        self._fail_all(EngineDeadError("the frontend is shutting down"))
        self._close_socket()

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: wire.SamplingParams,
        stream: OutputStream | None = None,
        choice: int = 0,
    ) -> OutputStream:
        """Send one engine request; its outputs go to `stream` (a new one if None), tagged
        `choice`. Raises EngineDeadError while the engine is not answering."""
        if not self._healthy:
            raise EngineDeadError("the engine is not answering")
        stream = stream if stream is not None else OutputStream()
        stream.open(request_id)
        self._requests[request_id] = (stream, choice)
        self.latency.on_add(request_id)
        self._send(wire.AddRequest(request_id, wire.ints(prompt_token_ids), params))
        return stream

    def abort(self, request_ids: list[str], stopped: bool = False) -> None:
        """Stop these requests in the engine now; their streams get nothing more. `stopped`:
        the frontend finished them itself (a stop string), so they count as "stop", not "abort"."""
        if not request_ids:
            return
        for rid in request_ids:
            entry = self._requests.pop(rid, None)
            if entry is not None:
                entry[0].close(rid)
                self.latency.on_finish(rid, FinishReason.STOP if stopped else FinishReason.ABORT)
        ids = list(request_ids)
        self._send(wire.StopRequest(ids) if stopped else wire.AbortRequest(ids))

    async def stats(self, timeout: float = 5.0) -> wire.EngineStats:
        """The engine's figures; raises UtilityError, EngineDeadError, TimeoutError."""
        result = await self.call_utility("stats", timeout)
        if result.stats is None:
            raise UtilityError("the engine answered \"stats\" without figures")
        return result.stats

    async def call_utility(self, method: str, timeout: float = 5.0,
                           lora: wire.LoRACard | None = None) -> wire.UtilityResult:
        """Ask the engine for "stats" or "ping", or another utility (`lora`: the adapter a
        LoRA call names).

        Raises UtilityError, EngineDeadError, TimeoutError."""
        if not self._healthy:
            raise EngineDeadError("the engine is not answering")
        call_id = next(self._call_ids)
        future: asyncio.Future[wire.UtilityResult] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            self._send(wire.UtilityRequest(call_id, method, lora))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._calls.pop(call_id, None)

    # -- internals -------------------------------------------------------------------------

    def _send(self, msg: wire.EngineInput) -> None:
        # HWM is 0 (unbounded): the send never waits. ZeroMQ's descriptor is edge-triggered,
        # and a send may take in what arrived meanwhile without the descriptor telling: look.
        sock = self._sock
        sock.send(self._in.encode(msg), zmq.NOBLOCK)
        if self._reading and not self._drain_soon and self._readable():
            self._drain_soon = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _decode(self, frame: bytes) -> wire.EngineOutput | None:
        try:
            return self._out.decode(frame)
        except msgspec.DecodeError:
            logger.warning("dropped an engine frame that does not decode (%d bytes)", len(frame))
            return None

    def _drain(self) -> None:
        """Route every frame waiting (the reader callback): a consumer that fell behind finds
        several steps at once, and merges them. Then every stream routed to is notified, in
        this one callback. After MAX_DRAIN frames the rest waits for the next loop round, so
        that consumers and handlers run now and then."""
        self._drain_soon = False
        sock, handle = self._sock, self._handle
        if self._handshake is not None:
            self._await_ready()
            return
        try:
            for _ in range(MAX_DRAIN):
                if not cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    break
                handle(sock.recv(zmq.NOBLOCK))
            else:
                self._drain_soon = True
                asyncio.get_running_loop().call_soon(self._drain)
        except zmq.ZMQError as exc:  # the socket is closing
            logger.debug("engine socket: %s", exc)
        self._notify()

    def _await_ready(self) -> None:
        """The handshake: frames before Ready are dropped."""
        assert self._handshake is not None
        while self._readable():
            msg = self._decode(self._sock.recv(zmq.NOBLOCK))
            if isinstance(msg, wire.Ready) and not self._handshake.done():
                self._handshake.set_result(msg)
                return

    def _notify(self) -> None:
        news, self._news = self._news, []
        for stream in news:
            try:
                stream.notify()
            except Exception:  # one failing consumer must not keep news from the others
                logger.exception("failed to hand engine outputs to a request")

    def _handle(self, frame: bytes) -> None:
        msg = self._decode(frame)
        self._heard()
        try:
            if isinstance(msg, wire.StepOutputs):
                self._route(msg)
            elif isinstance(msg, wire.UtilityResult):
                self._resolve_call(msg)
        except Exception:  # one bad message must not stop the routing of all others
            logger.exception("failed to route an engine message")

    def _route(self, out: wire.StepOutputs) -> None:
        """Each row that brings anything to its stream, straight from the columns."""
        requests, news = self._requests, self._news
        tokens = wire.read_ints(out.token_ids)
        logprobs = token_logprobs(out)
        if not (out.prompt_logprobs or out.finished):  # the common step: tokens (+ logprobs)
            timings = self.latency.step_timer()
            for rid, token, logprob in zip(out.req_ids, tokens, logprobs or itertools.repeat(None)):
                entry = requests.get(rid)
                if entry is not None and token >= 0:
                    timings(rid)
                    entry[0].put_token(entry[1], token, logprob, news)
            return
        prompts = {p.index: p for p in out.prompt_logprobs}
        finished = {f.index: f for f in out.finished}
        for i, rid in enumerate(out.req_ids):  # shared.step_outputs.unpack_step, inlined
            fin, plp, token = finished.get(i), prompts.get(i), tokens[i]
            if token < 0 and fin is None and plp is None:
                continue
            entry = requests.get(rid)
            if entry is None:
                continue
            logprob = logprobs[i] if logprobs is not None and token >= 0 else None
            self._route_row(rid, entry, token if token >= 0 else None, logprob,
                            None if plp is None else prompt_rows(plp), fin)

    def _route_row(self, rid: str, entry: tuple[OutputStream, int], token: int | None,
                   logprob: TokenLogprob | None, prompt_logprobs: Sequence[TokenLogprob] | None,
                   fin: wire.Finished | None) -> None:
        stream, choice = entry
        self.latency.on_output(rid, token is not None, fin.reason if fin else None)
        if fin is not None and fin.reason is FinishReason.OVERLOADED:
            del self._requests[rid]
            stream.close(rid)
            self.abort(stream.unfinished)  # its sibling choices cannot be answered either
            stream.fail(EngineOverloadedError(fin.message or "the server is overloaded"))
            return
        if fin is not None:
            del self._requests[rid]
        stream.put(rid, StepItem(choice, token, logprob, prompt_logprobs,
                                 fin.reason if fin else None,
                                 fin.stop_token_id if fin else None,
                                 fin.message if fin else None,
                                 fin.embedding if fin else b""), self._news)

    def _resolve_call(self, result: wire.UtilityResult) -> None:
        if result.progress is not None:
            self._judge_progress(result.progress)
        if result.load is not None:
            self._load = result.load
        future = self._calls.get(result.call_id)
        if future is None or future.done():
            return
        if result.error is not None:
            future.set_exception(UtilityError(result.error, result.status))
        else:
            future.set_result(result)

    def _judge_progress(self, progress: wire.StepProgress) -> None:
        """A ping answer says how the engine's busy loop fares: stuck is as good as dead."""
        stalled = is_stalled(progress, self._stall_timeout)
        if stalled and not self._stalled:
            self._stalled = True
            self._mark_dead(f"the engine's step loop has finished no step for "
                            f"{progress.since_step_s:.1f} s while it has work")
        elif self._stalled and not stalled:
            logger.warning("the engine at %s finishes steps again", self.address)
            self._stalled = False
            self._heard()

    def _heard(self) -> None:
        self._unanswered_since = None
        self._unanswered_ticks = 0
        self._busy_said = False
        if not self._healthy and not self._stalled:
            if self._tasks:
                logger.warning("the engine at %s is answering again", self.address)
            self._healthy = True

    async def _heartbeat(self) -> None:
        """Ping every interval; a ping unanswered for `silence_timeout` is judged by
        `_judge_silence` (dead, or busy while the engine's process is up).

        Silence is what the engine owes, not what this process failed to read. It is counted
        from the first unanswered ping, and only in ticks that ran on time: a tick that wakes
        late means this process's own loop was blocked or backlogged, and the engine's answer
        may be waiting unread. Before judging, the tick yields once, so an answer the socket
        has already handed to the routing task (but that task has not run yet) is heard first;
        an answer still waiting in the socket counts as heard too.
        """
        loop = asyncio.get_running_loop()
        interval = self._heartbeat_interval
        last = loop.time()
        while True:
            await asyncio.sleep(interval)
            now = loop.time()
            on_time, last = now - last <= 2 * interval, now
            if self._unanswered_since is not None and on_time:
                self._unanswered_ticks += 1
            if self._healthy and self._silent_for(now) > self._silence_timeout:
                await asyncio.sleep(0)  # let a routed answer reach _heard() first
                silent = self._silent_for(loop.time())
                if silent > self._silence_timeout and not self._readable():
                    self._judge_silence(silent)
            if self._unanswered_since is None:
                self._unanswered_since = now
            self._send(wire.UtilityRequest(next(self._call_ids), "ping"))

    def _judge_silence(self, silent: float) -> None:
        """Silence past `silence_timeout`: death when the engine's process is gone too (its
        link down: killed, stopped, cut off); while the link stands the process runs, and only
        silence past the stall bound is death (its Python held up for good)."""
        assert self._link is not None
        if not self._link.up:
            self._mark_dead(f"the engine stopped answering (no reply for {silent:.1f} s)")
        elif silent > self._stall_timeout:
            self._mark_dead(f"the engine's process is up but has answered no ping for "
                            f"{silent:.1f} s")
        elif not self._busy_said:
            self._busy_said = True
            logger.warning("the engine at %s has not answered for %.1f s, but its process is "
                           "up: busy, not dead (up to %g s)", self.address, silent,
                           self._stall_timeout)

    def _silent_for(self, now: float) -> float:
        """Seconds of silence the engine owes: wall time since the first unanswered ping, but
        no more than the on-time ticks since then account for."""
        if self._unanswered_since is None:
            return 0.0
        return min(now - self._unanswered_since,
                   self._unanswered_ticks * self._heartbeat_interval)

    def _readable(self) -> bool:
        return bool(cast(int, self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def _mark_dead(self, why: str) -> None:
        logger.error("the engine at %s is unavailable: %s", self.address, why)
        self._healthy = False
        ids = list(self._requests)
        self._fail_all(EngineDeadError(why))
        if ids:  # in case it is only slow: do not leave work running there
            self._send(wire.AbortRequest(ids))

    def _fail_all(self, exc: Exception) -> None:
        self.latency.forget_all()
        for stream, _ in self._requests.values():
            stream.fail(exc)
        self._requests.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(exc)

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            asyncio.get_running_loop().remove_reader(self._sock.fileno())

    def _close_socket(self) -> None:
        self._stop_reading()
        # A live engine still gets the last aborts; a dead one must not delay the exit.
        self._sock.close(linger=200 if self._healthy else 0)
        if self._link is not None:
            self._link.close()
        self._healthy = False
        self._ctx.term()
