"""The whole server's latency histograms, added up from every frontend's reports.

Latencies (time to first token, inter-token latency, end-to-end) can only be measured where
tokens reach the client, in the frontends; counters and gauges are the engine's own
(`EngineCore.stats()`). Frontends send `MetricsReport`s of per-bucket counts since their last
report; the engine keeps the running totals here and returns them with the "stats" utility,
so whichever frontend answers a scrape shows the figures of every frontend, local or remote.

The engine never interprets the buckets: a frontend chooses them, and a report whose bounds
differ from the ones already held for that histogram (a frontend of another version) is
logged once and left out, rather than mixed into totals it does not fit.
"""

from __future__ import annotations

import logging

from shared.messages import Histogram, MetricsReport

log = logging.getLogger(__name__)


class HistogramTotals:
    """Running totals per histogram name. Only the engine's busy loop touches it."""

    def __init__(self) -> None:
        self._totals: dict[str, Histogram] = {}
        self._mismatched: set[str] = set()

    def add(self, report: MetricsReport) -> None:
        for h in report.histograms:
            self._add(h)

    def _add(self, h: Histogram) -> None:
        if len(h.counts) != len(h.bounds) + 1:
            log.warning("dropped histogram %r: %d counts for %d bounds", h.name, len(h.counts),
                        len(h.bounds))
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
