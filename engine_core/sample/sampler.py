"""The CPU's sampler: a step's tokens and logprobs on top of one LM-head scan (lm_head.py).

Logprobs are those of the model's raw distribution (log_softmax of the logits, before
temperature, penalties or truncation), as OpenAI and vLLM report them, and are computed only
for the rows that asked. Sampling draws by inverse CDF: one uniform number per row (the
batch's), found in the row's cumulative distribution (an exponential race would need a random
number per vocabulary entry: 128k logs per row per step), two-level so no scan covers the
vocabulary: the block sums come out of the head's scan, then one block of 256 is searched.

Rows with edits (logit bias, penalties, a pending min_tokens) or top-k/top-p/min-p truncation
take the general path: their logits are copied out of the scan, processed and drawn whole, with
the device sampler's own ops (logits_ops.py).

Constrained rows (structured outputs) follow their grammars exactly: greedy = argmax of the
masked raw logits, a draw from softmax(masked logits / T); constrained_sampling.py does their
grammar work, after the fast path's draws and before the general path's processing. Logprobs
stay the raw model's (vLLM's default `logprobs_mode`, raw_logprobs): the masked distribution is
not reported. A step without a constrained row does no grammar work at all.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from engine_core.layers.host_link import HostLink
from engine_core.layers.lm_head import LMHead, Scan
from engine_core.sample.constrained_sampling import ConstrainedSampler, FastDraws
from engine_core.sample.interface import PendingSample, SamplerOutput
from engine_core.sample.logits_ops import DrawArgs, apply_edits, draw_from_blocks, pick
from engine_core.sample.sampling_batch import SamplingBatch
from shared.step_outputs import Logprobs

CPU = torch.device("cpu")


def token_logprobs(head: LMHead, hidden: torch.Tensor, tokens: torch.Tensor, k: int) -> Logprobs:
    """Logprob and rank of `tokens` under the logits of `hidden` rows, plus each row's top-k."""
    scan = head.scan(hidden, lse=True, top_k=k)
    return _logprobs(head, scan, torch.arange(len(tokens)), tokens, k)


def _logprobs(head: LMHead, scan: Scan, rows: torch.Tensor, tokens: torch.Tensor,
              k: int) -> Logprobs:
    """Logprobs of `tokens` (one per row of `rows`) from a scan made with lse and top_k >= k.
    A row's argmax has rank 1 without counting; other tokens are ranked by one more pass."""
    assert scan.lse is not None
    chosen = scan.logits[rows.to(scan.logits.device), tokens.to(scan.logits.device)].cpu()
    lse = scan.lse[rows]
    ranks = torch.ones(len(rows), dtype=torch.int64)
    recount = torch.nonzero(tokens != scan.argmax[rows])[:, 0]
    if len(recount):
        ranks[recount] += head.count_above(scan, rows[recount], chosen[recount])
    if k:
        assert scan.top_vals is not None and scan.top_ids is not None
        top_ids, top_lps = scan.top_ids[rows, :k], scan.top_vals[rows, :k] - lse[:, None]
    else:
        top_ids, top_lps = torch.zeros(len(rows), 0, dtype=torch.int64), torch.zeros(len(rows), 0)
    return Logprobs((chosen - lse).numpy().astype(np.float32), ranks.numpy().astype(np.int32),
                    top_ids.numpy().astype(np.int32), top_lps.numpy().astype(np.float32))


class _Plan(NamedTuple):
    """Which rows of a step take which path."""

    general: np.ndarray  # edited, or sampled with truncation: logits copied out (sorted)
    fast_sampled: np.ndarray  # the rest that sample: the scan's block sums
    constrained: list[int]  # constrained rows on the fast path (greedy or sampled)
    general_constrained: list[int]  # constrained rows on the general path

    @staticmethod
    def of(batch: SamplingBatch) -> _Plan:
        s = batch.sampled
        truncated = s[(batch.top_k[s] > 0) | (batch.top_p[s] < 1.0) | (batch.min_p[s] > 0)]
        general = truncated
        if batch.bias or batch.banned or batch.repetition or batch.penalty:
            general = np.union1d(truncated, batch.edited_rows)
        fast = s if not len(general) else np.setdiff1d(s, general, assume_unique=True)
        if not batch.constrained:
            return _Plan(general, fast, [], [])
        on_general = set(general.tolist())
        return _Plan(general, fast, [i for i in batch.constrained if i not in on_general],
                     [i for i in batch.constrained if i in on_general])


class Sampler:
    """The CPU's `TokenSampler` (interface.py), on the scan of its LM head."""

    def __init__(self, head: LMHead) -> None:
        self.head = head
        self.link = HostLink(CPU, pinned=False, synchronize=lambda: None)
        self._constrained: ConstrainedSampler | None = None  # made at the first constrained row

    @property
    def vocab(self) -> int:
        return self.head.vocab

    def sample_later(self, hidden: torch.Tensor, batch: SamplingBatch) -> PendingSample:
        """`self(...)`, as a `PendingSample` (on the CPU nothing is left to wait for)."""
        return PendingSample.done(self(hidden, batch))

    def __call__(self, hidden: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """One token per row of the batch, from `hidden` (its final hidden states)."""
        batch.check(hidden)
        plan = _Plan.of(batch)
        lp_rows, k = batch.logprob_rows, batch.top_logprobs
        fast = FastDraws(torch.from_numpy(plan.fast_sampled),
                         torch.from_numpy(batch.temperature[plan.fast_sampled]))
        scan = self.head.scan(hidden, lse=bool(len(lp_rows)), top_k=k, temperatures=fast.temps,
                              sample_rows=fast.rows if len(plan.fast_sampled) else None)
        tokens = scan.argmax.clone()  # greedy rows are done
        if len(plan.fast_sampled):
            assert scan.block_sums is not None
            tokens[fast.rows] = draw_from_blocks(scan, scan.block_sums, fast.rows, fast.temps,
                                                 batch.uniform[plan.fast_sampled])
        masks = None  # the general path's constrained rows' masks, when it has any
        if plan.constrained or plan.general_constrained:
            self._constrained = self._constrained or ConstrainedSampler(self.link)
            masks = self._constrained.constrain(scan, tokens, batch, plan.constrained,
                                                plan.general_constrained, fast)
        if len(plan.general):
            idx = torch.from_numpy(plan.general)
            logits = scan.logits[idx.to(scan.logits.device)].cpu()
            tokens[idx] = self._draw_general(logits, batch, plan.general, masks)
        top = None
        if len(lp_rows):
            lp = torch.from_numpy(lp_rows)
            top = _logprobs(self.head, scan, lp, tokens[lp], k)
        return SamplerOutput(tokens.numpy(), lp_rows, top)

    def _draw_general(self, logits: torch.Tensor, batch: SamplingBatch, rows: np.ndarray,
                      masks: torch.Tensor | None) -> torch.Tensor:
        """The general path's `rows` (their `logits`; `masks`: those of its constrained rows,
        in order, when it has any): mask, edit, draw, advance."""
        if masks is not None:
            ConstrainedSampler.mask_general(logits, batch, rows, masks)
        apply_edits(logits, batch, rows, self.link)
        tokens = pick(logits, DrawArgs.of(batch, self.link, rows))
        if masks is not None:
            assert self._constrained is not None
            self._constrained.advance_general(logits, batch, rows, tokens)
        return tokens
