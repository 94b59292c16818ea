"""The whole server's latency histograms, added up from every frontend's reports.

Latencies (time to first token, inter-token latency, end-to-end) can only be measured where
tokens reach the client, in the frontends; counters and gauges are the engine's own
(`EngineCore.stats()`). Frontends send `MetricsReport`s of per-bucket counts since their last
report; the engine keeps the running totals here and returns them with the "stats" utility,
so whichever frontend answers a scrape shows the figures of every frontend, local or remote.

The engine never interprets the buckets: a frontend chooses them, and a report whose bounds
differ from the ones already held for that histogram (a frontend of another version) is
logged once and left out, rather than mixed into totals it does not fit. Nor does it trust
them: a report is summed only if it is bounded and finite (`report_error`), so a buggy or hostile
client cannot push NaN, negative counts or 1e12 into the figures every scrape shows.
"""

from __future__ import annotations

import logging
import math

from shared.messages import Histogram, MetricsReport

log = logging.getLogger(__name__)
MAX_HISTOGRAMS = 16  # distinct names kept; frontends report three
MAX_BOUNDS = 64
MAX_COUNT = 10**9  # observations of one bucket in one report (a report covers a second or so)
MAX_SECONDS = 86_400.0  # the longest latency one observation may add to a sum


def report_error(h: Histogram) -> str | None:
    """Why one reported histogram cannot be summed, or None."""
    if len(h.bounds) > MAX_BOUNDS:
        return f"{len(h.bounds)} bounds (at most {MAX_BOUNDS})"
    if len(h.counts) != len(h.bounds) + 1:
        return f"{len(h.counts)} counts for {len(h.bounds)} bounds"
    if not all(math.isfinite(b) for b in h.bounds) or any(
            a >= b for a, b in zip(h.bounds, h.bounds[1:])):
        return "bounds are not finite and increasing"
    if not all(0 <= c <= MAX_COUNT for c in h.counts):
        return f"counts must be in [0, {MAX_COUNT}]"
    if not (math.isfinite(h.sum) and 0 <= h.sum <= MAX_SECONDS * sum(h.counts)):
        return "the sum is not a finite latency total of its observations"
    return None


class HistogramTotals:
    """Running totals per histogram name. Only the engine's busy loop touches it."""

    def __init__(self) -> None:
        self._totals: dict[str, Histogram] = {}
        self._mismatched: set[str] = set()

    def add(self, report: MetricsReport) -> None:
        for h in report.histograms:
            self._add(h)

    def _add(self, h: Histogram) -> None:
        error = report_error(h)
        if error is None and h.name not in self._totals and len(self._totals) >= MAX_HISTOGRAMS:
            error = f"more than {MAX_HISTOGRAMS} histogram names"
        if error is not None:
            log.warning("dropped histogram %r: %s", h.name[:64], error)
            return
        total = self._totals.setdefault(
            h.name, Histogram(h.name, list(h.bounds), [0] * len(h.counts), 0.0))
        if total.bounds != list(h.bounds):
            if h.name not in self._mismatched:
                self._mismatched.add(h.name)
                log.warning("histogram %r: a frontend reports other buckets than the first one "
                            "did; its observations are left out", h.name)
            return
        total.counts = [a + b for a, b in zip(total.counts, h.counts)]
        total.sum += h.sum

    def snapshot(self) -> list[Histogram]:
        """Copies of the totals, ready for the wire."""
        return [Histogram(t.name, list(t.bounds), list(t.counts), t.sum)
                for t in self._totals.values()]
