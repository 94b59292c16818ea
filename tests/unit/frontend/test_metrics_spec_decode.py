"""/metrics' speculative-decoding counters against the lines vLLM 0.32's own Prometheus code
writes for the same figures (tests/data/spec_decode/, recorded by its record_vllm.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from frontend.metrics import render
from frontend.server import init_app
from shared.messages import EngineStats
from tests.unit.fake_engine import FakeEngine, cached_tokenizer, frontend_config

GOLDEN = Path(__file__).parents[2] / "data" / "spec_decode" / "metrics.txt"
PREFIX = "vllm:spec_decode"
# record_vllm.py's scenario: k = 3, two data-parallel engines.
ENGINES = [
    (0, EngineStats(running=1, spec_drafts=10, spec_draft_tokens=30, spec_accepted_tokens=17,
                    spec_accepted_per_pos=[8, 6, 3])),
    (1, EngineStats(spec_drafts=4, spec_draft_tokens=12, spec_accepted_tokens=3,
                    spec_accepted_per_pos=[2, 1, 0])),
]


def metric_name(line: str) -> str:
    """The metric a line is about: a HELP or TYPE line's name, or a sample's name."""
    return line.split(" ")[2] if line.startswith("# ") else line.split("{")[0].split(" ")[0]


def spec_lines(text: str) -> list[str]:
    """The spec_decode lines, without prometheus-client's `_created` series (the time each
    counter was made: vLLM's process has them, Tandem's counters are built per scrape)."""
    return [line for line in text.splitlines()
            if metric_name(line).startswith(PREFIX) and not metric_name(line).endswith("_created")]


def test_spec_decode_lines_are_vllms() -> None:
    golden = spec_lines(GOLDEN.read_text())
    assert len(golden) == 4 * 2 + 2 * 3 + 2 * 3  # HELP and TYPE per family, the samples
    ours = spec_lines(render(ENGINES, "golden-model", spec_tokens=3).decode())
    assert ours == golden


def test_no_spec_decode_lines_without_speculation() -> None:
    """vLLM creates the counters only with a speculative config: none at all without one."""
    text = render(ENGINES, "golden-model").decode()
    assert PREFIX not in text and "vllm:num_requests_running" in text


def test_a_series_per_draft_position_whatever_the_engine_sent() -> None:
    short = EngineStats(spec_drafts=2, spec_accepted_per_pos=[1])  # nothing reported past 0
    long = EngineStats(spec_drafts=2, spec_accepted_per_pos=[2, 1, 1, 5])
    for stats, want in ((short, ["1.0", "0.0"]), (long, ["2.0", "1.0"])):
        lines = [line for line in spec_lines(render([(0, stats)], "m", 2).decode())
                 if line.startswith(f"{PREFIX}_num_accepted_tokens_per_pos_total{{")]
        assert [line.split('position="')[1][0] for line in lines] == ["0", "1"]
        assert [line.rsplit(" ", 1)[1] for line in lines] == want


async def test_metrics_endpoint_publishes_them_when_the_engine_speculates(
    aiohttp_client: Any, engine: FakeEngine
) -> None:
    engine.ready.num_speculative_tokens = 2  # before the frontend's handshake
    client = await aiohttp_client(init_app(frontend_config(engine), cached_tokenizer))
    text = await (await client.get("/metrics")).text()
    lines = spec_lines(text)
    assert f"# TYPE {PREFIX}_num_drafts_total counter" in lines
    assert (f'{PREFIX}_num_accepted_tokens_per_pos_total{{engine="0",model_name="fake-model",'
            'position="1"} 0.0') in lines
    assert len(lines) == 4 * 2 + 3 + 2
