"""Speculative decoding's acceptance from two /metrics scrapes: the counters read from vLLM
0.32's own exposition (tests/data/spec_decode/) and from Tandem's, vLLM bench serve's
arithmetic, and how the figures are printed and saved (no server)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from frontend.bench import BenchConfig, BenchResult, Round, Target
from frontend.bench.metrics import RequestResult, summarize
from frontend.bench.report import format_comparison, format_summary, result_json
from frontend.bench.spec_decode import (
    SpecCounters,
    SpecDecodeStats,
    acceptance,
    parse_counters,
    total,
)
from frontend.bench.vllm_result import vllm_result
from frontend.metrics import render
from shared.messages import EngineStats

GOLDEN = Path(__file__).parents[3] / "data" / "spec_decode" / "metrics.txt"


def test_counters_are_read_from_vllms_own_lines_summed_over_engines() -> None:
    # engine 0: 10 drafts, 30 tokens, 17 accepted (8 6 3); engine 1: 4, 12, 3 (2 1 0)
    assert parse_counters(GOLDEN.read_text()) == SpecCounters(14, 42, 20, {0: 10, 1: 7, 2: 3})


def test_counters_are_read_from_tandems_metrics() -> None:
    stats = EngineStats(spec_drafts=5, spec_draft_tokens=10, spec_accepted_tokens=4,
                        spec_accepted_per_pos=[3, 1])
    text = render([(0, stats), (1, stats)], "m", spec_tokens=2).decode()
    assert parse_counters(text) == SpecCounters(10, 20, 8, {0: 6, 1: 2})


@pytest.mark.parametrize("text", [
    render([(0, EngineStats(spec_drafts=5))], "m").decode(),  # the server does not speculate
    "",
    "this is not an exposition {",
])
def test_no_counters_read_as_none(text: str) -> None:
    assert parse_counters(text) is None


def test_acceptance_is_vllms_arithmetic_over_the_growth() -> None:
    before = SpecCounters(100, 300, 150, {0: 70, 1: 50, 2: 30})
    after = SpecCounters(140, 420, 210, {0: 100, 1: 70, 2: 40})
    spec = acceptance(after.since(before))
    assert spec is not None
    assert (spec.num_drafts, spec.draft_tokens, spec.accepted_tokens) == (40, 120, 60)
    assert spec.acceptance_rate == pytest.approx(50.0)  # percent: 60 / 120
    assert spec.acceptance_length == pytest.approx(2.5)  # 1 + 60 / 40
    assert spec.per_position_acceptance_rates == pytest.approx([0.75, 0.5, 0.25])


def test_rounds_add_up_and_a_run_without_drafts_reports_nothing() -> None:
    one, two = SpecCounters(4, 12, 6, {0: 3, 1: 2, 2: 1}), SpecCounters(2, 6, 0, {0: 0})
    assert total([one, None, two]) == SpecCounters(6, 18, 6, {0: 3, 1: 2, 2: 1})
    assert total([None, None]) is None
    assert acceptance(None) is None
    assert acceptance(SpecCounters(0, 0, 0, {0: 0})) is None  # vLLM reports no run undrafted


SPEC = SpecDecodeStats(40, 120, 60, 50.0, 2.5, [0.75, 0.5, 0.25])


def result(spec: SpecDecodeStats | None, label: str = "A") -> BenchResult:
    requests = [RequestResult(True, 0.5, (0.1, 0.2), 8, 9, 2)]
    summary = replace(summarize(requests, 1.0), spec_decode=spec)
    return BenchResult(Target(f"http://{label}", label=label), "m", (Round(requests, 1.0),),
                       summary)


def test_the_table_and_files_carry_the_figures_only_when_the_server_has_them() -> None:
    config = BenchConfig(Target("http://A"))
    table = format_summary(result(SPEC), config)
    assert "-------------Speculative Decoding---------------" in table
    for line in ("Acceptance rate (%):                     50.00",
                 "Acceptance length:                       2.50",
                 "Drafts:                                  40",
                 "Accepted tokens:                         60",
                 "  Position 2:                            25.00"):
        assert line in table
    assert "Speculative" not in format_summary(result(None), config)
    saved = vllm_result(config, result(SPEC), "d")
    assert {k: v for k, v in saved.items() if k.startswith("spec_decode_")} == {
        "spec_decode_acceptance_rate": 50.0, "spec_decode_acceptance_length": 2.5,
        "spec_decode_num_drafts": 40, "spec_decode_draft_tokens": 120,
        "spec_decode_accepted_tokens": 60,
        "spec_decode_per_position_acceptance_rates": [0.75, 0.5, 0.25]}
    assert not any(k.startswith("spec_decode") for k in vllm_result(config, result(None), "d"))
    rich = result_json(config, [result(SPEC)])["results"][0]["summary"]["spec_decode"]
    assert rich["acceptance_length"] == 2.5
    comparison = format_comparison(result(SPEC), result(None, "B"))
    assert "Acceptance length" in comparison and "n/a" in comparison
