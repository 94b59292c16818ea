"""What both samplers do to a `SamplingBatch`'s logits: torch on whatever device the logits are.

- `apply_edits`: the batch's edits, in its order (bias, the min_tokens ban, the repetition
  penalty, frequency and presence penalties);
- `DrawArgs` and `pick`: greedy is the argmax (the first of equal maxima); a sampled row draws
  from softmax(logits / T) after its top-k, top-p and min-p, by the inverse CDF at its uniform
  number;
- `inverse_cdf` in two levels, so no scan runs over the whole vocabulary: block sums, a scan
  over them, then a scan inside the one block chosen (`pick_block`, `pick_within`: the CPU
  sampler's fast path runs the same two on the block sums of its LM-head scan);
- `draw_plain`: a draw over a few candidate logits per row (a narrow grammar mask's).

Every decision is taken on the host from the batch's arrays, so nothing here waits on a device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from engine_core.layers.host_link import HostLink
from engine_core.layers.lm_head import BLOCK, Scan, gather_blocks
from engine_core.sample.sampling_batch import GREEDY_EPS, Edits, SamplingBatch

_NO_ROWS = np.zeros(0, np.int64)


def apply_edits(x: torch.Tensor, batch: SamplingBatch, rows: np.ndarray | None,
                link: HostLink) -> None:
    """The batch's edits applied to the logits `x` in place: x's row j is the batch's row
    rows[j] (`rows` sorted and holding every edited row; None: x has every row, in order)."""
    def at(edits: Edits) -> tuple[torch.Tensor, torch.Tensor]:
        where = edits.rows if rows is None else np.searchsorted(rows, edits.rows)
        r, ids = link.upload(np.stack([where, edits.ids]))
        return r, ids

    if batch.bias:
        x.index_put_(at(batch.bias), link.upload(batch.bias.values), accumulate=True)
    if batch.banned:
        x.index_put_(at(batch.banned), torch.full((), -float("inf"), device=x.device))
    if batch.repetition:
        where, penalty = at(batch.repetition), link.upload(batch.repetition.values)
        seen = x[where]
        x.index_put_(where, torch.where(seen > 0, seen / penalty, seen * penalty))
    if batch.penalty:
        x.index_put_(at(batch.penalty), link.upload(-batch.penalty.values), accumulate=True)


class DrawArgs(NamedTuple):
    """Some rows' draw settings where their logits are (two uploads, one per dtype). Indices
    are positions among those rows."""

    sampled: torch.Tensor  # the rows that draw
    k_rows: torch.Tensor  # of the sampled rows, those with top-k; and their k
    k: torch.Tensor
    p_rows: torch.Tensor  # of the sampled rows, those with top-p; and their p
    logprob_rows: torch.Tensor  # carried along for the device sampler (one upload fewer)
    temperature: torch.Tensor  # of the sampled rows
    uniform: torch.Tensor
    p: torch.Tensor
    min_p: torch.Tensor
    k_max: int
    cuts_min_p: bool

    @staticmethod
    def of(batch: SamplingBatch, link: HostLink, rows: np.ndarray | None = None,
           fresh: bool = False, logprob_rows: np.ndarray = _NO_ROWS) -> DrawArgs:
        """The settings of the batch's `rows` (None: every row): their first draw, or with
        `fresh` a draw again (new uniform numbers)."""
        if rows is None:
            sampled = at = batch.sampled
        else:
            sampled = np.flatnonzero(batch.temperature[rows] >= GREEDY_EPS)
            at = rows[sampled]
        u = batch.more_uniforms(at.tolist()) if fresh else batch.uniform[at]
        ks, ps, min_p = batch.top_k[at], batch.top_p[at], batch.min_p[at]
        k_rows, p_rows = np.flatnonzero(ks), np.flatnonzero(ps < 1.0)
        sampled_t, k_rows_t, k, p_rows_t, lp_rows = link.upload_many(
            [sampled, k_rows, ks[k_rows], p_rows, logprob_rows], np.int64)
        temperature, uniform, p, min_p_t = link.upload_many(
            [batch.temperature[at], u, ps[p_rows], min_p], np.float32)
        return DrawArgs(sampled_t, k_rows_t, k, p_rows_t, lp_rows, temperature, uniform, p,
                        min_p_t, int(ks.max(initial=0)), bool((min_p > 0).any()))


def pick(x: torch.Tensor, args: DrawArgs) -> torch.Tensor:
    """Each row's token: the argmax of `x`, or for the sampled rows a draw from the truncated
    softmax of x / T. `x` is left as it is."""
    tokens = x.argmax(-1)
    if len(args.sampled):
        scaled = x.index_select(0, args.sampled) / args.temperature[:, None]
        tokens.index_copy_(0, args.sampled, inverse_cdf(truncated_probs(scaled, args),
                                                        args.uniform))
    return tokens


def truncated_probs(scaled: torch.Tensor, args: DrawArgs) -> torch.Tensor:
    """Softmax after each sampled row's top-k, top-p and min-p: top-k cuts below the k-th
    largest logit, top-p drops tokens once the mass before them reaches p, min-p those below
    min_p times the row's largest probability. `scaled` is overwritten."""
    if len(args.k_rows):
        sub = scaled.index_select(0, args.k_rows)
        kth = sub.topk(args.k_max, dim=-1).values.gather(1, (args.k - 1)[:, None])
        scaled.index_copy_(0, args.k_rows, sub.masked_fill_(sub < kth, -float("inf")))
    probs = scaled.softmax(-1)
    if len(args.p_rows):
        sp, si = probs.index_select(0, args.p_rows).sort(dim=-1, descending=True)
        drop = (sp.cumsum(-1) - sp) >= args.p[:, None]  # mass strictly above each token
        kept = torch.zeros_like(sp).scatter_(1, si, sp.masked_fill_(drop, 0.0))
        probs.index_copy_(0, args.p_rows, kept)
    if args.cuts_min_p:
        floor = probs.amax(-1, keepdim=True) * args.min_p[:, None]
        probs = probs.masked_fill_(probs < floor, 0.0)
    return probs


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the index i with cdf[i-1] <= u * total < cdf[i] (weights >= 0, unnormalised;
    u [n]), with gathers, so that every index stays on the weights' device. A token of zero
    weight is never chosen: targets are kept strictly below each level's total."""
    rows, vocab = weights.shape
    nblocks = -(-vocab // BLOCK)
    if nblocks * BLOCK != vocab:
        weights = F.pad(weights, (0, nblocks * BLOCK - vocab))
    blocks = weights.view(rows, nblocks, BLOCK)
    b, rest = pick_block(blocks.sum(-1), u[:, None])
    inner = blocks.gather(1, b[:, None, None].expand(-1, -1, BLOCK))[:, 0]
    return (b * BLOCK + pick_within(inner, rest)).clamp_(max=vocab - 1)


def pick_block(block_sums: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block holding each row's target u * total (u [n, 1]), and what is left of the
    target in it ([n, 1])."""
    outer = block_sums.cumsum(-1)
    target = _below(u * outer[:, -1:], outer[:, -1:])
    b = torch.searchsorted(outer, target, right=True).clamp_(max=outer.shape[1] - 1)
    before = torch.where(b > 0, outer.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(target))
    return b[:, 0], target - before


def pick_within(weights: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """The column of each row of `weights` [n, BLOCK] where its cumulative weight passes
    `rest` [n, 1]."""
    inner = weights.cumsum(-1)
    rest = _below(rest, inner[:, -1:])
    return torch.searchsorted(inner, rest, right=True).clamp_(max=weights.shape[1] - 1)[:, 0]


def _below(x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """x clamped into [0, total): the largest float under `total` at most."""
    return torch.minimum(x.clamp(min=0), torch.nextafter(total, torch.zeros_like(total)))


def draw_from_blocks(scan: Scan, block_sums: torch.Tensor, rows: torch.Tensor,
                     temps: torch.Tensor, u: np.ndarray) -> torch.Tensor:
    """Draw for `rows` of an LM-head scan (their `block_sums` and temperatures) at the uniform
    numbers `u`, by the two-level inverse CDF: a block from the sums, a token from the
    block's logits."""
    block, rest = pick_block(block_sums, torch.from_numpy(u)[:, None])
    vals, _ = gather_blocks(scan.logits, block[:, None], rows)  # -inf past the vocabulary
    weights = ((vals - scan.max[rows, None]) / temps[:, None]).exp_()
    return (block * BLOCK + pick_within(weights, rest)).clamp_(max=scan.logits.shape[1] - 1)


def draw_plain(vals: np.ndarray, batch: SamplingBatch, rows: Sequence[int]) -> np.ndarray:
    """A column per row of `vals` (a few candidates of the batch's `rows`, -inf where not
    allowed), for rows with nothing to process or truncate, drawn again (new uniform
    numbers): the argmax (the first of equal maxima) for a greedy row or one that allows
    nothing, else a draw from softmax(vals / T)."""
    temps = batch.temperature[np.asarray(rows, dtype=np.int64)]
    cols = vals.argmax(1)
    rand = np.flatnonzero((temps >= GREEDY_EPS) & (vals.max(1, initial=-np.inf) > -np.inf))
    if len(rand):
        u = batch.more_uniforms([rows[int(i)] for i in rand])
        cols[rand] = softmax_draw(vals[rand], temps[rand], u)
    return cols


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
