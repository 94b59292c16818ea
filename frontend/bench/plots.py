"""`--plot DIR`: PNG pictures of a run, drawn with matplotlib's non-interactive Agg backend.

- latency_cdf{suffix}.png: the CDFs of TTFT, ITL and end-to-end latency, every server of the
  run (A and B of a comparison) on the same three charts;
- tokens_per_second{suffix}.png: output tokens/s in each second of a round (averaged over
  rounds), every server on one chart;
- sweep_throughput_latency.png: for a sweep, output tok/s against TTFT p50/p99 and TPOT p50,
  one curve per server, each point labelled with its concurrency or rate.
Every title names the model, the workload and the date. matplotlib is imported only here and
only when pictures are asked for (the rest of the frontend stays light).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from frontend.bench.metrics import curve_point, itls, tokens_per_second, ttft

if TYPE_CHECKING:
    from frontend.bench import BenchResult
    from frontend.bench.sweep import Sweep, SweepPoint

LATENCIES = (
    ("TTFT", "time to first token (ms)"),
    ("ITL", "inter-token latency (ms)"),
    ("E2E latency", "end-to-end latency (ms)"),
)


class PlotContext(NamedTuple):
    """What every title says: the model, the workload and the date."""

    model: str
    workload: str
    date: str

    def title(self, what: str) -> str:
        return f"{what}\n{self.model} · {self.workload} · {self.date}"


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, with a message when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def server_name(result: BenchResult) -> str:
    return f"{result.target.label}: {result.target.base_url}"


def latency_samples_ms(result: BenchResult) -> list[np.ndarray]:
    """TTFT, ITL and end-to-end latency of the successful requests, in ms."""
    done = [r for r in result.requests if r.success]
    gaps = [gap for r in done for gap in itls(r)]
    samples = ([ttft(r) for r in done], gaps, [r.latency for r in done])
    return [np.sort(np.asarray(s, dtype=np.float64)) * 1000.0 for s in samples]


def plot_latency_cdfs(
    results: Sequence[BenchResult], ctx: PlotContext, out_dir: Path, suffix: str = ""
) -> Path:
    """Three CDF charts side by side; one line per server on each."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8), constrained_layout=True)
    for result in results:
        for ax, values in zip(axes, latency_samples_ms(result)):
            if len(values):
                fractions = np.arange(1, len(values) + 1) / len(values)
                ax.step(values, fractions, where="post", label=server_name(result))
    for ax, (name, xlabel) in zip(axes, LATENCIES):
        ax.set(title=name, xlabel=xlabel, ylabel="fraction ≤ x", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
    fig.suptitle(ctx.title("Latency CDFs"))
    return save(plt, fig, out_dir / f"latency_cdf{suffix}.png")


def mean_tokens_per_second(result: BenchResult) -> list[float]:
    """Output tokens/s in each second of a round, averaged over the rounds."""
    series = [tokens_per_second(one.requests) for one in result.rounds]
    length = max((len(s) for s in series), default=0)
    padded = np.zeros((len(series), length))
    for row, values in zip(padded, series):
        row[: len(values)] = values
    return padded.mean(axis=0).tolist() if len(series) else []


def plot_tokens_over_time(
    results: Sequence[BenchResult], ctx: PlotContext, out_dir: Path, suffix: str = ""
) -> Path:
    """Output tokens/s against seconds since the round began; one line per server."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.8), constrained_layout=True)
    for result in results:
        series = mean_tokens_per_second(result)
        ax.step(range(len(series)), series, where="post", label=server_name(result))
    ax.set(xlabel="seconds since the round began", ylabel="output tokens/s", ylim=(0, None))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(ctx.title("Output tokens per second"))
    return save(plt, fig, out_dir / f"tokens_per_second{suffix}.png")


def plot_run(
    results: Sequence[BenchResult], ctx: PlotContext, out_dir: Path, suffix: str = ""
) -> list[Path]:
    """The pictures of one run (one or two servers)."""
    return [
        plot_latency_cdfs(results, ctx, out_dir, suffix),
        plot_tokens_over_time(results, ctx, out_dir, suffix),
    ]


def plot_sweep(
    points: Sequence[SweepPoint], sweep: Sweep, ctx: PlotContext, out_dir: Path
) -> Path:
    """Throughput against latency over the sweep: TTFT p50 and p99 left, TPOT p50 right."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), constrained_layout=True)
    servers = len(points[0].results) if points else 0
    for i in range(servers):
        curve = [curve_point(point.results[i]) for point in points]
        x = [c.output_throughput for c in curve]
        name = server_name(points[0].results[i])
        color = f"C{i}"  # one colour per server; p99 dashed
        left.plot(x, nan(c.ttft_p50_ms for c in curve), "o-", color=color, label=f"{name} p50")
        left.plot(x, nan(c.ttft_p99_ms for c in curve), "s--", color=color, label=f"{name} p99")
        right.plot(x, nan(c.tpot_p50_ms for c in curve), "o-", color=color, label=f"{name} p50")
        for point, xi, yi in zip(points, x, nan(c.ttft_p50_ms for c in curve)):
            left.annotate(sweep.label(point.value), (xi, yi), fontsize="x-small",
                          xytext=(4, 4), textcoords="offset points")
    left.set(title="TTFT", xlabel="output tokens/s", ylabel="ms")
    right.set(title="TPOT", xlabel="output tokens/s", ylabel="ms")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(ctx.title(f"Throughput vs latency, sweep over {sweep.kind}"))
    return save(plt, fig, out_dir / "sweep_throughput_latency.png")


def nan(values: Any) -> list[float]:
    return [float("nan") if v is None else v for v in values]


def save(plt: Any, fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
