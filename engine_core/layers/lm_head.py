"""The LM head, computed one vocabulary chunk at a time together with the reductions that
sampling and logprobs need.

On a 128k vocabulary the head's GEMM and the vocab-wide passes after it (softmax, logsumexp,
top-k) are most of a CPU step. `LMHead.scan` produces the logits a chunk of columns at a time
and reduces every 256-column block while it is still in cache: its maximum, and the sums of
exp((logit - block max) * scale) that the logsumexp (scale 1) and the two-level inverse CDF in
sampler.py (scale 1 / T) are combined from. Argmax and top-k come afterwards from the leading
blocks (`gather_blocks`). Two backends fill the blocks, as the platform says
(engine_core/worker/platform.py): the compiled CPU kernels (`_NativeOps`: native.py, csrc/kernels.c,
the GEMM and the reductions fused) or torch ops (`_TorchOps`: on CUDA, with a bias or softcap,
or without a compiler). Their speeds are in docs/benchmarks.md.

The chunks are shared out to a few threads, each taking the next chunk when it is done (torch
ops and the ctypes kernels release the GIL): a core that another process (a frontend) is busy
on just takes fewer chunks, where OpenMP's static split would stall the whole op until that
core came back.

Under tensor parallelism (`tp`) each rank holds its rows of the vocabulary: the ranks' logits
are gathered into the whole vocabulary's first (one all-gather a scan), and the reductions run
on them with torch ops, so that what the samplers read is as at one rank.

A scan keeps the full logits (`Scan.logits`) for what needs them afterwards: the chosen
tokens' logits, their ranks (`count_above`) and rows with penalties or truncation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

import engine_core.layers.native as native_kernels
from engine_core.layers.chunk_pool import ChunkPool
from engine_core.layers.parallel import TensorParallel

BLOCK = 256  # inverse-CDF block; chunk boundaries fall on block boundaries
HeadBackend = Literal["native", "torch"]

class Scan(NamedTuple):
    """One pass of the LM head. `logits` stays where the model runs; the rest is on the CPU."""

    logits: torch.Tensor  # [R, V] float32 raw logits
    max: torch.Tensor  # [R]
    argmax: torch.Tensor  # [R] int64, first of equal maxima as torch.argmax
    lse: torch.Tensor | None  # [R] logsumexp, when asked
    top_vals: torch.Tensor | None  # [R, k] raw logits of each row's top k, when asked
    top_ids: torch.Tensor | None  # [R, k] int64
    block_sums: torch.Tensor | None  # [S, ceil(V / BLOCK)] of exp((logit - max) / T), sampled rows


class _Blocks(NamedTuple):
    """What the chunks fill in, per row and BLOCK-column block."""

    max: torch.Tensor  # [R, blocks]
    sum_a: torch.Tensor | None  # [R, blocks] sum exp((logit - block max) * scale_a[row])
    sum_b: torch.Tensor | None  # the same with scale_b (a sampled row's 1 / T)
    scale_a: torch.Tensor | None  # [R] 1 for the rows that want their logsumexp, else 0
    scale_b: torch.Tensor | None  # [R] 1 / T for sampled rows, else 0


class LMHead:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 softcap: float | None = None, *, kernels: native_kernels.Kernels | None = None,
                 workers: int = 1, chunk: int | None = None, tp: TensorParallel | None = None,
                 vocab: int | None = None,
                 announce: Callable[[torch.Tensor], None] | None = None) -> None:
        """weight: [vocab, hidden] as in nn.Linear (with `tp`: this rank's rows of a `vocab`
        wide head; `announce(hidden)`, on rank 0, tells the other ranks the rows it scans,
        so that they join the gather with `gather_logits`).

        `kernels` (the platform's compiled CPU kernels, `Platform.head_kernels`) run the head
        natively; without them, or with a bias or a softcap (which the kernels do not fuse),
        torch ops do. `workers` threads share the vocabulary, `chunk` columns at a time (None:
        the whole vocabulary in one task)."""
        self.vocab, self.hidden = weight.shape
        self.device = weight.device
        self._ops: _NativeOps | _TorchOps | _GatheredOps
        self.announce = announce
        if tp is not None:
            assert vocab is not None and bias is None and not softcap
            self.vocab = vocab
            self._ops = _GatheredOps(weight, tp, vocab)
        elif kernels is not None and bias is None and not softcap:
            self._ops = _NativeOps(weight, kernels)
        else:
            self._ops = _TorchOps(weight, bias, softcap)
        chunk = max(BLOCK, -(-(chunk or self.vocab) // BLOCK) * BLOCK)
        self.bounds = [(a, min(a + chunk, self.vocab)) for a in range(0, self.vocab, chunk)]
        self.pool = ChunkPool(workers, "lm-head")

    @property
    def backend(self) -> HeadBackend:
        return self._ops.backend

    def scan(self, hidden: torch.Tensor, *, lse: bool = False, top_k: int = 0,
             sample_rows: torch.Tensor | None = None,
             temperatures: torch.Tensor | None = None) -> Scan:
        """Logits of `hidden` [R, H] with every row's max and argmax; with `lse` the logsumexp,
        with `top_k` each row's top k; for `sample_rows` (indices, with their `temperatures`)
        the inverse CDF's block sums.

        Chunks only keep per-block maxima and sums (an order of magnitude cheaper than max with
        indices or top-k over the chunk); argmax and top-k are then found among the few blocks
        whose maxima lead: any of a row's k largest logits lies in one of its k highest blocks.
        """
        rows = hidden.shape[0]
        hidden = hidden.to(self.device, self._ops.input_dtype).contiguous()
        if isinstance(self._ops, _GatheredOps):
            if self.announce is not None:
                self.announce(hidden)
            logits = self._ops.gather(hidden)
        else:
            logits = torch.empty(rows, self._ops.width, dtype=torch.float32, device=self.device)
        temps = torch.ones(0, 1)
        if sample_rows is not None:
            assert temperatures is not None
            temps = temperatures.to(torch.float32)[:, None]
        blocks = self._blocks(rows, lse, sample_rows, temps)
        fill = self._ops.fill
        self.pool.map(lambda i: fill(hidden, logits, blocks, *self.bounds[i]), len(self.bounds))
        return self._combine(logits[:, :self.vocab], blocks, top_k, sample_rows, temps)

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype the head reads its hidden rows in."""
        return self._ops.input_dtype

    def gather_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """A tensor-parallel rank's part of rank 0's scan of `hidden`: every rank's logits,
        gathered."""
        assert isinstance(self._ops, _GatheredOps)
        return self._ops.gather(hidden.to(self.device, self._ops.input_dtype).contiguous())

    def count_above(self, scan: Scan, rows: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
        """How many logits of each of `rows` exceed its threshold (rank - 1 of a token)."""
        thr = thresholds.to(self.device, torch.float32).contiguous()
        return self._ops.count_above(scan.logits, rows, thr, self.bounds, self.pool)

    def _blocks(self, rows: int, lse: bool, sample_rows: torch.Tensor | None,
                temps: torch.Tensor) -> _Blocks:
        nblocks = -(-self.vocab // BLOCK)

        def new() -> torch.Tensor:
            return torch.zeros(rows, nblocks, dtype=torch.float32, device=self.device)

        scale_a = torch.ones(rows) if lse else None
        scale_b = None
        if sample_rows is not None and not (lse and bool((temps == 1.0).all())):
            scale_b = torch.zeros(rows)  # (with lse at T = 1, the draw uses sum_a)
            scale_b[sample_rows] = 1.0 / temps[:, 0]
        scales = [None if s is None else s.to(self.device) for s in (scale_a, scale_b)]
        return _Blocks(new(), new() if lse else None, None if scale_b is None else new(), *scales)

    def _combine(self, logits: torch.Tensor, blocks: _Blocks, top_k: int,
                 sample_rows: torch.Tensor | None, temps: torch.Tensor) -> Scan:
        block_max = blocks.max
        peak, best = block_max.max(1)  # the first block holding the max: torch.argmax's rule
        vals, cols = gather_blocks(logits, best[:, None])
        argmax = cols.gather(1, vals.argmax(-1, keepdim=True))[:, 0]
        lse = top_vals = top_ids = block_sums = None
        behind = block_max - peak[:, None]  # <= 0
        if blocks.sum_a is not None:
            lse = peak + (blocks.sum_a * behind.exp()).sum(1).log()
        if top_k:
            leading = block_max.topk(min(top_k, block_max.shape[1]), -1).indices
            vals, cols = gather_blocks(logits, leading)
            top_vals, j = vals.topk(top_k, -1)
            top_ids = cols.gather(1, j)
        if sample_rows is not None:
            rows = sample_rows.to(self.device)
            if blocks.sum_b is None:  # every temperature is 1: the logsumexp's sums serve
                block_sums = blocks.sum_a[rows] * behind[rows].exp()  # type: ignore[index]
            else:
                block_sums = blocks.sum_b[rows] * (behind[rows] / temps.to(self.device)).exp()
        cpu = [None if t is None else t.cpu()
               for t in (peak, argmax, lse, top_vals, top_ids, block_sums)]
        return Scan(logits, *cpu)  # type: ignore[arg-type]


class _NativeOps:
    """The compiled CPU kernels (native.py): the GEMM from a float32 copy of the weight packed
    in 16-column panels, each block's reductions fused in."""

    backend: HeadBackend = "native"
    input_dtype = torch.float32

    def __init__(self, weight: torch.Tensor, kernels: native_kernels.Kernels) -> None:
        self.hidden = weight.shape[1]
        self.kernels = kernels
        self.panels = native_kernels.pack_panels(weight.detach().t().float())
        self.width = self.panels.shape[0] * native_kernels.PANEL  # whole panels

    def fill(self, hidden: torch.Tensor, logits: torch.Tensor, blocks: _Blocks,
             a: int, b: int) -> None:
        ptr = native_kernels.ptr
        self.kernels.head_scan(
            ptr(hidden), hidden.stride(0), hidden.shape[0], self.hidden, ptr(self.panels),
            a, b, ptr(logits), logits.stride(0), BLOCK, ptr(blocks.max), blocks.max.stride(0),
            ptr(blocks.scale_a), ptr(blocks.sum_a), ptr(blocks.scale_b), ptr(blocks.sum_b))

    def count_above(self, logits: torch.Tensor, rows: torch.Tensor, thr: torch.Tensor,
                    bounds: list[tuple[int, int]], pool: ChunkPool) -> torch.Tensor:
        idx = rows.to(torch.int64).contiguous()
        ptr = native_kernels.ptr
        counts = torch.zeros(len(bounds), len(rows), dtype=torch.int64)

        def run(i: int) -> None:
            a, b = bounds[i]
            self.kernels.count_above(ptr(logits), logits.stride(0), ptr(idx), len(idx), ptr(thr),
                                     a, b, ptr(counts[i]))

        pool.map(run, len(bounds))
        return counts.sum(0)


class _TorchOps:
    """torch ops. On the CPU (without a bias) the GEMM reads a [hidden, vocab] float32 copy
    with torch.mm, faster than F.linear reads [vocab, hidden] (docs/benchmarks.md); elsewhere
    F.linear runs on the weight as it is."""

    backend: HeadBackend = "torch"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 softcap: float | None) -> None:
        self.weight, self.bias, self.softcap = weight.detach(), bias, softcap
        self.width = weight.shape[0]
        self.weight_t: torch.Tensor | None = None
        if weight.device.type == "cpu" and bias is None:
            self.weight_t = self.weight.t().contiguous().float()
        self.input_dtype = torch.float32 if self.weight_t is not None else self.weight.dtype

    def fill(self, hidden: torch.Tensor, logits: torch.Tensor, blocks: _Blocks,
             a: int, b: int) -> None:
        x = logits[:, a:b]
        if self.weight_t is not None:
            torch.mm(hidden, self.weight_t[:, a:b], out=x)
        else:
            bias = None if self.bias is None else self.bias[a:b]
            x.copy_(F.linear(hidden, self.weight[a:b], bias))
        if self.softcap:
            x.div_(self.softcap).tanh_().mul_(self.softcap)
        _reduce_blocks(x, blocks, a, b)

    def count_above(self, logits: torch.Tensor, rows: torch.Tensor, thr: torch.Tensor,
                    bounds: list[tuple[int, int]], pool: ChunkPool) -> torch.Tensor:
        # Most of the rows: count every row through views of the logits (the others against
        # +inf) rather than gather copies of most of them, chunk by chunk.
        total = logits.shape[0]
        every = 2 * len(rows) > total and len(set(rows.tolist())) == len(rows)
        on_device = rows.to(logits.device)
        picked: torch.Tensor | slice = on_device
        if every:
            thr = torch.full((total,), float("inf"), device=logits.device).index_copy_(
                0, on_device, thr)
            picked = slice(None)

        def one(i: int) -> torch.Tensor:
            a, b = bounds[i]
            return (logits[picked, a:b] > thr[:, None]).sum(-1)

        counts = torch.stack(pool.map(one, len(bounds)), 1).sum(1)
        return (counts[on_device] if every else counts).cpu()


class _GatheredOps(_TorchOps):
    """A rank's rows of a vocabulary-parallel head: its logits computed with torch ops and
    gathered with the other ranks' into the whole vocabulary's (`gather`, once a scan); the
    chunks then only reduce them."""

    def __init__(self, weight: torch.Tensor, tp: TensorParallel, vocab: int) -> None:
        super().__init__(weight, None, None)
        self.tp, self.width = tp, vocab

    def gather(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, vocab] float32: every rank's logits of `hidden` (the same rows on every rank)."""
        if self.weight_t is not None:
            local = torch.mm(hidden, self.weight_t)
        else:
            local = F.linear(hidden, self.weight).float()
        return self.tp.gather_columns(local, self.width)

    def fill(self, hidden: torch.Tensor, logits: torch.Tensor, blocks: _Blocks,
             a: int, b: int) -> None:
        _reduce_blocks(logits[:, a:b], blocks, a, b)


def _reduce_blocks(x: torch.Tensor, blocks: _Blocks, a: int, b: int) -> None:
    """Columns [a, b) of the logits (x) into `blocks`: each block's max and sums."""
    cols = slice(a // BLOCK, -(-b // BLOCK))
    block_max = blocks.max[:, cols]
    block_max.copy_(_per_block(x, torch.amax))
    for scale, sums in ((blocks.scale_a, blocks.sum_a), (blocks.scale_b, blocks.sum_b)):
        if scale is None or sums is None:
            continue
        picked = torch.nonzero(scale)[:, 0]
        if len(picked) == len(scale):
            sums[:, cols] = _block_sum_exp(x, block_max, scale[:, None])
        else:
            sums[picked, cols] = _block_sum_exp(x[picked], block_max[picked],
                                                scale[picked, None])


def gather_blocks(logits: torch.Tensor, blocks: torch.Tensor,
                  rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [R, n * BLOCK] of blocks [R, n] of each row (or of `rows` of `logits`), and their
    columns; columns past the vocabulary read -inf. Results are on `blocks`' device."""
    vocab = logits.shape[1]
    cols = (blocks[:, :, None] * BLOCK + torch.arange(BLOCK, device=blocks.device)).flatten(1)
    at = cols.clamp(max=vocab - 1).to(logits.device)
    vals = logits.gather(1, at) if rows is None else logits[rows.to(logits.device)[:, None], at]
    return vals.to(blocks.device).masked_fill_(cols >= vocab, -float("inf")), cols


def _block_sum_exp(x: torch.Tensor, block_max: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per BLOCK columns of x [R, n]: sum exp((x - block max) * scale) ([R, 1] scales)."""
    full = x.shape[1] // BLOCK * BLOCK
    nfull = full // BLOCK
    shifted = x[:, :full].unflatten(1, (-1, BLOCK)) - block_max[:, :nfull, None]
    if not bool((scale == 1.0).all()):
        shifted.mul_(scale[:, :, None])
    out = shifted.exp_().sum(-1)
    if full < x.shape[1]:
        tail = (x[:, full:] - block_max[:, nfull:]).mul_(scale).exp_().sum(-1, keepdim=True)
        out = torch.cat([out, tail], 1)
    return out


def _per_block(values: torch.Tensor, reduce: Callable[..., torch.Tensor]) -> torch.Tensor:
    """reduce (torch.sum, torch.amax) over consecutive BLOCK columns; a last partial block
    reduces what there is."""
    full = values.shape[1] // BLOCK * BLOCK
    out = reduce(values[:, :full].unflatten(1, (-1, BLOCK)), -1)
    if full < values.shape[1]:
        out = torch.cat([out, reduce(values[:, full:], -1, keepdim=True)], 1)
    return out
