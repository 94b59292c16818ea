"""Torch's intra-op threads for each step, chosen by measuring the steps themselves.

On a small CPU box the engine shares its cores with the frontends. A second torch thread pays
off for a step whose GEMMs are large and compute-bound (prefill chunks of a real model); it
costs for a step of small ops, where OpenMP's even split waits at every op for the thread whose
core a frontend has taken (docs/benchmarks.md). Which steps are which depends on the model, the
CPU and how busy the frontends are, so it is not assumed: `ThreadPolicy` keeps, for each step
size (tokens, in powers of two), a running mean of the seconds per token that each thread count
took, uses the faster one and now and then tries the other, less often the worse it did.
With one choice (`--num-threads N`) it only sets N.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)
WARMUP = 3  # steps of each size measured with each thread count before choosing...
# ... or one each, where each count's step took this long: a step of seconds (a real model's
# prefill chunk) is measured well by one, and three of them on the slower count cost seconds
# (docs/benchmarks.md: the 0.5B shape's first 64 embeddings, 1.29 against 1.47 req/s). Both
# counts' steps must be long, so that one step slowed by a one-off cost decides nothing.
LONG_STEP_S = 0.1
EXPLORE_EVERY = 16  # steps of a size between tries of a count that is not the best
SMOOTHING = 0.2  # weight of the newest step in a running mean
# More threads must be this much faster to be used: a core the engine takes for a small gain
# is a core a busy frontend loses, which the engine's own step times do not show
# (docs/benchmarks.md: the tiny model at concurrency 64).
MORE_THREADS_MARGIN = 1.2


@dataclass
class _Arm:
    seconds_per_token: float = 0.0
    steps: int = 0
    seconds: float = 0.0  # the steps' time in all

    def add(self, seconds: float, tokens: int) -> None:
        self.steps += 1
        self.seconds += seconds
        weight = max(SMOOTHING, 1.0 / self.steps)  # a plain mean until it has a few steps
        self.seconds_per_token += weight * (seconds / tokens - self.seconds_per_token)


@dataclass
class _Size:
    arms: dict[int, _Arm]
    steps: int = 0
    best: int = 0  # the thread count it uses, once every count has been measured

    @property
    def measured(self) -> bool:
        """Whether every count has been measured enough to choose (WARMUP, LONG_STEP_S)."""
        arms = self.arms.values()
        return (all(a.steps >= WARMUP for a in arms)
                or all(a.steps > 0 and a.seconds >= LONG_STEP_S * a.steps for a in arms))


@dataclass
class ThreadPolicy:
    """Picks the thread count of each step from `choices`; see the module docstring."""

    choices: tuple[int, ...]
    set_threads: Callable[[int], None] = torch.set_num_threads
    _sizes: dict[int, _Size] = field(default_factory=dict)
    _current: int = 0

    def choose(self, tokens: int) -> int:
        size = self._size(tokens)
        size.steps += 1
        # Warming up, the counts take turns (the least measured first), so a phase of the
        # load (a burst of arrivals, a busy frontend) weighs on each alike.
        if not size.measured:
            return min(size.arms, key=lambda n: size.arms[n].steps)
        best = self._best(size)
        for n, arm in size.arms.items():
            if n != best and size.steps % self._explore_every(arm, size.arms[best]) == 0:
                return n
        return best

    def record(self, tokens: int, threads: int, seconds: float) -> None:
        if tokens <= 0:
            return
        size = self._size(tokens)
        size.arms[threads].add(seconds, tokens)
        if size.measured:
            best = self._best(size)
            if best != size.best:
                log.log(logging.INFO if not size.best else logging.DEBUG,
                        "steps of %d-%d tokens now run on %d torch thread(s): %s ms per token",
                        1 << (tokens.bit_length() - 1), (1 << tokens.bit_length()) - 1, best,
                        {n: round(a.seconds_per_token * 1e3, 3) for n, a in size.arms.items()})
                size.best = best

    @contextmanager
    def step(self, tokens: int) -> Iterator[int]:
        """Run a step of `tokens` tokens on the chosen thread count and record its time."""
        if not self.choices:  # torch's own choice
            yield torch.get_num_threads()
            return
        threads = self.choose(tokens)
        if threads != self._current:
            self.set_threads(threads)
            self._current = threads
        start = time.perf_counter()
        yield threads
        if len(self.choices) > 1:
            self.record(tokens, threads, time.perf_counter() - start)

    def best(self) -> dict[int, int]:
        """{size class: the thread count it now uses}, for the log and the tests."""
        return {bits: s.best for bits, s in sorted(self._sizes.items()) if s.best}

    def _best(self, size: _Size) -> int:
        """The fewest threads whose time is within MORE_THREADS_MARGIN of the fastest's."""
        fastest = min(a.seconds_per_token for a in size.arms.values())
        return min(n for n, a in size.arms.items()
                   if a.seconds_per_token <= fastest * MORE_THREADS_MARGIN)

    def _size(self, tokens: int) -> _Size:
        bits = max(1, tokens).bit_length()
        size = self._sizes.get(bits)
        if size is None:
            size = self._sizes[bits] = _Size({n: _Arm() for n in self.choices})
        return size

    @staticmethod
    def _explore_every(arm: _Arm, best: _Arm) -> int:
        """A count that took twice the best's time is tried a quarter as often, and so on."""
        ratio = arm.seconds_per_token / max(best.seconds_per_token, 1e-12)
        return EXPLORE_EVERY * max(1, min(16, int(ratio * ratio)))
