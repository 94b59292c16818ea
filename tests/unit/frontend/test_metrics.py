"""/metrics: rendering from the engine's stats, latency recording, engine-side totals, and the
overload refusal's mapping to 503, against the fake engine (no model)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_core.metrics import HistogramTotals
from frontend.engine.latency import BUCKETS, E2E, ITL, TTFT, HistogramBuffer, LatencyRecorder
from frontend.metrics import render
from frontend.server import init_app
from shared.messages import (
    AddRequest,
    EngineStats,
    Finished,
    FinishReason,
    Histogram,
    MetricsReport,
    StopRequest,
)
from tests.unit.fake_engine import FakeEngine, cached_tokenizer, frontend_config

STATS = EngineStats(
    running=3, waiting=2, num_blocks=200, free_blocks=150, request_prompt_tokens=120,
    generation_tokens=55,
    finished={FinishReason.STOP: 4, FinishReason.LENGTH: 7, FinishReason.ABORT: 1},
    rejected={FinishReason.OVERLOADED: 9}, prefix_queries=130, prefix_hits=32, preemptions=2,
    histograms=[Histogram(TTFT, [0.1, 1.0], [2, 1, 1], 3.25)],
)


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of an exposition, keyed by (name, labels)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_render_uses_vllm_names_and_the_engine_figures() -> None:
    text = render([(0, STATS)], "m").decode()
    got = samples(text)
    m = frozenset({("model_name", "m"), ("engine", "0")})

    def value(name: str, **labels: str) -> float:
        return got[(name, m | frozenset(labels.items()))]

    assert value("vllm:num_requests_running") == 3 and value("vllm:num_requests_waiting") == 2
    assert value("vllm:kv_cache_usage_perc") == pytest.approx(0.25)
    assert value("vllm:prompt_tokens_total") == 120
    assert value("vllm:generation_tokens_total") == 55
    assert [value("vllm:request_success_total", finished_reason=r)
            for r in ("stop", "length", "abort")] == [4, 7, 1]
    assert value("tandem:requests_rejected_total", reason="overloaded") == 9
    assert value("tandem:requests_rejected_total", reason="error") == 0
    assert value("vllm:prefix_cache_queries_total") == 130
    assert value("vllm:prefix_cache_hits_total") == 32
    assert value("vllm:num_preemptions_total") == 2
    # cumulative buckets from per-bucket counts
    assert [value(f"{TTFT}_bucket", le=le) for le in ("0.1", "1.0", "+Inf")] == [2, 3, 4]
    assert value(f"{TTFT}_count") == 4 and value(f"{TTFT}_sum") == 3.25
    # not reported yet: empty, with this frontend's buckets
    assert value(f"{ITL}_count") == 0
    assert sum(1 for name, _ in got if name == f"{E2E}_bucket") == len(BUCKETS[E2E]) + 1
    assert "# TYPE vllm:e2e_request_latency_seconds histogram" in text


def test_render_without_figures_is_all_zero() -> None:
    got = samples(render([(0, EngineStats())], "m").decode())
    info = {k: v for k, v in got.items() if k[0] == "vllm:cache_config_info"}
    assert info and all(v == 1 for v in info.values())
    assert all(v == 0 for k, v in got.items() if k not in info)


def test_every_engine_has_its_series_and_its_cache_config() -> None:
    one = EngineStats(running=1, waiting=4, num_blocks=200, free_blocks=50, block_size=16)
    two = EngineStats(running=2, num_blocks=100, free_blocks=100, block_size=32,
                      cache_dtype="fp8")
    text = render([(0, one), (3, two)], "m").decode()
    got = samples(text)

    def value(name: str, engine: str) -> float:
        return got[(name, frozenset({("model_name", "m"), ("engine", engine)}))]

    assert [value("vllm:num_requests_running", e) for e in ("0", "3")] == [1, 2]
    assert [value("vllm:num_requests_waiting", e) for e in ("0", "3")] == [4, 0]
    assert value("vllm:kv_cache_usage_perc", "0") == pytest.approx(0.75)
    assert value("vllm:kv_cache_usage_perc", "3") == 0
    configs = {k[1] for k in got if k[0] == "vllm:cache_config_info"}
    # vLLM's cache_dtype label: "auto" unless --kv-cache-dtype says otherwise
    assert configs == {frozenset({("engine", "0"), ("block_size", "16"),
                                  ("cache_dtype", "auto"), ("num_gpu_blocks", "200")}),
                       frozenset({("engine", "3"), ("block_size", "32"),
                                  ("cache_dtype", "fp8"), ("num_gpu_blocks", "100")})}
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1  # one family, two series


def test_histogram_buckets_are_upper_inclusive() -> None:
    buf = HistogramBuffer("h", (0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 7.0):
        buf.observe(v)
    taken = buf.take()
    assert taken is not None and taken.counts == [2, 2, 1] and taken.sum == pytest.approx(8.65)
    assert buf.take() is None


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def totals(reports: list[MetricsReport]) -> dict[str, Histogram]:
    engine_side = HistogramTotals()
    for report in reports:
        engine_side.add(report)
    return {h.name: h for h in engine_side.snapshot()}


async def test_latency_recorder_times_requests_and_reports_soon_after_a_finish() -> None:
    sent: list[MetricsReport] = []
    clock = FakeClock()
    rec = LatencyRecorder(sent.append, flush_interval=60, clock=clock)
    rec.on_add("a")
    rec.on_add("prompt-only")
    rec.on_add("refused")
    for dt in (0.5, 0.25, 0.25):  # TTFT 0.5, then two gaps of 0.25
        clock.now += dt
        rec.on_output("a", True, None)
    rec.on_output("prompt-only", False, "length")
    rec.on_output("refused", False, "overloaded")
    clock.now += 1.0
    rec.on_output("a", False, "length")
    assert not sent
    await asyncio.sleep(0)  # one loop turn: the finish flushes without waiting 60 s
    got = totals(sent)
    assert got[TTFT].counts[BUCKETS[TTFT].index(0.5)] == 1 and got[TTFT].sum == 0.5
    assert sum(got[ITL].counts) == 2 and got[ITL].sum == 0.5
    assert sum(got[E2E].counts) == 2 and got[E2E].sum == pytest.approx(2.0 + 1.0)
    rec.on_add("b")
    rec.on_finish("b", "abort")  # a client disconnect still has an end-to-end latency
    rec.on_finish("b", "abort")  # and only one
    await asyncio.sleep(0)
    assert sum(totals(sent)[E2E].counts) == 3


def test_engine_totals_add_up_frontends_and_leave_out_other_buckets() -> None:
    one = MetricsReport([Histogram("h", [1.0], [1, 0], 0.5)])
    other = MetricsReport([Histogram("h", [1.0], [2, 1], 3.0)])
    foreign = MetricsReport([Histogram("h", [2.0], [5, 5], 9.0)])
    assert totals([one, other, foreign]) == {"h": Histogram("h", [1.0], [3, 1], 3.5)}


class OverloadedFakeEngine(FakeEngine):
    """Refuses every request whose prompt holds token 666 with "overloaded"; keeps reports."""

    def __init__(self) -> None:
        super().__init__()
        self.reports: list[MetricsReport] = []
        self.stopped: list[str] = []

    def _handle(self, identity: bytes, msg: Any) -> None:
        if isinstance(msg, MetricsReport):
            self.reports.append(msg)
        elif isinstance(msg, StopRequest):
            self.stopped.extend(msg.request_ids)
        super()._handle(identity, msg)

    def _advance(self, req: Any, step: Any, row: int) -> Finished | None:
        add: AddRequest = req.add
        if 666 in req.source and add.request_id.endswith("-0"):
            self._no_token(step)
            message = "the server is overloaded: 2 waiting"
            return Finished(row, FinishReason.OVERLOADED, message=message)
        return super()._advance(req, step, row)


@pytest.fixture
def engine() -> Iterator[OverloadedFakeEngine]:
    fake = OverloadedFakeEngine()
    fake.start()
    yield fake
    fake.stop()


async def test_overloaded_is_a_503_with_retry_after_and_frees_the_siblings(
    aiohttp_client: Any, engine: OverloadedFakeEngine
) -> None:
    client = await aiohttp_client(init_app(frontend_config(engine), cached_tokenizer))
    body = {"prompt": [1, 666, 2], "max_tokens": 50, "n": 2, "ignore_eos": True}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 503 and resp.headers["Retry-After"] == "1"
    error = (await resp.json())["error"]
    assert error["type"] == "ServiceUnavailableError" and "overloaded" in error["message"]
    await asyncio.sleep(0.1)
    assert any(rid.endswith("-1") for rid in engine.aborted)  # the accepted sibling
    assert not engine.running


async def test_metrics_endpoint_and_latency_reports_reach_the_engine(
    aiohttp_client: Any, engine: OverloadedFakeEngine
) -> None:
    client = await aiohttp_client(init_app(frontend_config(engine), cached_tokenizer))
    resp = await client.post("/v1/completions", json={"prompt": [1, 5, 6], "max_tokens": 3,
                                                      "ignore_eos": True})
    assert resp.status == 200
    resp = await client.post("/v1/completions", json={"prompt": [1, 9, 7, 8], "max_tokens": 9,
                                                      "stop": ["("], "ignore_eos": True})
    assert (await resp.json())["choices"][0]["finish_reason"] == "stop"
    resp = await client.get("/metrics")
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
    assert "vllm:request_success_total" in await resp.text()
    assert "X-Tandem-Frontend" in resp.headers
    await asyncio.sleep(0.1)
    assert len(engine.stopped) == 1  # the engine counts it as "stop", not "abort"
    got = totals(engine.reports)
    assert sum(got[TTFT].counts) == 2 and sum(got[E2E].counts) == 2
