"""The active adapters on the device, and the layer that applies them.

`--max-loras` slots, each able to hold one adapter of rank up to `--max-lora-rank`. For each
decoder layer and each of its four products (the merged QKV and gate/up products, the output
and down products) a slot holds the adapters' matrices of that product's parts side by side:
A as [parts * R, in] and B as [out, parts * R], part j's rank-r matrices at columns
[j R, j R + r) and at its output rows, zeros elsewhere (R = --max-lora-rank). So one product
of any adapter is two matrix products, `(x A^T) B^T`, whatever its parts and rank, and loading
an adapter is copying into fixed buffers (what CUDA graphs read).

`LoRALinear` wraps a product's linear: its output plus each row's adapter's delta. Rows of the
base model (slot -1) get nothing. Two paths, chosen once by the platform:
- the plain path (the CPU's): the step's slots found on the host (`LoRAContext`, set once per
  step); a step of one adapter runs its two products on every row, a step mixing several runs
  the shrink of every slot up to the highest present, masked by each row's one-hot slot, and one
  expand over them all (three ops a product, whatever the mix);
- the kernels' path (CUDA, graphs): each token's slot in a persistent int32 device buffer,
  filled by one copy per step (rows past the step's: -1), read by the shrink and expand kernels
  (triton_lora.py) on the device, so a captured graph replays any mix of adapters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from engine_core.lora.adapters import LoRAAdapter
from engine_core.lora.triton_lora import LoRAKernels
from engine_core.models.parts import Part

# a product's parts: (checkpoint name, its output rows (offset, size)) in the merged product
Parts = tuple[tuple[str, tuple[int, int]], ...]


class LoRAContext:
    """The step's tokens' slots, set by the runner before each forward: as row groups per slot
    (the plain path), or in the persistent device buffer `slots` (with `kernels`)."""

    def __init__(self, device: torch.device, kernels: LoRAKernels | None = None,
                 max_tokens: int = 0) -> None:
        self.device, self.kernels = device, kernels
        self.groups: list[tuple[int, torch.Tensor | None]] = []  # (slot, rows; None: all)
        # rows of several slots: each token's one-hot slot [T, slots] (base rows all zero)
        self.one_hot: torch.Tensor | None = None
        # the kernels' per-token slots (-1 past the step's tokens: graphs' padded rows are
        # base rows), and two pinned staging copies used in turn (an overlapped step fills one
        # while the copy out of the other may still be queued)
        pinned = device.type == "cuda"
        self.slots = torch.full((max_tokens if kernels else 0,), -1, dtype=torch.int32,
                                device=device)
        self._staging = [torch.full_like(self.slots, -1, device="cpu", pin_memory=pinned)
                         for _ in range(2)]
        self._turn = 0

    def set(self, token_slots: np.ndarray) -> None:
        """Each of the step's tokens' slot (-1: the base model)."""
        if self.kernels is not None:
            self._upload(token_slots)
            return
        slots = np.unique(token_slots)
        slots = slots[slots >= 0]
        self.groups, self.one_hot = [], None
        if len(slots) == 1 and (token_slots == slots[0]).all():
            self.groups = [(int(slots[0]), None)]
        elif len(slots):  # (one-hot products beat per-slot gathers: docs/benchmarks.md)
            width = int(slots[-1]) + 1
            one_hot = (token_slots[:, None] == np.arange(width)).astype(np.float32)
            self.one_hot = torch.from_numpy(one_hot).to(self.device)

    def _upload(self, token_slots: np.ndarray) -> None:
        tokens = len(token_slots)
        if tokens > len(self.slots):
            raise ValueError(f"a step of {tokens} tokens: the LoRA slot buffer holds "
                             f"{len(self.slots)}")
        staging = self._staging[self._turn]
        self._turn ^= 1
        stage = staging.numpy()
        stage[:tokens] = token_slots
        stage[tokens:] = -1
        self.slots.copy_(staging, non_blocking=staging.is_pinned())


class ProductSlots:
    """One product's matrices in every slot."""

    def __init__(self, parts: Parts, slots: int, rank: int, width_in: int, width_out: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.parts, self.rank = parts, rank
        self.a = torch.zeros(slots, len(parts) * rank, width_in, dtype=dtype, device=device)
        self.b = torch.zeros(slots, width_out, len(parts) * rank, dtype=dtype, device=device)
        self._b_wide: torch.Tensor | None = None  # B of every slot side by side [out, slots N]

    def load(self, slot: int, layer: int, adapter: LoRAAdapter) -> None:
        self._b_wide = None
        self.a[slot].zero_()
        self.b[slot].zero_()
        for j, (target, (offset, size)) in enumerate(self.parts):
            pair = adapter.weights.get((layer, target))
            if pair is None:
                continue
            a, b = pair
            r, lo = a.shape[0], j * self.rank
            self.a[slot, lo:lo + r].copy_(a)
            self.b[slot, offset:offset + size, lo:lo + r].copy_(b)

    def delta(self, slot: int, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.a[slot].t()) @ self.b[slot].t()

    def add_mixed(self, x: torch.Tensor, one_hot: torch.Tensor, y: torch.Tensor) -> None:
        """y += each row's slot's delta, for rows of slots [0, W) (`one_hot` [T, W]): the
        shrink of every slot, masked to each row's own, then one expand over all of them."""
        width, n = one_hot.shape[1], self.a.shape[1]
        t = x @ self.a[:width].reshape(width * n, -1).t()
        t.view(len(x), width, n).mul_(one_hot.to(t.dtype).unsqueeze(2))
        if self._b_wide is None:
            self._b_wide = self.b.permute(1, 0, 2).reshape(self.b.shape[1], -1)
        y.addmm_(t, self._b_wide[:, :width * n].t())


class LoRALinear(nn.Module):
    """A product's linear (`base`, whatever form the platform gave it) plus the step's
    adapters' deltas."""

    def __init__(self, base: nn.Module, slots: ProductSlots, context: LoRAContext) -> None:
        super().__init__()
        self.base, self.slots, self.context = base, slots, context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        kernels = self.context.kernels
        if kernels is not None:  # sizes from the host, slots from the device: graph-safe
            slots = self.context.slots[:x.shape[0]]
            kernels.expand(kernels.shrink(x, self.slots.a, slots), self.slots.b, slots, y)
            return y
        if self.context.one_hot is not None:
            self.slots.add_mixed(x, self.context.one_hot, y)
            return y
        for slot, rows in self.context.groups:
            if rows is None:
                y = y + self.slots.delta(slot, x)
            else:
                y.index_add_(0, rows, self.slots.delta(slot, x.index_select(0, rows)))
        return y


class LoRASlots:
    """Every product's slots in a decoder of Tandem's own model files, its linears wrapped."""

    def __init__(self, decoder: nn.Module, packed: dict[str, Part], slots: int, rank: int,
                 dtype: torch.dtype, device: torch.device, kernels: LoRAKernels | None = None,
                 max_tokens: int = 0) -> None:
        """`kernels`: the graph-safe path's, over steps of at most `max_tokens` tokens (the
        slot buffer's size, fixed); None: the plain path."""
        self.num_slots, self.rank = slots, rank
        self.context = LoRAContext(device, kernels, max_tokens)
        self.products: list[ProductSlots] = []
        self._layers: list[tuple[int, ProductSlots]] = []
        layers: Any = decoder.layers
        self.num_layers = len(layers)
        for i, layer in enumerate(layers):
            for owner, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
                base = getattr(owner, name)
                width_in, width_out = _widths(base)
                product = ProductSlots(_parts(name, packed, width_out), slots, rank, width_in,
                                       width_out, dtype, device)
                setattr(owner, name, LoRALinear(base, product, self.context))
                self._layers.append((i, product))

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` in `slot` (every product's matrices, zeros where it has none)."""
        for layer, product in self._layers:
            product.load(slot, layer, adapter)


def _parts(name: str, packed: dict[str, Part], width_out: int) -> Parts:
    merged = [(target, part.rows) for target, part in packed.items() if part.target == name]
    return tuple(merged) if merged else ((name, (0, width_out)),)


def _widths(linear: nn.Module) -> tuple[int, int]:
    """(in, out) of a linear in any of the forms the platform gives it (each keeps
    nn.Linear's `in_features` and `out_features`)."""
    return int(linear.in_features), int(linear.out_features)  # type: ignore[arg-type]


def token_slots(request_slots: Sequence[int], num_new: np.ndarray) -> np.ndarray:
    """Each of a step's tokens' slot, from its requests' slots and token counts."""
    return np.repeat(np.asarray(request_slots, dtype=np.int64), num_new)
