"""One step's sampling arguments, read from the requests once, on the host, as arrays.

The device sampler (device_sampler.py) decides everything about a step from these arrays
before it queues a kernel, so no decision waits on the device: which rows sample, which are
truncated, which logits are biased, banned or penalised. The edits to the logits are sparse
(row, token, value) triples applied with one indexed op each, in the CPU sampler's order
(engine_core/sample/sampler.py, `_process_row`): logit bias, the min_tokens ban, the repetition
penalty, then the frequency and presence penalties.

Uniform numbers come from the same generators as the CPU sampler's: the engine's for every
sampled row, in row order, then a seeded request's own generator for its row, so a seeded
request draws the same numbers whatever shares its batch, on either sampler.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from engine_core.sched.request import Request

GREEDY_EPS = 1e-5  # below this temperature a row is greedy (as engine_core/sample/sampler.py)


class Edits(NamedTuple):
    """Sparse edits of the logits: `values[i]` at (rows[i], ids[i])."""

    rows: np.ndarray  # int64
    ids: np.ndarray  # int64
    values: np.ndarray  # float32

    @staticmethod
    def of(rows: list[np.ndarray], ids: list[np.ndarray], values: list[np.ndarray]) -> Edits:
        if not rows:
            return Edits(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32))
        return Edits(np.concatenate(rows).astype(np.int64), np.concatenate(ids).astype(np.int64),
                     np.concatenate(values).astype(np.float32))

    def __bool__(self) -> bool:
        return len(self.rows) > 0


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row arguments of one step (rows are the requests, in order)."""

    sampled: np.ndarray  # int64 rows that draw (temperature >= GREEDY_EPS); the rest are greedy
    temperature: np.ndarray  # float32 [len(sampled)]
    uniform: np.ndarray  # float32 [len(sampled)]
    top_k: np.ndarray  # int64 [len(sampled)]: 0 where off
    top_p: np.ndarray  # float32 [len(sampled)]: 1 where off
    min_p: np.ndarray  # float32 [len(sampled)]: 0 where off
    bias: Edits  # added
    banned: Edits  # set to -inf (values unused): stop tokens before min_tokens
    repetition: Edits  # the penalty of each seen token (prompt and output)
    penalty: Edits  # subtracted: frequency * count + presence, per output token
    logprob_rows: np.ndarray  # int64 rows that asked for logprobs
    top_logprobs: int  # the most top entries a logprob row asked for
    constrained: list[int]  # rows a grammar masks (constrained, done thinking)

    @property
    def processed(self) -> bool:
        """Whether any row's logits are edited before the draw (so the raw ones are copied)."""
        return bool(self.bias or self.banned or self.repetition or self.penalty
                    or self.constrained)

    @staticmethod
    def of(reqs: Sequence[Request], vocab: int, eos_token_ids: Sequence[int],
           generator: torch.Generator) -> SamplingBatch:
        """From one pass over the requests' temperatures; the draw parameters are read only
        for the rows that draw (`Request.draw`), the rest only for requests with
        `sampling_extras` or a grammar."""
        n = len(reqs)
        temps = np.fromiter([r.params.temperature for r in reqs], np.float32, n)
        sampled = np.flatnonzero(temps >= GREEDY_EPS)
        drawing = reqs if len(sampled) == n else [reqs[i] for i in sampled.tolist()]
        drawn = np.fromiter(itertools.chain.from_iterable([r.draw for r in drawing]),
                            np.float64, 3 * len(drawing)).reshape(-1, 3)
        top_k = drawn[:, 0]
        extras = [i for i, r in enumerate(reqs) if r.sampling_extras or r.grammar is not None]
        lp_rows = [i for i in extras if reqs[i].params.logprobs is not None]
        return SamplingBatch(
            sampled=sampled.astype(np.int64),
            temperature=temps[sampled],
            uniform=uniforms(reqs, sampled, extras, generator),
            top_k=np.where((top_k > 0) & (top_k < vocab), top_k, 0).astype(np.int64),
            top_p=drawn[:, 1].astype(np.float32),
            min_p=drawn[:, 2].astype(np.float32),
            bias=_bias(reqs, extras, vocab) if extras else NO_EDITS,
            banned=_banned(reqs, extras, vocab, eos_token_ids) if extras else NO_EDITS,
            repetition=_repetition(reqs, extras) if extras else NO_EDITS,
            penalty=_penalty(reqs, extras) if extras else NO_EDITS,
            logprob_rows=np.array(lp_rows, dtype=np.int64),
            top_logprobs=max((reqs[i].params.logprobs or 0 for i in lp_rows), default=0),
            constrained=[i for i in extras if reqs[i].masked],
        )


NO_EDITS = Edits.of([], [], [])


def uniforms(reqs: Sequence[Request], sampled: np.ndarray, extras: Sequence[int],
             generator: torch.Generator) -> np.ndarray:
    """One uniform number per sampled row of `reqs`: the engine generator's, or its own when
    seeded (a seeded request is among `extras`)."""
    if not len(sampled):
        return np.zeros(0, np.float32)  # (drawing none leaves the generator as it is)
    u = torch.rand(len(sampled), generator=generator)
    for i in extras:
        req = reqs[i]
        if req.generator is not None:
            j = int(np.searchsorted(sampled, i))
            if j < len(sampled) and sampled[j] == i:
                u[j] = torch.rand(1, generator=req.generator)
    return u.numpy()


def _row(i: int, n: int) -> np.ndarray:
    return np.full(n, i, dtype=np.int64)


def _bias(reqs: Sequence[Request], extras: Sequence[int], vocab: int) -> Edits:
    rows, ids, vals = [], [], []
    for i in extras:
        r = reqs[i]
        if not r.params.logit_bias:
            continue
        bias = {t: v for t, v in r.params.logit_bias.items() if 0 <= t < vocab}
        if bias:
            rows.append(_row(i, len(bias)))
            ids.append(np.fromiter(bias.keys(), np.int64, len(bias)))
            vals.append(np.fromiter(bias.values(), np.float32, len(bias)))
    return Edits.of(rows, ids, vals)


def _banned(reqs: Sequence[Request], extras: Sequence[int], vocab: int,
            eos_token_ids: Sequence[int]) -> Edits:
    rows, ids = [], []
    for i in extras:
        r = reqs[i]
        p = r.params
        if p.min_tokens and len(r.output_token_ids) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
            banned = [t for t in banned if t < vocab]
            rows.append(_row(i, len(banned)))
            ids.append(np.array(banned, dtype=np.int64))
    return Edits.of(rows, ids, [np.zeros(len(r), np.float32) for r in rows])


def _repetition(reqs: Sequence[Request], extras: Sequence[int]) -> Edits:
    rows, ids, vals = [], [], []
    for i in extras:
        r = reqs[i]
        if r.params.repetition_penalty != 1.0:
            seen = np.unique(np.asarray(r.all_token_ids, dtype=np.int64))
            rows.append(_row(i, len(seen)))
            ids.append(seen)
            vals.append(np.full(len(seen), r.params.repetition_penalty, dtype=np.float32))
    return Edits.of(rows, ids, vals)


def _penalty(reqs: Sequence[Request], extras: Sequence[int]) -> Edits:
    rows, ids, vals = [], [], []
    for i in extras:
        r = reqs[i]
        p = r.params
        if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
            out, counts = np.unique(np.asarray(r.output_token_ids, dtype=np.int64),
                                    return_counts=True)
            rows.append(_row(i, len(out)))
            ids.append(out)
            vals.append(np.float32(p.frequency_penalty) * counts.astype(np.float32)
                        + np.float32(p.presence_penalty))
    return Edits.of(rows, ids, vals)
