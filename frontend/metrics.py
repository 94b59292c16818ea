"""Prometheus `/metrics`: the whole server's figures, whichever frontend answers the scrape.

Design. The engine is the single source of truth. At scrape time the frontend asks it for
"stats" and renders them with vLLM's metric names: the gauges (running, waiting, KV cache
usage) and counters (tokens, finished requests by reason, prefix cache, preemptions) are the
engine's own. Latencies (TTFT, inter-token, end-to-end) can only be measured where tokens
arrive, in the frontends: each frontend's `LatencyRecorder` buckets its observations and sends
them to the engine as `MetricsReport` messages, which the engine adds up and returns with
"stats" (engine_core/metrics.py).

Why reports to the engine rather than prometheus-client's multiprocess mode: the frontends of
one server are not always on one host. Frontends started with `tandem frontend` on other
machines share no PROMETHEUS_MULTIPROC_DIR, and in multiprocess mode each would show its own
latencies next to the engine's global counters. Through the engine every frontend, local or
remote, shows the same complete figures; there are no files to clean up between runs, and no
mmap per process and metric. The cost is one small message per frontend at most every
`flush_interval` (sooner when a request finishes, so a scrape right after a response already
counts it) and, for other frontends, that much lag in the histograms.

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from frontend.errors import OpenAIError
from shared.messages import EngineStats, FinishReason, Histogram, MetricsReport

if TYPE_CHECKING:  # engine_client imports this module for LatencyRecorder
    from frontend.engine_client import EngineClient

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
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
# request_success_total's finished_reason values, and the reasons of refused requests
FINISHED = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT)
REJECTED = (FinishReason.OVERLOADED, FinishReason.ERROR)


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


def render(stats: EngineStats, model_name: str) -> bytes:
    """The Prometheus text exposition of the engine's figures."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(stats, model_name))
    return generate_latest(registry)


async def metrics_response(client: EngineClient, model_name: str) -> web.Response:
    """GET /metrics: 503 when the engine, which holds the figures, does not answer."""
    client.latency.flush()  # this frontend's latest observations reach the engine first
    try:
        stats = await client.stats()
    except (RuntimeError, TimeoutError) as exc:  # EngineDeadError, UtilityError, no answer
        message = f"Metrics are unavailable: the engine did not answer ({exc})."
        return OpenAIError(503, message).to_response()
    return web.Response(body=render(stats, model_name), headers={"Content-Type": CONTENT_TYPE})


class _StatsCollector:
    """A one-scrape prometheus-client collector over one stats snapshot."""

    def __init__(self, stats: EngineStats, model_name: str) -> None:
        self.stats = stats
        self.model = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        yield self._gauge("vllm:num_requests_running", "Requests running in the engine now.",
                          stats.running)
        yield self._gauge("vllm:num_requests_waiting", "Requests queued for a slot now.",
                          stats.waiting)
        usage = 1.0 - stats.free_blocks / stats.num_blocks if stats.num_blocks else 0.0
        yield self._gauge("vllm:kv_cache_usage_perc",
                          "Fraction of KV-cache blocks in use (1 = full).", usage)
        yield self._counter("vllm:prompt_tokens", "Prompt tokens of requests whose prefill "
                            "completed (prefix-cache hits included).", stats.request_prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Tokens sampled.", stats.generation_tokens)
        yield self._by_label("vllm:request_success", "Requests finished, by reason.",
                             "finished_reason", {r: stats.finished.get(r, 0) for r in FINISHED})
        yield self._by_label("tandem:requests_rejected", "Requests the engine refused: "
                             "'overloaded' (queue full, answered 503) or 'error' (invalid).",
                             "reason", {r: stats.rejected.get(r, 0) for r in REJECTED})
        yield self._counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                            "cache.", stats.prefix_queries)
        yield self._counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                            stats.prefix_hits)
        yield self._counter("vllm:num_preemptions", "Requests preempted for lack of KV cache "
                            "(recomputed later).", stats.preemptions)
        reported = {h.name: h for h in stats.histograms}
        for name, doc in ((TTFT, "Time to first token, seconds."),
                          (ITL, "Time between consecutive tokens of a request, seconds."),
                          (E2E, "Request latency from arrival to finish, seconds.")):
            yield self._histogram(name, doc, reported.get(name))

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self.model], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self.model], value)
        return family

    def _by_label(self, name: str, doc: str, label: str, values: dict[str, float]) -> Metric:
        family = CounterMetricFamily(name, doc, labels=["model_name", label])
        for key, value in values.items():
            family.add_metric([self.model, key], value)
        return family

    def _histogram(self, name: str, doc: str, totals: Histogram | None) -> Metric:
        """From the engine's totals, or empty with this frontend's buckets before any report."""
        bounds = list(totals.bounds) if totals else list(BUCKETS[name])
        counts = list(totals.counts) if totals else [0] * (len(bounds) + 1)
        buckets, running = [], 0
        for le, count in zip([*map(floatToGoString, bounds), "+Inf"], counts):
            running += count
            buckets.append((le, float(running)))
        family = HistogramMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self.model], buckets, totals.sum if totals else 0.0)
        return family
