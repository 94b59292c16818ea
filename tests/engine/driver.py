"""Drive an in-process EngineCore to completion and collect what it said per request."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine_core.engine import EngineCore
from shared.messages import StepOutputs
from shared.step_outputs import unpack_step


@dataclass
class Collected:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    prompt_logprobs: np.ndarray | None = None
    finish: str | None = None
    stop_token_id: int | None = None
    message: str | None = None
    embedding: np.ndarray | None = None  # a pooling request's vector (float32)


def absorb(out: StepOutputs, results: dict[str, Collected]) -> None:
    for row in unpack_step(out):
        r = results.setdefault(row.request_id, Collected())
        if row.token_id is not None:
            r.token_ids.append(row.token_id)
        if row.logprob is not None:
            r.logprobs.append(row.logprob.logprob)
            r.ranks.append(row.logprob.rank)
            r.top_ids.append(list(row.logprob.top_ids))
        if row.prompt_logprobs is not None:
            r.prompt_logprobs = np.float32([lp.logprob for lp in row.prompt_logprobs])
        if row.finish is not None:
            f = row.finish
            r.finish, r.stop_token_id, r.message = f.reason, f.stop_token_id, f.message
            if f.embedding:
                r.embedding = np.frombuffer(f.embedding, dtype="<f4")


def run(core: EngineCore, results: dict[str, Collected] | None = None, max_steps: int = 10_000,
        on_step=None) -> dict[str, Collected]:
    results = {} if results is None else results
    steps = 0
    while core.has_work:
        for out in core.step().values():
            absorb(out, results)
        steps += 1
        if on_step is not None:
            on_step(core, steps)
        assert steps < max_steps, "engine did not finish"
    return results
