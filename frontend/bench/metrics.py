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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")


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


@dataclass(frozen=True)
class Stats:
    """Mean, median and 99th percentile of one metric, in milliseconds."""

    mean: float
    median: float
    p99: float


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


def stats_ms(values_s: Sequence[float]) -> Stats | None:
    """Mean / median / p99 (numpy's linear interpolation) of seconds, in milliseconds."""
    if not values_s:
        return None
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return Stats(
        mean=float(ms.mean()),
        median=float(np.median(ms)),
        p99=float(np.percentile(ms, 99)),
    )


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
    results: Sequence[RequestResult], duration_s: float, slos_ms: Mapping[str, float] | None = None
) -> Summary:
    """Fold a run's results into totals and statistics; failed requests only count as failed."""
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
        ttft_ms=stats_ms([ttft(r) for r in done]),
        tpot_ms=stats_ms([t for r in done if (t := tpot(r)) is not None]),
        itl_ms=stats_ms([gap for r in done for gap in itls(r)]),
        e2el_ms=stats_ms([r.latency for r in done]),
        errors=errors,
    )
