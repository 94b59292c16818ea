"""`--sweep`: the same benchmark at several concurrencies or request rates, in one command.

Each point is a whole run (with `--compare`, A and B alternate inside it). Point i uses seed
`seed + i`, so its prompts are new to the servers and no point answers from the prefix cache
an earlier point filled (a file dataset repeats its prompts: there the cache can help).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

from frontend.bench import BenchConfig, BenchResult, all_targets, run_targets

SWEEP_KINDS = ("max-concurrency", "request-rate")


class Sweep(NamedTuple):
    """What varies ("max-concurrency" | "request-rate") and its values, in order."""

    kind: str
    values: tuple[float, ...]

    def label(self, value: float) -> str:
        """"concurrency 4", "rate 2.5/s" or "rate inf"."""
        if self.kind == "max-concurrency":
            return f"concurrency {int(value)}"
        return "rate inf" if math.isinf(value) else f"rate {value:g}/s"


class SweepPoint(NamedTuple):
    value: float
    results: list[BenchResult]  # A (and B)


def parse_sweep(spec: str) -> Sweep:
    """Parse "max-concurrency=1,4,16" or "request-rate=1,2,inf"."""
    kind, _, values = spec.partition("=")
    kind = kind.strip().replace("_", "-")
    try:
        numbers = tuple(float(v) for v in values.split(",") if v.strip())
    except ValueError:
        numbers = ()
    if kind not in SWEEP_KINDS or not numbers or any(v <= 0 for v in numbers):
        raise ValueError(
            f"--sweep {spec!r}: use max-concurrency=1,4,16 or request-rate=1,2,inf "
            "(positive numbers)"
        )
    if kind == "max-concurrency" and any(v != int(v) or math.isinf(v) for v in numbers):
        raise ValueError(f"--sweep {spec!r}: concurrencies are whole numbers")
    return Sweep(kind, numbers)


def point_config(config: BenchConfig, sweep: Sweep, index: int) -> BenchConfig:
    """The run of point `index`: its concurrency or rate, and seed + index."""
    value = sweep.values[index]
    if sweep.kind == "max-concurrency":
        return dataclasses.replace(config, max_concurrency=int(value), seed=config.seed + index)
    return dataclasses.replace(config, request_rate=value, seed=config.seed + index)


async def run_sweep(
    config: BenchConfig,
    sweep: Sweep,
    on_point: Callable[[SweepPoint], None] | None = None,
) -> list[SweepPoint]:
    """Run every point in order; `on_point` sees each as it finishes (to print its tables)."""
    points = []
    for index, value in enumerate(sweep.values):
        point_cfg = point_config(config, sweep, index)
        point = SweepPoint(value, await run_targets(point_cfg, all_targets(point_cfg)))
        if on_point is not None:
            on_point(point)
        points.append(point)
    return points
