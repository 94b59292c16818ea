"""The decoder layers' small ops as Triton kernels, on CUDA (`TritonOps`, ops.py's API).

One launch each, one program per row (per token):
- `rms_norm_kernel`: RMSNorm, with the residual add folded in (the sum stored back into the
  residual stream, the norm over the input's memory);
- `silu_mul_kernel`: SiLU(gate) × up of the merged gate-up product;
- `rope_cache_kernel`: the rotary embedding of every query and key head of a token (after
  Qwen3's per-head norms, where the model has them), in place in the packed QKV rows, and the
  key and value rows written to their paged-cache slot: what transformers runs as some twenty
  ops and the CUDA path as two kernels more.

The arithmetic is transformers' own, rounded where it rounds: statistics in float32, each
product and sum brought back to the model's dtype where transformers' bf16 ops would be (so a
bf16 step gives transformers' values, not merely close ones); in float32 every rounding is a
no-op. Why Triton rather than torch.compile: nothing to compile at start-up for each step
shape (one specialization per kernel, whatever the token count: the same rule as the
attention kernels, tests/engine/test_cuda_graphs.py), the same kernels inside and outside
CUDA graphs, and each kernel checked against `TorchOps` in Triton's interpreter on the CPU.
Jitted on first use; the module imports without Triton.
"""

from __future__ import annotations

import functools
from typing import Any, no_type_check

import torch

from engine_core.layers.ops import HeadShape, QKNorm, TorchOps
from engine_core.layers.rotary import RotaryTable
from engine_core.quant import fp8_kv

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernels are only jitted where Triton is installed
    triton = tl = None  # type: ignore[assignment]

SILU_BLOCK = 1024  # columns per program of silu_mul


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _warps(width: int) -> int:
    return 4 if width <= 2048 else 8 if width <= 8192 else 16


class TritonOps(TorchOps):
    """ops.py's API on the Triton kernels (TorchOps' for anything they do not cover)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        self._norm(x, None, weight, eps, out)
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        self._norm(x, residual, weight, eps, x)
        return x

    def _norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
              eps: float, out: torch.Tensor) -> None:
        rows, width = x.shape
        if rows == 0:
            return
        assert x.stride(1) == 1 and out.stride(1) == 1
        res = x if residual is None else residual
        _jitted("rms_norm")[(rows,)](
            x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), width, eps,
            HAS_RES=residual is not None, BLOCK=_pow2(width), num_warps=_warps(width))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
        if rows:
            assert gate_up.stride(1) == 1
            _jitted("silu_mul")[(rows, triton.cdiv(width, SILU_BLOCK))](
                gate_up, out, width, gate_up.stride(0), out.stride(0), BLOCK=SILU_BLOCK)
        return out

    def rope_and_cache(self, qkv: torch.Tensor, positions: torch.Tensor, table: RotaryTable,
                       shape: HeadShape, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slots: torch.Tensor, qk_norm: QKNorm | None = None,
                       scales: torch.Tensor | None = None) -> None:
        rows = qkv.shape[0]
        if rows == 0:
            return
        heads, kv_heads, dim = shape
        assert qkv.stride(1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
        q_weight = k_weight = table.cos  # unread stand-ins without q/k norms
        eps = 0.0
        if qk_norm is not None:
            q_weight, k_weight, eps = qk_norm
        fp8 = fp8_kv.is_fp8(k_cache)
        assert scales is not None or not fp8, "an fp8 KV cache needs its layer's scales"
        _jitted("rope_cache")[(rows,)](
            qkv, positions, table.cos, table.sin, k_cache, v_cache, slots, q_weight, k_weight,
            table.cos if scales is None else scales,  # an unread stand-in unless fp8
            qkv.stride(0), table.cos.stride(0), k_cache.stride(0), k_cache.stride(1), eps,
            HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=dim, HALF=dim // 2,
            PAD_H=_pow2(heads), PAD_KV=_pow2(kv_heads), PAD_HALF=_pow2(dim // 2),
            QK_NORM=qk_norm is not None, FP8=fp8, num_warps=4)


# -- the kernels ------------------------------------------------------------------------------
def _device_fn(fn: Any) -> Any:
    """A helper the kernels call (jitted where Triton is installed)."""
    return triton.jit(fn) if triton is not None else fn


@_device_fn
@no_type_check
def _rounded(x, dtype):
    """x (float32) as the model's dtype would hold it, back in float32."""
    return x.to(dtype).to(tl.float32)


@_device_fn
@no_type_check
def _fp8(x, scale):
    """x / scale in float32, saturated at e4m3's ±448 (the cast to e4m3 is the store's)."""
    y = x.to(tl.float32) / scale
    return tl.minimum(tl.maximum(y, -448.0), 448.0)


@no_type_check
def rms_norm_kernel(x_ptr, r_ptr, w_ptr, o_ptr, x_row, r_row, o_row, width, eps,
                    HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    dtype = o_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_row + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        x = _rounded(x + tl.load(r_ptr + row * r_row + cols, mask=ok, other=0.0).to(tl.float32),
                     dtype)
        tl.store(r_ptr + row * r_row + cols, x.to(dtype), mask=ok)
    var = tl.sum(x * x, axis=0) / width
    y = _rounded(x * tl.rsqrt(var + eps), dtype)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * o_row + cols, (w * y).to(dtype), mask=ok)


@no_type_check
def silu_mul_kernel(x_ptr, o_ptr, width, x_row, o_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    dtype = o_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * x_row + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_row + width + cols, mask=ok, other=0.0).to(tl.float32)
    act = _rounded(gate * tl.sigmoid(gate), dtype)
    tl.store(o_ptr + row * o_row + cols, (act * up).to(dtype), mask=ok)


@_device_fn
@no_type_check
def _head_norm(a, b, w_ptr, i, i_ok, eps, HALF: tl.constexpr, HEAD_DIM: tl.constexpr, dtype):
    """RMSNorm of each head [heads, HALF] x 2 halves (a, b), weights w[i] and w[HALF + i]."""
    var = (tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / HEAD_DIM
    inv = tl.rsqrt(var + eps)[:, None]
    wa = tl.load(w_ptr + i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    wb = tl.load(w_ptr + HALF + i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    return (_rounded(wa * _rounded(a * inv, dtype), dtype),
            _rounded(wb * _rounded(b * inv, dtype), dtype))


@_device_fn
@no_type_check
def _rotate(a, b, cos, sin, dtype):
    """transformers' `x * cos + rotate_half(x) * sin` on halves (a, b), rounded as it is."""
    ra = _rounded(_rounded(a * cos, dtype) + _rounded(-b * sin, dtype), dtype)
    rb = _rounded(_rounded(b * cos, dtype) + _rounded(a * sin, dtype), dtype)
    return ra, rb


@no_type_check
def rope_cache_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slots_ptr, qw_ptr,
                      kw_ptr, scales_ptr, qkv_row, table_row, c_slot, c_head, eps,
                      HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      HALF: tl.constexpr, PAD_H: tl.constexpr, PAD_KV: tl.constexpr,
                      PAD_HALF: tl.constexpr, QK_NORM: tl.constexpr, FP8: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    dtype = qkv_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    i = tl.arange(0, PAD_HALF)
    i_ok = i < HALF
    cos = _rounded(tl.load(cos_ptr + pos * table_row + i, mask=i_ok, other=0.0), dtype)[None, :]
    sin = _rounded(tl.load(sin_ptr + pos * table_row + i, mask=i_ok, other=0.0), dtype)[None, :]
    row = qkv_ptr + tok * qkv_row
    # the query heads, in place
    h = tl.arange(0, PAD_H)[:, None]
    ok = (h < HEADS) & i_ok[None, :]
    at = row + h * HEAD_DIM + i[None, :]
    a = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(at + HALF, mask=ok, other=0.0).to(tl.float32)
    if QK_NORM:
        a, b = _head_norm(a, b, qw_ptr, i, i_ok, eps, HALF, HEAD_DIM, dtype)
    a, b = _rotate(a, b, cos, sin, dtype)
    tl.store(at, a.to(dtype), mask=ok)
    tl.store(at + HALF, b.to(dtype), mask=ok)
    # the key heads, in place and into the cache
    h = tl.arange(0, PAD_KV)[:, None]
    ok = (h < KV_HEADS) & i_ok[None, :]
    at = row + HEADS * HEAD_DIM + h * HEAD_DIM + i[None, :]
    a = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(at + HALF, mask=ok, other=0.0).to(tl.float32)
    if QK_NORM:
        a, b = _head_norm(a, b, kw_ptr, i, i_ok, eps, HALF, HEAD_DIM, dtype)
    a, b = _rotate(a, b, cos, sin, dtype)
    tl.store(at, a.to(dtype), mask=ok)
    tl.store(at + HALF, b.to(dtype), mask=ok)
    cache = slot * c_slot + h * c_head + i[None, :]
    a, b = a.to(dtype), b.to(dtype)  # the rotated key as the model's dtype holds it
    at = row + (HEADS + KV_HEADS) * HEAD_DIM + h * HEAD_DIM + i[None, :]
    va = tl.load(at, mask=ok, other=0.0)
    vb = tl.load(at + HALF, mask=ok, other=0.0)
    if FP8:  # x / scale, saturated, as e4m3 (fp8_kv.quantize)
        k_scale = tl.load(scales_ptr)
        v_scale = tl.load(scales_ptr + 1)
        a, b = _fp8(a, k_scale), _fp8(b, k_scale)
        va, vb = _fp8(va, v_scale), _fp8(vb, v_scale)
    tl.store(kc_ptr + cache, a.to(kc_ptr.dtype.element_ty), mask=ok)
    tl.store(kc_ptr + cache + HALF, b.to(kc_ptr.dtype.element_ty), mask=ok)
    # the value heads into the cache, as they are (or quantized)
    tl.store(vc_ptr + cache, va.to(vc_ptr.dtype.element_ty), mask=ok)
    tl.store(vc_ptr + cache + HALF, vb.to(vc_ptr.dtype.element_ty), mask=ok)


KERNELS: dict[str, tuple[Any, list[str]]] = {
    # name: (the kernel, its integer arguments kept out of Triton's specialization: those that
    # vary with the step)
    "rms_norm": (rms_norm_kernel, []),
    "silu_mul": (silu_mul_kernel, []),
    "rope_cache": (rope_cache_kernel, []),
}


@functools.cache
def _jitted(name: str) -> Any:
    """The jitted kernel, once per process."""
    fn, fixed = KERNELS[name]
    return triton.jit(fn, do_not_specialize=fixed)
