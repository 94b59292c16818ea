"""A step's `SamplingBatch`, built from the requests that sample.

The builder runs once a step on the engine's hot path, so it reads as little per row as it
can: each request's parameters are read once, when it arrives, into its `RequestSampling`,
whose `columns` pack what every step reads (temperature, top-k, top-p, min-p, and whether the
request needs anything else) into 40 bytes; a step joins its rows' and reads them as one
[rows, 5] array, then reads everything else (bias, min_tokens, penalties and their token
counts, seeds, logprobs, grammars) only of the rows that have `extras`.

It reads a request through `SamplingRow`, the few attributes it needs (the scheduler's
`Request` has them), so that nothing in engine_core/sample/ imports the scheduler. A new
sampling parameter is read here (and into `RequestSampling` when a step must look for it),
carried by `SamplingBatch`, and applied by the samplers' kernels (logits_ops.py).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from engine_core.sample.sampling_batch import (
    GREEDY_EPS,
    NO_EDITS,
    Drafts,
    Edits,
    SamplingBatch,
    first_uniforms,
)
from engine_core.structured.grammar import RequestGrammar
from shared.messages import SamplingParams

# RequestSampling.columns: temperature, top_k, top_p, min_p, extras (1.0 or 0.0)
_COLUMNS = struct.Struct("<5d")


class RequestSampling:
    """One request's sampling, read once from its parameters: what a step's builder reads of
    every row, and its own generator when seeded."""

    __slots__ = ("params", "logprobs_k", "reads_history", "generator", "extras", "columns")

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.logprobs_k = -1 if params.logprobs is None else params.logprobs
        # its sampling reads its earlier tokens (penalties)
        self.reads_history = bool(params.repetition_penalty != 1.0 or params.presence_penalty
                                  or params.frequency_penalty)
        self.generator = (None if params.seed is None
                          else torch.Generator().manual_seed(params.seed))
        # whether a step reads more of it than the above: edits of the logits, its own
        # generator, logprobs, a grammar (a request has one only when `structured` is set)
        self.extras = bool(params.logit_bias or params.min_tokens or self.reads_history
                           or params.seed is not None or params.logprobs is not None
                           or params.structured is not None)
        self.columns = _COLUMNS.pack(params.temperature, params.top_k, params.top_p,
                                     params.min_p, float(self.extras))


class SamplingRow(Protocol):
    """What the builder reads of a request that samples (engine_core/sched/request.py)."""

    @property
    def sampling(self) -> RequestSampling: ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...  # prompt and output

    @property
    def grammar(self) -> RequestGrammar | None: ...

    @property
    def masked(self) -> bool: ...  # its grammar masks its next token (done thinking)


class DraftRow:
    """Row j of a request verifying drafts: the request seen with its first j drafts accepted
    (what the builder reads of a `SamplingRow`; the token lists made only if read). A
    constrained request's row has its grammar's fork after those drafts (RequestGrammar.forks),
    or none past the drafts its grammar allows (such a row is never emitted)."""

    __slots__ = ("row", "drafts", "grammar", "masked")

    def __init__(self, row: SamplingRow, drafts: Sequence[int],
                 grammar: RequestGrammar | None = None) -> None:
        self.row = row
        self.drafts = drafts
        self.grammar = grammar
        self.masked = grammar is not None

    @property
    def sampling(self) -> RequestSampling:
        return self.row.sampling

    @property
    def output_token_ids(self) -> list[int]:
        return [*self.row.output_token_ids, *self.drafts]

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.row.all_token_ids, *self.drafts]


def expand(rows: Sequence[SamplingRow], drafts: Drafts) -> tuple[list[SamplingRow], np.ndarray]:
    """The batch's rows: each request, or its k + 1 `DraftRow`s when it has k drafts; and how
    many of each request's drafts may be accepted (k, or fewer where a grammar refuses one)."""
    limits = drafts.counts.copy()
    if not len(drafts.token_ids):
        return list(rows), limits
    out: list[SamplingRow] = []
    at = 0
    for i, (row, k) in enumerate(zip(rows, drafts.counts.tolist())):
        if not k:
            out.append(row)
            continue
        ids = drafts.token_ids[at:at + k].tolist()
        at += k
        if row.grammar is not None and row.masked:  # constrained (and done thinking)
            forks, limits[i] = row.grammar.forks(ids)
            out += [DraftRow(row, ids[:j], forks[j] if j < len(forks) else None)
                    for j in range(k + 1)]
        else:
            out += [DraftRow(row, ids[:j]) for j in range(k + 1)]
    return out, limits


def build_sampling_batch(rows: Sequence[SamplingRow], vocab: int,
                         eos_token_ids: Sequence[int], generator: torch.Generator,
                         drafts: Drafts | None = None) -> SamplingBatch:
    """The batch of `rows` (one per request that samples, in order; k + 1 for one verifying k
    `drafts`: speculative.expand) for logits `vocab` wide; `eos_token_ids` are banned with the
    stop tokens before min_tokens, `generator` (the engine's) draws the unseeded rows' uniform
    numbers."""
    seeded_states = {}
    if drafts is not None and len(drafts.token_ids):
        for i in np.flatnonzero(drafts.counts).tolist():
            own = rows[i].sampling.generator
            if own is not None:
                seeded_states[i] = (own, own.get_state())
        rows, limits = expand(rows, drafts)
        drafts = Drafts(drafts.counts, drafts.token_ids, limits)
    n = len(rows)
    cols = np.frombuffer(b"".join([r.sampling.columns for r in rows]), np.float64).reshape(n, 5)
    temps = cols[:, 0].astype(np.float32)
    draws = temps >= GREEDY_EPS
    sampled = np.flatnonzero(draws)
    k = cols[:, 1]
    extras = np.flatnonzero(cols[:, 4]).tolist()
    seeded: dict[int, torch.Generator] = {}
    lp_rows, lp_k, grammars = [], [], {}
    reads_outputs = False
    for i in extras:
        row = rows[i]
        s = row.sampling
        if s.generator is not None:
            seeded[i] = s.generator
        if s.logprobs_k >= 0:
            lp_rows.append(i)
            lp_k.append(s.logprobs_k)
        if row.grammar is not None and row.masked:
            grammars[i] = row.grammar
        reads_outputs = reads_outputs or s.reads_history or row.grammar is not None
    return SamplingBatch(
        temperature=temps,
        sampled=sampled.astype(np.int64),
        top_k=np.where(draws & (k > 0) & (k < vocab), k, 0).astype(np.int64),
        top_p=np.where(draws, cols[:, 2], 1.0).astype(np.float32),
        min_p=np.where(draws, cols[:, 3], 0.0).astype(np.float32),
        uniform=first_uniforms(temps, sampled, seeded, generator),
        bias=_bias(rows, extras, vocab) if extras else NO_EDITS,
        banned=_banned(rows, extras, vocab, eos_token_ids) if extras else NO_EDITS,
        repetition=_repetition(rows, extras) if extras else NO_EDITS,
        penalty=_penalty(rows, extras) if extras else NO_EDITS,
        logprob_rows=np.array(lp_rows, dtype=np.int64),
        logprob_k=np.array(lp_k, dtype=np.int64),
        constrained=list(grammars),
        grammars=grammars,
        drafts=Drafts.none(n) if drafts is None else drafts,
        generator=generator,
        seeded=seeded,
        seeded_states=seeded_states,
        reads_outputs=reads_outputs,
    )


def _row(i: int, n: int) -> np.ndarray:
    return np.full(n, i, dtype=np.int64)


def _bias(rows: Sequence[SamplingRow], extras: Sequence[int], vocab: int) -> Edits:
    at, ids, vals = [], [], []
    for i in extras:
        logit_bias = rows[i].sampling.params.logit_bias
        if not logit_bias:
            continue
        bias = {t: v for t, v in logit_bias.items() if 0 <= t < vocab}
        if bias:
            at.append(_row(i, len(bias)))
            ids.append(np.fromiter(bias.keys(), np.int64, len(bias)))
            vals.append(np.fromiter(bias.values(), np.float32, len(bias)))
    return Edits.of(at, ids, vals)


def _banned(rows: Sequence[SamplingRow], extras: Sequence[int], vocab: int,
            eos_token_ids: Sequence[int]) -> Edits:
    at, ids = [], []
    for i in extras:
        p = rows[i].sampling.params
        if p.min_tokens and len(rows[i].output_token_ids) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
            banned = [t for t in banned if t < vocab]
            at.append(_row(i, len(banned)))
            ids.append(np.array(banned, dtype=np.int64))
    return Edits.of(at, ids, [np.zeros(len(r), np.float32) for r in at])


def _repetition(rows: Sequence[SamplingRow], extras: Sequence[int]) -> Edits:
    at, ids, vals = [], [], []
    for i in extras:
        penalty = rows[i].sampling.params.repetition_penalty
        if penalty != 1.0:
            seen = np.unique(np.asarray(rows[i].all_token_ids, dtype=np.int64))
            at.append(_row(i, len(seen)))
            ids.append(seen)
            vals.append(np.full(len(seen), penalty, dtype=np.float32))
    return Edits.of(at, ids, vals)


def _penalty(rows: Sequence[SamplingRow], extras: Sequence[int]) -> Edits:
    at, ids, vals = [], [], []
    for i in extras:
        p = rows[i].sampling.params
        outputs = rows[i].output_token_ids
        if (p.presence_penalty or p.frequency_penalty) and outputs:
            out, counts = np.unique(np.asarray(outputs, dtype=np.int64), return_counts=True)
            at.append(_row(i, len(out)))
            ids.append(out)
            vals.append(np.float32(p.frequency_penalty) * counts.astype(np.float32)
                        + np.float32(p.presence_penalty))
    return Edits.of(at, ids, vals)
