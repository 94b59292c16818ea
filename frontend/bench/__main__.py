"""The benchmark CLI (`tandem bench serve ...` runs `python -m frontend.bench serve ...`).

    tandem bench serve --base-url http://127.0.0.1:8000 --dataset-name sharegpt \\
        --dataset-path conversations.json --num-prompts 200 --request-rate 8 \\
        --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \\
        --save-result --plot plots/

Exit status: 0 on success, 1 when every request to a target failed, 2 on a setup error
(bad arguments, unreachable server, no tokenizer, an unreadable dataset).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import aiohttp

from frontend.bench import BenchConfig, BenchResult, all_targets, run_targets
from frontend.bench.args import Outputs, build_parser, config_from_args, outputs_from_args
from frontend.bench.plots import PlotContext, plot_run, plot_sweep
from frontend.bench.report import (
    format_comparison,
    format_summary,
    format_sweep,
    write_result_file,
)
from frontend.bench.sweep import Sweep, SweepPoint, point_config, run_sweep
from frontend.bench.vllm_result import DATE_FORMAT, result_path, save_vllm_result, vllm_result


async def serve(config: BenchConfig, outputs: Outputs | None = None) -> int:
    """Run (once, or each point of a sweep), print the tables, write the files; exit status 1
    when a target had no successful request."""
    outputs = outputs or Outputs()
    date = datetime.now()
    if outputs.sweep is None:
        results = await run_targets(config, all_targets(config))
        report_run(config, results, outputs, date)
        runs = [results]
    else:
        points = await run_sweep(
            config, outputs.sweep, lambda point: report_point(config, outputs, date, point)
        )
        report_sweep(config, outputs.sweep, points, outputs, date)
        runs = [point.results for point in points]
    return 1 if any(r.summary.completed == 0 for run in runs for r in run) else 0


def report_run(
    config: BenchConfig,
    results: Sequence[BenchResult],
    outputs: Outputs,
    date: datetime,
    suffix: str = "",
) -> None:
    """Print one run's tables and write its files (`suffix` tells a sweep's points apart)."""
    for result in results:
        print(format_summary(result, config, outputs.metrics))
    if len(results) == 2:
        print(format_comparison(results[0], results[1], outputs.metrics))
    if outputs.result_file:
        write_result_file(suffixed(outputs.result_file, suffix), config, results)
    if outputs.save is not None:
        save_results(config, results, outputs, date, suffix)
    if outputs.plot_dir:
        ctx = plot_context(config, results, date)
        for path in plot_run(results, ctx, Path(outputs.plot_dir), suffix):
            print(f"picture: {path}")


def save_results(
    config: BenchConfig,
    results: Sequence[BenchResult],
    outputs: Outputs,
    date: datetime,
    suffix: str,
) -> None:
    """One vLLM-format file per server (named -A/-B when comparing)."""
    assert outputs.save is not None
    stamp = date.strftime(DATE_FORMAT)
    for result in results:
        server = f"-{result.target.label}" if len(results) > 1 else ""
        path = result_path(config, result.model, stamp, outputs.save, server + suffix)
        content = vllm_result(config, result, stamp, outputs.save.label, outputs.metrics)
        print(f"vLLM result: {save_vllm_result(path, content)}")


def report_point(
    config: BenchConfig, outputs: Outputs, date: datetime, point: SweepPoint
) -> None:
    """Print and write one sweep point as soon as it is done."""
    assert outputs.sweep is not None
    index = outputs.sweep.values.index(point.value)
    print(f"--- sweep point {index + 1}/{len(outputs.sweep.values)}: "
          f"{outputs.sweep.label(point.value)} ---")
    point_cfg = point_config(config, outputs.sweep, index)
    report_run(point_cfg, point.results, outputs, date, sweep_suffix(outputs.sweep, point.value))


def report_sweep(
    config: BenchConfig,
    sweep: Sweep,
    points: Sequence[SweepPoint],
    outputs: Outputs,
    date: datetime,
) -> None:
    """The sweep's table, and its throughput-latency picture."""
    print(format_sweep(sweep.kind, [(p.value, p.results) for p in points]))
    if outputs.plot_dir and points:
        ctx = plot_context(config, points[0].results, date)
        print(f"picture: {plot_sweep(points, sweep, ctx, Path(outputs.plot_dir))}")


def sweep_suffix(sweep: Sweep, value: float) -> str:
    """"-c4" for a concurrency, "-r2.5" for a rate."""
    return f"-c{int(value)}" if sweep.kind == "max-concurrency" else f"-r{value:g}"


def suffixed(path: str, suffix: str) -> Path:
    name = Path(path)
    return name.with_name(name.stem + suffix + name.suffix) if suffix else name


def plot_context(
    config: BenchConfig, results: Sequence[BenchResult], date: datetime
) -> PlotContext:
    """Titles: the model(s), the workload and the date."""
    models = " vs ".join(dict.fromkeys(r.model for r in results))
    workload = f"{config.dataset.describe()}, {config.num_prompts} prompts, {config.endpoint}"
    return PlotContext(models, workload, date.strftime("%Y-%m-%d %H:%M"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        outputs = outputs_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        return asyncio.run(serve(config, outputs))
    except (ValueError, aiohttp.ClientError, OSError) as exc:
        print(f"tandem bench: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
