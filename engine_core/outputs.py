"""One step's news for every frontend, in whole-step columns, split into one `StepOutputs`
per frontend by index arrays.

The sampled tokens' logprobs stay in the sampler's columns (`Logprobs`, one row per request
that asked, top width the batch's largest k): each frontend's rows are taken from them by
index, and each row sends its own request's k.
"""

from __future__ import annotations

import numpy as np

from shared.messages import Finished, FinishReason, StepOutputs
from shared.step_outputs import Logprobs, pack_step


class StepNews:
    """Rows of news, one per request, in the order they are added."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.owners: list[bytes] = []
        self._tokens: list[np.ndarray] = []  # int [n] per added batch; -1 = no token
        self._lp_rows: list[np.ndarray] = []  # int [n]: row in `logprobs`, -1 = none
        self._lp_k: list[np.ndarray] = []  # int [n]: top entries sent, -1 = no logprobs
        self.logprobs: Logprobs | None = None  # the sampler's columns, for `_lp_rows`
        self._finished: dict[int, Finished] = {}  # by row; `index` set per frontend
        self._prompt_logprobs: dict[int, Logprobs] = {}

    def __len__(self) -> int:
        return len(self.request_ids)

    def add_sampled(self, request_ids: list[str], owners: list[bytes], token_ids: np.ndarray,
                    logprobs: Logprobs | None, lp_rows: np.ndarray, lp_k: np.ndarray) -> None:
        """Rows for requests that sampled `token_ids`; `lp_rows[i]` is row i's row of
        `logprobs` (or -1), `lp_k[i]` its k (or -1). Once per step: one sampler output."""
        assert self.logprobs is None, "one sampler output per step"
        self.logprobs = logprobs
        self._add(request_ids, owners, token_ids, lp_rows, lp_k)

    def add_finish(self, request_id: str, owner: bytes, reason: FinishReason,
                   stop_token_id: int | None = None, message: str | None = None,
                   embedding: bytes = b"") -> None:
        """A row with no token, only a finish (a refusal, a prompt-only request, with its
        `embedding` if it pooled)."""
        self._add([request_id], [owner], *(np.full(1, -1, np.int64) for _ in range(3)))
        self._finished[len(self) - 1] = Finished(0, reason, stop_token_id, message, embedding)

    def finish(self, row: int, reason: FinishReason, stop_token_id: int | None = None) -> None:
        self._finished[row] = Finished(0, reason, stop_token_id)

    def set_prompt_logprobs(self, row: int, logprobs: Logprobs) -> None:
        self._prompt_logprobs[row] = logprobs

    def pack(self) -> dict[bytes, StepOutputs]:
        """One StepOutputs per frontend (by owner identity), rows in the order added."""
        if not self.request_ids:
            return {}
        tokens, lp_rows, lp_k = (np.concatenate(c) for c in (self._tokens, self._lp_rows,
                                                            self._lp_k))
        if len(set(self.owners)) == 1:  # one frontend: every row, in order
            return {self.owners[0]: self._pack(np.arange(len(self.owners)), tokens, lp_rows,
                                               lp_k)}
        by_owner: dict[bytes, list[int]] = {}
        for row, owner in enumerate(self.owners):
            by_owner.setdefault(owner, []).append(row)
        return {owner: self._pack(np.asarray(rows, np.int64), tokens, lp_rows, lp_k)
                for owner, rows in by_owner.items()}

    def _add(self, request_ids: list[str], owners: list[bytes], token_ids: np.ndarray,
             lp_rows: np.ndarray, lp_k: np.ndarray) -> None:
        self.request_ids += request_ids
        self.owners += owners
        self._tokens.append(token_ids)
        self._lp_rows.append(lp_rows)
        self._lp_k.append(lp_k)

    def _pack(self, rows: np.ndarray, tokens: np.ndarray, lp_rows: np.ndarray,
              lp_k: np.ndarray) -> StepOutputs:
        if len(rows) == len(self.request_ids):  # every row (one frontend): indices as they are
            finished = [Finished(r, f.reason, f.stop_token_id, f.message, f.embedding)
                        for r, f in self._finished.items()]
            prompts = dict(self._prompt_logprobs)
        else:
            local = {int(row): i for i, row in enumerate(rows)}
            finished = [Finished(local[r], f.reason, f.stop_token_id, f.message, f.embedding)
                        for r, f in self._finished.items() if r in local]
            prompts = {local[r]: lps for r, lps in self._prompt_logprobs.items() if r in local}
        ks = lp_k[rows]
        logprobs = None
        if self.logprobs is not None and (ks >= 0).any():
            logprobs = _take_rows(self.logprobs, lp_rows[rows])
        ids = (self.request_ids if len(rows) == len(self.request_ids) else
               [self.request_ids[r] for r in rows.tolist()])
        return pack_step(ids, tokens[rows], logprobs=logprobs,
                         lp_k=ks if logprobs is not None else None,
                         prompt_logprobs=dict(sorted(prompts.items())),
                         finished=sorted(finished, key=lambda f: f.index))


def _take_rows(logprobs: Logprobs, rows: np.ndarray) -> Logprobs:
    """`logprobs` at `rows`; a row of -1 (no logprobs) reads NaN with rank 0 (never sent as a
    logprob: its k is -1)."""
    missing = rows < 0
    taken = logprobs.take(np.where(missing, 0, rows))
    taken.logprobs[missing] = np.nan
    taken.ranks[missing] = 0
    return taken
