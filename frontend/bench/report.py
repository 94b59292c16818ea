"""Printing and saving benchmark results: one summary table per target, the A/B ratio table
of a comparison, and the JSON result file (config, totals, statistics, per-request arrays)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from frontend.bench.metrics import Stats, Summary, itls, output_tokens, tpot, ttft

if TYPE_CHECKING:
    from frontend.bench import BenchConfig, BenchResult

WIDTH = 64
LATENCIES = (
    ("ttft_ms", "TTFT"),
    ("tpot_ms", "TPOT"),
    ("itl_ms", "ITL"),
    ("e2el_ms", "E2E latency"),
)
THROUGHPUTS = (
    ("request_throughput", "Request throughput (req/s)"),
    ("output_throughput", "Output token throughput (tok/s)"),
    ("total_token_throughput", "Total token throughput (tok/s)"),
    ("goodput", "Goodput (req/s)"),
)


def row(label: str, value: object) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label + ':':<44}{text:>20}"


def format_summary(result: BenchResult) -> str:
    """The table printed for one target."""
    s = result.summary
    title = f" Benchmark result {result.target.label}: {result.target.base_url} "
    lines = [
        f"{title:=^{WIDTH}}",
        row("Model", result.model),
        row("Successful requests", s.completed),
        row("Failed requests", s.failed),
        row("Benchmark duration (s)", s.duration_s),
        row("Prompt tokens (server usage, incl. BOS)", s.prompt_tokens),
        row("Output tokens", s.output_tokens),
    ]
    for key, label in THROUGHPUTS:
        if getattr(s, key) is not None:  # goodput only with SLOs
            lines.append(row(label, getattr(s, key)))
    lines.append(f"{' Latency (ms) ':-^{WIDTH}}")
    lines.append(f"{'':<28}{'mean':>12}{'median':>12}{'p99':>12}")
    for key, label in LATENCIES:
        stats: Stats | None = getattr(s, key)
        values = (stats.mean, stats.median, stats.p99) if stats else ("n/a",) * 3
        lines.append(f"{label:<28}" + "".join(f"{fmt(v):>12}" for v in values))
    for message, count in sorted(s.errors.items(), key=lambda item: -item[1])[:5]:
        lines.append(f"error x{count}: {message[: WIDTH * 2]}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def fmt(value: float | str | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}" if isinstance(value, float) else value


def comparison_rows(a: Summary, b: Summary) -> list[tuple[str, float | None, float | None, str]]:
    """(metric, A, B, better) for every throughput and latency metric of the two summaries."""
    rows: list[tuple[str, float | None, float | None, str]] = [
        (label, getattr(a, key), getattr(b, key), "higher")
        for key, label in THROUGHPUTS
        if getattr(a, key) is not None
    ]
    for key, label in LATENCIES:
        for part in ("mean", "median", "p99"):
            name = f"{part.capitalize()} {label} (ms)"
            rows.append((name, stat(getattr(a, key), part), stat(getattr(b, key), part), "lower"))
    return rows


def stat(stats: Stats | None, part: str) -> float | None:
    return getattr(stats, part) if stats else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def format_comparison(a: BenchResult, b: BenchResult) -> str:
    """The A/B table: A/B > 1 is better for throughputs, A/B < 1 is better for latencies."""
    lines = [
        f"{' Comparison ':=^{WIDTH + 22}}",
        f"A = {a.target.base_url} ({a.model})",
        f"B = {b.target.base_url} ({b.model})",
        "A/B: above 1 means A is better where higher is better (throughput),",
        "     below 1 means A is better where lower is better (latency).",
        f"{'Metric':<34}{'A':>12}{'B':>12}{'A/B':>10}{'better':>18}",
    ]
    for label, value_a, value_b, better in comparison_rows(a.summary, b.summary):
        direction = f"{better} (A/B {'>' if better == 'higher' else '<'} 1)"
        cells = f"{fmt(value_a):>12}{fmt(value_b):>12}{fmt(ratio(value_a, value_b)):>10}"
        lines.append(f"{label:<34}{cells}{direction:>18}")
    lines.append("=" * (WIDTH + 22))
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
