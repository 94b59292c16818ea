"""Prometheus `/metrics` rendering: the whole server's figures, whichever frontend answers.

Design. The engines are the source of truth. At scrape time the frontend asks every serving
engine for "stats" (the handler is in `frontend.server`) and `render` writes them with vLLM's
metric names, each series labelled with its engine's rank (`engine="K"`, vLLM's label; one
engine is engine "0"): the gauges (running, waiting, KV cache usage), counters (tokens, finished
requests by reason, prefix cache, preemptions) and `vllm:cache_config_info` (block size,
`cache_dtype` and block count, what llm-d's endpoint picker reads next to the queue gauges)
are the engine's own.
With speculative decoding (the engines' `Ready` says how many tokens a draft has), vLLM's
`spec_decode` counters too, with vLLM's help texts and a series per draft position, and only
then, as vLLM creates them only with a speculative config (`tests/data/spec_decode/` holds the
lines vLLM 0.32 writes; the `_created` series prometheus-client adds to vLLM's are left out, as
for every counter here).
Latencies (TTFT, inter-token, end-to-end) can only be measured where tokens arrive, in the
frontends: each frontend's `LatencyRecorder` (frontend/engine/latency.py) buckets its
observations and sends them to the engine that ran the requests as `MetricsReport` messages,
which the engine adds up and returns with "stats" (engine_core/metrics.py).

Why reports to the engine rather than prometheus-client's multiprocess mode: the frontends of
one server are not always on one host. Frontends started with `tandem frontend` on other
machines share no PROMETHEUS_MULTIPROC_DIR, and in multiprocess mode each would show its own
latencies next to the engine's global counters. Through the engine every frontend, local or
remote, shows the same complete figures; there are no files to clean up between runs, and no
mmap per process and metric. The cost is one small message per frontend at most every
`flush_interval` (sooner when a request finishes, so a scrape right after a response already
counts it) and, for other frontends, that much lag in the histograms.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from frontend.engine.latency import BUCKETS, E2E, FINISHED, ITL, TTFT
from shared.messages import EngineStats, FinishReason, Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# tandem:requests_rejected's reason values (request_success_total's are FINISHED)
REJECTED = (FinishReason.OVERLOADED, FinishReason.ERROR)


def render(engines: Sequence[tuple[int, EngineStats]], model_name: str,
           spec_tokens: int = 0, max_loras: int = 0) -> bytes:
    """The Prometheus text exposition of the engines' figures, by (rank, stats); with
    `spec_tokens` (the draft length, 0: no speculation) the spec_decode counters too; with
    `max_loras` (--enable-lora's, 0: off) vllm:lora_requests_info."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(engines, model_name, spec_tokens))
    if max_loras:
        registry.register(_LoRAInfo(engines, max_loras))
    return generate_latest(registry)


class _LoRAInfo:
    """vLLM's `vllm:lora_requests_info`: a gauge whose labels name the adapters with requests
    and whose value is when that was seen (time.time()). As vLLM 0.32 writes it, both
    `running_lora_adapters` and `waiting_lora_adapters` list every adapter with a running or
    waiting request (its LoRARequestStates keys both by every adapter it tracks), and the
    series has no engine label: engines whose adapters agree share one series (the latest
    time), the others have their own (tests/data/lora_metrics/ holds vLLM's lines)."""

    def __init__(self, engines: Sequence[tuple[int, EngineStats]], max_loras: int) -> None:
        self.engines, self.max_loras = engines, max_loras

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                   labels=["max_lora", "running_lora_adapters",
                                           "waiting_lora_adapters"])
        latest: dict[str, float] = {}
        for _, stats in self.engines:
            names = ",".join(stats.lora_running)  # (lora_waiting has the same keys)
            latest[names] = max(latest.get(names, 0.0), stats.lora_time)
        for names, when in latest.items():
            family.add_metric([str(self.max_loras), names, names], when)
        yield family


class _StatsCollector:
    """A one-scrape prometheus-client collector over the engines' stats snapshots: one family
    per metric, one series per engine in it."""

    def __init__(self, engines: Sequence[tuple[int, EngineStats]], model_name: str,
                 spec_tokens: int) -> None:
        self.engines = engines
        self.model = model_name
        self.spec_tokens = spec_tokens

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for rank, stats in self.engines:
            for family in _EngineSeries(self.model, str(rank), self.spec_tokens).families(stats):
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        yield from families.values()


class _EngineSeries:
    """One engine's series, labelled with its model name and rank."""

    def __init__(self, model_name: str, engine: str, spec_tokens: int = 0) -> None:
        self.model = model_name
        self.engine = engine
        self.spec_tokens = spec_tokens

    def families(self, stats: EngineStats) -> Iterator[Metric]:
        yield self._info("vllm:cache_config_info", "The KV cache's configuration.", {
            "block_size": str(stats.block_size), "cache_dtype": stats.cache_dtype or "auto",
            "num_gpu_blocks": str(stats.num_blocks)})
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
        yield self._counter("tandem:engine_step_errors", "Engine steps that raised; their "
                            "requests finished with an error and the engine kept serving.",
                            stats.step_errors)
        yield self._counter("tandem:frontends_lost", "Frontends that went silent; the engine "
                            "aborted their requests.", stats.frontends_lost)
        yield self._counter("tandem:kv_events_dropped", "KV-cache event batches the engine's "
                            "publisher had no room for (--kv-events-config max_queue_size).",
                            stats.kv_events_dropped)
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
        if self.spec_tokens:
            yield from self._spec_decode(stats)

    def _spec_decode(self, stats: EngineStats) -> Iterator[Metric]:
        """vLLM's spec_decode counters (its SpecDecodingProm: names, help texts, a series per
        draft position 0..k-1, zeros included, positions past k left out)."""
        yield self._counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                            stats.spec_drafts)
        yield self._counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                            stats.spec_draft_tokens)
        yield self._counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                            stats.spec_accepted_tokens)
        per_pos = list(stats.spec_accepted_per_pos[:self.spec_tokens])
        per_pos += [0] * (self.spec_tokens - len(per_pos))
        yield self._by_label("vllm:spec_decode_num_accepted_tokens_per_pos",
                             "Accepted tokens per draft position.", "position",
                             {str(pos): count for pos, count in enumerate(per_pos)})

    def _info(self, name: str, doc: str, labels: dict[str, str]) -> Metric:
        """vLLM's `*_info` gauges: value 1, the facts in the labels."""
        family = GaugeMetricFamily(name, doc, labels=["engine", *labels])
        family.add_metric([self.engine, *labels.values()], 1.0)
        return family

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        family = GaugeMetricFamily(name, doc, labels=["model_name", "engine"])
        family.add_metric([self.model, self.engine], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        family = CounterMetricFamily(name, doc, labels=["model_name", "engine"])
        family.add_metric([self.model, self.engine], value)
        return family

    def _by_label(self, name: str, doc: str, label: str, values: dict[str, float]) -> Metric:
        family = CounterMetricFamily(name, doc, labels=["model_name", "engine", label])
        for key, value in values.items():
            family.add_metric([self.model, self.engine, key], value)
        return family

    def _histogram(self, name: str, doc: str, totals: Histogram | None) -> Metric:
        """From the engine's totals, or empty with this frontend's buckets before any report."""
        bounds = list(totals.bounds) if totals else list(BUCKETS[name])
        counts = list(totals.counts) if totals else [0] * (len(bounds) + 1)
        buckets, running = [], 0
        for le, count in zip([*map(floatToGoString, bounds), "+Inf"], counts):
            running += count
            buckets.append((le, float(running)))
        family = HistogramMetricFamily(name, doc, labels=["model_name", "engine"])
        family.add_metric([self.model, self.engine], buckets, totals.sum if totals else 0.0)
        return family
