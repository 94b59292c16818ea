"""A few threads sharing a list of independent chunks of work, each taking the next one when it
is done: the LM head's vocabulary chunks (lm_head.py) and the decoder's linears split by
columns or rows (linear.py). Torch ops and the compiled kernels release the GIL, so the
threads run in parallel; taking chunks on demand tolerates a core that another process (a
frontend) holds for a while, where OpenMP's even split waits for it (docs/benchmarks.md)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


def _one_thread_for_torch() -> None:
    """A helper's torch ops run on the helper alone. A thread that OpenMP did not start has its
    default team size (every core), so without this each MKL or ATen op a helper ran started a
    team of its own and the pool's threads shared the cores three or four ways: two threads'
    products ran 1.26x one thread's, 1.94x with it (docs/benchmarks.md)."""
    torch.set_num_threads(1)


class ChunkPool:
    """Runs fn(0..n-1) on the calling thread plus `workers - 1` helper threads; each takes the
    next index when it is done, so a thread the OS has parked holds up at most one chunk."""

    def __init__(self, workers: int, name: str = "chunks") -> None:
        self.workers = max(1, workers)
        self.active = self.workers  # how many of them the next maps use (`use`)
        self._helpers = (ThreadPoolExecutor(self.workers - 1, thread_name_prefix=name,
                                            initializer=_one_thread_for_torch)
                         if self.workers > 1 else None)

    def use(self, workers: int) -> None:
        """Run the next maps on `workers` threads (at most the pool's), the caller's included."""
        self.active = max(1, min(workers, self.workers))

    def map(self, fn: Callable[[int], T], n: int) -> list[T]:
        if self._helpers is None or self.active < 2 or n < 2:
            return [fn(i) for i in range(n)]
        results: list = [None] * n
        errors: list[Exception] = []
        tickets = itertools.count()  # next() is atomic under the GIL
        left = [n]
        lock, done = threading.Lock(), threading.Event()

        def work() -> None:
            with torch.inference_mode():
                for i in tickets:
                    if i >= n:
                        return
                    try:
                        results[i] = fn(i)
                    except Exception as e:  # noqa: BLE001 - re-raised on the calling thread
                        errors.append(e)
                    finally:
                        with lock:
                            left[0] -= 1
                            if left[0] == 0:
                                done.set()

        for _ in range(self.active - 1):
            self._helpers.submit(work)
        work()
        done.wait()  # not the helpers' exit: one the OS has not run yet finds no ticket left
        if errors:
            raise errors[0]
        return results
