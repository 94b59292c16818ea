"""Benchmark arithmetic: per-request latencies from a stream's timings, and the run's summary.

Everything here is pure: `RequestResult` is what the client saw of one request (times are
seconds since that request was sent), `summarize` folds a run's results into a `Summary`.

Definitions (the client's view of the stream):
- TTFT: time to the first chunk carrying non-empty text. With `echo` that chunk is the echoed
  prompt, so TTFT then measures the echo, not the first generated token.
- ITL: the gaps between consecutive text chunks after the first (one per chunk, so a chunk that
  carries several tokens counts as one gap).
- TPOT: (e2e latency - TTFT) / (output_tokens - 1); undefined for a single output token.
- output_tokens: the server's usage.completion_tokens, or the number of text chunks without it.
- E2E latency: from sending the request to the end of the stream.

Statistics are vLLM's: mean, median, population standard deviation and the chosen
percentiles (numpy's linear interpolation), in milliseconds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

if TYPE_CHECKING:
    from frontend.bench.spec_decode import SpecDecodeStats


class HasRequests(Protocol):
    """A run's results and summary (a BenchResult) as the pure functions here read them."""

    @property
    def requests(self) -> Sequence[RequestResult]: ...

    @property
    def summary(self) -> Summary: ...


SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class RequestResult:
    """One request as the client saw it; `text_times` are the arrival times of text chunks.

    Invariant: a successful result has at least one text time (the client fails a stream
    that carried no text).
    """

    success: bool
    latency: float = 0.0
    text_times: tuple[float, ...] = ()
    prompt_len: int = 0  # tokens in the prompt as the benchmark built it (no BOS)
    prompt_tokens: int | None = None  # the server's usage.prompt_tokens
    completion_tokens: int | None = None  # the server's usage.completion_tokens
    error: str = ""
    start: float = 0.0  # when it was sent, seconds from the start of its round
    text_chars: int = 0  # characters of text the stream carried (echoed prompt included)


@dataclass(frozen=True)
class Stats:
    """One metric's statistics in milliseconds; `percentiles` maps p (e.g. 99.0) to its value."""

    mean: float
    median: float
    std: float
    percentiles: Mapping[float, float]

    @property
    def p99(self) -> float | None:
        return self.percentiles.get(99.0)


@dataclass(frozen=True)
class Summary:
    """A run's totals and latency statistics; a `Stats` is None when no request measured it."""

    duration_s: float
    completed: int
    failed: int
    prompt_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None
    ttft_ms: Stats | None
    tpot_ms: Stats | None
    itl_ms: Stats | None
    e2el_ms: Stats | None
    errors: Mapping[str, int] = field(default_factory=dict)
    max_output_tokens_per_s: float = 0.0  # the busiest whole second of a round
    max_concurrent_requests: int = 0  # the most requests in flight at once
    # the server's speculative decoding over the run (None: no counters, or nothing drafted)
    spec_decode: SpecDecodeStats | None = None

    def stats(self, metric: str) -> Stats | None:
        """The statistics of "ttft", "tpot", "itl" or "e2el"."""
        value: Stats | None = getattr(self, f"{metric}_ms")
        return value


def ttft(result: RequestResult) -> float:
    """Time to the first text chunk."""
    return result.text_times[0]


def itls(result: RequestResult) -> list[float]:
    """Gaps between consecutive text chunks after the first."""
    return [later - earlier for earlier, later in pairwise(result.text_times)]


def output_tokens(result: RequestResult) -> int:
    """usage.completion_tokens when the server sent it, else the number of text chunks."""
    if result.completion_tokens is not None:
        return result.completion_tokens
    return len(result.text_times)


def prompt_tokens(result: RequestResult) -> int:
    """usage.prompt_tokens when the server sent it (it includes BOS / a chat template)."""
    return result.prompt_tokens if result.prompt_tokens is not None else result.prompt_len


def tpot(result: RequestResult) -> float | None:
    """(latency - TTFT) / (output_tokens - 1), or None for fewer than two output tokens."""
    tokens = output_tokens(result)
    if tokens < 2:
        return None
    return (result.latency - ttft(result)) / (tokens - 1)


def stats_ms(values_s: Sequence[float], percentiles: Sequence[float] = (99.0,)) -> Stats | None:
    """Mean, median, std (population) and percentiles of seconds, in milliseconds."""
    if not values_s:
        return None
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return Stats(
        mean=float(ms.mean()),
        median=float(np.median(ms)),
        std=float(ms.std()),
        percentiles={float(p): float(np.percentile(ms, p)) for p in percentiles},
    )


def parse_percentiles(spec: str) -> tuple[float, ...]:
    """Parse "50,90,99" (vLLM's --metric-percentiles) into (50.0, 90.0, 99.0)."""
    try:
        values = tuple(float(part) for part in spec.split(","))
    except ValueError:
        raise ValueError(f"--metric-percentiles {spec!r}: use numbers, e.g. 50,90,99") from None
    if not all(0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles {spec!r}: each must be in [0, 100]")
    return values


def parse_metrics(spec: str) -> tuple[str, ...]:
    """Parse "ttft,tpot,itl,e2el" (vLLM's --percentile-metrics)."""
    names = tuple(name.strip() for name in spec.split(",") if name.strip())
    unknown = [name for name in names if name not in LATENCY_METRICS]
    if unknown or not names:
        raise ValueError(
            f"--percentile-metrics {spec!r}: use a comma-separated subset of "
            + ",".join(LATENCY_METRICS)
        )
    return names


def token_times(result: RequestResult) -> list[tuple[float, float]]:
    """(time from the round's start, tokens) of each text chunk; a request's output tokens are
    spread evenly over its chunks (a chunk may carry several)."""
    if not result.text_times:
        return []
    share = output_tokens(result) / len(result.text_times)
    return [(result.start + t, share) for t in result.text_times]


def tokens_per_second(results: Sequence[RequestResult]) -> list[float]:
    """Output tokens that arrived in each whole second from the round's start."""
    times = [pair for r in results if r.success for pair in token_times(r)]
    if not times:
        return []
    buckets = [0.0] * (int(max(t for t, _ in times)) + 1)
    for t, tokens in times:
        buckets[int(t)] += tokens
    return buckets


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """The most successful requests in flight at once (an end before a start at a tie)."""
    done = [r for r in results if r.success]
    events = sorted([(r.start, 1) for r in done] + [(r.start + r.latency, -1) for r in done])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def meets_slos(result: RequestResult, slos_ms: Mapping[str, float]) -> bool:
    """True when a successful request meets every given SLO (a missing TPOT counts as 0)."""
    if not result.success:
        return False
    measured = {"ttft": ttft(result), "tpot": tpot(result) or 0.0, "e2el": result.latency}
    return all(measured[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def parse_slos(specs: Sequence[str]) -> dict[str, float]:
    """Parse ["ttft:200", "tpot:50"] into {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs:
        name, _, value = spec.partition(":")
        if name not in SLO_METRICS:
            raise ValueError(f"unknown SLO {name!r} in {spec!r}; use one of {SLO_METRICS}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(
                f"SLO {spec!r} needs a number of milliseconds, e.g. ttft:200"
            ) from None
        if slos[name] <= 0:
            raise ValueError(f"SLO {spec!r} must be positive")
    return slos


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    slos_ms: Mapping[str, float] | None = None,
    percentiles: Sequence[float] = (99.0,),
) -> Summary:
    """Fold a run's results into totals and statistics; failed requests only count as failed.

    The peaks (tokens/s, concurrency) assume the results come from one round (start times
    count from one origin); `merge_rounds` takes the largest over rounds."""
    done = [r for r in results if r.success]
    prompt = sum(prompt_tokens(r) for r in done)
    output = sum(output_tokens(r) for r in done)
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error] = errors.get(r.error, 0) + 1
    per_second = 1.0 / duration_s if duration_s > 0 else 0.0
    good = sum(meets_slos(r, slos_ms) for r in done) if slos_ms else None
    return Summary(
        duration_s=duration_s,
        completed=len(done),
        failed=len(results) - len(done),
        prompt_tokens=prompt,
        output_tokens=output,
        request_throughput=len(done) * per_second,
        output_throughput=output * per_second,
        total_token_throughput=(prompt + output) * per_second,
        goodput=None if good is None else good * per_second,
        ttft_ms=stats_ms([ttft(r) for r in done], percentiles),
        tpot_ms=stats_ms([t for r in done if (t := tpot(r)) is not None], percentiles),
        itl_ms=stats_ms([gap for r in done for gap in itls(r)], percentiles),
        e2el_ms=stats_ms([r.latency for r in done], percentiles),
        errors=errors,
        max_output_tokens_per_s=max(tokens_per_second(done), default=0.0),
        max_concurrent_requests=peak_concurrency(done),
    )


class CurvePoint(NamedTuple):
    """One run on a throughput-latency curve (latencies in ms, None when unmeasured)."""

    output_throughput: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None


def curve_point(result: HasRequests) -> CurvePoint:
    """A run's output tokens/s against its TTFT p50/p99 and TPOT p50."""
    done = [r for r in result.requests if r.success]
    ttfts = stats_ms([ttft(r) for r in done], (50.0, 99.0))
    tpots = stats_ms([t for r in done if (t := tpot(r)) is not None], (50.0,))
    return CurvePoint(
        result.summary.output_throughput,
        ttfts.percentiles[50.0] if ttfts else None,
        ttfts.percentiles[99.0] if ttfts else None,
        tpots.percentiles[50.0] if tpots else None,
    )
