"""Frontends' latency reports are bounded and finite before the engine sums them (issue 15)."""

from __future__ import annotations

import math

import pytest

from engine_core.metrics import MAX_HISTOGRAMS, HistogramTotals
from shared.messages import Histogram, MetricsReport

GOOD = Histogram("ttft", [0.1, 1.0], [1, 2, 0], 1.5)


@pytest.mark.parametrize("bad", [
    Histogram("ttft", [0.1, 1.0], [1, 2, 0], math.nan),
    Histogram("ttft", [0.1, 1.0], [1, 2, 0], 1e12),  # 3 observations cannot add up to that
    Histogram("ttft", [0.1, 1.0], [1, -2, 0], 0.5),
    Histogram("ttft", [0.1, 1.0], [10**12, 0, 0], 1.0),
    Histogram("ttft", [0.1, math.inf], [1, 0, 0], 0.05),
    Histogram("ttft", [1.0, 0.1], [1, 0, 0], 0.05),
    Histogram("ttft", [0.1, 1.0], [1, 0], 0.05),
])
def test_bad_reports_are_left_out(bad: Histogram) -> None:
    totals = HistogramTotals()
    totals.add(MetricsReport([GOOD]))
    totals.add(MetricsReport([bad]))
    [held] = totals.snapshot()
    assert held.counts == GOOD.counts and held.sum == GOOD.sum


def test_names_are_bounded() -> None:
    totals = HistogramTotals()
    totals.add(MetricsReport([Histogram(f"h{i}", [1.0], [1, 0], 0.5) for i in range(100)]))
    assert len(totals.snapshot()) == MAX_HISTOGRAMS
