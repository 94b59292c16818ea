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

Constrained rows (structured outputs, engine_core/structured.py) follow their grammars exactly:
a greedy constrained token is the argmax of the masked raw logits, a sampled one is drawn from
softmax(masked logits / T). With nothing else to process they stay on the fast path and pay
for the grammar where it matters: the row's argmax or block-path draw is offered to its
matcher first (one call for all rows), and kept when accepted, which is rejection sampling and
so exact (a draw from p, given that the grammar accepts it, follows p restricted to what the
grammar accepts). Only the rows refused get a token bitmask (filled for all of them in one
call): a sampled row whose mask allows much draws again until the mask allows the draw (up to
_RETRIES times), and the rest are drawn exactly from their masked logits (`_draw_masked`: at a
structural position only the few allowed tokens are looked at, not the vocabulary).
Constrained rows with bias, penalties or truncation take the general path, their masks (in the
same fill) applied before anything else. A token a matcher refuses although its mask allowed it
(xgrammar's mask over-approximates a few tokens) is banned and the row drawn again. Logprobs
stay the raw model's (vLLM's default `logprobs_mode`, raw_logprobs): the masked distribution is
not reported, and the scan's logits are never masked in place. A step without a constrained
row does no grammar work at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from engine_core.lm_head import BLOCK, LMHead, Scan, gather_blocks
from engine_core.request import Request
from engine_core.structured import TokenMasker, allowed_ids, allows, apply_bitmask, is_broad
from shared.step_outputs import Logprobs

_GREEDY_EPS = 1e-5
_MAX_REDRAWS = 64  # tokens a constrained row may draw and see refused before it is given up
# A sampled constrained row whose unconstrained draw the grammar refuses draws again up to
# _RETRIES times (a new uniform each, from the scan's block sums: cheap) when at least _BROAD
# of its mask words allow a token; otherwise, or when still refused, it takes the exact masked
# draw, which copies the whole row for a broad mask and reads only the allowed tokens else.
_RETRIES = 8
# Offering each constrained row's unmasked draw to its matcher first (and keeping it when
# accepted) skips most mask fills, but produced JSON with a raw control character inside a
# string in tests/e2e/test_structured.py (matcher and mask disagree somewhere): off until
# understood. Every constrained row is then masked before its draw, as the contract requires.
OFFER_FIRST = False
_BROAD = 0.25


class SamplerOutput(NamedTuple):
    token_ids: np.ndarray  # int64 [S]
    logprob_rows: np.ndarray  # int64 indices of the rows with logprobs
    logprobs: Logprobs | None


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


def _masked_candidates(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
                       dense: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [n, m] and their raw logits on the CPU, -inf where the mask disallows them, for
    `rows`: `dense`, every token of the row (one masked copy); else only the allowed ones."""
    at = logits.device
    if dense:
        vals = logits[rows.to(at)]
        apply_bitmask(vals, bitmask[rows])
        return torch.arange(vals.shape[1]).expand(len(rows), -1), vals.cpu()
    allowed = allowed_ids(bitmask[rows], logits.shape[1])
    vals = logits[rows.to(at)[:, None], allowed.ids.to(at)].cpu()
    return allowed.ids, vals.masked_fill_(~allowed.valid, -float("inf"))


class _Plan(NamedTuple):
    """Which rows of a step take which path."""

    general: list[int]  # bias, penalties, min_tokens or truncation: logits copied out
    fast_sampled: list[int]  # the rest that sample: the scan's block sums
    constrained: list[int]  # every row with a grammar
    masked: list[int]  # constrained rows on the fast path (greedy or sampled)
    general_constrained: list[int]  # constrained rows on the general path

    @staticmethod
    def of(reqs: Sequence[Request], vocab: int) -> _Plan:
        general = [i for i, r in enumerate(reqs) if Sampler._needs_general_path(r, vocab)]
        skip = set(general)
        fast_sampled = [i for i, r in enumerate(reqs)
                        if r.params.temperature >= _GREEDY_EPS and i not in skip]
        constrained = [i for i, r in enumerate(reqs) if r.grammar is not None]
        masked = [i for i in constrained if i not in skip]
        return _Plan(general, fast_sampled, constrained, masked,
                     [i for i in constrained if i in skip])


class _Draws(NamedTuple):
    """The fast path's sampled rows (scan rows, in the order of the scan's block sums) and their
    temperatures."""

    rows: torch.Tensor
    temps: torch.Tensor


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int], seed: int = 0) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator().manual_seed(seed)
        self._masker: TokenMasker | None = None  # made at the first constrained row

    def __call__(self, head: LMHead, hidden: torch.Tensor,
                 reqs: Sequence[Request]) -> SamplerOutput:
        """One token per row of `hidden` (the final hidden state of each of `reqs`)."""
        plan = _Plan.of(reqs, head.vocab)
        lp_rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        k = max((reqs[i].params.logprobs or 0 for i in lp_rows), default=0)
        fast = torch.tensor(plan.fast_sampled, dtype=torch.int64)
        temps = torch.tensor([reqs[i].params.temperature for i in plan.fast_sampled])
        scan = head.scan(hidden, lse=bool(lp_rows), top_k=k,
                         sample_rows=fast if plan.fast_sampled else None, temperatures=temps)
        tokens = scan.argmax.clone()  # greedy rows are done
        if plan.fast_sampled:
            assert scan.block_sums is not None
            tokens[fast] = self._draw_from_blocks(scan, scan.block_sums, fast, temps,
                                                  [reqs[i] for i in plan.fast_sampled])
        bitmask = None
        if plan.constrained:
            self._masker = self._masker or TokenMasker()
            refused = self._accept_drawn(plan.masked, tokens, reqs)
            bitmask = self._fill_masks(reqs, sorted(refused + plan.general_constrained),
                                       head.vocab)
            if refused:
                assert bitmask is not None
                self._constrain(scan, bitmask, torch.tensor(refused), tokens, reqs,
                                _Draws(fast, temps))
        if plan.general:
            idx = torch.tensor(plan.general, dtype=torch.int64)
            logits = scan.logits[idx.to(scan.logits.device)].cpu()
            tokens[idx] = self._draw_general(logits, [reqs[i] for i in plan.general],
                                             None if bitmask is None else bitmask[idx])
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

    def _draw_from_blocks(self, scan: Scan, block_sums: torch.Tensor, rows: torch.Tensor,
                          temps: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """Draw for `rows` of the scan (their `block_sums` and temperatures) by the two-level
        inverse CDF: a block from the sums, a token from the block's 256 logits."""
        block, rest = _pick_block(block_sums, self._uniforms(reqs))
        vals, _ = gather_blocks(scan.logits, block[:, None], rows)  # -inf past the vocabulary
        weights = ((vals - scan.max[rows, None]) / temps[:, None]).exp_()
        return (block * BLOCK + _pick_within(weights, rest)).clamp_(max=scan.logits.shape[1] - 1)

    def _accept_drawn(self, rows: Sequence[int], tokens: torch.Tensor,
                      reqs: Sequence[Request]) -> list[int]:
        """Offer the constrained fast-path `rows`' tokens (argmax or unconstrained draw) to
        their matchers, in one call; the rows whose matcher refused (and stayed as it was)."""
        if not rows or not OFFER_FIRST:
            return list(rows)
        assert self._masker is not None
        grammars = [g for g in (reqs[i].grammar for i in rows) if g is not None]
        accepted = self._masker.accept(grammars, tokens[rows].tolist())
        return [i for i, ok in zip(rows, accepted, strict=True) if not ok]

    def _constrain(self, scan: Scan, bitmask: torch.Tensor, rows: torch.Tensor,
                   tokens: torch.Tensor, reqs: Sequence[Request], draws: _Draws) -> None:
        """New tokens for the constrained fast-path `rows` whose first token the matcher
        refused, exactly under their masks, then their matchers advanced. Sampled rows with a
        broad mask draw again while the mask refuses (rejection sampling: the accepted draw
        follows the masked distribution however many were refused, and so does the exact
        draw that ends the tries); the rest draw from their masked logits."""
        broad = is_broad(bitmask[rows], _BROAD)
        left = self._retry(scan, bitmask, rows, broad, tokens, reqs, draws)
        if bool(left.any()):
            tokens[rows[left]] = self._draw_masked(scan.logits, bitmask, rows[left], broad[left],
                                                   reqs)
        self._advance_masked(scan, bitmask, rows, tokens, reqs)

    def _retry(self, scan: Scan, bitmask: torch.Tensor, rows: torch.Tensor, broad: torch.Tensor,
               tokens: torch.Tensor, reqs: Sequence[Request], draws: _Draws) -> torch.Tensor:
        """Draw again from the scan's block sums for the sampled ones of `rows` whose masks are
        `broad`, up to _RETRIES times, keeping the first draw the mask allows; which of `rows`
        are still without one (bool). Whether a row retries depends on its mask only, never on
        what it drew."""
        left = torch.ones(len(rows), dtype=torch.bool)
        if not len(draws.rows):
            return left
        position = torch.full((len(tokens),), -1, dtype=torch.int64)
        position[draws.rows] = torch.arange(len(draws.rows))
        again = torch.nonzero((position[rows] >= 0) & broad)[:, 0]  # indices into rows
        sums = scan.block_sums
        for _ in range(_RETRIES):
            if not len(again) or sums is None:
                break
            at, scan_rows = position[rows[again]], rows[again]
            drawn = self._draw_from_blocks(scan, sums[at], scan_rows, draws.temps[at],
                                           [reqs[i] for i in scan_rows.tolist()])
            tokens[scan_rows] = drawn
            ok = allows(bitmask, scan_rows, drawn)
            left[again[ok]] = False
            again = again[~ok]
        return left

    def _draw_masked(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
                     broad: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """Exact tokens for `rows` from their masked raw logits: the argmax for a greedy row,
        else a draw from softmax(masked logits / T), the masked distribution itself. A narrow
        mask's row looks at its allowed tokens only; a broad one's at its whole row, masked."""
        tokens = torch.empty(len(rows), dtype=torch.int64)
        for part, dense in ((broad, True), (~broad, False)):
            if bool(part.any()):
                ids, vals = _masked_candidates(logits, bitmask, rows[part], dense)
                picked = [reqs[i] for i in rows[part].tolist()]
                tokens[part] = ids.gather(1, self._pick_among(vals, picked)[:, None])[:, 0]
        return tokens

    def _pick_among(self, vals: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """Per row of masked logits (-inf where disallowed), the column of the argmax (the first
        of equal maxima, as torch.argmax over the row) or of a draw from softmax(vals / T)."""
        picks = vals.argmax(-1)
        temps = torch.tensor([r.params.temperature for r in reqs])
        # (a row that allows nothing keeps a column its matcher refuses: see _advance_masked)
        rand = torch.nonzero((temps >= _GREEDY_EPS) & (vals.amax(-1) > -float("inf")))[:, 0]
        if len(rand):
            v = vals[rand]
            weights = ((v - v.amax(-1, keepdim=True)) / temps[rand, None]).exp_()
            picks[rand] = inverse_cdf(weights, self._uniforms([reqs[int(i)] for i in rand]))
        return picks

    def _advance_masked(self, scan: Scan, bitmask: torch.Tensor, rows: torch.Tensor,
                        tokens: torch.Tensor, reqs: Sequence[Request]) -> None:
        """Advance the matchers of `rows` past their masked tokens, in one call; a token the
        matcher refuses although its mask allowed it is drawn again (_advance_grammar)."""
        assert self._masker is not None
        picked = rows.tolist()
        grammars = [g for g in (reqs[i].grammar for i in picked) if g is not None]
        accepted = self._masker.accept(grammars, tokens[rows].tolist())
        for i, ok in zip(picked, accepted, strict=True):
            if not ok:
                row = scan.logits[i:i + 1].to("cpu", copy=True)
                apply_bitmask(row, bitmask[i:i + 1])
                row[0, tokens[i]] = -float("inf")
                redrawn = int(self._draw_processed(row, [reqs[i]])[0])
                tokens[i] = self._advance_grammar(row, reqs[i], redrawn)

    def _draw_general(self, logits: torch.Tensor, reqs: Sequence[Request],
                      bitmask: torch.Tensor | None) -> torch.Tensor:
        """Rows with bias, penalties, min_tokens or truncation (`bitmask`: their rows of the
        step's bitmask, when the step has constrained rows): mask, process, draw, advance."""
        if bitmask is not None:
            self._mask(logits, reqs, bitmask)
        for i, req in enumerate(reqs):
            self._process_row(logits[i], req)
        tokens = self._draw_processed(logits, reqs)
        for i, req in enumerate(reqs):
            if req.grammar is not None:
                tokens[i] = self._advance_grammar(logits[i:i + 1], req, int(tokens[i]))
        return tokens

    def _advance_grammar(self, logits: torch.Tensor, req: Request, token: int) -> int:
        """Advance the request's matcher past its drawn token. The mask may let through a token
        the matcher then refuses (xgrammar over-approximates some tokens that end inside a
        UTF-8 character, e.g. under a regex): ban it and draw again."""
        assert req.grammar is not None
        for _ in range(_MAX_REDRAWS):
            if req.grammar.accept(token):
                return token
            logits[0, token] = -float("inf")
            token = int(self._draw_processed(logits, [req])[0])
        req.grammar.lost = True  # the scheduler ends the request
        return token

    def _draw_processed(self, logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in reqs], dtype=logits.dtype)
        tokens = logits.argmax(-1)
        rand = torch.nonzero(temps >= _GREEDY_EPS)[:, 0]
        if len(rand):
            scaled = logits[rand] / temps[rand, None]
            weights = _truncated_probs(scaled, [reqs[int(i)] for i in rand])
            tokens[rand] = inverse_cdf(weights, self._uniforms([reqs[int(i)] for i in rand]))
        return tokens

    def _fill_masks(self, reqs: Sequence[Request], rows: Sequence[int],
                    vocab: int) -> torch.Tensor | None:
        """The step's bitmask, one row per request, filled in one call for the constrained
        `rows` (all tokens allowed elsewhere); None, and no fill, when `rows` is empty."""
        if not rows:
            return None
        assert self._masker is not None
        grammars = [g for g in (reqs[i].grammar for i in rows) if g is not None]
        return self._masker.fill(len(reqs), vocab, rows, grammars)

    @staticmethod
    def _mask(logits: torch.Tensor, reqs: Sequence[Request], bitmask: torch.Tensor) -> None:
        """Apply the constrained rows' masks (the rows of `logits` and `bitmask` are `reqs`)."""
        rows = torch.tensor([i for i, r in enumerate(reqs) if r.grammar is not None],
                            dtype=torch.int64)
        if len(rows):
            masked = logits[rows]
            apply_bitmask(masked, bitmask[rows])
            logits[rows] = masked

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
