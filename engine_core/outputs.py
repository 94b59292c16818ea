"""Turn one step's per-request news into columnar StepOutputs, one message per frontend."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.messages import Finished, StepOutputs
from shared.step_outputs import Logprobs, pack_step


@dataclass
class Row:
    request_id: str
    owner: bytes
    token_id: int = -1
    logprobs: Logprobs | None = None  # one row: arrays of length 1 / [1, k]
    prompt_logprobs: Logprobs | None = None
    finish: Finished | None = None


def group_by_owner(rows: list[Row]) -> dict[bytes, StepOutputs]:
    owners: dict[bytes, list[Row]] = {}
    for row in rows:
        owners.setdefault(row.owner, []).append(row)
    return {owner: encode_rows(group) for owner, group in owners.items()}


def encode_rows(rows: list[Row]) -> StepOutputs:
    with_lp = [r.logprobs for r in rows if r.logprobs is not None]
    logprobs = lp_k = None
    if with_lp:
        width = max(lp.top_ids.shape[1] for lp in with_lp)
        filler = Logprobs(np.full(1, np.nan, np.float32), np.zeros(1, np.int32),
                          np.zeros((1, width), np.int32), np.zeros((1, width), np.float32))
        logprobs = Logprobs.concat([_widen(r.logprobs or filler, width) for r in rows])
        lp_k = [-1 if r.logprobs is None else r.logprobs.top_ids.shape[1] for r in rows]
    finished = []
    for i, r in enumerate(rows):
        if r.finish is not None:
            r.finish.index = i
            finished.append(r.finish)
    prompts = {i: r.prompt_logprobs for i, r in enumerate(rows) if r.prompt_logprobs is not None}
    return pack_step([r.request_id for r in rows], [r.token_id for r in rows], logprobs=logprobs,
                     lp_k=lp_k, prompt_logprobs=prompts, finished=finished)


def _widen(lp: Logprobs, width: int) -> Logprobs:
    pad = width - lp.top_ids.shape[1]
    if not pad:
        return lp
    return Logprobs(lp.logprobs, lp.ranks, np.pad(lp.top_ids, ((0, 0), (0, pad))),
                    np.pad(lp.top_logprobs, ((0, 0), (0, pad))))
