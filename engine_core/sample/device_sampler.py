"""Sampling where the model runs (CUDA), with one host sync a step.

The CPU sampler (sampler.py) is built around the CPU's costs: one LM-head scan with the
reductions fused, block sums for the draw, logits copied out only for rows that need them.
On a GPU those copies and the small host-side decisions are what costs: each `.cpu()`,
`.item()` or `bool()` of a device tensor waits for every kernel queued before it.
`DeviceSampler` keeps the whole step on the device instead: full logits from the LM head's
weight, the step's edits (grammar mask, logit bias, min_tokens ban, penalties), temperature,
top-k / top-p / min-p, the draw, and logprobs with ranks, every decision taken on the host
beforehand from the requests' parameters (sampling_batch.py); then the tokens and logprobs
come back together, one wait (host_link.py).

It returns what the CPU sampler returns (`SamplerOutput`, logprobs as `Logprobs` columns),
with the same semantics: greedy is the argmax of the processed logits (the first of equal
maxima); a draw is the inverse CDF of the truncated softmax at one uniform number per row
(the same numbers as the CPU sampler's, sampling_batch.py); logprobs and ranks are the raw
model's. A constrained row's logits are masked by its grammar before anything else, and its
matcher advanced past the drawn token once the tokens are back: a token the matcher refuses
(xgrammar's mask over-approximates a few) is banned and the row drawn again, which costs
another sync, only then.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from engine_core.layers.host_link import HostLink
from engine_core.layers.lm_head import BLOCK
from engine_core.sample.sampler import PendingSample, SamplerOutput
from engine_core.sample.sampling_batch import Edits, SamplingBatch
from engine_core.sched.request import Request
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


class _DrawArgs(NamedTuple):
    """A batch's per-row arrays on the device: two uploads, one per dtype."""

    sampled: torch.Tensor  # rows that draw
    k_rows: torch.Tensor  # of the sampled rows, those with top-k; and their k
    k: torch.Tensor
    p_rows: torch.Tensor  # of the sampled rows, those with top-p; and their p
    logprob_rows: torch.Tensor
    temperature: torch.Tensor
    uniform: torch.Tensor
    p: torch.Tensor
    min_p: torch.Tensor

    @staticmethod
    def upload(batch: SamplingBatch, link: HostLink) -> _DrawArgs:
        k_rows = np.nonzero(batch.top_k)[0]
        p_rows = np.nonzero(batch.top_p < 1.0)[0]
        ints = link.upload_many([batch.sampled, k_rows, batch.top_k[k_rows], p_rows,
                                 batch.logprob_rows], np.int64)
        floats = link.upload_many([batch.temperature, batch.uniform, batch.top_p[p_rows],
                                   batch.min_p], np.float32)
        return _DrawArgs(*ints, *floats)


class DeviceSampler:
    def __init__(self, eos_token_ids: Sequence[int], seed: int, weights: HeadWeights,
                 link: HostLink) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator().manual_seed(seed)
        self.weights = weights
        self.vocab = weights.weight.shape[0]
        self.link = link
        self._masker: TokenMasker | None = None  # made at the first constrained row
        self._no_args: _DrawArgs | None = None

    def __call__(self, head: object, hidden: torch.Tensor,
                 reqs: Sequence[Request]) -> SamplerOutput:
        """One token per row of `hidden` (the final hidden state of each of `reqs`). `head`,
        the CPU path's LM head, is not used: the logits come from this sampler's weights."""
        return self.sample_later(head, hidden, reqs).result()

    def sample_later(self, head: object, hidden: torch.Tensor,
                     reqs: Sequence[Request]) -> PendingSample:
        """The step's sampling queued on the device, its results copied back behind it: the
        wait comes with `result()`. A step with constrained rows waits at once (their
        matchers need the tokens)."""
        batch = SamplingBatch.of(reqs, self.vocab, self.eos_token_ids, self.generator)
        args = self._args(batch)
        logits = self.weights.logits(hidden)
        processed = self._process(logits, batch, reqs)
        tokens = self._pick(processed, batch, args)
        download = self.link.download_later([tokens, *self._logprobs(logits, tokens, batch,
                                                                     args)])
        if not batch.constrained:
            return PendingSample(tokens, lambda: _output(download.wait(), batch))
        host = download.wait()
        token_ids = host[0]
        if self._advance_grammars(processed, batch, reqs, token_ids):
            tokens = self.link.upload(token_ids)  # a row was drawn again: its logprobs too
            host = [token_ids, *self.link.download(self._logprobs(logits, tokens, batch, args))]
        return PendingSample.done(_output(host, batch), tokens)

    def _args(self, batch: SamplingBatch) -> _DrawArgs:
        """The batch's arrays on the device; a greedy batch with no logprobs has none to
        upload (its empty arrays are made once)."""
        if len(batch.sampled) or len(batch.logprob_rows):
            return _DrawArgs.upload(batch, self.link)
        if self._no_args is None:
            self._no_args = _DrawArgs.upload(batch, self.link)
        return self._no_args

    def profile(self, hidden: torch.Tensor) -> None:
        """The costliest step this sampler can be given for `hidden`'s rows, for the memory
        profile: every row truncated every way, penalised, with the most logprobs. Use a
        sampler of its own: the draws advance the generator."""
        params = SamplingParams(temperature=0.8, top_k=self.vocab // 2, top_p=0.9, min_p=0.01,
                                repetition_penalty=1.1, frequency_penalty=0.1,
                                logprobs=MAX_LOGPROBS, logit_bias={0: 1.0}, min_tokens=1)
        self(None, hidden, [Request(f"profile-{i}", [0], params) for i in range(len(hidden))])

    # -- the step's edits -------------------------------------------------------------------
    def _process(self, logits: torch.Tensor, batch: SamplingBatch,
                 reqs: Sequence[Request]) -> torch.Tensor:
        """The logits the draw reads: the grammar masks first, then the CPU sampler's order
        of edits. The raw logits are left as they are (logprobs read them)."""
        if not batch.processed:
            return logits
        x = logits.clone()
        if batch.constrained:
            self._mask(x, batch.constrained, reqs)
        if batch.bias:
            x.index_put_(self._at(batch.bias), self.link.upload(batch.bias.values),
                         accumulate=True)
        if batch.banned:
            x.index_put_(self._at(batch.banned), torch.full((), -float("inf"), device=x.device))
        if batch.repetition:
            at, penalty = self._at(batch.repetition), self.link.upload(batch.repetition.values)
            seen = x[at]
            x.index_put_(at, torch.where(seen > 0, seen / penalty, seen * penalty))
        if batch.penalty:
            x.index_put_(self._at(batch.penalty), self.link.upload(-batch.penalty.values),
                         accumulate=True)
        return x

    def _at(self, edits: Edits) -> tuple[torch.Tensor, torch.Tensor]:
        rows, ids = self.link.upload(np.stack([edits.rows, edits.ids]))
        return rows, ids

    def _mask(self, x: torch.Tensor, rows: list[int], reqs: Sequence[Request]) -> None:
        """Mask the constrained `rows` of `x` in place, their bitmasks filled in one call."""
        self._masker = self._masker or TokenMasker()
        grammars = [g for g in (reqs[i].grammar for i in rows) if g is not None]
        bitmask = self._masker.fill(len(reqs), x.shape[1], rows, grammars)
        at = self.link.upload(np.asarray(rows, dtype=np.int64))
        masked = x.index_select(0, at)
        apply_bitmask(masked, self.link.upload(bitmask[rows]))
        x.index_copy_(0, at, masked)

    # -- the draw ---------------------------------------------------------------------------
    @staticmethod
    def _pick(x: torch.Tensor, batch: SamplingBatch, args: _DrawArgs) -> torch.Tensor:
        """Each row's token: the argmax of `x`, or for the sampled rows a draw from the
        truncated softmax of x / T."""
        tokens = x.argmax(-1)
        if len(batch.sampled):
            scaled = x.index_select(0, args.sampled) / args.temperature[:, None]
            probs = _truncated_probs(scaled, batch, args)
            tokens.index_copy_(0, args.sampled, inverse_cdf(probs, args.uniform))
        return tokens

    def _advance_grammars(self, processed: torch.Tensor, batch: SamplingBatch,
                          reqs: Sequence[Request], tokens: np.ndarray) -> bool:
        """Advance the constrained rows' matchers past their tokens (one call); a refused
        token is banned and its row drawn again (`tokens` updated). Whether any was."""
        assert self._masker is not None
        rows = batch.constrained
        grammars = [g for g in (reqs[i].grammar for i in rows) if g is not None]
        accepted = self._masker.accept(grammars, tokens[rows].tolist())
        refused = [i for i, ok in zip(rows, accepted, strict=True) if not ok]
        for i in refused:
            tokens[i] = self._redraw(processed[i:i + 1], reqs[i], int(tokens[i]))
        return bool(refused)

    def _redraw(self, row: torch.Tensor, req: Request, token: int) -> int:
        assert req.grammar is not None
        one = [req]
        for _ in range(_MAX_REDRAWS):
            row[0, token] = -float("inf")
            batch = SamplingBatch.of(one, self.vocab, self.eos_token_ids, self.generator)
            drawn = self._pick(row, batch, _DrawArgs.upload(batch, self.link))
            token = int(self.link.download([drawn])[0][0])
            if req.grammar.accept(token):
                return token
        req.grammar.lost = True  # the scheduler ends the request
        return token

    # -- logprobs ---------------------------------------------------------------------------
    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch,
                  args: _DrawArgs) -> list[torch.Tensor]:
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


def _output(host: list[np.ndarray], batch: SamplingBatch) -> SamplerOutput:
    logprobs = Logprobs(*host[1:]) if len(batch.logprob_rows) else None
    return SamplerOutput(host[0].astype(np.int64), batch.logprob_rows, logprobs)


def _truncated_probs(scaled: torch.Tensor, batch: SamplingBatch,
                     args: _DrawArgs) -> torch.Tensor:
    """Softmax after each sampled row's top-k, top-p and min-p (sampler.py's rules): top-k
    cuts below the k-th largest logit, top-p drops tokens once the mass before them reaches p,
    min-p those below min_p times the row's largest probability."""
    if len(args.k_rows):
        sub = scaled.index_select(0, args.k_rows)
        kth = sub.topk(int(batch.top_k.max()), dim=-1).values.gather(1, (args.k - 1)[:, None])
        scaled.index_copy_(0, args.k_rows, sub.masked_fill_(sub < kth, -float("inf")))
    probs = scaled.softmax(-1)
    if len(args.p_rows):
        sp, si = probs.index_select(0, args.p_rows).sort(dim=-1, descending=True)
        drop = (sp.cumsum(-1) - sp) >= args.p[:, None]
        kept = torch.zeros_like(sp).scatter_(1, si, sp.masked_fill_(drop, 0.0))
        probs.index_copy_(0, args.p_rows, kept)
    if bool((batch.min_p > 0).any()):  # a host array: no sync
        floor = probs.amax(-1, keepdim=True) * args.min_p[:, None]
        probs = probs.masked_fill_(probs < floor, 0.0)
    return probs


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the index i with cdf[i-1] <= u * total < cdf[i] (weights >= 0, unnormalised;
    u [n]): sampler.inverse_cdf's two levels and arithmetic, written with gathers so that
    every index stays on the weights' device. A token of zero weight is never chosen."""
    rows, vocab = weights.shape
    nblocks = -(-vocab // BLOCK)
    if nblocks * BLOCK != vocab:
        weights = F.pad(weights, (0, nblocks * BLOCK - vocab))
    blocks = weights.view(rows, nblocks, BLOCK)
    outer = blocks.sum(-1).cumsum(-1)
    target = _below(u[:, None] * outer[:, -1:], outer[:, -1:])
    b = torch.searchsorted(outer, target, right=True).clamp_(max=nblocks - 1)
    before = torch.where(b > 0, outer.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(target))
    inner = blocks.gather(1, b[:, :, None].expand(-1, -1, BLOCK))[:, 0].cumsum(-1)
    rest = _below(target - before, inner[:, -1:])
    within = torch.searchsorted(inner, rest, right=True).clamp_(max=BLOCK - 1)
    return (b * BLOCK + within)[:, 0].clamp_(max=vocab - 1)


def _below(x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """x clamped into [0, total): the largest float under `total` at most."""
    return torch.minimum(x.clamp(min=0), torch.nextafter(total, torch.zeros_like(total)))
