"""Drive an in-process EngineCore to completion and collect what it said per request."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine_core.engine import EngineCore
from shared.messages import StepOutputs, as_floats, as_ints


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


def absorb(out: StepOutputs, results: dict[str, Collected]) -> None:
    tokens = as_ints(out.token_ids)
    ks = as_ints(out.lp_k) if out.lp_k else None
    top = as_ints(out.lp_top_ids)
    pos = 0
    for i, rid in enumerate(out.req_ids):
        r = results.setdefault(rid, Collected())
        if tokens[i] >= 0:
            r.token_ids.append(int(tokens[i]))
        if ks is not None and ks[i] >= 0:
            r.logprobs.append(float(as_floats(out.lp_sampled)[i]))
            r.ranks.append(int(as_ints(out.lp_rank)[i]))
            r.top_ids.append(top[pos:pos + ks[i]].tolist())
            pos += int(ks[i])
    for p in out.prompt_logprobs:
        results[out.req_ids[p.index]].prompt_logprobs = as_floats(p.logprobs)
    for f in out.finished:
        r = results[out.req_ids[f.index]]
        r.finish, r.stop_token_id, r.message = f.reason, f.stop_token_id, f.message


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
