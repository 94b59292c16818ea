"""The whole server's latency histograms, added up from every frontend's reports; and the
engine's periodic stats line (`StatsLog`).

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
import time

from shared.messages import EngineStats, Histogram, MetricsReport

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


LOG_STATS_EVERY_S = 10.0  # vLLM's interval


class StatsLog:
    """vLLM's periodic engine log line, every LOG_STATS_EVERY_S while the engine works: the
    prompt and generation throughput since the last line, the queue, the KV cache's use, the
    prefix cache's hit rate and, with speculative decoding, the drafts' acceptance (mean
    acceptance length = 1 + accepted / drafts, per-position rates, the share accepted)."""

    def __init__(self, every_s: float = LOG_STATS_EVERY_S) -> None:
        self.every_s = every_s
        self.last: EngineStats | None = None
        self.last_at = time.monotonic()

    def due(self, now: float) -> bool:
        return now - self.last_at >= self.every_s

    def line(self, stats: EngineStats, now: float) -> str | None:
        """The line for `stats` (None when nothing ran since the last); starts a new period."""
        last, elapsed = self.last or EngineStats(), max(now - self.last_at, 1e-9)
        self.last, self.last_at = stats, now
        prompt = stats.prompt_tokens - last.prompt_tokens
        generated = stats.generation_tokens - last.generation_tokens
        if not prompt and not generated:
            return None
        used = 1 - stats.free_blocks / stats.num_blocks if stats.num_blocks else 0.0
        queries = stats.prefix_queries - last.prefix_queries
        hits = stats.prefix_hits - last.prefix_hits
        text = (f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, Avg generation "
                f"throughput: {generated / elapsed:.1f} tokens/s, Running: {stats.running} reqs, "
                f"Waiting: {stats.waiting} reqs, KV cache usage: {100 * used:.1f}%, Prefix cache "
                f"hit rate: {100 * hits / queries if queries else 0.0:.1f}%")
        drafts = stats.spec_drafts - last.spec_drafts
        if drafts:
            drafted = stats.spec_draft_tokens - last.spec_draft_tokens
            accepted = stats.spec_accepted_tokens - last.spec_accepted_tokens
            before = last.spec_accepted_per_pos
            per_pos = [(n - (before[i] if i < len(before) else 0)) / drafts
                       for i, n in enumerate(stats.spec_accepted_per_pos)]
            text += (f"; SpecDecoding metrics: Mean acceptance length: "
                     f"{1 + accepted / drafts:.2f}, Accepted: {accepted} tokens, Drafted: "
                     f"{drafted} tokens, Per-position acceptance rate: "
                     f"{', '.join(f'{r:.3f}' for r in per_pos)}, Avg Draft acceptance rate: "
                     f"{100 * accepted / drafted if drafted else 0.0:.1f}%")
        return text
