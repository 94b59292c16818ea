"""How many draft tokens to propose: as many positions as are accepted often enough.

Verifying a draft token costs a row of the step; it pays only if the token is accepted. The
share accepted falls with the position (a draft's j-th token is kept only if the j before it
were): on the CPU's 0.5B shape, n-gram drafts were accepted 70-83% at their first position,
3-14% at their second and not at all after (docs/benchmarks.md). `DraftDepth` keeps, per
position, the share of drafts accepted there among those that reached it (an exponential
average over steps), and proposes the first position always and each next one while its share
is at least `floor`. Every `explore_every` steps it proposes the full k, so a position that
became useful (a request entering a loop, a copy) is found again.
"""

from __future__ import annotations

import numpy as np

FLOOR = 0.2  # a position worth a row of the step (its expected tokens per row)
ALPHA = 0.1  # weight of a step's share in the running average
EXPLORE_EVERY = 16


class DraftDepth:
    def __init__(self, k: int, floor: float = FLOOR, alpha: float = ALPHA,
                 explore_every: int = EXPLORE_EVERY) -> None:
        self.k, self.floor, self.alpha, self.explore_every = k, floor, alpha, explore_every
        self.rates = np.ones(k)  # optimistic: every position is tried first
        self.steps = 0

    def depth(self) -> int:
        """The most draft tokens the next step's proposals may have."""
        self.steps += 1
        if self.steps % self.explore_every == 0:
            return self.k
        depth = 1
        while depth < self.k and self.rates[depth] >= self.floor:
            depth += 1
        return depth

    def update(self, drafted: np.ndarray, accepted: np.ndarray) -> None:
        """A step's drafts: drafted[i] tokens proposed to request i, accepted[i] of them."""
        for j in range(self.k):
            reached = (drafted > j) & (accepted >= j)  # its earlier drafts all accepted
            if reached.any():
                share = float((accepted[reached] > j).mean())
                self.rates[j] += self.alpha * (share - self.rates[j])
