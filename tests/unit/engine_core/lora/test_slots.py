"""slots.py's step state without a model: the kernels' slot buffer (one copy a step, padded rows
base rows) and the plain path's one-hot products against the per-slot ones."""

from __future__ import annotations

import numpy as np
import torch

from engine_core.lora.adapters import LoRAAdapter
from engine_core.lora.slots import LoRAContext, ProductSlots
from engine_core.lora.triton_lora import REFERENCE

CPU = torch.device("cpu")


def test_the_slot_buffer_holds_the_step_and_base_rows_past_it():
    context = LoRAContext(CPU, REFERENCE, max_tokens=8)
    context.set(np.array([0, 2, 1, 2, -1, 0]))
    context.set(np.array([1, 1, 0]))  # a smaller step after a larger one
    assert context.slots.tolist() == [1, 1, 0, -1, -1, -1, -1, -1]
    context.set(np.array([2, 0]))  # the other staging copy, the same device buffer
    assert context.slots.tolist() == [2, 0, -1, -1, -1, -1, -1, -1]


def test_one_hot_products_equal_the_per_slot_path():
    g = torch.Generator().manual_seed(0)
    product = ProductSlots((("q_proj", (0, 6)), ("v_proj", (6, 4))), slots=3, rank=4,
                           width_in=12, width_out=10, dtype=torch.float32, device=CPU)
    product.a.copy_(torch.randn(product.a.shape, generator=g))
    product.b.copy_(torch.randn(product.b.shape, generator=g))
    token_slots = np.array([1, -1, 0, 1, 1, -1, 0])
    x = torch.randn(len(token_slots), 12, generator=g)
    y = torch.randn(len(token_slots), 10, generator=g)
    want = y.clone()
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            want[row] += product.delta(int(slot), x[row:row + 1])[0]
    context = LoRAContext(CPU)
    context.set(token_slots)
    assert context.one_hot is not None and context.one_hot.shape == (7, 2)  # slots 0..1 only
    got = y.clone()
    product.add_mixed(x, context.one_hot, got)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # slot 1 loaded again (q only): B of every slot side by side must follow
    adapter = LoRAAdapter("other", 4, {(0, "q_proj"): (torch.randn(4, 12, generator=g),
                                                       torch.randn(6, 4, generator=g))})
    product.load(1, 0, adapter)
    want = y.clone()
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            want[row] += product.delta(int(slot), x[row:row + 1])[0]
    got = y.clone()
    product.add_mixed(x, context.one_hot, got)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], y[1])  # a base row untouched
