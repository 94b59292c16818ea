"""The engine's periodic stats line (engine_core/metrics.py, StatsLog): rates over the period,
nothing when nothing ran, and speculative decoding's acceptance as vLLM words it."""

from __future__ import annotations

from engine_core.metrics import StatsLog
from shared.messages import EngineStats


def test_rates_over_the_period_and_the_speculation_figures():
    log = StatsLog(every_s=10.0)
    start = log.last_at
    assert not log.due(start + 5) and log.due(start + 10)
    first = EngineStats(prompt_tokens=500, generation_tokens=100, running=3, waiting=1,
                        num_blocks=100, free_blocks=75, prefix_queries=500, prefix_hits=100,
                        spec_drafts=20, spec_draft_tokens=80, spec_accepted_tokens=40,
                        spec_accepted_per_pos=[16, 12, 8, 4])
    line = log.line(first, start + 10)
    assert line is not None
    assert "Avg prompt throughput: 50.0 tokens/s" in line
    assert "Avg generation throughput: 10.0 tokens/s" in line
    assert "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%" in line
    assert "Prefix cache hit rate: 20.0%" in line
    assert "Mean acceptance length: 3.00, Accepted: 40 tokens, Drafted: 80 tokens" in line
    assert "Per-position acceptance rate: 0.800, 0.600, 0.400, 0.200" in line
    assert "Avg Draft acceptance rate: 50.0%" in line
    # the next period counts only what came after
    later = EngineStats(prompt_tokens=500, generation_tokens=120, num_blocks=100,
                        free_blocks=100, spec_drafts=30, spec_draft_tokens=120,
                        spec_accepted_tokens=50, spec_accepted_per_pos=[22, 16, 8, 4])
    line = log.line(later, start + 20)
    assert line is not None and "Avg generation throughput: 2.0 tokens/s" in line
    assert "Mean acceptance length: 2.00" in line and "rate: 0.600, 0.400, 0.000, 0.000" in line
    assert log.line(later, start + 30) is None  # nothing ran
    plain = StatsLog().line(EngineStats(generation_tokens=5, num_blocks=4, free_blocks=4), 1e9)
    assert plain is not None and "SpecDecoding" not in plain
