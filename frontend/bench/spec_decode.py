"""Speculative decoding's acceptance over a run, from the server's own counters.

A server that speculates (Tandem or vLLM with `--speculative-config`) publishes vLLM's
counters on GET /metrics: `vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
`..._num_accepted_tokens_total` and `..._num_accepted_tokens_per_pos_total{position}`, a series
per engine. The benchmark reads them before and after each round (`client.fetch_spec_counters`,
outside the timed window), sums the rounds' differences, and reports `vllm bench serve`'s figures
(`acceptance`):
- acceptance rate: accepted / draft tokens, in percent;
- acceptance length: 1 + accepted / drafts (the mean tokens a draft yields, the target
  model's own token included: vLLM's definition);
- per-position acceptance: accepted at position i / drafts, as fractions.
A server without the counters (no speculation, no /metrics) gives None: nothing is reported.
As in vLLM, neither is anything reported for a run in which no token was drafted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "vllm:spec_decode_"


@dataclass(frozen=True)
class SpecCounters:
    """The spec_decode counters summed over a server's engines (or a difference of two)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: dict[int, int] = field(default_factory=dict)

    def since(self, before: SpecCounters) -> SpecCounters:
        """What was counted between `before` and this reading."""
        positions = before.accepted_per_pos.keys() | self.accepted_per_pos.keys()
        return SpecCounters(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted_tokens - before.accepted_tokens,
            {pos: self.accepted_per_pos.get(pos, 0) - before.accepted_per_pos.get(pos, 0)
             for pos in sorted(positions)},
        )


@dataclass(frozen=True)
class SpecDecodeStats:
    """One run's speculative decoding, as `vllm bench serve` reports it."""

    num_drafts: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float  # percent: accepted / draft tokens
    acceptance_length: float  # 1 + accepted / drafts
    per_position_acceptance_rates: list[float]  # accepted at position i / drafts


def parse_counters(text: str) -> SpecCounters | None:
    """The counters in a Prometheus text exposition, summed over engines; None without them."""
    totals = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
    per_pos: dict[int, int] = {}
    found = False
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not (sample.name.startswith(PREFIX) and sample.name.endswith("_total")):
                    continue
                found = True
                kind = sample.name.removeprefix(PREFIX).removesuffix("_total")
                if kind == "num_accepted_tokens_per_pos":
                    pos = int(sample.labels["position"])
                    per_pos[pos] = per_pos.get(pos, 0) + int(sample.value)
                elif kind in totals:
                    totals[kind] += sample.value
    except (ValueError, KeyError):  # not an exposition, or a series without its position
        return None
    if not found:
        return None
    return SpecCounters(int(totals["num_drafts"]), int(totals["num_draft_tokens"]),
                        int(totals["num_accepted_tokens"]), dict(sorted(per_pos.items())))


def total(deltas: Iterable[SpecCounters | None]) -> SpecCounters | None:
    """The rounds' differences added up; None when no round had the counters."""
    known = [d for d in deltas if d is not None]
    if not known:
        return None
    per_pos: dict[int, int] = {}
    for delta in known:
        for pos, count in delta.accepted_per_pos.items():
            per_pos[pos] = per_pos.get(pos, 0) + count
    return SpecCounters(sum(d.drafts for d in known), sum(d.draft_tokens for d in known),
                        sum(d.accepted_tokens for d in known), dict(sorted(per_pos.items())))


def acceptance(delta: SpecCounters | None) -> SpecDecodeStats | None:
    """vLLM's figures for what a run counted; None without counters or draft tokens."""
    if delta is None or delta.draft_tokens <= 0:
        return None
    per_pos = ([count / delta.drafts for count in delta.accepted_per_pos.values()]
               if delta.drafts > 0 else [])
    length = 1 + delta.accepted_tokens / delta.drafts if delta.drafts > 0 else 0.0
    return SpecDecodeStats(
        num_drafts=delta.drafts,
        draft_tokens=delta.draft_tokens,
        accepted_tokens=delta.accepted_tokens,
        acceptance_rate=delta.accepted_tokens / delta.draft_tokens * 100,
        acceptance_length=length,
        per_position_acceptance_rates=per_pos,
    )
