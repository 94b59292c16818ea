"""Sampling where the model runs (CUDA), with one host sync a step.

The CPU sampler (sampler.py) is built around the CPU's costs: one LM-head scan with the
reductions fused, block sums for the draw, logits copied out only for rows that need them.
On a GPU those copies and the small host-side decisions are what costs: each `.cpu()`,
`.item()` or `bool()` of a device tensor waits for every kernel queued before it.
`DeviceSampler` keeps the whole step on the device instead: full logits from the LM head's
weight, the step's edits (grammar mask, logit bias, min_tokens ban, penalties), temperature,
top-k / top-p / min-p, the draw, and logprobs with ranks, every decision taken on the host
beforehand from the batch's host arrays (sampling_batch.py); then the tokens and logprobs
come back together, one wait (host_link.py).

It is the other `TokenSampler` (interface.py), with the CPU sampler's semantics and the same
ops for the edits and the draw (logits_ops.py): greedy is the argmax of the processed logits
(the first of equal maxima); a draw is the inverse CDF of the truncated softmax at the batch's
uniform number for the row; logprobs and ranks are the raw model's. A constrained row's logits
are masked by its grammar before anything else, and its matcher advanced past the drawn token
once the tokens are back: a token the matcher refuses (xgrammar's mask over-approximates a
few) is banned and the row drawn again, which costs another sync, only then.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from engine_core.layers.host_link import HostLink
from engine_core.sample.batch_builder import RequestSampling, build_sampling_batch
from engine_core.sample.interface import PendingSample, SamplerOutput
from engine_core.sample.logits_ops import DrawArgs, apply_edits, pick
from engine_core.sample.sampling_batch import SamplingBatch
from engine_core.structured.grammar import RequestGrammar
from engine_core.structured.masks import TokenMasker, apply_bitmask
from shared.messages import MAX_LOGPROBS, SamplingParams
from shared.step_outputs import Logprobs

_MAX_REDRAWS = 64  # tokens a constrained row may draw and see refused (as sampler.py)


class HeadWeights(NamedTuple):
    """The LM head as the model has it: weight [vocab, hidden], its bias, a final softcap."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    softcap: float | None = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Raw float32 logits of `hidden` rows, as the CPU path's torch ops compute them: the
        product in the weight's dtype, then float32, then the softcap."""
        x = F.linear(hidden.to(self.weight.dtype), self.weight, self.bias).float()
        if self.softcap:
            x = x.div_(self.softcap).tanh_().mul_(self.softcap)
        return x


class DeviceSampler:
    """The device's `TokenSampler` (interface.py): logits from its own head weights."""

    def __init__(self, weights: HeadWeights, link: HostLink) -> None:
        self.weights = weights
        self.vocab = weights.weight.shape[0]
        self.link = link
        self._masker: TokenMasker | None = None  # made at the first constrained row
        self._no_args: DrawArgs | None = None

    def __call__(self, hidden: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        return self.sample_later(hidden, batch).result()

    def sample_later(self, hidden: torch.Tensor, batch: SamplingBatch) -> PendingSample:
        """The step's sampling queued on the device, its results copied back behind it: the
        wait comes with `result()`. A step with constrained rows waits at once (their
        matchers need the tokens)."""
        batch.check(hidden)
        args = self._args(batch)
        logits = self.weights.logits(hidden)
        processed = self._process(logits, batch)
        tokens = pick(processed, args)
        download = self.link.download_later([tokens, *self._logprobs(logits, tokens, batch,
                                                                     args)])
        if not batch.constrained:
            return PendingSample(tokens, lambda: _output(download.wait(), batch))
        host = download.wait()
        token_ids = host[0]
        if self._advance_grammars(processed, batch, token_ids):
            tokens = self.link.upload(token_ids)  # a row was drawn again: its logprobs too
            host = [token_ids, *self.link.download(self._logprobs(logits, tokens, batch, args))]
        return PendingSample.done(_output(host, batch), tokens)

    def _args(self, batch: SamplingBatch) -> DrawArgs:
        """The batch's draw settings on the device; a greedy batch with no logprobs has none
        to upload (its empty ones are made once)."""
        if len(batch.sampled) or len(batch.logprob_rows):
            return DrawArgs.of(batch, self.link, logprob_rows=batch.logprob_rows)
        if self._no_args is None:
            self._no_args = DrawArgs.of(batch, self.link)
        return self._no_args

    def profile(self, hidden: torch.Tensor) -> None:
        """The costliest step this sampler can be given for `hidden`'s rows, for the memory
        profile: every row truncated every way, penalised, with the most logprobs."""
        params = SamplingParams(temperature=0.8, top_k=self.vocab // 2, top_p=0.9, min_p=0.01,
                                repetition_penalty=1.1, frequency_penalty=0.1,
                                logprobs=MAX_LOGPROBS, logit_bias={0: 1.0}, min_tokens=1)
        rows = [_ProfileRow(RequestSampling(params)) for _ in range(len(hidden))]
        self(hidden, build_sampling_batch(rows, self.vocab, [], torch.Generator()))

    # -- the step's edits -------------------------------------------------------------------
    def _process(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The logits the draw reads: the grammar masks first, then the batch's edits. The raw
        logits are left as they are (logprobs read them)."""
        if not batch.processed:
            return logits
        x = logits.clone()
        if batch.constrained:
            self._mask(x, batch)
        apply_edits(x, batch, None, self.link)
        return x

    def _mask(self, x: torch.Tensor, batch: SamplingBatch) -> None:
        """Mask the constrained rows of `x` in place, their bitmasks filled in one call."""
        self._masker = self._masker or TokenMasker()
        rows = batch.constrained
        grammars = [batch.grammars[i] for i in rows]
        bitmask = self._masker.fill(batch.num_rows, x.shape[1], rows, grammars)
        at = self.link.upload(np.asarray(rows, dtype=np.int64))
        masked = x.index_select(0, at)
        apply_bitmask(masked, self.link.upload(bitmask[rows]))
        x.index_copy_(0, at, masked)

    # -- the draw ---------------------------------------------------------------------------
    def _advance_grammars(self, processed: torch.Tensor, batch: SamplingBatch,
                          tokens: np.ndarray) -> bool:
        """Advance the constrained rows' matchers past their tokens (one call); a refused
        token is banned and its row drawn again (`tokens` updated). Whether any was."""
        assert self._masker is not None
        rows = batch.constrained
        accepted = self._masker.accept([batch.grammars[i] for i in rows], tokens[rows].tolist())
        refused = [i for i, ok in zip(rows, accepted, strict=True) if not ok]
        for i in refused:
            tokens[i] = self._redraw(processed[i:i + 1], batch, i, int(tokens[i]))
        return bool(refused)

    def _redraw(self, row: torch.Tensor, batch: SamplingBatch, i: int, token: int) -> int:
        grammar = batch.grammars[i]
        for _ in range(_MAX_REDRAWS):
            row[0, token] = -float("inf")
            args = DrawArgs.of(batch, self.link, np.array([i], dtype=np.int64), fresh=True)
            token = int(self.link.download([pick(row, args)])[0][0])
            if grammar.accept(token):
                return token
        grammar.lost = True  # the scheduler ends the request
        return token

    # -- logprobs ---------------------------------------------------------------------------
    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch,
                  args: DrawArgs) -> list[torch.Tensor]:
        """The raw model's logprob and rank of each logprob row's token, and its top entries:
        the `Logprobs` columns, on the device."""
        if not len(batch.logprob_rows):
            return []
        raw = logits.index_select(0, args.logprob_rows)
        chosen = raw.gather(1, tokens.index_select(0, args.logprob_rows)[:, None])
        lse = raw.logsumexp(-1, keepdim=True)
        ranks = (raw > chosen).sum(-1).add_(1).to(torch.int32)
        top_vals, top_ids = raw.topk(batch.top_logprobs, -1)
        return [(chosen - lse)[:, 0], ranks, top_ids.to(torch.int32), top_vals - lse]


class _ProfileRow(NamedTuple):
    """A row of the memory profile's batch: a one-token prompt, no output yet."""

    sampling: RequestSampling
    output_token_ids: tuple[int, ...] = ()
    all_token_ids: tuple[int, ...] = (0,)
    grammar: RequestGrammar | None = None
    masked: bool = False


def _output(host: list[np.ndarray], batch: SamplingBatch) -> SamplerOutput:
    logprobs = Logprobs(*host[1:]) if len(batch.logprob_rows) else None
    return SamplerOutput(host[0].astype(np.int64), batch.logprob_rows, logprobs)
