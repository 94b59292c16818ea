"""The decoder's linear layers in the product orientation this machine runs fastest.

`F.linear(x, W)` multiplies by a [out, in] weight read row by row. For the few rows of a
decode step, some CPUs' BLAS runs `x @ W_t` with the weight stored transposed ([in, out],
contiguous) much faster, and the gap depends on the CPU (docs/benchmarks.md, "Decoder linear
layers"). So the orientation is not assumed: `transposed_is_faster()` times both on a
decoder-sized product once at start-up (the Platform asks it), and `transpose_linears()`
swaps the decoder's `nn.Linear`s for `TransposedLinear`s when it wins. The LM head has its own
kernels (lm_head.py) and is left alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

PROBE_ROWS = 16  # a decode step's rows
PROBE_SHAPE = (1024, 4096)  # (in, out): an MLP projection of a small served model
MARGIN = 0.9  # the transposed layout must be at least 10% faster to be chosen


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
