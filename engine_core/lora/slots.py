"""The active adapters on the device, and the layer that applies them.

`--max-loras` slots, each able to hold one adapter of rank up to `--max-lora-rank`. For each
decoder layer and each of its four products (the merged QKV and gate/up products, the output
and down products) a slot holds the adapters' matrices of that product's parts side by side:
A as [parts * R, in] and B as [out, parts * R], part j's rank-r matrices at columns
[j R, j R + r) and at its output rows, zeros elsewhere (R = --max-lora-rank). So one product
of any adapter is two matrix products, `(x A^T) B^T`, whatever its parts and rank, and loading
an adapter is copying into fixed buffers (what CUDA graphs would read).

`LoRALinear` wraps a product's linear: its output plus, for the rows of each slot in the step
(`LoRAContext`, set once per step from the requests' slots), that slot's delta. Rows of the
base model (slot -1) get nothing. This is the plain path (the CPU's, and the GPU's for now):
one gather and two products per slot present in the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from engine_core.lora.adapters import LoRAAdapter
from engine_core.models.parts import Part

# a product's parts: (checkpoint name, its output rows (offset, size)) in the merged product
Parts = tuple[tuple[str, tuple[int, int]], ...]


class LoRAContext:
    """The step's rows of each active slot: set by the runner before each forward."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.groups: list[tuple[int, torch.Tensor | None]] = []  # (slot, rows; None: all)

    def set(self, token_slots: np.ndarray) -> None:
        """Each of the step's tokens' slot (-1: the base model)."""
        slots = np.unique(token_slots)
        slots = slots[slots >= 0]
        if len(slots) == 1 and (token_slots == slots[0]).all():
            self.groups = [(int(slots[0]), None)]
            return
        self.groups = [(int(s), torch.from_numpy(np.flatnonzero(token_slots == s)).to(
            self.device)) for s in slots]


class ProductSlots:
    """One product's matrices in every slot."""

    def __init__(self, parts: Parts, slots: int, rank: int, width_in: int, width_out: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.parts, self.rank = parts, rank
        self.a = torch.zeros(slots, len(parts) * rank, width_in, dtype=dtype, device=device)
        self.b = torch.zeros(slots, width_out, len(parts) * rank, dtype=dtype, device=device)

    def load(self, slot: int, layer: int, adapter: LoRAAdapter) -> None:
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


class LoRALinear(nn.Module):
    """A product's linear (`base`, whatever form the platform gave it) plus the step's
    adapters' deltas."""

    def __init__(self, base: nn.Module, slots: ProductSlots, context: LoRAContext) -> None:
        super().__init__()
        self.base, self.slots, self.context = base, slots, context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        for slot, rows in self.context.groups:
            if rows is None:
                y = y + self.slots.delta(slot, x)
            else:
                y.index_add_(0, rows, self.slots.delta(slot, x.index_select(0, rows)))
        return y


class LoRASlots:
    """Every product's slots in a decoder of Tandem's own model files, its linears wrapped."""

    def __init__(self, decoder: nn.Module, packed: dict[str, Part], slots: int, rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_slots, self.rank = slots, rank
        self.context = LoRAContext(device)
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
