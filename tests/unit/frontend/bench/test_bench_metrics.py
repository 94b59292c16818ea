"""The benchmark's arithmetic on synthetic streams (exact numbers), and its workload: arrival
times and prompts of an exact token length."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from frontend.bench.metrics import (
    RequestResult,
    Stats,
    curve_point,
    itls,
    meets_slos,
    output_tokens,
    parse_metrics,
    parse_percentiles,
    parse_slos,
    peak_concurrency,
    stats_ms,
    summarize,
    tokens_per_second,
    tpot,
    ttft,
)
from frontend.bench.workload import RampUp, arrival_times, build_prompts, check_ramp_up, rate_at


def ok(
    times: tuple[float, ...],
    latency: float,
    completion: int | None = None,
    prompt_tokens: int | None = None,
    prompt_len: int = 8,
) -> RequestResult:
    return RequestResult(
        success=True,
        latency=latency,
        text_times=times,
        prompt_len=prompt_len,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
    )


def failed(message: str = "HTTP 500: boom") -> RequestResult:
    return RequestResult(success=False, latency=0.5, prompt_len=8, error=message)


# Times are binary fractions so that every difference and quotient below is exact.
def test_ttft_itl_tpot_exact() -> None:
    result = ok((0.125, 0.25, 0.5), latency=0.625, completion=3)
    assert ttft(result) == 0.125
    assert itls(result) == [0.125, 0.25]
    assert tpot(result) == 0.25  # (0.625 - 0.125) / (3 - 1)


def test_decimal_stream_from_the_brief() -> None:
    result = ok((0.1, 0.15, 0.25), latency=0.3, completion=3)
    assert ttft(result) == 0.1
    assert itls(result) == pytest.approx([0.05, 0.1], abs=1e-12)
    assert tpot(result) == pytest.approx(0.1, abs=1e-12)


def test_usage_counts_tokens_not_chunks() -> None:
    # Two chunks carried five tokens: TPOT divides by the server's count, ITL stays per chunk.
    result = ok((0.25, 0.75), latency=1.25, completion=5)
    assert output_tokens(result) == 5
    assert itls(result) == [0.5]
    assert tpot(result) == 0.25  # (1.25 - 0.25) / 4


def test_without_usage_text_chunks_are_the_token_count() -> None:
    result = ok((0.25, 0.5, 0.75, 1.0), latency=1.0)
    assert output_tokens(result) == 4
    assert tpot(result) == 0.25


def test_single_token_has_no_tpot_or_itl() -> None:
    result = ok((0.5,), latency=0.5, completion=1)
    assert tpot(result) is None
    assert itls(result) == []


def test_stats_ms_mean_median_std_percentiles() -> None:
    stats = stats_ms([0.125, 0.25, 0.5, 1.0], percentiles=(50, 90, 99, 99.9))
    assert stats is not None
    assert (stats.mean, stats.median) == (468.75, 375.0)
    # population std: deviations -343.75, -218.75, 31.25, 531.25 ms
    variance = (343.75**2 + 218.75**2 + 31.25**2 + 531.25**2) / 4
    assert stats.std == pytest.approx(math.sqrt(variance), rel=1e-12)  # 334.95...
    assert stats.percentiles[50.0] == 375.0
    assert stats.percentiles[90.0] == pytest.approx(850.0, rel=1e-12)  # 500 + 0.7 * 500
    assert stats.percentiles[99.0] == pytest.approx(985.0, rel=1e-12)  # 500 + 0.97 * 500
    assert stats.percentiles[99.9] == pytest.approx(998.5, rel=1e-12)  # 500 + 0.997 * 500
    assert stats_ms([]) is None


def test_stats_of_one_value_have_no_spread() -> None:
    stats = stats_ms([0.25], percentiles=(1, 99))
    assert stats == Stats(mean=250.0, median=250.0, std=0.0, percentiles={1.0: 250.0, 99.0: 250.0})


def test_parse_percentiles_and_metrics() -> None:
    assert parse_percentiles("50,90,99") == (50.0, 90.0, 99.0)
    assert parse_percentiles("99.9") == (99.9,)
    assert parse_metrics("ttft, e2el") == ("ttft", "e2el")
    for bad in ("fast", "101", "-1"):
        with pytest.raises(ValueError, match="metric-percentiles"):
            parse_percentiles(bad)
    for bad in ("ttft,latency", ""):
        with pytest.raises(ValueError, match="percentile-metrics"):
            parse_metrics(bad)


def at(start: float, times: tuple[float, ...], latency: float, completion: int) -> RequestResult:
    return replace(ok(times, latency, completion), start=start)


def test_tokens_per_second_spreads_usage_over_chunks() -> None:
    results = [
        at(0.0, (0.5, 1.25), latency=1.5, completion=4),  # 2 tokens at 0.5 s, 2 at 1.25 s
        at(1.0, (0.5,), latency=0.75, completion=3),  # 3 tokens at 1.5 s
        failed(),
    ]
    assert tokens_per_second(results) == [2.0, 5.0]
    assert tokens_per_second([failed()]) == []


def test_peak_concurrency_counts_overlaps_with_ends_before_starts() -> None:
    results = [
        at(0.0, (0.5,), latency=1.0, completion=1),  # [0, 1)
        at(0.5, (0.5,), latency=1.0, completion=1),  # [0.5, 1.5)
        at(1.0, (0.5,), latency=1.0, completion=1),  # [1, 2): starts as the first ends
        at(1.25, (0.5,), latency=0.5, completion=1),  # [1.25, 1.75)
    ]
    assert peak_concurrency(results) == 3  # during [1.25, 1.5)
    summary = summarize(results, duration_s=2.0)
    # one token each at 0.5, 1.0, 1.5 and 1.75 s: three in second 1
    assert (summary.max_concurrent_requests, summary.max_output_tokens_per_s) == (3, 3.0)


def test_curve_point_reads_p50_p99_of_ttft_and_p50_of_tpot() -> None:
    results = [ok((0.125, 0.25), 0.25, 2), ok((0.25, 0.5), 0.5, 2), ok((0.5,), 0.5, 1)]

    class Run:
        requests = results
        summary = summarize(results, duration_s=1.0)

    point = curve_point(Run())
    assert point.output_throughput == 5.0
    assert point.ttft_p50_ms == 250.0
    assert point.ttft_p99_ms == pytest.approx(495.0)  # 250 + 0.98 * 250
    assert point.tpot_p50_ms == pytest.approx(187.5)  # TPOTs 125 and 250


def test_summarize_totals_and_pooled_itl() -> None:
    results = [
        ok((0.125, 0.25, 0.5), latency=0.625, completion=3, prompt_tokens=9),
        ok((0.25, 0.375), latency=0.5, completion=2, prompt_tokens=9),
        ok((0.5,), latency=0.5, completion=None),  # no usage: prompt_len 8, one chunk
        failed(),
    ]
    summary = summarize(results, duration_s=2.0)
    assert (summary.completed, summary.failed) == (3, 1)
    assert summary.prompt_tokens == 9 + 9 + 8
    assert summary.output_tokens == 3 + 2 + 1
    assert summary.request_throughput == 1.5
    assert summary.output_throughput == 3.0
    assert summary.total_token_throughput == 16.0
    assert summary.goodput is None
    assert summary.ttft_ms is not None  # TTFTs 125, 250, 500 ms
    assert (summary.ttft_ms.mean, summary.ttft_ms.median) == (875 / 3, 250.0)
    assert summary.ttft_ms.p99 == pytest.approx(495.0)  # 250 + 0.98 * 250
    assert summary.itl_ms is not None
    assert (summary.itl_ms.mean, summary.itl_ms.median) == (500 / 3, 125.0)  # 125, 250, 125
    assert summary.tpot_ms is not None  # 250 and 250; the single-token request has none
    assert (summary.tpot_ms.mean, summary.tpot_ms.p99) == (250.0, 250.0)
    assert summary.e2el_ms is not None and summary.e2el_ms.median == 500.0
    assert summary.errors == {"HTTP 500: boom": 1}


def test_summarize_all_failed() -> None:
    summary = summarize([failed("a"), failed("a"), failed("b")], duration_s=1.0)
    assert (summary.completed, summary.failed, summary.output_tokens) == (0, 3, 0)
    assert summary.ttft_ms is None and summary.itl_ms is None and summary.e2el_ms is None
    assert summary.errors == {"a": 2, "b": 1}


def test_goodput_counts_requests_meeting_every_slo() -> None:
    fast = ok((0.125, 0.25), latency=0.25, completion=2)  # TTFT 125 ms, TPOT 125 ms
    slow_start = ok((0.5, 0.625), latency=0.625, completion=2)  # TTFT 500 ms
    slow_tokens = ok((0.125, 0.5), latency=0.5, completion=2)  # TPOT 375 ms
    results = [fast, slow_start, slow_tokens, failed()]
    slos = {"ttft": 200.0, "tpot": 200.0}
    assert [meets_slos(r, slos) for r in results] == [True, False, False, False]
    assert summarize(results, duration_s=0.5, slos_ms=slos).goodput == 2.0
    assert summarize(results, duration_s=0.5, slos_ms={"e2el": 500.0}).goodput == 4.0


def test_single_token_meets_any_tpot_slo() -> None:
    assert meets_slos(ok((0.125,), latency=0.125, completion=1), {"tpot": 1.0})


def test_parse_slos() -> None:
    assert parse_slos(["ttft:200", "tpot:50.5", "e2el:3000"]) == {
        "ttft": 200.0,
        "tpot": 50.5,
        "e2el": 3000.0,
    }
    for bad in ("itl:5", "ttft", "ttft:fast", "tpot:-1"):
        with pytest.raises(ValueError, match="SLO|ttft|tpot"):
            parse_slos([bad])


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_times(4, math.inf, 1.0, seed=0) == [0.0, 0.0, 0.0, 0.0]


def test_poisson_arrivals_are_reproducible_and_have_mean_gap_one_over_rate() -> None:
    times = arrival_times(20_000, request_rate=50.0, burstiness=1.0, seed=3)
    assert times == arrival_times(20_000, request_rate=50.0, burstiness=1.0, seed=3)
    assert times != arrival_times(20_000, request_rate=50.0, burstiness=1.0, seed=4)
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1


def test_burstiness_is_the_gamma_shape() -> None:
    gaps = np.diff(arrival_times(20_000, request_rate=10.0, burstiness=4.0, seed=0))
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(0.5, rel=0.05)  # CV = 1/sqrt(shape)


def test_ramp_up_rates_follow_vllm_formulas() -> None:
    linear, exponential = RampUp("linear", 1.0, 9.0), RampUp("exponential", 1.0, 16.0)
    assert [rate_at(i, 5, math.inf, linear) for i in range(5)] == [1.0, 3.0, 5.0, 7.0, 9.0]
    assert [rate_at(i, 5, math.inf, exponential) for i in range(5)] == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert rate_at(3, 5, 2.5, None) == 2.5


def test_ramp_up_arrivals_get_denser() -> None:
    times = arrival_times(400, math.inf, 1.0, seed=3, ramp_up=RampUp("linear", 2.0, 200.0))
    assert times[0] == 0.0 and times == sorted(times)
    early, late = times[50] - times[0], times[-1] - times[-51]
    assert early > 5 * late  # the first 50 gaps at ~2-50 req/s, the last 50 at ~175-200


def test_ramp_up_checks_say_what_to_fix() -> None:
    with pytest.raises(ValueError, match="drop --request-rate"):
        check_ramp_up(RampUp("linear", 1.0, 2.0), 5.0)
    with pytest.raises(ValueError, match="start-rps"):
        check_ramp_up(RampUp("linear", 3.0, 2.0), math.inf)
    with pytest.raises(ValueError, match="exponential"):
        check_ramp_up(RampUp("exponential", 0.0, 2.0), math.inf)


def test_bad_rates_are_rejected() -> None:
    with pytest.raises(ValueError, match="positive"):
        arrival_times(3, 0.0, 1.0, seed=0)
    with pytest.raises(ValueError, match="positive"):
        arrival_times(3, 1.0, 0.0, seed=0)


@pytest.mark.parametrize("input_len", [1, 7, 128, 513])
def test_prompts_encode_to_exactly_input_len(byte_bpe_tokenizer: Any, input_len: int) -> None:
    prompts = build_prompts(byte_bpe_tokenizer, num_prompts=6, input_len=input_len, seed=1)
    special = set(byte_bpe_tokenizer.all_special_ids)
    for prompt in prompts:
        ids = byte_bpe_tokenizer.encode(prompt.text, add_special_tokens=False)
        assert len(ids) == prompt.input_len == input_len
        assert not special & set(ids)
    assert len({p.text for p in prompts}) == len(prompts)


def test_prompts_are_reproducible_by_seed(llama3_tokenizer: Any) -> None:
    first = build_prompts(llama3_tokenizer, num_prompts=3, input_len=32, seed=7)
    assert first == build_prompts(llama3_tokenizer, num_prompts=3, input_len=32, seed=7)
    assert first != build_prompts(llama3_tokenizer, num_prompts=3, input_len=32, seed=8)
