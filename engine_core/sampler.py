"""Batched sampling and logprobs for one step.

Logprobs are those of the model's raw distribution (log_softmax of the logits, before
temperature, penalties or truncation), as OpenAI and vLLM report them, and are computed only
for the rows that asked. Sampling draws by inverse CDF: one uniform number per row, found in
the row's cumulative distribution (an exponential race would need a random number per
vocabulary entry: 128k logs per row per step), two-level so no scan covers the vocabulary. A request with a seed draws its number from its
own generator, so its tokens do not depend on what else shares the batch.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch

from engine_core.request import Request

_GREEDY_EPS = 1e-5


class TopLogprobs(NamedTuple):
    logprobs: np.ndarray  # float32 [n] logprob of each row's token
    ranks: np.ndarray  # int32 [n] 1 = most likely
    top_ids: np.ndarray  # int32 [n, k]
    top_logprobs: np.ndarray  # float32 [n, k]


class SamplerOutput(NamedTuple):
    token_ids: np.ndarray  # int64 [S]
    logprob_rows: np.ndarray  # int64 indices of the rows with logprobs
    logprobs: TopLogprobs | None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> TopLogprobs:
    """Logprob and rank of `tokens` under `logits` rows, plus each row's top-k.

    Consumes `logits` (overwritten in place): on a 128k vocabulary every vocab-sized temporary
    costs more than the arithmetic, so the passes are max (free from the top-k), exp in place,
    sum, and one comparison count. exp is monotonic, so ranks compare exp(x - max) directly.
    """
    chosen = logits.gather(1, tokens[:, None])
    top_vals, top_ids = logits.topk(max(k, 1), dim=-1)
    peak = top_vals[:, :1].clone()
    weights = logits.sub_(peak).exp_()
    lse = peak + weights.sum(-1, keepdim=True).log_()
    ranks = weights.gt_((chosen - peak).exp_()).sum(-1) + 1
    return TopLogprobs((chosen - lse)[:, 0].numpy().astype(np.float32),
                       ranks.numpy().astype(np.int32), top_ids[:, :k].numpy().astype(np.int32),
                       (top_vals[:, :k] - lse).numpy().astype(np.float32))


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int], seed: int = 0) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: Sequence[Request]) -> SamplerOutput:
        logits = logits.cpu()
        processed = self._process(logits, reqs)
        tokens = self._draw(processed, reqs)
        rows = np.array([i for i, r in enumerate(reqs) if r.params.logprobs is not None], dtype=np.int64)
        top = None
        if len(rows):
            k = max(reqs[i].params.logprobs or 0 for i in rows)
            if len(rows) == len(reqs):  # nothing reads the logits after this: let it consume them
                top = token_logprobs(logits, tokens, k)
            else:
                idx = torch.from_numpy(rows)
                top = token_logprobs(logits[idx], tokens[idx], k)
        return SamplerOutput(tokens.numpy(), rows, top)

    def _process(self, logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """Bias, min_tokens and penalties; copies the logits only when something applies."""
        out = logits
        for i, req in enumerate(reqs):
            p = req.params
            touched = (p.logit_bias or req.num_output_tokens < p.min_tokens
                       or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty)
            if not touched:
                continue
            if out is logits:
                out = logits.clone()
            self._process_row(out[i], req)
        return out

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
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
            ids, counts = torch.tensor(req.output_token_ids).unique(return_counts=True)
            row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty

    def _draw(self, logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in reqs], dtype=logits.dtype)
        greedy = temps < _GREEDY_EPS
        if bool(greedy.all()):
            return logits.argmax(-1)
        if bool(greedy.any()):
            tokens = logits.argmax(-1)
            rand = torch.nonzero(~greedy)[:, 0]
            tokens[rand] = self._sample(logits[rand], temps[rand], [reqs[int(i)] for i in rand])
            return tokens
        return self._sample(logits, temps, reqs)

    def _sample(self, logits: torch.Tensor, temps: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """Inverse-CDF draw: one uniform number per row, found in the row's cumulative
        (unnormalised) distribution. `logits` is left untouched (logprobs read it later)."""
        scaled = logits if bool((temps == 1.0).all()) else logits / temps[:, None]
        if any(0 < r.params.top_k < logits.shape[1] or r.params.top_p < 1.0 or r.params.min_p > 0
               for r in reqs):
            weights = _truncated_probs(scaled, reqs)
        else:  # torch's fused per-row softmax: 2x faster than max, exp, sum as separate passes
            weights = torch.softmax(scaled, -1)
        u = torch.rand(len(reqs), 1, generator=self.generator, dtype=weights.dtype)
        for j, req in enumerate(reqs):
            if req.generator is not None:
                u[j] = torch.rand(1, generator=req.generator, dtype=weights.dtype)
        return inverse_cdf(weights, u)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor, block: int = 256) -> torch.Tensor:
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
    outer = blocks.sum(-1).cumsum_(-1)
    target = _below(u * outer[:, -1:], outer[:, -1:])
    b = torch.searchsorted(outer, target, right=True).clamp_(max=nblocks - 1)
    before = torch.where(b > 0, outer.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(target))
    inner = blocks[torch.arange(rows), b[:, 0]].cumsum(-1)
    rest = _below(target - before, inner[:, -1:])
    j = torch.searchsorted(inner, rest, right=True).clamp_(max=block - 1)
    return (b * block + j)[:, 0]


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
