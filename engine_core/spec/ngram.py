"""N-gram proposals (vLLM's `ngram` method, prompt lookup decoding): a request's own tokens
predict its next ones.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the request's last n tokens are
looked for earlier in its tokens (prompt and output); at the latest earlier occurrence of the
longest n that has one, the tokens that followed it are the proposal (up to k of them). On
text that copies its context (code edits, answers quoting their sources, JSON, a model
looping), most are accepted; elsewhere nothing matches and nothing is proposed. Proposals
are a function of the tokens alone: the distribution they are verified against is the
target's (q is one-hot), so acceptance keeps the output exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to min(k, limit) tokens to follow `tokens`, or none."""
        k = min(self.k, limit)
        length = len(tokens)
        if k <= 0 or length <= self.min_n:
            return []
        ids = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # every earlier window of n tokens (its continuation starts inside `ids`)
            windows = sliding_window_view(ids[:length - 1], n)
            hits = np.flatnonzero((windows == ids[length - n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return ids[start:start + k].tolist()
        return []
