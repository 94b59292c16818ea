"""What every model file is built from: the platform's ops and attention (`ModelKit`), the
RMSNorm weights, and a product written into a given buffer (for the piecewise CUDA graphs,
engine_core/worker/piecewise.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from engine_core.layers.ops import LayerOps
from engine_core.layers.parallel import TensorParallel

# (layer, q [T, H, D], k and v [T, Hkv, D] already in the cache, scale, the step's attention
# metadata, out [T, H, D] or None) -> the attention [T, H, D]: attention.attend (the CPU,
# portable) or attention_cuda.attend
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float, Any,
                     torch.Tensor | None], torch.Tensor]


class ModelKit(NamedTuple):
    """The device's implementations a model's layers run on (the Platform chooses them), and
    the model's share of a tensor-parallel group (None: the whole model, on one device)."""

    ops: LayerOps
    attend: AttendFn
    tp: TensorParallel | None = None


class Slice(NamedTuple):
    """A rank's part of a checkpoint tensor: `size` entries from `start` along `dim` (a size of
    0: none, the parameter stays zeros, as a row-parallel bias off rank 0)."""

    dim: int
    start: int
    size: int


class Part(NamedTuple):
    """A checkpoint's projection loaded as part `shard` of a merged product (`target`, whose
    parts' output sizes are `sizes`, in order)."""

    target: str
    shard: int
    sizes: tuple[int, ...]

    @property
    def rows(self) -> tuple[int, int]:
        """(offset, size) of its rows in the merged weight."""
        return sum(self.sizes[:self.shard]), self.sizes[self.shard]


class RMSNorm(nn.Module):
    """An RMSNorm's weight and epsilon; the norm itself is the kit's (`LayerOps`)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width), requires_grad=False)
        self.eps = eps


def linear_into(linear: nn.Module, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """linear(x), written into `out` when given (an nn.Linear's product goes there directly,
    as F.linear computes it; any other linear's is copied)."""
    if out is None:
        result: torch.Tensor = linear(x)
        return result
    if type(linear) is nn.Linear:
        if linear.bias is None:
            return torch.mm(x, linear.weight.t(), out=out)
        return torch.addmm(linear.bias, x, linear.weight.t(), out=out)
    return out.copy_(linear(x))
