"""Printing and saving benchmark results: one summary table per target (laid out as vLLM's),
the A/B ratio table of a comparison, a sweep's table, and Tandem's own JSON result file
(config, totals, statistics, per-request arrays; vLLM's flat file is vllm_result.py's)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from frontend.bench.metrics import (
    LATENCY_METRICS,
    Stats,
    Summary,
    curve_point,
    itls,
    output_tokens,
    tpot,
    ttft,
)

if TYPE_CHECKING:
    from frontend.bench import BenchConfig, BenchResult
    from frontend.bench.spec_decode import SpecDecodeStats

WIDTH = 50  # vLLM's table width
METRIC_TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
THROUGHPUTS = (
    ("request_throughput", "Request throughput (req/s)"),
    ("goodput", "Request goodput (req/s)"),
    ("output_throughput", "Output token throughput (tok/s)"),
    ("max_output_tokens_per_s", "Peak output token throughput (tok/s)"),
    ("max_concurrent_requests", "Peak concurrent requests"),
    ("total_token_throughput", "Total token throughput (tok/s)"),
)


def row(label: str, value: object) -> str:
    """One line as vLLM prints it: the label in 40 columns, then the value."""
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label + ':':<40} {text:<10}"


def percentile_name(p: float) -> str:
    """vLLM's spelling of a percentile: 99.0 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def format_summary(
    result: BenchResult,
    config: BenchConfig | None = None,
    metrics: Sequence[str] = LATENCY_METRICS,
) -> str:
    """The table printed for one target, laid out as `vllm bench serve` prints its own."""
    s = result.summary
    title = f" Serving Benchmark Result {result.target.label} "
    lines = [
        f"{title:=^{WIDTH}}",
        row("Server", result.target.base_url),
        row("Model", result.model),
        row("Successful requests", s.completed),
        row("Failed requests", s.failed),
    ]
    if config is not None and config.max_concurrency is not None:
        lines.append(row("Maximum request concurrency", config.max_concurrency))
    if config is not None and not math.isinf(config.request_rate):
        lines.append(row("Request rate configured (RPS)", config.request_rate))
    lines += [
        row("Benchmark duration (s)", s.duration_s),
        row("Total input tokens", s.prompt_tokens),
        row("Total generated tokens", s.output_tokens),
    ]
    for key, label in THROUGHPUTS:
        if getattr(s, key) is not None:  # goodput only with SLOs
            lines.append(row(label, getattr(s, key)))
    for metric in metrics:
        lines += metric_lines(metric, s.stats(metric))
    if s.spec_decode is not None:
        lines += spec_decode_lines(s.spec_decode)
    for message, count in sorted(s.errors.items(), key=lambda item: -item[1])[:5]:
        lines.append(f"error x{count}: {message[: WIDTH * 3]}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def metric_lines(metric: str, stats: Stats | None) -> list[str]:
    """Mean, median, std and percentiles of one metric under its header."""
    short, header = METRIC_TITLES[metric]
    lines = [f"{header:-^{WIDTH}}"]
    if stats is None:
        return [*lines, row(f"{short} (ms)", "n/a")]
    lines += [
        row(f"Mean {short} (ms)", stats.mean),
        row(f"Median {short} (ms)", stats.median),
        row(f"Std {short} (ms)", stats.std),
    ]
    lines += [row(f"P{percentile_name(p)} {short} (ms)", v) for p, v in stats.percentiles.items()]
    return lines


def spec_decode_lines(spec: SpecDecodeStats) -> list[str]:
    """The server's speculative decoding over the run, as `vllm bench serve` prints it."""
    lines = [
        f"{'Speculative Decoding':-^{WIDTH}}",
        row("Acceptance rate (%)", spec.acceptance_rate),
        row("Acceptance length", spec.acceptance_length),
        row("Drafts", spec.num_drafts),
        row("Draft tokens", spec.draft_tokens),
        row("Accepted tokens", spec.accepted_tokens),
    ]
    if spec.per_position_acceptance_rates:
        lines.append("Per-position acceptance (%):")
        lines += [row(f"  Position {i}", rate * 100)
                  for i, rate in enumerate(spec.per_position_acceptance_rates)]
    return lines


def fmt(value: float | str | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}" if isinstance(value, float) else value


Comparable = tuple[str, float | None, float | None, str]


def comparison_rows(a: Summary, b: Summary, metrics: Sequence[str]) -> list[Comparable]:
    """(metric, A, B, better) for every throughput and chosen latency statistic."""
    rows: list[Comparable] = [
        (label, float(getattr(a, key)), float(getattr(b, key)), "higher")
        for key, label in THROUGHPUTS
        if getattr(a, key) is not None and getattr(b, key) is not None
    ]
    for metric in metrics:
        short = METRIC_TITLES[metric][0]
        stats_a, stats_b = a.stats(metric), b.stats(metric)
        for name, pick in stat_pickers(stats_a or stats_b):
            rows.append((f"{name} {short} (ms)", pick(stats_a), pick(stats_b), "lower"))
    if a.spec_decode is not None or b.spec_decode is not None:
        for key, label in SPEC_FIGURES:
            rows.append((label, spec_figure(a, key), spec_figure(b, key), "higher"))
    return rows


SPEC_FIGURES = (("acceptance_rate", "Acceptance rate (%)"),
                ("acceptance_length", "Acceptance length"))


def spec_figure(summary: Summary, key: str) -> float | None:
    """A speculative decoding figure, None (n/a) for a server that reported none."""
    return None if summary.spec_decode is None else float(getattr(summary.spec_decode, key))


Picker = Callable[[Stats | None], float | None]


def stat_pickers(stats: Stats | None) -> list[tuple[str, Picker]]:
    """How to read mean, median and each percentile from a Stats (None reads as None)."""
    pickers: list[tuple[str, Picker]] = [
        ("Mean", lambda st: st.mean if st else None),
        ("Median", lambda st: st.median if st else None),
    ]
    for p in stats.percentiles if stats else ():
        pickers.append((f"P{percentile_name(p)}", percentile_picker(p)))
    return pickers


def percentile_picker(p: float) -> Picker:
    return lambda st: st.percentiles.get(p) if st else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def format_comparison(
    a: BenchResult, b: BenchResult, metrics: Sequence[str] = LATENCY_METRICS
) -> str:
    """The A/B table: A/B > 1 is better for throughputs, A/B < 1 is better for latencies."""
    width = 86
    lines = [
        f"{' Comparison ':=^{width}}",
        f"A = {a.target.base_url} ({a.model})",
        f"B = {b.target.base_url} ({b.model})",
        "A/B: above 1 means A is better where higher is better (throughput),",
        "     below 1 means A is better where lower is better (latency).",
        f"{'Metric':<38}{'A':>10}{'B':>10}{'A/B':>10}{'better':>18}",
    ]
    for label, value_a, value_b, better in comparison_rows(a.summary, b.summary, metrics):
        direction = f"{better} (A/B {'>' if better == 'higher' else '<'} 1)"
        cells = f"{fmt(value_a):>10}{fmt(value_b):>10}{fmt(ratio(value_a, value_b)):>10}"
        lines.append(f"{label[:37]:<38}{cells}{direction:>18}")
    lines.append("=" * width)
    return "\n".join(lines)


def format_sweep(kind: str, points: Sequence[tuple[float, Sequence[BenchResult]]]) -> str:
    """One line per point and target: output tok/s, TTFT p50/p99 and TPOT p50 (ms)."""
    names = ("out tok/s", "TTFT p50", "TTFT p99", "TPOT p50")
    header = f"{kind:<16}{'server':<8}" + "".join(f"{name:>11}" for name in names)
    lines = [f"{' Sweep ':=^{len(header)}}", header]
    for value, results in points:
        for result in results:
            cells = "".join(f"{fmt(cell):>11}" for cell in curve_point(result))
            lines.append(f"{value:<16g}{result.target.label:<8}{cells}")
    lines.append("=" * len(header))
    return "\n".join(lines)


def result_json(config: BenchConfig, results: Sequence[BenchResult]) -> dict[str, Any]:
    """Everything a later analysis needs; API keys are redacted."""
    return {
        "config": jsonable(dataclasses.asdict(config)),
        "results": [target_json(result) for result in results],
    }


def target_json(result: BenchResult) -> dict[str, Any]:
    requests = result.requests
    return {
        "target": jsonable(dataclasses.asdict(result.target)),
        "model": result.model,
        "round_durations_s": list(result.round_durations_s),
        "round_sizes": [len(one.requests) for one in result.rounds],
        "summary": dataclasses.asdict(result.summary),
        "requests": {
            "success": [r.success for r in requests],
            "error": [r.error for r in requests],
            "prompt_len": [r.prompt_len for r in requests],
            "prompt_tokens": [r.prompt_tokens for r in requests],
            "output_tokens": [output_tokens(r) if r.success else 0 for r in requests],
            "ttft_s": [ttft(r) if r.success else None for r in requests],
            "tpot_s": [tpot(r) if r.success else None for r in requests],
            "itl_s": [itls(r) if r.success else [] for r in requests],
            "e2el_s": [r.latency for r in requests],
            "start_s": [r.start for r in requests],
        },
    }


def jsonable(value: Any) -> Any:
    """A copy for strict JSON: non-empty api_key values become "***", infinities "inf"."""
    if isinstance(value, dict):
        return {k: "***" if k == "api_key" and v else jsonable(v) for k, v in value.items()}
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def write_result_file(
    path: str | Path, config: BenchConfig, results: Sequence[BenchResult]
) -> None:
    """Write `result_json` to `path`."""
    Path(path).write_text(json.dumps(result_json(config, results), indent=2, allow_nan=False))
