"""Latencies measured where tokens arrive: TTFT, inter-token and end-to-end, per engine request.

Each frontend's `LatencyRecorder` buckets its observations (`HistogramBuffer`, with vLLM's
bucket bounds) and sends them to the engine as `MetricsReport` messages; the engine adds every
frontend's reports up and returns the totals with "stats", which `frontend.metrics` renders.
Why through the engine, and when reports are sent: see `frontend.metrics`.

Definitions (per engine request, so each of n choices counts): TTFT from the moment the
frontend hands the request to the engine to its first sampled token; inter-token latency
between consecutive tokens; end-to-end from hand-over to finish, for requests finished by
stop, length or abort (requests the engine refused are counted apart, by reason). A prompt-only
request (max_tokens 0) samples no token, so it has an end-to-end latency but no TTFT.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from shared.messages import FinishReason, Histogram, MetricsReport

logger = logging.getLogger(__name__)

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
E2E = "vllm:e2e_request_latency_seconds"
BUCKETS: dict[str, tuple[float, ...]] = {
    TTFT: (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
           7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0),
    ITL: (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
          2.5, 5.0, 10.0, 20.0, 80.0),
    E2E: (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
          240.0, 480.0, 960.0, 1920.0, 7680.0),
}
# The finish reasons that count as finished requests (end-to-end latency, request_success_total)
FINISHED = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT)


class HistogramBuffer:
    """Observations of one histogram since the last `take()`."""

    def __init__(self, name: str, bounds: tuple[float, ...]) -> None:
        self.name = name
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += 1  # le: value <= bound
        self._sum += value

    def take(self) -> Histogram | None:
        """The observations so far (None if there are none), and start afresh."""
        if not any(self._counts):
            return None
        taken = Histogram(self.name, list(self.bounds), self._counts, self._sum)
        self._counts, self._sum = [0] * (len(self.bounds) + 1), 0.0
        return taken


@dataclass(slots=True)
class _Timing:
    start: float
    last_token: float | None = None


class LatencyRecorder:
    """Times each engine request of one frontend and reports to the engine through `send`.

    The EngineClient calls `on_add`, `on_output` for every row routed to a request, and
    `on_finish` when it aborts one itself. Sending is best effort: metrics never fail a request.
    """

    def __init__(self, send: Callable[[MetricsReport], None], flush_interval: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._send = send
        self._interval = flush_interval
        self._clock = clock
        self._open: dict[str, _Timing] = {}
        self._buffers = {name: HistogramBuffer(name, bounds) for name, bounds in BUCKETS.items()}
        self._flush: asyncio.Handle | None = None
        self._flush_is_soon = False

    def on_add(self, request_id: str) -> None:
        self._open[request_id] = _Timing(self._clock())

    def on_output(self, request_id: str, token: bool, finish_reason: str | None) -> None:
        timing = self._open.get(request_id)
        if timing is None:
            return
        now = self._clock()
        if token:
            if timing.last_token is None:
                self._buffers[TTFT].observe(now - timing.start)
            else:
                self._buffers[ITL].observe(now - timing.last_token)
            timing.last_token = now
            self._schedule(soon=False)
        if finish_reason is not None:
            self.on_finish(request_id, finish_reason)

    def step_timer(self) -> Callable[[str], None]:
        """`on_output(request_id, True, None)` for the rows of one engine message, which share
        one clock reading: a step's rows arrive together."""
        now = self._clock()
        timings, ttft, itl = self._open, self._buffers[TTFT], self._buffers[ITL]
        self._schedule(soon=False)

        def token(request_id: str) -> None:
            timing = timings.get(request_id)
            if timing is None:
                return
            if timing.last_token is None:
                ttft.observe(now - timing.start)
            else:
                itl.observe(now - timing.last_token)
            timing.last_token = now

        return token

    def on_finish(self, request_id: str, reason: str) -> None:
        timing = self._open.pop(request_id, None)
        if timing is not None and reason in FINISHED:
            self._buffers[E2E].observe(self._clock() - timing.start)
            self._schedule(soon=True)

    def forget_all(self) -> None:
        """The engine is gone: the open requests will never finish."""
        self._open.clear()

    def flush(self) -> None:
        """Send what was observed since the last report, if anything."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        histograms = [h for h in (b.take() for b in self._buffers.values()) if h is not None]
        if histograms:
            try:
                self._send(MetricsReport(histograms))
            except zmq.ZMQError as exc:  # the socket is closing: these observations are lost
                logger.debug("latency report not sent: %s", exc)

    def _schedule(self, soon: bool) -> None:
        if self._flush is not None and (self._flush_is_soon or not soon):
            return
        if self._flush is not None:
            self._flush.cancel()
        loop = asyncio.get_running_loop()
        if soon:  # once the rows of this engine message are routed
            self._flush = loop.call_soon(self.flush)
        else:
            self._flush = loop.call_later(self._interval, self.flush)
        self._flush_is_soon = soon
