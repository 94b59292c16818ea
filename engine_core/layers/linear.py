"""The decoder's linear layers in the product form this machine runs fastest.

Each choice is measured on the machine rather than assumed (docs/benchmarks.md, "Decoder
linear layers"):
- the orientation for many rows (prefill): `F.linear(x, W)` reads a [out, in] weight; some
  CPUs' BLAS runs `x @ W_t` with the weight stored [in, out] much faster. The Platform asks
  `transposed_is_faster()` once, on a decoder-sized product, before the model loads, and
  `transpose_linears()` swaps the decoder's `nn.Linear`s for `TransposedLinear`s when it wins.
- the kernel for few rows (a decode step): there the product is as fast as the weight streams
  from memory, and the compiled kernel (csrc/kernels.c) reading a copy packed in 16-column
  panels, prefetching ahead, streams it faster than BLAS does. Every linear gets such a copy
  (`DecoderLinear`: at most PANEL_ROWS rows go to the kernel) when one pass over the real
  decoder's weights measures faster that way (`panels_are_faster`) and memory holds the copy.
- the threads: on a small box torch runs on one thread and a step that the ThreadPolicy gives
  more shares each product out over a ChunkPool, by panels, columns or rows, a part at a
  time taken on demand, so a core a frontend holds delays one part, not every product.
The LM head has its own kernels (lm_head.py) and is left alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.layers import native
from engine_core.layers.chunk_pool import ChunkPool
from shared.machine import available_memory

log = logging.getLogger(__name__)

PROBE_ROWS = 16  # a decode step's rows
PROBE_SHAPE = (1024, 4096)  # (in, out): an MLP projection of a small served model
MARGIN = 0.9  # a layout or kernel must be at least 10% faster to be chosen
PANEL_ROWS = 32  # rows up to which the panel kernel streams faster than BLAS (benchmarks.md)
PARTS_PER_WORKER = 4  # parts of a product per thread at most, when a step runs on several
MIN_PART_PANELS = 16  # panels (256 columns) per part at least
MIN_SHARED_ROWS = 32  # rows from which a product without panels is shared out at all
# A product shared by rows streams the whole weight once per part, so few rows are shared by
# columns instead (each thread streams its share), and by rows in one part per thread unless
# every part can have MIN_PART_ROWS: on the 0.5B shape, two threads, a pass over the decoder's
# products of 64 rows by columns 287 ms against 537 by rows in parts of 32; of 144 rows by rows
# a part a thread 415 against 930 in four parts (docs/benchmarks.md).
COLUMNS_BELOW = 128
MIN_PART_ROWS = 256


class TransposedLinear(nn.Module):
    """`nn.Linear` with its weight kept as [in, out]: `x @ weight_t (+ bias)`."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(),
                                     requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.bias is None:
            out = torch.mm(rows, self.weight_t)
        else:
            out = torch.addmm(self.bias, rows, self.weight_t)
        return out.view(*x.shape[:-1], self.out_features)


def transpose_linears(module: nn.Module) -> int:
    """Replace every `nn.Linear` under `module` by a TransposedLinear; return how many."""
    swapped = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            setattr(module, name, TransposedLinear(child))
            swapped += 1
        else:
            swapped += transpose_linears(child)
    return swapped


def transposed_is_faster(dtype: torch.dtype = torch.float32, repeats: int = 7) -> bool:
    """Whether `x @ W_t` beats `F.linear(x, W)` on this CPU, for a decode step's rows."""
    generator = torch.Generator().manual_seed(0)
    inner, outer = PROBE_SHAPE
    x = torch.randn(PROBE_ROWS, inner, generator=generator).to(dtype)
    weight = torch.randn(outer, inner, generator=generator).to(dtype)
    weight_t = weight.t().contiguous()
    linear = _best_time(lambda: F.linear(x, weight), repeats)
    transposed = _best_time(lambda: torch.mm(x, weight_t), repeats)
    return transposed < MARGIN * linear


def _best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: allocation and BLAS dispatch
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def prepare_linears(decoder: nn.Module, transposed: bool, kernels: native.Kernels | None,
                    panels: bool | None, pool: ChunkPool | None) -> str:
    """Put the decoder's linears in the form the Platform settled (`panels` None: measured
    here, where memory holds a second copy of them; `pool`: the threads a step may share its
    products over, None on a GPU); return it, in words, for the log."""
    if transposed:
        transpose_linears(decoder)
    layout = "transposed [in, out]" if transposed else "torch's [out, in]"
    if pool is None:
        return layout
    packed = kernels is not None and panels is not False and (panels or _room_for_a_copy(decoder))
    wrapped = wrap_linears(decoder, kernels if packed else None, pool)
    if packed and panels is None:
        packed = panels_are_faster(wrapped)
        log.info("decoder linears: the compiled kernel on packed panels measured %s for decode "
                 "steps here", "faster" if packed else "no faster")
        if not packed:
            for layer in wrapped:
                layer.drop_panels()
    if packed:
        layout += f", packed panels for steps of at most {PANEL_ROWS} rows"
    return layout + (f", products shared over up to {pool.workers} threads"
                     if pool.workers > 1 else "")


class DecoderLinear(nn.Module):
    """A linear layer (`wide`, as it was), with its weight also packed in panels for few rows
    (unless `kernels` is None), whose products are shared out over `pool`'s threads when the
    step uses more than one (`pool.active`)."""

    def __init__(self, wide: nn.Module, kernels: native.Kernels | None,
                 pool: ChunkPool) -> None:
        super().__init__()
        self.wide = wide
        self.kernels = kernels
        self.pool = pool
        weight_t = _weight_t(wide)
        self.in_features, self.out_features = weight_t.shape
        self.panels = (None if kernels is None else
                       nn.Parameter(native.pack_panels(weight_t), requires_grad=False))
        self.bias: torch.Tensor | None = wide.bias  # type: ignore[assignment]

    def drop_panels(self) -> None:
        self.panels = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32:
            return self.wide(x)
        if self.panels is not None and rows.shape[0] <= PANEL_ROWS:
            out = self._by_panels(rows.contiguous())
        elif self.pool.active > 1 and rows.shape[0] >= MIN_SHARED_ROWS:
            out = self._shared(rows.contiguous())
        else:
            return self.wide(x)
        return out.view(*x.shape[:-1], self.out_features)

    def _by_panels(self, rows: torch.Tensor) -> torch.Tensor:
        assert self.panels is not None and self.kernels is not None
        panels, kernels = self.panels, self.kernels
        count = panels.shape[0]
        out = torch.empty(rows.shape[0], count * native.PANEL, dtype=torch.float32)

        def part(first: int, end: int) -> None:
            kernels.panel_matmul(rows.data_ptr(), self.in_features, rows.shape[0],
                                 self.in_features, panels.data_ptr(), first, end,
                                 out.data_ptr(), out.shape[1])

        parts = min(PARTS_PER_WORKER * self.pool.active, count // MIN_PART_PANELS)
        if parts > 1 and self.pool.active > 1:
            self.pool.map(lambda i: part(i * count // parts, (i + 1) * count // parts), parts)
        else:
            part(0, count)
        if out.shape[1] != self.out_features:
            out = out[:, :self.out_features].contiguous()
        if self.bias is not None:
            out += self.bias
        return out

    def _shared(self, rows: torch.Tensor) -> torch.Tensor:
        """The product shared out over the pool: with fewer than COLUMNS_BELOW rows by
        columns, a part per thread; else by rows, a part per thread, or up to PARTS_PER_WORKER
        per thread where each still has MIN_PART_ROWS."""
        weight_t, bias = _weight_t(self.wide), self.bias
        n, width, active = rows.shape[0], self.out_features, self.pool.active
        out = torch.empty(n, width, dtype=rows.dtype)
        if n >= COLUMNS_BELOW:
            parts = active * max(1, min(PARTS_PER_WORKER, n // (active * MIN_PART_ROWS)))

            def part(i: int) -> None:
                a, b = i * n // parts, (i + 1) * n // parts
                if bias is None:
                    torch.mm(rows[a:b], weight_t, out=out[a:b])
                else:
                    torch.addmm(bias, rows[a:b], weight_t, out=out[a:b])
        else:
            parts = active

            def part(i: int) -> None:
                a, b = i * width // parts, (i + 1) * width // parts
                w = weight_t[:, a:b]
                out[:, a:b] = torch.mm(rows, w) if bias is None else torch.addmm(bias[a:b],
                                                                                  rows, w)
        self.pool.map(part, parts)
        return out


def linears(module: nn.Module) -> list[nn.Module]:
    """The plain linear layers under `module`, in the order a forward pass runs them."""
    return [m for m in module.modules() if type(m) in (nn.Linear, TransposedLinear)]


def wrap_linears(module: nn.Module, kernels: native.Kernels | None,
                 pool: ChunkPool) -> list[DecoderLinear]:
    """Wrap every float32 linear under `module` in a DecoderLinear; return them."""
    wrapped = []
    for name, child in list(module.named_children()):
        if type(child) in (nn.Linear, TransposedLinear):
            if _weight_t(child).dtype == torch.float32:
                wrapped.append(DecoderLinear(child, kernels, pool))
                setattr(module, name, wrapped[-1])
        else:
            wrapped += wrap_linears(child, kernels, pool)
    return wrapped


def panels_are_faster(wrapped: Sequence[DecoderLinear], passes: int = 3) -> bool:
    """Whether a decode step's products over all these layers, their real weights streamed
    from memory as in serving, run faster through the panel kernel than as they were: the
    two ways alternate `passes` times and the best pass of each counts (the first pass of each
    also evicts from the caches what packing left there). On one thread, as torch runs."""
    if not wrapped:
        return False
    generator = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(PROBE_ROWS, n, generator=generator)
              for n in {layer.in_features for layer in wrapped}}
    best = {"wide": float("inf"), "panels": float("inf")}
    pool = wrapped[0].pool
    active, pool.active = pool.active, 1
    try:
        with torch.inference_mode():
            for _ in range(passes):
                best["wide"] = min(best["wide"], _pass([w.wide for w in wrapped], inputs))
                best["panels"] = min(best["panels"], _pass(wrapped, inputs))
    finally:
        pool.active = active
    return best["panels"] < MARGIN * best["wide"]


def _room_for_a_copy(decoder: nn.Module) -> bool:
    size = sum(_weight_t(m).nbytes for m in linears(decoder))
    spare = available_memory()
    return spare is None or 2 * size <= spare


def _pass(layers: Sequence[nn.Module], inputs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for layer in layers:
        layer(inputs[_in_features(layer)])
    return time.perf_counter() - start


def _in_features(layer: nn.Module) -> int:
    return _weight_t(layer).shape[0]


def _weight_t(layer: nn.Module) -> torch.Tensor:
    """[in, out] (a view for an nn.Linear)."""
    if isinstance(layer, TransposedLinear):
        return layer.weight_t.detach()
    assert isinstance(layer, nn.Linear | DecoderLinear)
    return layer.weight.detach().t() if isinstance(layer, nn.Linear) else _weight_t(layer.wide)
