"""A step's token bitmask for its constrained rows (the grammars: grammar.py).

- `TokenMasker` fills one bitmask row per constrained row of a step, all rows in one call,
  and advances their matchers in one call;
- `allows`, `apply_bitmask` and `read_masks` read a bitmask (the masked draws,
  engine_core/sample/constrained_sampling.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from engine_core.structured.grammar import RequestGrammar


class TokenMasker:
    """The grammar work of one step, each part one call for all of the step's constrained rows:
    filling their token bitmasks, and advancing their matchers past the drawn tokens."""

    def __init__(self) -> None:
        import xgrammar

        self._xgr = xgrammar
        self._batch = xgrammar.BatchGrammarMatcher(max_threads=1)

    def fill(self, rows: int, vocab: int, constrained: Sequence[int],
             grammars: Sequence[RequestGrammar]) -> torch.Tensor:
        """A step's bitmask [rows, ceil(vocab / 32)] int32 on the CPU: row `constrained[i]`
        allows `grammars[i]`'s next tokens, every other row allows every token. `vocab` is the
        model's (the logits' width), as the grammars were compiled for."""
        bitmask = self._xgr.allocate_token_bitmask(rows, vocab)
        self._batch.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask,
                                                  indices=list(constrained))
        return bitmask

    def accept(self, grammars: Sequence[RequestGrammar], tokens: Sequence[int]) -> list[bool]:
        """Advance each grammar past its token; False where the grammar refuses it (the matcher
        is then left as it was)."""
        return list(self._batch.batch_accept_token([g.matcher for g in grammars], list(tokens)))


def allows(bitmask: torch.Tensor, rows: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
    """Whether row `rows[i]` of `bitmask` allows `tokens[i]` (bool [n]): one bit each."""
    at = np.asarray(tokens, dtype=np.int64)
    words = bitmask.numpy()[np.asarray(rows, dtype=np.int64), at // 32]
    return ((words >> (at % 32)) & 1).astype(bool)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set every logit the bitmask (of the same rows, on the CPU) disallows to -inf, in place:
    xgrammar's kernel on CUDA, its CPU loop elsewhere."""
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device),
                                         vocab_size=logits.shape[1])


class AllowedIds(NamedTuple):
    """Each bitmask row's allowed tokens, ascending, padded to the longest row."""

    ids: np.ndarray  # [rows, n] int64, 0 where not valid
    valid: np.ndarray  # [rows, n] bool


class MaskRows(NamedTuple):
    """A bitmask's rows, read for the masked draws."""

    broad: list[bool]  # whether at least a given share of the row's words allow some token
    narrow: AllowedIds  # the allowed tokens of the rows that are not broad (none for the rest)


def read_masks(bitmask: torch.Tensor, vocab: int, share: float) -> MaskRows:
    """Which rows are broad (the share of their words that allow some token, a cheap stand-in
    for the share of the vocabulary, is at least `share`), and the allowed tokens (below
    `vocab`) of the others. One pass finds the words with a bit set; only the narrow rows'
    are unpacked, so a grammar that allows a few tokens costs a few, not the vocabulary."""
    words = bitmask.numpy()
    row_of, word = np.nonzero(words)  # row-major: rows, then words, ascend
    broad = np.bincount(row_of, minlength=len(words)) >= share * words.shape[1]
    if broad.any():
        narrow = ~broad[row_of]
        row_of, word = row_of[narrow], word[narrow]
    return MaskRows(broad.tolist(), _unpack(words, row_of, word, vocab))


def _unpack(words: np.ndarray, row_of: np.ndarray, word: np.ndarray, vocab: int) -> AllowedIds:
    """The tokens below `vocab` allowed by words `word` of rows `row_of` (row-major) of
    `words`, a row of AllowedIds per row of `words`."""
    # bit j of a word is column j: its little-endian bytes, each unpacked lowest bit first
    octets = words[row_of, word].astype("<i4").view(np.uint8).reshape(-1, 4)
    entry, bit = np.nonzero(np.unpackbits(octets, axis=1, bitorder="little"))
    row, token = row_of[entry], word[entry] * 32 + bit
    below = token < vocab
    row, token = row[below], token[below]
    counts = np.bincount(row, minlength=len(words))
    position = np.arange(len(row)) - (counts.cumsum() - counts)[row]
    width = max(1, int(counts.max(initial=0)))
    ids = np.zeros((len(words), width), dtype=np.int64)
    valid = np.zeros((len(words), width), dtype=bool)
    ids[row, position] = token
    valid[row, position] = True
    return AllowedIds(ids, valid)
