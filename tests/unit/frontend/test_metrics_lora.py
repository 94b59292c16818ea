"""/metrics' vllm:lora_requests_info against the lines vLLM 0.32's own code writes for the same
requests (tests/data/lora_metrics/, recorded by its record_vllm.py): equal but for the value,
the time each side took its figures."""

from __future__ import annotations

import time
from pathlib import Path

from frontend.metrics import render
from shared.messages import EngineStats

GOLDEN = Path(__file__).parents[2] / "data" / "lora_metrics" / "metrics.txt"
NAME = "vllm:lora_requests_info"
# record_vllm.py's scenario as the engine counts it: alpha has a waiting and a running
# request (its oldest arrived first), beta a running one; gamma's finished, the base model's
# request is not an adapter's.
NOW = time.time()
STATS = EngineStats(lora_running={"alpha": 1, "beta": 1}, lora_waiting={"alpha": 1, "beta": 0},
                    lora_time=NOW)


def lora_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if NAME in line]


def split_value(sample: str) -> tuple[str, float]:
    labels, value = sample.rsplit(" ", 1)
    return labels, float(value)


def test_lora_requests_info_is_vllms() -> None:
    golden = lora_lines(GOLDEN.read_text())
    ours = lora_lines(render([(0, STATS)], "golden-model", max_loras=2).decode())
    assert len(golden) == 3 and len(ours) == 3
    assert ours[:2] == golden[:2]  # HELP and TYPE
    (want, recorded), (got, value) = split_value(golden[2]), split_value(ours[2])
    assert got == want
    assert value == NOW and recorded > 1.7e9  # both a time.time()


def test_engines_share_a_series_when_their_adapters_agree() -> None:
    idle = EngineStats(lora_time=NOW - 5)
    older = EngineStats(lora_running={"alpha": 1, "beta": 1},
                        lora_waiting={"alpha": 1, "beta": 0}, lora_time=NOW - 1)
    samples = lora_lines(render([(0, STATS), (1, older), (2, idle)], "m",
                                max_loras=2).decode())[2:]
    assert [split_value(s) for s in samples] == [
        ('vllm:lora_requests_info{max_lora="2",running_lora_adapters="alpha,beta",'
         'waiting_lora_adapters="alpha,beta"}', NOW),
        ('vllm:lora_requests_info{max_lora="2",running_lora_adapters="",'
         'waiting_lora_adapters=""}', NOW - 5)]


def test_absent_without_lora() -> None:
    assert not lora_lines(render([(0, STATS)], "m").decode())
