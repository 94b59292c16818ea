"""Turn one step's per-request news into columnar StepOutputs, one message per frontend."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine_core.sampler import TopLogprobs
from shared.messages import Finished, PromptLogprobs, StepOutputs, floats, ints


@dataclass
class Row:
    request_id: str
    owner: bytes
    token_id: int = -1
    logprobs: TopLogprobs | None = None  # one row: arrays of length 1 / [1, k]
    prompt_logprobs: TopLogprobs | None = None
    finish: Finished | None = None


def group_by_owner(rows: list[Row]) -> dict[bytes, StepOutputs]:
    owners: dict[bytes, list[Row]] = {}
    for row in rows:
        owners.setdefault(row.owner, []).append(row)
    return {owner: encode_rows(group) for owner, group in owners.items()}


def encode_rows(rows: list[Row]) -> StepOutputs:
    out = StepOutputs(req_ids=[r.request_id for r in rows],
                      token_ids=ints([r.token_id for r in rows]))
    with_lp = [r for r in rows if r.logprobs is not None]
    if with_lp:
        ks = [r.logprobs.top_ids.shape[-1] if r.logprobs is not None else -1 for r in rows]
        out.lp_k = ints(ks)
        out.lp_sampled = floats([r.logprobs.logprobs[0] if r.logprobs is not None else np.nan for r in rows])
        out.lp_rank = ints([r.logprobs.ranks[0] if r.logprobs is not None else 0 for r in rows])
        out.lp_top_ids = ints(np.concatenate([r.logprobs.top_ids.reshape(-1) for r in with_lp]))  # type: ignore[union-attr]
        out.lp_top_vals = floats(np.concatenate([r.logprobs.top_logprobs.reshape(-1) for r in with_lp]))  # type: ignore[union-attr]
    for i, r in enumerate(rows):
        if r.prompt_logprobs is not None:
            p = r.prompt_logprobs
            out.prompt_logprobs.append(PromptLogprobs(
                index=i, logprobs=floats(p.logprobs), ranks=ints(p.ranks), k=p.top_ids.shape[-1],
                top_ids=ints(p.top_ids.reshape(-1)), top_logprobs=floats(p.top_logprobs.reshape(-1))))
        if r.finish is not None:
            r.finish.index = i
            out.finished.append(r.finish)
    return out
