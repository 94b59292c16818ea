"""The LoRA kernels (engine_core/lora/triton_lora.py) against the plain per-slot path.

The plain reference is slots.py's own arithmetic, one slot at a time: (x A[s]^T) B[s]^T added
to the rows of slot s. The kernels' torch references (graph-safe, fixed shapes) and the real
Triton kernels, run by Triton's interpreter on the CPU, must give it for mixed slots, base rows,
ranks below the slot's, one slot for every row, in float32 and bfloat16.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_core.lora import triton_lora
from engine_core.lora.triton_lora import LoRAKernels

# (tokens, in, parts * R, out, slots)
SHAPES = [(7, 40, 24, 56, 3), (1, 300, 16, 130, 2), (33, 64, 48, 96, 4)]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def case(tokens: int, width_in: int, n: int, width_out: int, num_slots: int,
         dtype: torch.dtype, pattern: str, seed: int = 0):
    """x, A, B, each token's slot and y (the base product's output); slot 1 holds an adapter
    of a lower rank (its last columns zero, as slots.py loads it)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width_in, generator=g).to(dtype)
    a = (torch.randn(num_slots, n, width_in, generator=g) / width_in ** 0.5).to(dtype)
    b = torch.randn(num_slots, width_out, n, generator=g).to(dtype)
    a[1, n // 2:] = 0
    b[1, :, n // 2:] = 0
    if pattern == "mixed":  # every slot and base rows, interleaved
        slots = (torch.arange(tokens) + 1) % (num_slots + 1) - 1
    elif pattern == "one":
        slots = torch.full((tokens,), num_slots - 1)
    else:  # "base"
        slots = torch.full((tokens,), -1)
    y = torch.randn(tokens, width_out, generator=g).to(dtype)
    return x, a, b, slots.int(), y


def plain(x, a, b, slots, y) -> torch.Tensor:
    """slots.py's plain path: per slot present, its rows' delta added."""
    out = y.clone().float()
    for s in slots.unique().tolist():
        if s < 0:
            continue
        rows = (slots == s).nonzero().squeeze(1)
        delta = (x[rows].float() @ a[s].float().t()) @ b[s].float().t()
        out.index_add_(0, rows, delta)
    return out


def check(kernels: LoRAKernels, dtype: torch.dtype) -> None:
    for shape in SHAPES:
        for pattern in ("mixed", "one", "base"):
            x, a, b, slots, y = case(*shape, dtype, pattern)
            want = plain(x, a, b, slots, y)
            got = y.clone()
            kernels.expand(kernels.shrink(x, a, slots), b, slots, got)
            scale = want.abs().max().item()
            error = (got.float() - want).abs().max().item() / scale
            assert error <= TOLERANCE[dtype], (shape, pattern, dtype, error)
            if pattern == "base":
                assert torch.equal(got, y)  # base rows untouched, bit for bit
            else:
                assert not torch.equal(got, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_references_equal_the_plain_path(dtype):
    check(triton_lora.REFERENCE, dtype)


def test_a_wrong_slot_is_caught():
    """The check fails a kernel that reads the wrong adapter (so it can fail at all)."""
    def shifted(x, a, slots):
        return triton_lora.shrink_reference(x, a.roll(1, 0), slots)

    with pytest.raises(AssertionError):
        check(LoRAKernels(shifted, triton_lora.expand_reference), torch.float32)


INTERPRETED = """
import torch
from engine_core.lora import triton_lora
from tests.unit.engine_core.lora.test_triton_lora import check
for dtype in (torch.float32, torch.bfloat16):
    check(triton_lora.TRITON, dtype)
print("interpreted ok")
"""


def test_triton_kernels_in_the_interpreter():
    """The real kernels, jitted as the engine jits them, in Triton's interpreter (a fresh
    process: the interpreter must be on before Triton is first imported)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).parents[4])
    assert done.returncode == 0 and "interpreted ok" in done.stdout, done.stderr[-3000:]


def signatures(dtype: str) -> dict[str, tuple[dict[str, str], dict[str, object]]]:
    """Each kernel's argument types and constexprs for a Llama-3.2-1B QKV product, rank 16."""
    shrink = {"x_ptr": f"*{dtype}", "a_ptr": f"*{dtype}", "slots_ptr": "*i32",
              "out_ptr": "*fp32", "x_row": "i32", "a_slot": "i32", "width_in": "i32",
              "n": "i32"}
    expand = {"t_ptr": "*fp32", "b_ptr": f"*{dtype}", "slots_ptr": "*i32",
              "y_ptr": f"*{dtype}", "y_row": "i32", "b_slot": "i32", "width_out": "i32",
              "n": "i32"}
    return {"shrink": (shrink, {"BLOCK_N": triton_lora.SHRINK_N,
                                "BLOCK_K": triton_lora.SHRINK_K}),
            "expand": (expand, {"BLOCK_OUT": triton_lora.EXPAND_OUT, "BLOCK_N": 64})}


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("name", ["shrink", "expand"])
def test_the_kernels_compile_for_hopper(dtype: str, name: str):
    """Triton compiles each kernel for sm_90 (an H100/H200) to PTX and a cubin, no GPU here."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, fixed = triton_lora.KERNELS[name]
    signature, constexprs = signatures(dtype)[name]
    signature = {**signature, **{c: "constexpr" for c in constexprs}}
    source = ASTSource(triton.jit(fn, do_not_specialize=fixed), signature, constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert ".target sm_90" in compiled.asm["ptx"] and compiled.asm.get("cubin")
