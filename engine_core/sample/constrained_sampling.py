"""The constrained rows of a step (structured outputs, engine_core/structured/): their tokens
follow their grammars exactly, and the grammar is paid for only where it matters.

A greedy constrained token is the argmax of the masked raw logits, a sampled one a draw from
softmax(masked logits / T). A constrained row with nothing else to process stays on the
sampler's fast path, and its argmax or block-path draw is offered to its matcher first (one call
for all rows) and kept when accepted. That is exact because xgrammar's matcher accepts no token
its mask refuses (its mask over-approximates, never the reverse): an accepted argmax is the
masked argmax, and an accepted draw is rejection sampling (a draw from p, given that the grammar
accepts it, follows p restricted to what the grammar accepts). Only the rows refused get a token
bitmask (filled for all of them in one call): a sampled row whose mask allows much draws again
until the mask allows the draw (up to _RETRIES times), and the rest are drawn exactly from their
masked logits (at a structural position only the few allowed tokens are looked at, not the
vocabulary). Constrained rows with bias, penalties or truncation take the sampler's general
path, their masks (from the same fill) applied before anything else. A token a matcher refuses
although its mask allowed it (a few tokens that end inside a UTF-8 character) is banned and the
row drawn again. The scan's logits are never masked in place: logprobs stay the raw model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from engine_core.layers.host_link import HostLink
from engine_core.layers.lm_head import Scan
from engine_core.sample.logits_ops import DrawArgs, draw_from_blocks, draw_plain, pick
from engine_core.sample.sampling_batch import SamplingBatch
from engine_core.structured.grammar import RequestGrammar
from engine_core.structured.masks import AllowedIds, TokenMasker, allows, apply_bitmask, read_masks

_MAX_REDRAWS = 64  # tokens a constrained row may draw and see refused before it is given up
# A sampled constrained row whose unconstrained draw the grammar refuses draws again up to
# _RETRIES times (a new uniform each, from the scan's block sums: cheap) when at least _BROAD
# of its mask words allow a token; otherwise, or when still refused, it takes the exact masked
# draw, which copies the whole row for a broad mask and reads only the allowed tokens else.
_RETRIES = 8
_BROAD = 0.25


class FastDraws(NamedTuple):
    """The fast path's sampled rows (scan rows, in the order of the scan's block sums) and their
    temperatures."""

    rows: torch.Tensor
    temps: torch.Tensor


class ConstrainedSampler:
    """The grammar work of a step: offering tokens to matchers, filling masks, masked draws.
    Rows are the batch's. A step's masks are filled in one bitmask with a row per constrained
    row that needs one (the fast path's refused rows, then the general path's), so `masks[j]`
    is the mask of the j-th of the rows a function is given."""

    def __init__(self, link: HostLink) -> None:
        self._link = link  # the CPU's
        self._masker = TokenMasker()

    def constrain(self, scan: Scan, tokens: torch.Tensor, batch: SamplingBatch,
                  fast: Sequence[int], general: Sequence[int],
                  sampled: FastDraws) -> torch.Tensor | None:
        """Make `tokens` of the constrained fast-path rows `fast` (their argmax or unconstrained
        draw in) follow their grammars, their matchers advanced. Returns the masks of the
        constrained general-path rows `general` (a row each, in order); None when there are
        none. The masks are filled in one call, for those rows and the fast rows refused."""
        refused = self._offer(fast, tokens, batch)
        masks = self._fill(batch, refused + list(general), scan.logits.shape[1])
        if refused:
            assert masks is not None
            self._redraw(scan, masks[:len(refused)], refused, tokens, batch, sampled)
        return masks[len(refused):] if general and masks is not None else None

    @staticmethod
    def mask_general(logits: torch.Tensor, batch: SamplingBatch, rows: np.ndarray,
                     masks: torch.Tensor) -> None:
        """Apply the constrained rows' `masks` (in order) to general-path `logits` (a row per
        batch row of `rows`), before anything else touches them."""
        at = torch.tensor([j for j, i in enumerate(rows.tolist()) if i in batch.grammars],
                          dtype=torch.int64)
        masked = logits[at]
        apply_bitmask(masked, masks)
        logits[at] = masked

    def advance_general(self, logits: torch.Tensor, batch: SamplingBatch, rows: np.ndarray,
                        tokens: torch.Tensor) -> None:
        """Advance the constrained general-path rows' matchers past `tokens` (drawn from the
        processed, masked `logits`, a row per batch row of `rows`), drawing again where a
        matcher refuses."""
        for j, i in enumerate(rows.tolist()):
            if i in batch.grammars:
                tokens[j] = self._advance(logits[j:j + 1], batch, i, int(tokens[j]))

    def _offer(self, rows: Sequence[int], tokens: torch.Tensor,
               batch: SamplingBatch) -> list[int]:
        """Offer `rows`' tokens to their matchers, in one call; the rows whose matcher refused
        (it stays as it was)."""
        if not rows:
            return []
        drawn = tokens.tolist()
        accepted = self._masker.accept(_grammars(batch, rows), [drawn[i] for i in rows])
        return [i for i, ok in zip(rows, accepted, strict=True) if not ok]

    def _fill(self, batch: SamplingBatch, rows: Sequence[int],
              vocab: int) -> torch.Tensor | None:
        """The masks of the constrained `rows` (a bitmask row each, in order), filled in one
        call; None, and no fill, when `rows` is empty."""
        if not rows:
            return None
        return self._masker.fill(len(rows), vocab, range(len(rows)), _grammars(batch, rows))

    def _redraw(self, scan: Scan, masks: torch.Tensor, rows: list[int], tokens: torch.Tensor,
                batch: SamplingBatch, sampled: FastDraws) -> None:
        """New tokens for the fast-path `rows` whose first token the matcher refused, exactly
        under their `masks`, then their matchers advanced. Sampled rows with a broad mask draw
        again while the mask refuses (rejection sampling: the accepted draw follows the masked
        distribution however many were refused, and so does the exact draw that ends the
        tries); the rest draw from their masked logits: a broad mask's whole row, masked, a
        narrow one's allowed tokens alone."""
        read = read_masks(masks, scan.logits.shape[1], _BROAD)
        left = self._retry(scan, masks, rows, read.broad, tokens, batch, sampled)
        for dense in (True, False):
            part = [j for j in left if read.broad[j] == dense]
            if part:
                picked = [rows[j] for j in part]
                ids, vals = (_masked_rows(scan.logits, masks[part], picked) if dense else
                             _allowed_logits(scan.logits, read.narrow, part, picked))
                cols = draw_plain(vals, batch, picked)
                tokens[picked] = torch.from_numpy(ids[np.arange(len(picked)), cols])
        self._advance_masked(scan, masks, rows, tokens, batch)

    def _retry(self, scan: Scan, masks: torch.Tensor, rows: list[int], broad: list[bool],
               tokens: torch.Tensor, batch: SamplingBatch, sampled: FastDraws) -> list[int]:
        """Draw again from the scan's block sums for the sampled ones of `rows` whose masks are
        `broad`, up to _RETRIES times, keeping the first draw the mask allows; which of `rows`
        (indices into it) are still without one. Whether a row retries depends on its mask
        only, never on what it drew."""
        sums = scan.block_sums
        position = {row: k for k, row in enumerate(sampled.rows.tolist())}
        again = [j for j, row in enumerate(rows) if broad[j] and row in position]
        if sums is None or not again:
            return list(range(len(rows)))
        left = [j for j in range(len(rows)) if j not in again]
        for _ in range(_RETRIES):
            scan_rows = [rows[j] for j in again]
            at = torch.tensor([position[i] for i in scan_rows])
            drawn = draw_from_blocks(scan, sums[at], torch.tensor(scan_rows), sampled.temps[at],
                                     batch.more_uniforms(scan_rows))
            tokens[scan_rows] = drawn
            ok = allows(masks, again, drawn.tolist()).tolist()
            again = [j for j, done in zip(again, ok, strict=True) if not done]
            if not again:
                break
        return sorted(left + again)

    def _advance_masked(self, scan: Scan, masks: torch.Tensor, rows: list[int],
                        tokens: torch.Tensor, batch: SamplingBatch) -> None:
        """Advance the matchers of `rows` past their masked tokens, in one call; a token the
        matcher refuses although its mask allowed it is drawn again (_advance)."""
        accepted = self._masker.accept(_grammars(batch, rows), tokens[rows].tolist())
        for j, (i, ok) in enumerate(zip(rows, accepted, strict=True)):
            if not ok:
                row = scan.logits[i:i + 1].to("cpu", copy=True)
                apply_bitmask(row, masks[j:j + 1])
                row[0, tokens[i]] = -float("inf")
                tokens[i] = self._advance(row, batch, i, self._draw_again(row, batch, i))

    def _advance(self, logits: torch.Tensor, batch: SamplingBatch, row: int, token: int) -> int:
        """Advance the row's matcher past its drawn token. The mask may let through a token
        the matcher then refuses (xgrammar over-approximates some tokens that end inside a
        UTF-8 character, e.g. under a regex): ban it and draw again."""
        grammar = batch.grammars[row]
        for _ in range(_MAX_REDRAWS):
            if grammar.accept(token):
                return token
            logits[0, token] = -float("inf")
            token = self._draw_again(logits, batch, row)
        grammar.lost = True  # the scheduler ends the request
        return token

    def _draw_again(self, logits: torch.Tensor, batch: SamplingBatch, row: int) -> int:
        """A new token for the batch's `row` from its processed `logits` [1, V]."""
        args = DrawArgs.of(batch, self._link, np.array([row], dtype=np.int64), fresh=True)
        return int(pick(logits, args)[0])


def _grammars(batch: SamplingBatch, rows: Sequence[int]) -> list[RequestGrammar]:
    return [batch.grammars[i] for i in rows]


def _masked_rows(logits: torch.Tensor, masks: torch.Tensor,
                 rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Every token id [n, V] and the raw logits on the CPU, -inf where `masks` disallow them,
    of `rows` (one masked copy)."""
    vals = logits[torch.tensor(rows, device=logits.device)]
    apply_bitmask(vals, masks)
    return np.broadcast_to(np.arange(vals.shape[1]), vals.shape), vals.cpu().numpy()


def _allowed_logits(logits: torch.Tensor, allowed: AllowedIds, part: list[int],
                    rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The allowed token ids [n, m] (`part` of `allowed`) of `rows` and their raw logits on the
    CPU, -inf past each row's own."""
    ids, valid = allowed.ids[part], allowed.valid[part]
    at = logits.device
    picked = logits[torch.tensor(rows, device=at)[:, None], torch.from_numpy(ids).to(at)]
    return ids, np.where(valid, picked.cpu().numpy(), -np.inf)
