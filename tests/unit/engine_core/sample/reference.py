"""The one reference both samplers are checked against: sampling written plainly, a row at a
time, in float64, from the requests' own parameters and token histories (not from the
`SamplingBatch`, so that the batch's builder is checked too), at the batch's uniform numbers.

Per row, in the documented order: the grammar's mask, logit bias, the min_tokens ban (stop
tokens and, unless ignore_eos, EOS), the repetition penalty over prompt and output (divide a
positive logit, multiply a negative one), frequency and presence penalties over the output.
Greedy (T < 1e-5) is the first maximum; a draw divides by T, keeps the top k logits, takes the
softmax, drops the tokens once the mass before them reaches top_p and those under min_p times
the largest probability, and takes the first token whose cumulative weight exceeds u * total.
Logprobs are the raw logits' log_softmax; a token's rank is 1 + the tokens above it.

Float32 samplers may part from it where a float64 decision sits within rounding of its edge (a
draw's u * total at a cumulative boundary, a top-p or min-p cut at its threshold, two greedy
maxima); such rows are marked `fragile` and their tokens not compared.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from shared.messages import SamplingParams

GREEDY_EPS = 1e-5
# how close to its edge a float64 decision makes a row fragile: two greedy maxima (logits), a
# top-p or min-p cut or a draw's target (probability mass, relative to the row's total)
EDGE_LOGIT = 1e-4
EDGE_MASS = 1e-5


class RefRow(NamedTuple):
    params: SamplingParams
    prompt: Sequence[int]
    outputs: Sequence[int] = ()
    allowed: torch.Tensor | None = None  # bool [V]: what its grammar allows now


class RefOutput(NamedTuple):
    tokens: np.ndarray  # int64 [n]
    fragile: np.ndarray  # bool [n]: a decision within rounding of its edge
    logprobs: np.ndarray  # float64 [n]: the token's raw logprob
    ranks: np.ndarray  # int64 [n]
    top_ids: list[np.ndarray]  # each row's top ids, as many as its params ask (0 if none)
    top_logprobs: list[np.ndarray]


def reference(logits: torch.Tensor, rows: Sequence[RefRow], uniform: np.ndarray,
              eos: Sequence[int] = ()) -> RefOutput:
    """`logits` [n, V] (raw), a row each of `rows`; `uniform[i]` the row's uniform number."""
    raw = logits.double()
    out = [_row(raw[i], r, float(uniform[i]), eos) for i, r in enumerate(rows)]
    lps = torch.log_softmax(raw, -1)
    tokens = np.array([t for t, _ in out], dtype=np.int64)
    chosen = lps[torch.arange(len(rows)), torch.from_numpy(tokens)]
    ranks = (lps > chosen[:, None]).sum(-1) + 1
    tops = [lps[i].topk(r.params.logprobs or 0) for i, r in enumerate(rows)]
    return RefOutput(tokens, np.array([f for _, f in out]), chosen.numpy(), ranks.numpy(),
                     [t.indices.numpy() for t in tops], [t.values.numpy() for t in tops])


def _row(raw: torch.Tensor, row: RefRow, u: float, eos: Sequence[int]) -> tuple[int, bool]:
    x = _processed(raw.clone(), row, eos)
    p = row.params
    if p.temperature < GREEDY_EPS:
        top2 = x.topk(2).values
        return int(x.argmax()), bool(top2[0] - top2[1] < EDGE_LOGIT)
    x = x / p.temperature
    if 0 < p.top_k < len(x):
        x = x.masked_fill(x < x.topk(p.top_k).values[-1], -float("inf"))
    probs = torch.softmax(x, -1)
    fragile = False
    if p.top_p < 1.0:
        sp, si = probs.sort(descending=True)
        before = sp.cumsum(0) - sp
        fragile |= bool(((before - p.top_p).abs() < EDGE_MASS).any())
        probs = torch.zeros_like(probs).scatter(0, si, sp.masked_fill(before >= p.top_p, 0.0))
    if p.min_p > 0:
        floor = probs.max() * p.min_p
        fragile |= bool(((probs - floor).abs() < EDGE_MASS * floor).any())
        probs = probs.masked_fill(probs < floor, 0.0)
    cdf = probs.cumsum(0)
    target = u * float(cdf[-1])
    token = int((cdf <= target).sum())
    edges = cdf[max(token - 1, 0):token + 1]
    fragile |= bool(((edges - target).abs() < EDGE_MASS * float(cdf[-1])).any())
    return token, fragile


def _processed(x: torch.Tensor, row: RefRow, eos: Sequence[int]) -> torch.Tensor:
    p, vocab = row.params, len(x)
    if row.allowed is not None:
        x = x.masked_fill(~row.allowed, -float("inf"))
    for t, v in (p.logit_bias or {}).items():
        if 0 <= t < vocab:
            x[t] += v
    if len(row.outputs) < p.min_tokens:
        for t in [*p.stop_token_ids, *([] if p.ignore_eos else eos)]:
            if t < vocab:
                x[t] = -float("inf")
    if p.repetition_penalty != 1.0:
        for t in set(row.prompt) | set(row.outputs):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, count in Counter(row.outputs).items():
        x[t] -= p.frequency_penalty * count + p.presence_penalty
    return x
