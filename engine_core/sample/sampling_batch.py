"""One step's sampling inputs: `SamplingBatch`, the only thing a sampler reads.

The engine builds it once a step from the requests that sample (batch_builder.py); both
samplers (sampler.py on the LM head's scan, device_sampler.py on the device) read it and
nothing else. Its rows are those requests, in order, and its columns are host arrays, so that a
sampler decides everything about a step (which rows draw, which are truncated, which logits
are edited) before it touches the logits.

- Rows are logits rows: one per request, or k + 1 consecutive ones for a request verifying k
  draft tokens (speculative decoding), row j the request with its first j drafts accepted
  (speculative.py); `drafts` says which rows are whose. A sampler samples every row alike;
  which tokens a request emits is decided after (speculative.py, `accept`).
- Edits of the logits are sparse (row, token, value) triples, applied in this order: logit
  bias, the min_tokens ban, the repetition penalty, then the frequency and presence penalties;
  a constrained row's grammar mask comes before all of them (logits_ops.py applies them).
- Uniform numbers: one per sampled row, drawn when the batch is built: the engine generator's
  for every sampled row in row order, then a seeded row's own generator's for its row, so a
  seeded request draws the same numbers whatever shares its batch, on either sampler. A row
  drawn again (a grammar refused its token) takes `more_uniforms`, from the same generators.
- Logprobs are asked per row (`logprob_rows`, each with its k); grammars are the handles of the
  rows a grammar masks this step (`constrained`): matchers to advance, masks to fill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from engine_core.structured.grammar import RequestGrammar

GREEDY_EPS = 1e-5  # below this temperature a row is greedy


class Edits(NamedTuple):
    """Sparse edits of the logits: `values[i]` at (rows[i], ids[i])."""

    rows: np.ndarray  # int64
    ids: np.ndarray  # int64
    values: np.ndarray  # float32

    @staticmethod
    def of(rows: list[np.ndarray], ids: list[np.ndarray], values: list[np.ndarray]) -> Edits:
        if not rows:
            return NO_EDITS
        return Edits(np.concatenate(rows).astype(np.int64), np.concatenate(ids).astype(np.int64),
                     np.concatenate(values).astype(np.float32))

    def __bool__(self) -> bool:
        return len(self.rows) > 0


NO_EDITS = Edits(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32))


class Drafts(NamedTuple):
    """Draft tokens to verify (speculative decoding): `counts[i]` (k) for request i, their ids
    request after request in `token_ids`; request i has the batch's k + 1 rows from
    `SamplingBatch.group_starts[i]`. At most `limits[i]` of them may be accepted (the batch
    builder's: fewer than k where a grammar refuses a draft or ends at one); None: all."""

    counts: np.ndarray  # int64 [rows]
    token_ids: np.ndarray  # int64 [sum of counts]
    limits: np.ndarray | None = None  # int64 [rows]

    @staticmethod
    def none(rows: int) -> Drafts:
        return Drafts(np.zeros(rows, np.int64), np.zeros(0, np.int64))


@dataclass(frozen=True, eq=False)
class SamplingBatch:
    """Everything a sampler reads of one step (see the module docstring). Rows are the
    requests that sample, in order; [n] marks a column with one entry per row."""

    temperature: np.ndarray  # float32 [n]: below GREEDY_EPS the row is greedy
    sampled: np.ndarray  # int64: the rows that draw, in order
    top_k: np.ndarray  # int64 [n]: 0 where off (greedy rows, k >= vocabulary)
    top_p: np.ndarray  # float32 [n]: 1 where off
    min_p: np.ndarray  # float32 [n]: 0 where off
    uniform: np.ndarray  # float32 [n]: a sampled row's uniform number (0 for a greedy row)
    bias: Edits  # added
    banned: Edits  # set to -inf (values unused): stop tokens before min_tokens
    repetition: Edits  # the penalty of each seen token (prompt and output)
    penalty: Edits  # subtracted: frequency * count + presence, per output token
    logprob_rows: np.ndarray  # int64: the rows that asked for logprobs
    logprob_k: np.ndarray  # int64 [len(logprob_rows)]: the top entries each one asked for
    constrained: list[int]  # the rows a grammar masks (constrained, done thinking)
    grammars: dict[int, RequestGrammar]  # their grammars, by row
    drafts: Drafts
    generator: torch.Generator  # the engine's, for more uniform numbers of unseeded rows
    seeded: dict[int, torch.Generator]  # a seeded row's own
    # a seeded request verifying drafts, by request: its generator and its state before the
    # step's draws (one per row), rewound after acceptance (speculative.rewind)
    seeded_states: dict[int, tuple[torch.Generator, torch.Tensor]] = field(default_factory=dict)
    # a row's sampling reads the tokens it sampled before (a grammar, penalties): the next
    # step's batch needs this step's tokens on the host
    reads_outputs: bool = False

    @property
    def num_rows(self) -> int:
        return len(self.temperature)

    @property
    def top_logprobs(self) -> int:
        """The most top entries a logprob row asked for."""
        return int(self.logprob_k.max()) if len(self.logprob_k) else 0

    @property
    def processed(self) -> bool:
        """Whether any row's logits are edited or masked before the draw."""
        return bool(self.bias or self.banned or self.repetition or self.penalty
                    or self.constrained)

    @property
    def edited_rows(self) -> np.ndarray:
        """The rows with an edit (sorted, each once)."""
        edits = [e.rows for e in (self.bias, self.banned, self.repetition, self.penalty) if e]
        return np.unique(np.concatenate(edits)) if edits else NO_EDITS.rows

    @property
    def group_starts(self) -> np.ndarray:
        """Each request's first row (a request verifying k drafts has k + 1)."""
        group = self.drafts.counts + 1
        return np.cumsum(group) - group

    def check(self, hidden: torch.Tensor) -> None:
        """Refuse hidden states that are not one row per batch row."""
        if hidden.shape[0] != self.num_rows:
            raise ValueError(f"{hidden.shape[0]} hidden rows for {self.num_rows} batch rows")

    def more_uniforms(self, rows: Sequence[int]) -> np.ndarray:
        """Fresh uniform numbers to draw `rows` again: the engine generator's for each, a
        seeded row's own generator's for it."""
        u = torch.rand(len(rows), generator=self.generator)
        if self.seeded:
            for j, i in enumerate(rows):
                own = self.seeded.get(i)
                if own is not None:
                    u[j] = torch.rand(1, generator=own)
        return u.numpy()


def first_uniforms(temperature: np.ndarray, sampled: np.ndarray,
                   seeded: dict[int, torch.Generator], generator: torch.Generator) -> np.ndarray:
    """A uniform number for each sampled row (0 for the others): the engine generator's for
    every sampled row, in row order, then a seeded row's own generator's for its row."""
    u = np.zeros(len(temperature), np.float32)
    if not len(sampled):
        return u  # (drawing none leaves the generator as it is)
    u[sampled] = torch.rand(len(sampled), generator=generator).numpy()
    for i, own in seeded.items():
        if temperature[i] >= GREEDY_EPS:
            u[i] = torch.rand(1, generator=own).numpy()[0]
    return u
