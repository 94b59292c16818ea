"""A step that raises fails its own requests with an error; the engine keeps serving (issue 15).
And a wire request the checks refuse never reaches a step."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from shared.messages import FinishReason, SamplingParams, ints
from tests.engine.driver import run

PROMPT = [128000, 9906, 1917]


@pytest.fixture(scope="module")
def core(tiny_llama: Path) -> EngineCore:
    return EngineCore(EngineConfig(model=str(tiny_llama), num_kv_blocks=64, max_model_len=64))


def test_a_failing_step_fails_its_requests_and_the_next_one_serves(
    core: EngineCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = core.runner.execute

    def broken(*args, **kwargs):
        raise IndexError("index -1000000000 is out of bounds")  # what a bad stop id raised

    monkeypatch.setattr(core.runner, "execute", broken)
    core.add_request("doomed", PROMPT, SamplingParams(max_tokens=4))
    before = core.stats().step_errors
    got = run(core)
    assert got["doomed"].finish == FinishReason.ERROR
    assert "IndexError" in (got["doomed"].message or "")
    assert core.stats().step_errors == before + 1
    monkeypatch.setattr(core.runner, "execute", real)
    core.add_request("after", PROMPT, SamplingParams(max_tokens=4, temperature=0.0))
    assert len(run(core)["after"].token_ids) == 4
    stats = core.stats()
    assert stats.num_requests == 0 and stats.free_blocks == stats.num_blocks


@pytest.mark.parametrize("prompt, params, why", [
    (b"\x00\x01\x02", SamplingParams(), "int32"),
    (ints(PROMPT), SamplingParams(stop_token_ids=[-10**9]), "stop_token_ids"),
    (ints(PROMPT), SamplingParams(temperature=float("nan")), "temperature"),
    (ints(PROMPT), SamplingParams(logit_bias={5: float("nan")}), "logit_bias"),
])
def test_wire_requests_that_crashed_the_engine_are_refused(
    core: EngineCore, prompt: bytes, params: SamplingParams, why: str
) -> None:
    errors = core.stats().step_errors
    core.add_request("bad", prompt, params)
    got = run(core)["bad"]
    assert got.finish == FinishReason.ERROR and why in (got.message or "")
    assert core.stats().step_errors == errors  # refused at the door, not failed in a step
