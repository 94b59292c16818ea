"""An overload refusal leaves the engine in the busy-loop turn that took its request, before
that turn's step runs, not with the step's outputs (issue 15: a 503 waited 0.5-1.5 steps).

The engine process is driven a turn at a time on this thread (its I/O threads not started), so
what the output queue holds when a step starts is seen exactly, with no timing involved.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from engine_core.process import EngineProcess
from shared.messages import AddRequest, FinishReason, Ready, SamplingParams, StepOutputs, ints
from shared.step_outputs import OutputRow, unpack_step

PROMPT = [128000, 9906, 1917]
FRONTEND = b"frontend-1"


@pytest.fixture
def proc(tiny_llama: Path, tmp_path: Path) -> Iterator[EngineProcess]:
    core = EngineCore(EngineConfig(model=str(tiny_llama), num_kv_blocks=64, max_model_len=64,
                                   max_num_seqs=1, max_waiting_requests=1))
    ready = Ready("m", "m", core.max_model_len, core.facts.vocab_size, [])
    process = EngineProcess(core, f"ipc://{tmp_path}/engine.sock", ready)
    yield process
    process.ctx.destroy(linger=0)


def send(proc: EngineProcess, request_id: str) -> None:
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    proc.inputs.put((FRONTEND, AddRequest(request_id, ints(PROMPT), params)))


def sent(proc: EngineProcess) -> list[list[OutputRow]]:
    """The rows of each message queued for sending so far (all to FRONTEND), oldest first."""
    messages: list[list[OutputRow]] = []
    while True:
        try:
            owner, msg = proc.outputs.get_nowait()
        except queue.Empty:
            return messages
        assert owner == FRONTEND and isinstance(msg, StepOutputs)
        messages.append(unpack_step(msg))


def test_a_refusal_is_sent_before_the_next_step_runs(
    proc: EngineProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    send(proc, "running")
    proc._turn()
    send(proc, "waiting")  # --max-num-seqs 1: it waits, and the waiting queue is full
    proc._turn()
    assert [[row.request_id for row in rows] for rows in sent(proc)] == [["running"]] * 2
    core = proc.core
    rejected = core.stats().rejected.get(FinishReason.OVERLOADED, 0)

    before_step: list[list[list[OutputRow]]] = []
    real_step = core.step

    def watched_step() -> dict[bytes, StepOutputs]:
        before_step.append(sent(proc))
        return real_step()

    monkeypatch.setattr(core, "step", watched_step)
    send(proc, "refused")
    proc._turn()

    [[refusal]] = before_step[0]  # one message, one row: already queued when the step began
    assert refusal.request_id == "refused" and refusal.token_id is None
    assert refusal.finish is not None and refusal.finish.reason == FinishReason.OVERLOADED
    assert "--max-waiting-requests 1" in (refusal.finish.message or "")
    [step_rows] = sent(proc)  # the step's own message: the running request's token, only
    assert [row.request_id for row in step_rows] == ["running"]
    assert core.stats().rejected.get(FinishReason.OVERLOADED, 0) == rejected + 1
    core.abort(["running", "waiting"])
