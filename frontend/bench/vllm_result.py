"""`--save-result`: one target's run as the flat JSON file `vllm bench serve --save-result`
writes, with the same key names and units, so the scripts and dashboards built on vLLM's files
read ours (the keys were checked against vllm/benchmarks/serve.py; the test names them).

Units, as vLLM's: statistics in milliseconds (`mean_ttft_ms`, `p99_itl_ms`, ...), durations
and per-request arrays in seconds (`duration`, `ttfts`, `itls`, `latencies`), throughputs per
second. A statistic no request measured is 0.0, as vLLM writes it. `total_input_tokens` is
the servers' own usage.prompt_tokens (BOS or a chat template included) when they send it.
The per-request arrays (`input_lens`, `output_lens`, `ttfts`, `itls`, `latencies`,
`start_times`, `errors`) are always written (vLLM keeps them only with --save-detailed);
`start_times` count from the start of the request's round. When the server published
speculative decoding's counters and drafted in the run, vLLM's `spec_decode_*` keys too
(`spec_decode_acceptance_rate` in percent, the per-position rates as fractions).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from frontend.bench.metrics import LATENCY_METRICS, Stats, Summary, itls, output_tokens, ttft
from frontend.bench.report import percentile_name

if TYPE_CHECKING:
    from frontend.bench import BenchConfig, BenchResult
    from frontend.bench.spec_decode import SpecDecodeStats

BACKENDS = {"completions": "openai", "chat": "openai-chat",  # vLLM's --backend names
            "embeddings": "openai-embeddings"}
DATE_FORMAT = "%Y%m%d-%H%M%S"


@dataclass(frozen=True)
class SaveOptions:
    """vLLM's --label, --result-dir and --result-filename."""

    label: str | None = None
    result_dir: str | None = None
    result_filename: str | None = None


def vllm_result(
    config: BenchConfig,
    result: BenchResult,
    date: str,
    label: str | None = None,
    metrics: Sequence[str] = LATENCY_METRICS,
) -> dict[str, Any]:
    """The flat dict vLLM saves: run settings, totals, per-request arrays, statistics."""
    backend = BACKENDS[config.endpoint]
    out: dict[str, Any] = {
        "date": date,
        "endpoint_type": backend,
        "backend": backend,
        "label": label,
        "model_id": result.model,
        "tokenizer_id": config.tokenizer,
        "num_prompts": config.num_prompts,
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
    }
    if config.ramp_up is not None:
        out["ramp_up_strategy"] = config.ramp_up.strategy
        out["ramp_up_start_rps"] = config.ramp_up.start_rps
        out["ramp_up_end_rps"] = config.ramp_up.end_rps
    out |= totals(result.summary, bool(config.goodput_slos_ms))
    out |= per_request(result)
    for metric in metrics:
        out |= statistic_keys(metric, result.summary.stats(metric), config.percentiles)
    if result.summary.spec_decode is not None:
        out |= spec_decode_keys(result.summary.spec_decode)
    out["base_url"] = result.target.base_url  # Tandem's addition: which server this was
    return out


def totals(s: Summary, with_goodput: bool) -> dict[str, Any]:
    return {
        "duration": s.duration_s,
        "completed": s.completed,
        "failed": s.failed,
        "total_input_tokens": s.prompt_tokens,
        "total_output_tokens": s.output_tokens,
        "request_throughput": s.request_throughput,
        "request_goodput": s.goodput if with_goodput else None,
        "output_throughput": s.output_throughput,
        "total_token_throughput": s.total_token_throughput,
        "max_output_tokens_per_s": s.max_output_tokens_per_s,
        "max_concurrent_requests": s.max_concurrent_requests,
    }


def spec_decode_keys(spec: SpecDecodeStats) -> dict[str, Any]:
    return {
        "spec_decode_acceptance_rate": spec.acceptance_rate,
        "spec_decode_acceptance_length": spec.acceptance_length,
        "spec_decode_num_drafts": spec.num_drafts,
        "spec_decode_draft_tokens": spec.draft_tokens,
        "spec_decode_accepted_tokens": spec.accepted_tokens,
        "spec_decode_per_position_acceptance_rates": list(spec.per_position_acceptance_rates),
    }


def per_request(result: BenchResult) -> dict[str, list[Any]]:
    """vLLM's per-request arrays, in seconds; a failed request has ttft 0 and no itls."""
    requests = result.requests
    return {
        "input_lens": [r.prompt_tokens or r.prompt_len for r in requests],
        "output_lens": [output_tokens(r) if r.success else 0 for r in requests],
        "ttfts": [ttft(r) if r.success else 0.0 for r in requests],
        "itls": [itls(r) if r.success else [] for r in requests],
        "latencies": [r.latency for r in requests],
        "start_times": [r.start for r in requests],
        "errors": [r.error for r in requests],
    }


def statistic_keys(
    metric: str, stats: Stats | None, percentiles: Sequence[float]
) -> dict[str, float]:
    """mean_/median_/std_/p{N}_{metric}_ms, 0.0 where nothing was measured."""
    keys = {
        f"mean_{metric}_ms": stats.mean if stats else 0.0,
        f"median_{metric}_ms": stats.median if stats else 0.0,
        f"std_{metric}_ms": stats.std if stats else 0.0,
    }
    for p in percentiles:
        value = stats.percentiles.get(float(p), 0.0) if stats else 0.0
        keys[f"p{percentile_name(float(p))}_{metric}_ms"] = value
    return keys


def result_path(
    config: BenchConfig, model: str, date: str, options: SaveOptions, suffix: str = ""
) -> Path:
    """vLLM's file name ({label}-{rate}qps[-concurrency{N}]-{model}-{date}.json, or the ramp-up
    form), or --result-filename; under --result-dir. `suffix` (e.g. "-A", "-c4") tells apart
    the files of one command (a comparison's servers, a sweep's points)."""
    if options.result_filename:
        name = Path(options.result_filename)
        name = name.with_name(name.stem + suffix + (name.suffix or ".json"))
    else:
        name = Path(default_name(config, model, date, options.label, suffix))
    return Path(options.result_dir) / name if options.result_dir else name


def default_name(
    config: BenchConfig, model: str, date: str, label: str | None, suffix: str
) -> str:
    label = label or BACKENDS[config.endpoint]
    concurrency = f"-concurrency{config.max_concurrency}" if config.max_concurrency else ""
    base_model = model.rstrip("/").split("/")[-1]
    if config.ramp_up is not None:
        ramp = config.ramp_up
        traffic = f"ramp-up-{ramp.strategy}-{ramp.start_rps:g}qps-{ramp.end_rps:g}qps"
    else:
        traffic = f"{config.request_rate}qps"
    return f"{label}{suffix}-{traffic}{concurrency}-{base_model}-{date}.json"


def save_vllm_result(path: Path, content: dict[str, Any]) -> Path:
    """Write one file (creating its folder) and return its path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, allow_nan=False))
    return path
