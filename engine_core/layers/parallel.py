"""Tensor parallelism (Megatron's split) over a torch.distributed group: what each rank holds
of a layer and the collectives that put the ranks' parts back together.

A decoder layer's QKV and gate/up products are split by output columns (each rank its own
attention heads and its slice of the MLP's width, no communication), the output and down
products by input rows (each rank a partial sum, one all-reduce each); the embedding and the
LM head by vocabulary (each rank its rows of the table: the embedding's partial lookups are
summed by an all-reduce, the head's logits gathered by columns). With fewer KV heads than
ranks, each KV head is held by the ranks whose query heads read it. Nothing here runs at one
rank: a model without a `TensorParallel` takes the single-device path as it always has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F


class HeadSplit(NamedTuple):
    """A rank's attention heads: `heads` query heads from `first_head`, `kv_heads` KV heads
    from `first_kv_head` (of the checkpoint's)."""

    heads: int
    first_head: int
    kv_heads: int
    first_kv_head: int


def split_error(heads: int, kv_heads: int, intermediate: int, size: int) -> str | None:
    """Why a model of these shapes cannot be split over `size` ranks, or None."""
    if heads % size:
        return f"its {heads} attention heads do not divide by --tensor-parallel-size {size}"
    if kv_heads % size and size % kv_heads:
        return (f"its {kv_heads} KV heads neither divide by --tensor-parallel-size {size} nor "
                f"divide it")
    if intermediate % size:
        return (f"its MLP width {intermediate} does not divide by --tensor-parallel-size "
                f"{size}")
    return None


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in a tensor-parallel group (`group` None: torch.distributed's default
    group, which `size` ranks form)."""

    rank: int
    size: int
    group: Any = None

    def heads(self, heads: int, kv_heads: int) -> HeadSplit:
        per, kv_per = heads // self.size, max(1, kv_heads // self.size)
        # with fewer KV heads than ranks, rank r's query heads read KV head r // (N / Hkv)
        first_kv = (self.rank * kv_per if kv_heads >= self.size
                    else self.rank // (self.size // kv_heads))
        return HeadSplit(per, self.rank * per, kv_per, first_kv)

    def columns(self, total: int) -> tuple[int, int]:
        """(first, count) of this rank's equal share of `total` (which `size` divides)."""
        per = total // self.size
        return self.rank * per, per

    def vocab_rows(self, vocab: int) -> int:
        """Rows each rank's part of the embedding and LM head has: the vocabulary's share,
        rounded up (the last rank's tail rows are zeros)."""
        return -(-vocab // self.size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The embedding of `ids` from each rank's rows [rank * R, (rank + 1) * R) of the
        table (`weight`, R rows): the ids a rank does not hold look up zeros, the sum is the
        whole table's lookup."""
        rows = weight.shape[0]
        local = ids - self.rank * rows
        outside = (local < 0) | (local >= rows)
        out = F.embedding(local.masked_fill(outside, 0), weight)
        return self.all_reduce(out.masked_fill_(outside[:, None], 0.0))

    def gather_columns(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """Every rank's columns of x [R, C] side by side, the first `width` of them."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, 1)[:, :width]
