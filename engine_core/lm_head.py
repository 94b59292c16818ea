"""The LM head, computed one vocabulary chunk at a time together with the reductions that
sampling and logprobs need.

On a 128k vocabulary the head's GEMM and the vocab-wide passes after it (softmax, logsumexp,
top-k) are most of a CPU step. `LMHead.scan` produces the logits a chunk of columns at a time
and reduces each chunk while it is still in cache: per-block maxima, the sum of exp for the
logsumexp, and, for the rows that sample, the per-block sums of exp((logit - max) / T) that the
two-level inverse CDF in sampler.py searches. Argmax and top-k come afterwards from the leading
blocks (`gather_blocks`). The chunks are shared out to a few
threads, each taking the next chunk when it is done (torch ops release the GIL): a core that
another process (a frontend) is busy on just takes fewer chunks, where OpenMP's static split
would stall the whole op until that core came back. Measured on a 2-core box, 16 rows of the
128k Llama 3 vocabulary: ~20 ms for the head and the sampling reductions on two workers,
~32-42 ms for one thread's GEMM + softmax.

A scan keeps the full logits (`Scan.logits`) for what needs them afterwards: the chosen
tokens' logits, their ranks (`count_above`) and rows with penalties or truncation.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, TypeVar

import torch
import torch.nn.functional as F

BLOCK = 256  # inverse-CDF block; chunk boundaries fall on block boundaries
CPU_CHUNK = 8192  # 16 rows of it are 512 KB: a chunk's logits stay in the 1 MB L2 while reduced

T = TypeVar("T")


class ChunkPool:
    """Runs fn(0..n-1) on the calling thread plus `workers - 1` helper threads; each takes the
    next index when it is done, so a thread the OS has parked holds up at most one chunk."""

    def __init__(self, workers: int) -> None:
        self.workers = max(1, workers)
        self._helpers = (ThreadPoolExecutor(self.workers - 1, thread_name_prefix="lm-head")
                         if self.workers > 1 else None)

    def map(self, fn: Callable[[int], T], n: int) -> list[T]:
        if self._helpers is None or n < 2:
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

        for _ in range(self.workers - 1):
            self._helpers.submit(work)
        work()
        done.wait()  # not the helpers' exit: one the OS has not run yet finds no ticket left
        if errors:
            raise errors[0]
        return results


class _ChunkStats(NamedTuple):
    block_max: torch.Tensor  # [R, blocks in chunk]
    sumexp: torch.Tensor | None  # [R] sum of exp(logit - chunk max)
    block_sums: torch.Tensor | None  # [S, blocks in chunk] of exp((logit - chunk max) / T)


class Scan(NamedTuple):
    """One pass of the LM head. `logits` stays where the model runs; the rest is on the CPU."""

    logits: torch.Tensor  # [R, V] float32 raw logits
    max: torch.Tensor  # [R]
    argmax: torch.Tensor  # [R] int64, first of equal maxima as torch.argmax
    lse: torch.Tensor | None  # [R] logsumexp, when asked
    top_vals: torch.Tensor | None  # [R, k] raw logits of each row's top k, when asked
    top_ids: torch.Tensor | None  # [R, k] int64
    block_sums: torch.Tensor | None  # [S, ceil(V / BLOCK)] of exp((logit - max) / T), sampled rows


class LMHead:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 softcap: float | None = None, workers: int = 1, chunk: int | None = None) -> None:
        """weight: [vocab, hidden] as in nn.Linear. On the CPU the head keeps a float32
        [hidden, vocab] copy: the few-row GEMM reads it 1.1-3x faster than F.linear reads
        [vocab, hidden] (4.7 vs 16 ms at 1 row, 128k vocab, one thread)."""
        self.vocab = weight.shape[0]
        self.device = weight.device
        self.softcap = softcap
        self._weight_t = None
        if self.device.type == "cpu" and bias is None:
            self._weight_t = weight.detach().t().contiguous().float()
        self._weight, self._bias = weight.detach(), bias
        if chunk is None:
            chunk = CPU_CHUNK if self.device.type == "cpu" else self.vocab
        chunk = max(BLOCK, -(-chunk // BLOCK) * BLOCK)
        self.bounds = [(a, min(a + chunk, self.vocab)) for a in range(0, self.vocab, chunk)]
        self.pool = ChunkPool(workers)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 [rows, vocab] logits, chunk by chunk (what `scan` keeps, without the rest)."""
        out = torch.empty(hidden.shape[0], self.vocab, dtype=torch.float32, device=self.device)
        self.pool.map(lambda i: self._chunk_logits(hidden, out, *self.bounds[i]), len(self.bounds))
        return out

    def _chunk_logits(self, hidden: torch.Tensor, out: torch.Tensor, a: int, b: int) -> torch.Tensor:
        view = out[:, a:b]
        if self._weight_t is not None:
            torch.mm(hidden.float(), self._weight_t[:, a:b], out=view)
        else:
            bias = None if self._bias is None else self._bias[a:b]
            view.copy_(F.linear(hidden, self._weight[a:b], bias))
        if self.softcap:
            view.div_(self.softcap).tanh_().mul_(self.softcap)
        return view

    def scan(self, hidden: torch.Tensor, *, lse: bool = False, top_k: int = 0,
             sample_rows: torch.Tensor | None = None,
             temperatures: torch.Tensor | None = None) -> Scan:
        """Logits of `hidden` [R, H] with every row's max and argmax; with `lse` the logsumexp,
        with `top_k` each row's top k; for `sample_rows` (indices, with their `temperatures`)
        the inverse CDF's block sums.

        Chunks only keep per-block maxima (an order of magnitude cheaper than max with indices
        or top-k over the chunk); argmax and top-k are then found among the few blocks whose
        maxima lead: any of a row's k largest logits lies in one of its k highest blocks.
        """
        rows = hidden.shape[0]
        logits = torch.empty(rows, self.vocab, dtype=torch.float32, device=self.device)
        temps = torch.ones(0, 1)
        if sample_rows is not None:
            assert temperatures is not None
            sample_rows = sample_rows.to(self.device)
            temps = temperatures.to(self.device, torch.float32)[:, None]
        every_row = sample_rows is not None and len(sample_rows) == rows  # no row gather
        unit_temp = bool((temps == 1.0).all())
        shared_exp = lse and every_row and unit_temp  # one exp serves the lse and the draw

        def one(i: int) -> _ChunkStats:
            a, b = self.bounds[i]
            chunk = self._chunk_logits(hidden, logits, a, b)
            block_max = _per_block(chunk, torch.amax)
            peak = block_max.amax(-1, keepdim=True)
            sumexp = block_sums = None
            if lse:
                e = chunk.sub(peak).exp_()
                sumexp = e.sum(-1)
                if shared_exp:
                    block_sums = _per_block(e, torch.sum)
            if sample_rows is not None and block_sums is None:
                w = chunk.sub(peak) if every_row else chunk[sample_rows].sub_(peak[sample_rows])
                block_sums = _per_block((w if unit_temp else w.div_(temps)).exp_(), torch.sum)
            return _ChunkStats(block_max, sumexp, block_sums)

        stats = self.pool.map(one, len(self.bounds))
        return self._combine(logits, stats, top_k, sample_rows, temps)

    def _combine(self, logits: torch.Tensor, stats: list[_ChunkStats], top_k: int,
                 sample_rows: torch.Tensor | None, temps: torch.Tensor) -> Scan:
        block_max = torch.cat([s.block_max for s in stats], 1)  # [R, blocks]
        chunk_max = torch.stack([s.block_max.amax(-1) for s in stats], 1)  # [R, chunks]
        peak, best = block_max.max(1)  # the first block holding the max: torch.argmax's rule
        vals, cols = gather_blocks(logits, best[:, None])
        argmax = cols.gather(1, vals.argmax(-1, keepdim=True))[:, 0]
        lse = top_vals = top_ids = block_sums = None
        if sums := _present(s.sumexp for s in stats):
            lse = peak + (torch.stack(sums, 1) * (chunk_max - peak[:, None]).exp()).sum(1).log()
        if top_k:
            vals, cols = gather_blocks(logits, block_max.topk(min(top_k, block_max.shape[1]), -1).indices)
            top_vals, j = vals.topk(top_k, -1)
            top_ids = cols.gather(1, j)
        if sample_rows is not None:
            scale = ((chunk_max[sample_rows] - peak[sample_rows, None]) / temps).exp()
            parts = _present(s.block_sums for s in stats)
            block_sums = torch.cat([p * scale[:, c:c + 1] for c, p in enumerate(parts)], 1)
        cpu = [None if t is None else t.cpu() for t in (peak, argmax, lse, top_vals, top_ids, block_sums)]
        return Scan(logits, *cpu)  # type: ignore[arg-type]

    def count_above(self, scan: Scan, rows: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
        """How many logits of each of `rows` exceed its threshold (rank - 1 of a token)."""
        thr = thresholds.to(self.device, torch.float32)[:, None]
        every = len(rows) == scan.logits.shape[0] and bool((rows == torch.arange(len(rows))).all())
        picked: torch.Tensor | slice = slice(None) if every else rows.to(self.device)

        def one(i: int) -> torch.Tensor:  # all rows: a view, not a copy of each chunk
            a, b = self.bounds[i]
            return (scan.logits[picked, a:b] > thr).sum(-1)

        return torch.stack(self.pool.map(one, len(self.bounds)), 1).sum(1).cpu()


def gather_blocks(logits: torch.Tensor, blocks: torch.Tensor,
                  rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [R, n * BLOCK] of blocks [R, n] of each row (or of `rows` of `logits`), and their
    columns; columns past the vocabulary read -inf. Results are on `blocks`' device."""
    vocab = logits.shape[1]
    cols = (blocks[:, :, None] * BLOCK + torch.arange(BLOCK, device=blocks.device)).flatten(1)
    at = cols.clamp(max=vocab - 1).to(logits.device)
    vals = logits.gather(1, at) if rows is None else logits[rows.to(logits.device)[:, None], at]
    return vals.to(blocks.device).masked_fill_(cols >= vocab, -float("inf")), cols


def _present(items: Iterable[torch.Tensor | None]) -> list[torch.Tensor]:
    """The chunks' values of one statistic: all there, or none asked for (empty list)."""
    got = list(items)
    present = [t for t in got if t is not None]
    assert len(present) in (0, len(got))
    return present


def _per_block(values: torch.Tensor, reduce: Callable[..., torch.Tensor]) -> torch.Tensor:
    """reduce (torch.sum, torch.amax) over consecutive BLOCK columns; a last partial block
    reduces what there is."""
    full = values.shape[1] // BLOCK * BLOCK
    out = reduce(values[:, :full].unflatten(1, (-1, BLOCK)), -1)
    if full < values.shape[1]:
        out = torch.cat([out, reduce(values[:, full:], -1, keepdim=True)], 1)
    return out
