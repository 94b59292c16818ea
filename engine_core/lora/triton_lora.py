"""The LoRA products of a step with adapters mixed, as Triton kernels (BGMV style), and their
torch references.

Every token reads its adapter's slot from a per-token int32 tensor on the device (-1: a row of
the base model, no delta), so a step's launches depend on its token count alone: a CUDA graph
captured once replays whichever adapters the slots hold (slots.py copies an adapter into the
fixed slot buffers, never reallocates them).

- `shrink`: t = x A[slot]^T, x [T, in], A [slots, N, in] -> t [T, N] in float32 (N: the
  product's parts times --max-lora-rank). One program per (token, block of N), looping over
  `in` in tiles: each token reads its own slot's A rows.
- `expand`: y += t B[slot]^T, t [T, N], B [slots, out, N], y [T, out] in place. One program per
  (token, block of out columns), the whole rank in one tile; base rows store nothing.

Ranks below --max-lora-rank and products an adapter leaves out are zeros in the slot buffers,
so they cost the same as full ones (one launch shape). The sums run in float32; y is rounded
once. Jitted on first use; the module imports without Triton (the references run anywhere).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Protocol, no_type_check

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernels are only jitted where Triton is installed
    triton = tl = None  # type: ignore[assignment]

SHRINK_N = 16  # shrink: rank columns per program
SHRINK_K = 256  # shrink: input columns per iteration
EXPAND_OUT = 128  # expand: output columns per program


class Shrink(Protocol):
    def __call__(self, x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        ...


class Expand(Protocol):
    def __call__(self, t: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                 y: torch.Tensor) -> None:
        ...


class LoRAKernels(NamedTuple):
    """The pair a graph-safe `LoRALinear` runs (slots.py)."""

    shrink: Shrink
    expand: Expand


def available() -> bool:
    return triton is not None


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


# -- the references -------------------------------------------------------------------------
def shrink_reference(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """What `shrink` computes, in torch ops of fixed shapes (no host sync): each token's
    slot's A gathered, one batched product, base rows zero."""
    index = slots.long().clamp(min=0)
    t = torch.bmm(a.index_select(0, index).float(), x.float().unsqueeze(2)).squeeze(2)
    return t * (slots >= 0).unsqueeze(1)


def expand_reference(t: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                     y: torch.Tensor) -> None:
    """What `expand` computes, in torch ops of fixed shapes: y += t B[slot]^T where slot >= 0."""
    index = slots.long().clamp(min=0)
    delta = torch.bmm(b.index_select(0, index).float(), t.unsqueeze(2)).squeeze(2)
    delta = delta * (slots >= 0).unsqueeze(1)
    y.copy_((y.float() + delta).to(y.dtype))


REFERENCE = LoRAKernels(shrink_reference, expand_reference)


# -- the kernels' launches ------------------------------------------------------------------
def shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    tokens, width_in = x.shape
    n = a.shape[1]
    out = torch.empty(tokens, n, dtype=torch.float32, device=x.device)
    if tokens:
        assert x.stride(1) == 1 and a.is_contiguous()
        _jitted("shrink")[(tokens, triton.cdiv(n, SHRINK_N))](
            x, a, slots, out, x.stride(0), a.stride(0), width_in, n,
            BLOCK_N=SHRINK_N, BLOCK_K=SHRINK_K)
    return out


def expand(t: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor) -> None:
    tokens, width_out = y.shape
    if tokens:
        n = b.shape[2]
        assert y.stride(1) == 1 and t.is_contiguous() and b.is_contiguous()
        _jitted("expand")[(tokens, triton.cdiv(width_out, EXPAND_OUT))](
            t, b, slots, y, y.stride(0), b.stride(0), width_out, n,
            BLOCK_OUT=EXPAND_OUT, BLOCK_N=_pow2(n))


TRITON = LoRAKernels(shrink, expand)


def device_kernels() -> LoRAKernels:
    """The kernels the CUDA path runs (a test puts the references in their place)."""
    return TRITON


# -- the kernels ----------------------------------------------------------------------------
@no_type_check
def shrink_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, x_row, a_slot, width_in, n,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if slot >= 0:
        rows = a_ptr + slot * a_slot + cols[:, None] * width_in
        for k0 in range(0, width_in, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < width_in
            x = tl.load(x_ptr + tok * x_row + k, mask=k_ok, other=0.0).to(tl.float32)
            a = tl.load(rows + k[None, :], mask=(cols[:, None] < n) & k_ok[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(out_ptr + tok * n + cols, acc, mask=cols < n)


@no_type_check
def expand_kernel(t_ptr, b_ptr, slots_ptr, y_ptr, y_row, b_slot, width_out, n,
                  BLOCK_OUT: tl.constexpr, BLOCK_N: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    if slot >= 0:
        cols = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        r = tl.arange(0, BLOCK_N)
        ok = cols < width_out
        t = tl.load(t_ptr + tok * n + r, mask=r < n, other=0.0)
        b = tl.load(b_ptr + slot * b_slot + cols[:, None] * n + r[None, :],
                    mask=ok[:, None] & (r[None, :] < n), other=0.0).to(tl.float32)
        delta = tl.sum(b * t[None, :], axis=1)
        at = y_ptr + tok * y_row + cols
        y = tl.load(at, mask=ok, other=0.0).to(tl.float32)
        tl.store(at, (y + delta).to(y_ptr.dtype.element_ty), mask=ok)


KERNELS: dict[str, tuple[Any, list[str]]] = {
    # name: (the kernel, its integer arguments kept out of Triton's specialization)
    "shrink": (shrink_kernel, []),
    "expand": (expand_kernel, []),
}


@functools.cache
def _jitted(name: str) -> Any:
    """The jitted kernel, once per process."""
    fn, fixed = KERNELS[name]
    return triton.jit(fn, do_not_specialize=fixed)
