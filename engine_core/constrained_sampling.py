"""The constrained rows of a step (structured outputs, engine_core/structured.py): their tokens
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
from typing import NamedTuple, Protocol

import torch

from engine_core.lm_head import Scan
from engine_core.request import Request
from engine_core.structured import TokenMasker, allowed_ids, allows, apply_bitmask, is_broad

_MAX_REDRAWS = 64  # tokens a constrained row may draw and see refused before it is given up
# A sampled constrained row whose unconstrained draw the grammar refuses draws again up to
# _RETRIES times (a new uniform each, from the scan's block sums: cheap) when at least _BROAD
# of its mask words allow a token; otherwise, or when still refused, it takes the exact masked
# draw, which copies the whole row for a broad mask and reads only the allowed tokens else.
_RETRIES = 8
_BROAD = 0.25


class Draws(Protocol):
    """The sampler's draws (engine_core/sampler.py), each request's seed respected."""

    def draw_from_blocks(self, scan: Scan, block_sums: torch.Tensor, rows: torch.Tensor,
                         temps: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """A token for `rows` of the scan from their block sums, at temperatures `temps`."""
        ...

    def draw_processed(self, logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """A token per row of `logits` (-inf where not allowed): argmax, or a draw from
        softmax(logits / T) after the request's truncation."""
        ...


class FastDraws(NamedTuple):
    """The fast path's sampled rows (scan rows, in the order of the scan's block sums) and their
    temperatures."""

    rows: torch.Tensor
    temps: torch.Tensor


class ConstrainedSampler:
    """The grammar work of a step: offering tokens to matchers, filling masks, masked draws."""

    def __init__(self, draws: Draws) -> None:
        self._draws = draws
        self._masker = TokenMasker()

    def constrain(self, scan: Scan, tokens: torch.Tensor, reqs: Sequence[Request],
                  fast: Sequence[int], general: Sequence[int],
                  sampled: FastDraws) -> torch.Tensor | None:
        """Make `tokens` of the constrained fast-path rows `fast` (their argmax or unconstrained
        draw in) follow their grammars, their matchers advanced. Returns the step's bitmask,
        filled for the rows refused and the constrained general-path rows `general`; None, and
        no fill, when there are none."""
        refused = self._offer(fast, tokens, reqs)
        bitmask = self._fill(reqs, sorted(refused + list(general)), scan.logits.shape[1])
        if refused:
            assert bitmask is not None
            self._redraw(scan, bitmask, torch.tensor(refused), tokens, reqs, sampled)
        return bitmask

    @staticmethod
    def mask_general(logits: torch.Tensor, reqs: Sequence[Request],
                     bitmask: torch.Tensor) -> None:
        """Apply the constrained rows' masks to general-path `logits` (the rows of `logits` and
        `bitmask` are `reqs`), before anything else touches them."""
        rows = torch.tensor([i for i, r in enumerate(reqs) if r.grammar is not None],
                            dtype=torch.int64)
        if len(rows):
            masked = logits[rows]
            apply_bitmask(masked, bitmask[rows])
            logits[rows] = masked

    def advance_general(self, logits: torch.Tensor, reqs: Sequence[Request],
                        tokens: torch.Tensor) -> None:
        """Advance the constrained general-path rows' matchers past `tokens` (drawn from the
        processed, masked `logits`), drawing again where a matcher refuses."""
        for i, req in enumerate(reqs):
            if req.grammar is not None:
                tokens[i] = self._advance(logits[i:i + 1], req, int(tokens[i]))

    def _offer(self, rows: Sequence[int], tokens: torch.Tensor,
               reqs: Sequence[Request]) -> list[int]:
        """Offer `rows`' tokens to their matchers, in one call; the rows whose matcher refused
        (it stays as it was)."""
        if not rows:
            return []
        grammars = [g for g in (reqs[i].grammar for i in rows) if g is not None]
        accepted = self._masker.accept(grammars, tokens[list(rows)].tolist())
        return [i for i, ok in zip(rows, accepted, strict=True) if not ok]

    def _fill(self, reqs: Sequence[Request], rows: Sequence[int],
              vocab: int) -> torch.Tensor | None:
        """The step's bitmask, one row per request, filled in one call for the constrained
        `rows` (every token allowed elsewhere); None, and no fill, when `rows` is empty."""
        if not rows:
            return None
        grammars = [g for g in (reqs[i].grammar for i in rows) if g is not None]
        return self._masker.fill(len(reqs), vocab, rows, grammars)

    def _redraw(self, scan: Scan, bitmask: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
                reqs: Sequence[Request], sampled: FastDraws) -> None:
        """New tokens for the fast-path `rows` whose first token the matcher refused, exactly
        under their masks, then their matchers advanced. Sampled rows with a broad mask draw
        again while the mask refuses (rejection sampling: the accepted draw follows the masked
        distribution however many were refused, and so does the exact draw that ends the
        tries); the rest draw from their masked logits."""
        broad = is_broad(bitmask[rows], _BROAD)
        left = self._retry(scan, bitmask, rows, broad, tokens, reqs, sampled)
        if bool(left.any()):
            tokens[rows[left]] = self._draw_masked(scan.logits, bitmask, rows[left], broad[left],
                                                   reqs)
        self._advance_masked(scan, bitmask, rows, tokens, reqs)

    def _retry(self, scan: Scan, bitmask: torch.Tensor, rows: torch.Tensor, broad: torch.Tensor,
               tokens: torch.Tensor, reqs: Sequence[Request], sampled: FastDraws) -> torch.Tensor:
        """Draw again from the scan's block sums for the sampled ones of `rows` whose masks are
        `broad`, up to _RETRIES times, keeping the first draw the mask allows; which of `rows`
        are still without one (bool). Whether a row retries depends on its mask only, never on
        what it drew."""
        left = torch.ones(len(rows), dtype=torch.bool)
        sums = scan.block_sums
        if not len(sampled.rows) or sums is None:
            return left
        position = torch.full((len(tokens),), -1, dtype=torch.int64)
        position[sampled.rows] = torch.arange(len(sampled.rows))
        again = torch.nonzero((position[rows] >= 0) & broad)[:, 0]  # indices into rows
        for _ in range(_RETRIES):
            if not len(again):
                break
            at, scan_rows = position[rows[again]], rows[again]
            drawn = self._draws.draw_from_blocks(scan, sums[at], scan_rows, sampled.temps[at],
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
        of equal maxima, as torch.argmax) or of a draw from softmax(vals / T). A row that allows
        nothing keeps a column its matcher refuses (see _advance_masked)."""
        picks = vals.argmax(-1)
        live = torch.nonzero(vals.amax(-1) > -float("inf"))[:, 0]
        if len(live):
            picks[live] = self._draws.draw_processed(vals[live], [reqs[int(i)] for i in live])
        return picks

    def _advance_masked(self, scan: Scan, bitmask: torch.Tensor, rows: torch.Tensor,
                        tokens: torch.Tensor, reqs: Sequence[Request]) -> None:
        """Advance the matchers of `rows` past their masked tokens, in one call; a token the
        matcher refuses although its mask allowed it is drawn again (_advance)."""
        picked = rows.tolist()
        grammars = [g for g in (reqs[i].grammar for i in picked) if g is not None]
        accepted = self._masker.accept(grammars, tokens[rows].tolist())
        for i, ok in zip(picked, accepted, strict=True):
            if not ok:
                row = scan.logits[i:i + 1].to("cpu", copy=True)
                apply_bitmask(row, bitmask[i:i + 1])
                row[0, tokens[i]] = -float("inf")
                redrawn = int(self._draws.draw_processed(row, [reqs[i]])[0])
                tokens[i] = self._advance(row, reqs[i], redrawn)

    def _advance(self, logits: torch.Tensor, req: Request, token: int) -> int:
        """Advance the request's matcher past its drawn token. The mask may let through a token
        the matcher then refuses (xgrammar over-approximates some tokens that end inside a
        UTF-8 character, e.g. under a regex): ban it and draw again."""
        assert req.grammar is not None
        for _ in range(_MAX_REDRAWS):
            if req.grammar.accept(token):
                return token
            logits[0, token] = -float("inf")
            token = int(self._draws.draw_processed(logits, [req])[0])
        req.grammar.lost = True  # the scheduler ends the request
        return token


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
