"""Verifying draft tokens on the one sampling path (speculative decoding).

A request with k draft tokens d_0..d_{k-1} is computed at k + 1 positions in one forward (its
last token and its drafts); the batch builder gives it k + 1 consecutive rows (batch_builder.py,
`expand`), row j the request as it would be had d_0..d_{j-1} been accepted (penalties count
them, min_tokens sees them), and the sampler samples every row as any other: t_j from the
target's processed distribution p_j. Acceptance (`accept`) then keeps the rows while
t_j == d_j and the first row where it differs, or the last: the tokens t_0..t_m, with m the
drafts accepted.

That is exact rejection sampling for proposals that are one-hot (q(d_j) = 1: the n-gram
proposer's, and a draft model's greedy ones): accepting d_j with probability min(1, p/q) =
p_j(d_j) is t_j == d_j, and on rejection t_j is a draw from p_j without d_j, renormalised,
which is max(0, p_j - q_j) normalised. So each emitted token is drawn from the target's own
distribution given the tokens before it, as without speculation; greedy rows emit the target's
argmax at every position.

Structured outputs: row j of a constrained request samples under its grammar's fork after
d_0..d_{j-1} (RequestGrammar.forks), so t_j is the masked target's token given the tokens
before it, exactly as without speculation; acceptance stops at the first draft the grammar
refuses or ends at (`Drafts.limits`), and the request's grammar then takes the fork of its last
emitted row (`adopt`), which has seen exactly the emitted tokens: the rejected drafts are rolled
back by never having been applied to it.

A seeded request's generator is left as after one draw per emitted token (`rewind`), so its
draws are those it would have made without speculation.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from engine_core.sample.sampling_batch import Drafts


class Accepted(NamedTuple):
    """What a verification step emits: `counts[i]` tokens for request i (its accepted drafts
    and one more), sampled in the batch's rows `rows` (request after request)."""

    counts: np.ndarray  # int64 [requests]
    rows: np.ndarray  # int64 [sum of counts]
    accepted: np.ndarray  # int64 [requests]: drafts accepted (counts - 1)


def accept(tokens: np.ndarray, drafts: Drafts) -> Accepted:
    """`tokens`, one per batch row (a request's k + 1 rows together), against `drafts`."""
    k = drafts.counts
    group = k + 1
    starts = np.cumsum(group) - group
    accepted = np.zeros(len(k), dtype=np.int64)
    if len(drafts.token_ids):
        first_draft = np.cumsum(k) - k
        offsets = np.arange(len(drafts.token_ids)) - np.repeat(first_draft, k)
        wrong = tokens[np.repeat(starts, k) + offsets] != drafts.token_ids
        # a request's first wrong draft, or k: its accepted drafts
        first_wrong = np.where(wrong, offsets, np.repeat(k, k))
        for i in np.flatnonzero(k).tolist():
            accepted[i] = first_wrong[first_draft[i]:first_draft[i] + k[i]].min()
        if drafts.limits is not None:
            accepted = np.minimum(accepted, drafts.limits)
    counts = accepted + 1
    rows = np.repeat(starts, counts) + (np.arange(int(counts.sum()))
                                         - np.repeat(np.cumsum(counts) - counts, counts))
    return Accepted(counts, rows, accepted)


def rewind(seeded: dict[int, tuple[torch.Generator, torch.Tensor]], counts: np.ndarray) -> None:
    """Seeded requests' generators (by request: the generator and its state before the step's
    draws) as after one draw per token emitted, as without speculation."""
    for i, (generator, state) in seeded.items():
        generator.set_state(state)
        for _ in range(int(counts[i])):
            torch.rand(1, generator=generator)
