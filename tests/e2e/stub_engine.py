"""The real engine process wrapper (ZeroMQ I/O thread, encoder, busy loop) around a stub core.

`StubCore` stands in for `EngineCore` with no model: each step gives every request one token
(its step count) until its max_tokens. Its steps can be made to hang (`hang()` / `resume()`),
so the watchdog can be tested on the work rather than on the socket, in milliseconds.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from engine_core.process import EngineProcess
from shared.messages import (
    EngineStats,
    Finished,
    FinishReason,
    Ready,
    SamplingParams,
    StepOutputs,
    ints,
)


@dataclass
class _Req:
    owner: bytes
    left: int


class _Scheduler:
    def __init__(self) -> None:
        self.requests: dict[str, _Req] = {}
        self.waiting: list[_Req] = []  # the queue's lengths, which ping answers carry

    @property
    def running(self) -> list[_Req]:
        return list(self.requests.values())


class StubCore:
    """What EngineProcess uses of EngineCore."""

    def __init__(self, step_s: float = 0.01) -> None:
        self.counts = EngineStats()
        self.scheduler = _Scheduler()
        self.step_s = step_s
        self.failed: str | None = None  # (EngineCore's: why the engine cannot go on)
        self._running = threading.Event()
        self._running.set()

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.requests)

    def add_request(self, request_id: str, prompt: bytes | list[int], params: SamplingParams,
                    owner: bytes = b"") -> None:
        self.scheduler.requests[request_id] = _Req(owner, params.max_tokens)

    def abort(self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT) -> None:
        for rid in request_ids:
            self.scheduler.requests.pop(rid, None)

    def take_refusals(self) -> dict[bytes, StepOutputs]:
        return {}  # it refuses nothing

    def stats(self) -> EngineStats:
        return EngineStats(num_requests=len(self.scheduler.requests),
                           step_errors=self.counts.step_errors,
                           frontends_lost=self.counts.frontends_lost)

    def hang(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def step(self) -> dict[bytes, StepOutputs]:
        self._running.wait()
        time.sleep(self.step_s)
        self.counts.steps += 1
        by_owner: dict[bytes, list[str]] = {}
        for rid, req in list(self.scheduler.requests.items()):
            req.left -= 1
            by_owner.setdefault(req.owner, []).append(rid)
        return {owner: self._news(rids) for owner, rids in by_owner.items()}

    def _news(self, rids: list[str]) -> StepOutputs:
        finished = []
        for i, rid in enumerate(rids):
            if self.scheduler.requests[rid].left <= 0:
                del self.scheduler.requests[rid]
                finished.append(Finished(i, FinishReason.LENGTH))
        return StepOutputs(rids, ints([self.counts.steps % 100] * len(rids)), finished=finished)


def start_stub_engine(address: str, core: StubCore, **kwargs: float) -> EngineProcess:
    """EngineProcess(core) serving `address` on a background thread; `stop()` ends its loop."""
    ready = Ready("stub", "stub-tokenizer", 256, 1000, [999])
    proc = EngineProcess(core, address, ready, **kwargs)  # type: ignore[arg-type]
    threading.Thread(target=proc.run, name="stub-engine-loop", daemon=True).start()
    return proc
