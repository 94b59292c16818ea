"""The step-output columns: one pack/unpack pair for whoever writes or reads `StepOutputs`.

The engine packs a step's news column by column (`pack_step`); frontends, the test engines
and the engine tests unpack it row by row (`unpack_step`). Logprobs travel as `Logprobs`
columns (numpy arrays) on the engine side and reach the frontend as one `TokenLogprob` per
token, with plain Python values.

Frontends import this module for the unpacking alone and never load numpy (its memory counts
in every frontend: docs/benchmarks.md, "Frontend memory"): numpy is imported where the engine
side uses it, inside `pack_step` and `Logprobs`' helpers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import TYPE_CHECKING, NamedTuple, overload

from shared.messages import Finished, PromptLogprobs, StepOutputs, read_floats, read_ints

if TYPE_CHECKING:
    import numpy as np


class Logprobs(NamedTuple):
    """Logprobs of n tokens, column by column."""

    logprobs: np.ndarray  # float32 [n] each token's logprob
    ranks: np.ndarray  # int32 [n] 1 = most likely
    top_ids: np.ndarray  # int32 [n, k]
    top_logprobs: np.ndarray  # float32 [n, k]

    def __len__(self) -> int:  # type: ignore[override]  # rows, not fields
        return len(self.logprobs)

    def take(self, rows: np.ndarray | Sequence[int], k: int | None = None) -> Logprobs:
        """These rows (and the first `k` top entries of each)."""
        import numpy as np

        idx = np.asarray(rows, dtype=np.int64)
        cols = slice(None) if k is None else slice(0, k)
        return Logprobs(self.logprobs[idx], self.ranks[idx], self.top_ids[idx, cols],
                        self.top_logprobs[idx, cols])

    @staticmethod
    def empty(k: int = 0) -> Logprobs:
        import numpy as np

        return Logprobs(np.zeros(0, np.float32), np.zeros(0, np.int32),
                        np.zeros((0, k), np.int32), np.zeros((0, k), np.float32))

    @staticmethod
    def concat(parts: Sequence[Logprobs], k: int = 0) -> Logprobs:
        import numpy as np

        if not parts:
            return Logprobs.empty(k)
        return Logprobs(*(np.concatenate([p[f] for p in parts]) for f in range(4)))


class TokenLogprob(NamedTuple):
    """One token's logprobs, as the frontend uses them."""

    logprob: float
    rank: int
    top_ids: Sequence[int]
    top_logprobs: Sequence[float]


class OutputRow(NamedTuple):
    """What one step brought one request."""

    request_id: str
    token_id: int | None  # None: no token this step (a prefill chunk, or a finish alone)
    logprob: TokenLogprob | None
    prompt_logprobs: PromptRows | None  # prompt tokens 1..P-1, once, when asked
    finish: Finished | None


def pack_step(req_ids: list[str], token_ids: np.ndarray | Sequence[int], *,
              logprobs: Logprobs | None = None, lp_k: np.ndarray | Sequence[int] | None = None,
              prompt_logprobs: Mapping[int, Logprobs] | None = None,
              finished: Sequence[Finished] = ()) -> StepOutputs:
    """One message from columns whose row i is request `req_ids[i]`.

    token_ids[i] is -1 where row i sampled nothing. `logprobs` rows align with `req_ids`;
    lp_k[i] is -1 where row i has none (its logprobs row is ignored), else how many of its
    top entries are sent. `prompt_logprobs` maps a row to its prompt's logprobs; each
    `Finished.index` names its row.
    """
    import numpy as np

    def ints(values: object) -> bytes:
        return np.asarray(values, dtype="<i4").tobytes()

    def floats(values: object) -> bytes:
        return np.asarray(values, dtype="<f4").tobytes()

    out = StepOutputs(req_ids=req_ids, token_ids=ints(token_ids), finished=list(finished))
    if logprobs is not None and lp_k is not None:
        ks = np.asarray(lp_k, dtype=np.int32)
        if (ks >= 0).any():
            width = logprobs.top_ids.shape[1]
            keep = np.arange(width)[None, :] < ks[:, None]  # row-major: each row's top-k in turn
            out.lp_k = ints(ks)
            out.lp_sampled = floats(logprobs.logprobs)
            out.lp_rank = ints(logprobs.ranks)
            out.lp_top_ids = ints(logprobs.top_ids[keep])
            out.lp_top_vals = floats(logprobs.top_logprobs[keep])
    for row, lps in (prompt_logprobs or {}).items():
        out.prompt_logprobs.append(PromptLogprobs(
            index=row, logprobs=floats(lps.logprobs), ranks=ints(lps.ranks),
            k=lps.top_ids.shape[1], top_ids=ints(lps.top_ids.reshape(-1)),
            top_logprobs=floats(lps.top_logprobs.reshape(-1))))
    return out


def unpack_step(out: StepOutputs) -> list[OutputRow]:
    """The rows of `out` that bring anything (a token, prompt logprobs or a finish)."""
    tokens = read_ints(out.token_ids)
    logprobs = token_logprobs(out)
    prompts = {p.index: p for p in out.prompt_logprobs}
    finished = {f.index: f for f in out.finished}
    rows = []
    for i, rid in enumerate(out.req_ids):
        fin, plp = finished.get(i), prompts.get(i)
        token = tokens[i] if tokens[i] >= 0 else None
        if token is None and fin is None and plp is None:
            continue
        logprob = logprobs[i] if logprobs is not None and token is not None else None
        rows.append(OutputRow(rid, token, logprob, None if plp is None else prompt_rows(plp), fin))
    return rows


def token_logprobs(out: StepOutputs) -> list[TokenLogprob | None] | None:
    """Row i's sampled-token logprobs (None where it has none), or None when no row has any."""
    if not out.lp_k:
        return None
    ks = read_ints(out.lp_k)
    sampled, ranks = read_floats(out.lp_sampled), read_ints(out.lp_rank)
    ids, vals = read_ints(out.lp_top_ids), read_floats(out.lp_top_vals)
    new = tuple.__new__  # TokenLogprob(...) without the named tuple's __new__: per token
    k = ks[0] if ks else 0
    if k > 0 and ks.count(k) == len(ks):  # every row asked the same top-k (the common step)
        return [new(TokenLogprob, (s, r, ids[a:a + k], vals[a:a + k]))
                for s, r, a in zip(sampled, ranks, range(0, k * len(ks), k))]
    ends = list(accumulate(max(k, 0) for k in ks))
    starts = [0, *ends[:-1]]
    return [None if k < 0 else new(TokenLogprob, (sampled[i], ranks[i], ids[a:b], vals[a:b]))
            for i, (k, a, b) in enumerate(zip(ks, starts, ends))]


class PromptRows(Sequence[TokenLogprob]):
    """Prompt tokens 1..P-1's logprobs as the wire's columns (plain Python lists), read as one
    TokenLogprob per token on demand: a reader that takes them all at once (the echo of a
    prompt) uses the columns and builds no per-token rows."""

    __slots__ = ("logprobs", "ranks", "top_ids", "top_logprobs", "k")

    def __init__(self, logprobs: list[float], ranks: list[int], top_ids: list[int],
                 top_logprobs: list[float], k: int) -> None:
        self.logprobs = logprobs
        self.ranks = ranks
        self.top_ids = top_ids  # k per token, back to back
        self.top_logprobs = top_logprobs
        self.k = k

    def __len__(self) -> int:
        return len(self.logprobs)

    @overload
    def __getitem__(self, i: int) -> TokenLogprob: ...
    @overload
    def __getitem__(self, i: slice) -> list[TokenLogprob]: ...
    def __getitem__(self, i: int | slice) -> TokenLogprob | list[TokenLogprob]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self.logprobs)
        k = self.k
        return TokenLogprob(self.logprobs[i], self.ranks[i], self.top_ids[i * k:(i + 1) * k],
                            self.top_logprobs[i * k:(i + 1) * k])


def prompt_rows(plp: PromptLogprobs) -> PromptRows:
    """Prompt tokens 1..P-1, one TokenLogprob each (read from the columns on demand)."""
    return PromptRows(read_floats(plp.logprobs), read_ints(plp.ranks), read_ints(plp.top_ids),
                      read_floats(plp.top_logprobs), plp.k)
