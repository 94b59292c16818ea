"""Batched sampling and logprobs for one step, on top of one LM-head scan (lm_head.py).

Logprobs are those of the model's raw distribution (log_softmax of the logits, before
temperature, penalties or truncation), as OpenAI and vLLM report them, and are computed only
for the rows that asked. Sampling draws by inverse CDF: one uniform number per row, found in
the row's cumulative distribution (an exponential race would need a random number per
vocabulary entry: 128k logs per row per step), two-level so no scan covers the vocabulary: the
block sums come out of the head's scan, then one block of 256 is searched. A request with a
seed draws its number from its own generator, so its tokens do not depend on what else shares
the batch.

Rows with logit bias, penalties, a pending min_tokens or top-k/top-p/min-p truncation take the
general path: their logits are copied out of the scan, processed and searched whole.

Constrained rows (structured outputs) follow their grammars exactly: greedy = argmax of the
masked raw logits, a draw from softmax(masked logits / T); constrained_sampling.py
does their grammar work, after the fast path's draws and before the general path's processing.
Logprobs stay the raw model's (vLLM's default `logprobs_mode`, raw_logprobs): the masked
distribution is not reported. A step without a constrained row does no grammar work at all. A
row counts as constrained once a grammar masks it (`Request.masked`): a request still thinking
samples as an unconstrained one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from engine_core.layers.lm_head import BLOCK, LMHead, Scan, gather_blocks
from engine_core.sample.constrained_sampling import ConstrainedSampler, FastDraws
from engine_core.sched.request import Request
from shared.step_outputs import Logprobs

_GREEDY_EPS = 1e-5


class SamplerOutput(NamedTuple):
    token_ids: np.ndarray  # int64 [S]
    logprob_rows: np.ndarray  # int64 indices of the rows with logprobs
    logprobs: Logprobs | None


class PendingSample:
    """A step's sampling, queued: `tokens` on the device at once (an overlapped step's next
    inputs read them there), the whole `SamplerOutput` on the host when `result()` is asked
    (the one wait of the step)."""

    def __init__(self, tokens: torch.Tensor, result: Callable[[], SamplerOutput]) -> None:
        self.tokens = tokens
        self._result = result
        self._output: SamplerOutput | None = None

    @staticmethod
    def done(output: SamplerOutput, tokens: torch.Tensor | None = None) -> PendingSample:
        """A sampling already on the host (the CPU's, or one that had to wait)."""
        device_tokens = torch.from_numpy(output.token_ids) if tokens is None else tokens
        return PendingSample(device_tokens, lambda: output)

    def result(self) -> SamplerOutput:
        if self._output is None:
            self._output = self._result()
        return self._output


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

    general: list[int]  # bias, penalties, min_tokens or truncation: logits copied out
    fast_sampled: list[int]  # the rest that sample: the scan's block sums
    constrained: list[int]  # constrained rows on the fast path (greedy or sampled)
    general_constrained: list[int]  # constrained rows on the general path

    @staticmethod
    def of(reqs: Sequence[Request], vocab: int) -> _Plan:
        general = [i for i, r in enumerate(reqs) if Sampler._needs_general_path(r, vocab)]
        skip = set(general)
        fast_sampled = [i for i, r in enumerate(reqs)
                        if r.params.temperature >= _GREEDY_EPS and i not in skip]
        constrained = [i for i, r in enumerate(reqs) if r.masked]
        return _Plan(general, fast_sampled, [i for i in constrained if i not in skip],
                     [i for i in constrained if i in skip])


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int], seed: int = 0) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator().manual_seed(seed)
        self._constrained: ConstrainedSampler | None = None  # made at the first constrained row

    def sample_later(self, head: LMHead, hidden: torch.Tensor,
                     reqs: Sequence[Request]) -> PendingSample:
        """`self(...)`, as a `PendingSample` (on the CPU nothing is left to wait for)."""
        return PendingSample.done(self(head, hidden, reqs))

    def __call__(self, head: LMHead, hidden: torch.Tensor,
                 reqs: Sequence[Request]) -> SamplerOutput:
        """One token per row of `hidden` (the final hidden state of each of `reqs`)."""
        plan = _Plan.of(reqs, head.vocab)
        lp_rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        k = max((reqs[i].params.logprobs or 0 for i in lp_rows), default=0)
        fast = FastDraws(torch.tensor(plan.fast_sampled, dtype=torch.int64),
                         torch.tensor([reqs[i].params.temperature for i in plan.fast_sampled]))
        scan = head.scan(hidden, lse=bool(lp_rows), top_k=k, temperatures=fast.temps,
                         sample_rows=fast.rows if plan.fast_sampled else None)
        tokens = scan.argmax.clone()  # greedy rows are done
        if plan.fast_sampled:
            assert scan.block_sums is not None
            tokens[fast.rows] = self.draw_from_blocks(scan, scan.block_sums, fast.rows,
                                                      fast.temps,
                                                      [reqs[i] for i in plan.fast_sampled])
        masks = None  # the general path's constrained rows' masks, when it has any
        if plan.constrained or plan.general_constrained:
            self._constrained = self._constrained or ConstrainedSampler(self)
            masks = self._constrained.constrain(scan, tokens, reqs, plan.constrained,
                                                plan.general_constrained, fast)
        if plan.general:
            idx = torch.tensor(plan.general, dtype=torch.int64)
            logits = scan.logits[idx.to(scan.logits.device)].cpu()
            tokens[idx] = self._draw_general(logits, [reqs[i] for i in plan.general], masks)
        rows = np.array(lp_rows, dtype=np.int64)
        top = None
        if lp_rows:
            lp = torch.from_numpy(rows)
            top = _logprobs(head, scan, lp, tokens[lp], k)
        return SamplerOutput(tokens.numpy(), rows, top)

    @staticmethod
    def _needs_general_path(req: Request, vocab: int) -> bool:
        p = req.params
        processed = bool(p.logit_bias or req.num_output_tokens < p.min_tokens
                         or p.repetition_penalty != 1.0 or p.presence_penalty
                         or p.frequency_penalty)
        truncated = p.temperature >= _GREEDY_EPS and (
            0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0)
        return processed or truncated

    def _uniforms(self, reqs: Sequence[Request]) -> torch.Tensor:
        u = torch.rand(len(reqs), 1, generator=self.generator)
        for j, req in enumerate(reqs):
            if req.generator is not None:
                u[j] = torch.rand(1, generator=req.generator)
        return u

    def draw_from_blocks(self, scan: Scan, block_sums: torch.Tensor, rows: torch.Tensor,
                         temps: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """Draw for `rows` of the scan (their `block_sums` and temperatures) by the two-level
        inverse CDF: a block from the sums, a token from the block's 256 logits."""
        block, rest = _pick_block(block_sums, self._uniforms(reqs))
        vals, _ = gather_blocks(scan.logits, block[:, None], rows)  # -inf past the vocabulary
        weights = ((vals - scan.max[rows, None]) / temps[:, None]).exp_()
        return (block * BLOCK + _pick_within(weights, rest)).clamp_(max=scan.logits.shape[1] - 1)

    def _draw_general(self, logits: torch.Tensor, reqs: Sequence[Request],
                      masks: torch.Tensor | None) -> torch.Tensor:
        """Rows with bias, penalties, min_tokens or truncation (`masks`: those of its
        constrained rows, in order, when it has any): mask, process, draw, advance."""
        if masks is not None:
            ConstrainedSampler.mask_general(logits, reqs, masks)
        for i, req in enumerate(reqs):
            self._process_row(logits[i], req)
        tokens = self.draw_processed(logits, reqs)
        if masks is not None:
            assert self._constrained is not None
            self._constrained.advance_general(logits, reqs, tokens)
        return tokens

    def draw_processed(self, logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """A token per row of `logits`: the argmax for a greedy row, else a draw from
        softmax(logits / T) after the request's top-k, top-p and min-p."""
        temps = torch.tensor([r.params.temperature for r in reqs], dtype=logits.dtype)
        tokens = logits.argmax(-1)
        rand = torch.nonzero(temps >= _GREEDY_EPS)[:, 0]
        if len(rand):
            scaled = logits[rand] / temps[rand, None]
            weights = _truncated_probs(scaled, [reqs[int(i)] for i in rand])
            tokens[rand] = inverse_cdf(weights, self._uniforms([reqs[int(i)] for i in rand]))
        return tokens

    def draw_plain(self, vals: np.ndarray, reqs: Sequence[Request]) -> np.ndarray:
        """A column per row of `vals` (a few candidates per row, -inf where not allowed) for
        requests with nothing to process or truncate: the argmax (the first of equal maxima)
        for a greedy row or one that allows nothing, else a draw from softmax(vals / T)."""
        temps = np.array([r.params.temperature for r in reqs])
        cols = vals.argmax(1)
        rand = np.flatnonzero((temps >= _GREEDY_EPS) & (vals.max(1, initial=-np.inf) > -np.inf))
        if len(rand):
            u = self._uniforms([reqs[int(i)] for i in rand]).numpy()[:, 0]
            cols[rand] = softmax_draw(vals[rand], temps[rand], u)
        return cols

    def _process_row(self, row: torch.Tensor, req: Request) -> None:
        p = req.params
        if p.logit_bias:
            ids = torch.tensor([t for t in p.logit_bias if 0 <= t < row.shape[0]], dtype=torch.long)
            vals = torch.tensor([p.logit_bias[int(t)] for t in ids], dtype=row.dtype)
            row.index_add_(0, ids, vals)
        if req.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
            row[[t for t in banned if t < row.shape[0]]] = -float("inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long)
            vals = row[seen]
            penalty = p.repetition_penalty
            row[seen] = torch.where(vals > 0, vals / penalty, vals * penalty)
        if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
            ids, counts = torch.tensor(req.output_token_ids).unique(return_counts=True)
            row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Per row, the index i with cdf[i-1] <= u * total < cdf[i] (weights >= 0, unnormalised).

    Two levels, so no scan runs over the whole vocabulary: block sums (a vectorised reduction),
    a scan over the few hundred block sums, then a scan inside the one chosen block. A token of
    zero weight is never chosen: targets are kept strictly below each level's total.
    """
    rows, vocab = weights.shape
    nblocks = -(-vocab // block)
    if nblocks * block != vocab:
        weights = torch.nn.functional.pad(weights, (0, nblocks * block - vocab))
    blocks = weights.view(rows, nblocks, block)
    b, rest = _pick_block(blocks.sum(-1), u)
    return b * block + _pick_within(blocks[torch.arange(rows), b], rest)


def softmax_draw(vals: np.ndarray, temps: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Per row of `vals` [n, m] (some finite), the column of the inverse-CDF draw from
    softmax(vals / T) at the uniform u in [0, 1): the first whose cumulative weight exceeds
    u * total. One scan of the row, in float64; a column of zero weight is never chosen (the
    target is kept below the total)."""
    x = vals.astype(np.float64)
    cdf = np.exp((x - x.max(1, keepdims=True)) / temps[:, None]).cumsum(1)
    total = cdf[:, -1:]
    target = np.minimum(u[:, None] * total, np.nextafter(total, 0.0))
    return np.count_nonzero(cdf <= target, axis=1)


def _pick_block(block_sums: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block holding each row's target u * total, and what is left of the target in it."""
    outer = block_sums.cumsum(-1)
    target = _below(u * outer[:, -1:], outer[:, -1:])
    b = torch.searchsorted(outer, target, right=True).clamp_(max=outer.shape[1] - 1)
    before = torch.where(b > 0, outer.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(target))
    return b[:, 0], target - before


def _pick_within(weights: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    inner = weights.cumsum(-1)
    rest = _below(rest, inner[:, -1:])
    return torch.searchsorted(inner, rest, right=True).clamp_(max=weights.shape[1] - 1)[:, 0]


def _below(x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """x clamped into [0, total): the largest float under `total` at most."""
    return torch.minimum(x.clamp(min=0), torch.nextafter(total, torch.zeros_like(total)))


def _truncated_probs(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """Softmax after top-k, top-p and min-p truncation (each row its own settings)."""
    vocab = logits.shape[1]
    rows = [i for i, r in enumerate(reqs) if 0 < r.params.top_k < vocab]
    if rows:
        idx = torch.tensor(rows)
        ks = torch.tensor([reqs[i].params.top_k for i in rows])
        top = logits[idx].topk(int(ks.max()), dim=-1).values  # cheaper than sorting the vocab
        kth = top.gather(1, (ks - 1)[:, None])
        logits = logits.clone()
        logits[idx] = logits[idx].masked_fill(logits[idx] < kth, -float("inf"))
    probs = logits.softmax(-1)
    top_p = torch.tensor([r.params.top_p for r in reqs], dtype=probs.dtype)
    p_rows = torch.nonzero(top_p < 1.0)[:, 0]
    if len(p_rows):
        sp, si = probs[p_rows].sort(dim=-1, descending=True)
        before = sp.cumsum(-1) - sp  # mass strictly above each token
        drop = before >= top_p[p_rows, None]
        probs[p_rows] = torch.zeros_like(sp).scatter(1, si, sp.masked_fill(drop, 0.0))
    min_p = torch.tensor([r.params.min_p for r in reqs], dtype=probs.dtype)
    if bool((min_p > 0).any()):
        floor = probs.max(-1, keepdim=True).values * min_p[:, None]
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs
