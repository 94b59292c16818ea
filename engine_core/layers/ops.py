"""The decoder layers' small ops, behind one API that each device implements its own way.

A decoder layer is four products (QKV, output, gate-up, down), the attention, and between them
a handful of elementwise ops: RMSNorm with the residual add folded in, SiLU(gate) × up, the
rotary embedding (with Qwen3's per-head q/k norms) and the write of the step's keys and values
into the paged cache. Run one torch op each, they are some thirty passes over memory a layer
(thirty kernels on a GPU); behind `LayerOps` they are four:

- `TorchOps`: plain torch ops, in transformers' own order and precision: the reference every
  other implementation is tested against, and the path of any device or dtype without a
  faster one;
- `NativeOps`: the CPU's compiled kernels (csrc/kernels.c, loaded by native.py), float32;
- `TritonOps` (triton_ops.py): one Triton kernel each on CUDA, the rotary embedding, the
  norms of Qwen3 and the KV-cache write in a single one.

Conventions shared by all three, which the models rely on: tensors are rows [tokens, width];
`add_rms_norm` adds `x` into `residual` in place (the residual stream) and returns the norm,
which may be written over `x`; `rope_and_cache` rotates q and k in place inside the packed
QKV rows and writes k and v to their cache slots.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from engine_core.layers import native
from engine_core.layers.rotary import RotaryTable
from engine_core.quant import fp8_kv


class HeadShape(NamedTuple):
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def qkv_width(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim


class QKNorm(NamedTuple):
    """Qwen3's RMSNorm of each query and key head before the rotary embedding."""

    q_weight: torch.Tensor  # [head_dim]
    k_weight: torch.Tensor
    eps: float


class LayerOps(Protocol):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of rows x [T, n] (x left as it is)."""
        ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """residual += x, in place; returns RMSNorm(residual), possibly in x's memory."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up [T, n] of gate_up [T, 2n], gate then up side by side."""
        ...

    def rope_and_cache(self, qkv: torch.Tensor, positions: torch.Tensor, table: RotaryTable,
                       shape: HeadShape, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slots: torch.Tensor, qk_norm: QKNorm | None = None,
                       scales: torch.Tensor | None = None) -> None:
        """qkv [T, (H + 2 Hkv) D] (q, k then v): q and k normed (with `qk_norm`) and rotated
        at `positions` in place; k and v written to the caches [slots, Hkv, D] at `slots`
        (quantized with the layer's `scales` row where the caches are fp8: quant/fp8_kv.py)."""
        ...


def split_qkv(qkv: torch.Tensor, shape: HeadShape
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views q [T, H, D], k and v [T, Hkv, D] of packed QKV rows."""
    heads, kv_heads, dim = shape
    rows = qkv.shape[0]
    q_end, k_end = heads * dim, (heads + kv_heads) * dim
    return (qkv[:, :q_end].view(rows, heads, dim), qkv[:, q_end:k_end].view(rows, kv_heads, dim),
            qkv[:, k_end:].view(rows, kv_heads, dim))


# -- the reference ----------------------------------------------------------------------------
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: float32 statistics, the weight applied in x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchOps:
    """Each op as transformers writes it (see the module docstring)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_reference(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        residual.add_(x)
        return rms_norm_reference(residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_and_cache(self, qkv: torch.Tensor, positions: torch.Tensor, table: RotaryTable,
                       shape: HeadShape, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slots: torch.Tensor, qk_norm: QKNorm | None = None,
                       scales: torch.Tensor | None = None) -> None:
        q, k, v = split_qkv(qkv, shape)
        if qk_norm is not None:
            q.copy_(rms_norm_reference(q, qk_norm.q_weight, qk_norm.eps))
            k.copy_(rms_norm_reference(k, qk_norm.k_weight, qk_norm.eps))
        cos = table.cos.index_select(0, positions).to(qkv.dtype)[:, None, :]
        sin = table.sin.index_select(0, positions).to(qkv.dtype)[:, None, :]
        q.copy_(q * cos + _rotate_half(q) * sin)
        k.copy_(k * cos + _rotate_half(k) * sin)
        fp8_kv.write(k_cache, v_cache, slots, k, v, scales)


# -- the CPU's compiled kernels -----------------------------------------------------------------
class NativeOps(TorchOps):
    """The ops on csrc/kernels.c's kernels, float32 rows on the CPU; the q/k norms (Qwen3
    only) and the write of an fp8 cache (quant/fp8_kv.py) stay torch's. The kernels'
    -ffast-math build sums RMSNorm's squares vectorised and uses a vector expf: the last bits
    differ from torch's (HF parity holds: tests/engine/test_model_parity.py)."""

    def __init__(self, kernels: native.Kernels) -> None:
        self.kernels = kernels
        # the step's cos and sin rows, gathered by its first layer for all (every layer of a
        # step passes the same positions tensor)
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        assert x.is_contiguous() and x.dtype == torch.float32
        out = torch.empty_like(x)
        self.kernels.rms_norm(x.data_ptr(), None, weight.data_ptr(), eps, x.shape[0],
                              x.shape[1], out.data_ptr())
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        # the kernel leaves the sum in its first operand and reads its second before it
        # writes the norm over it
        assert x.is_contiguous() and residual.is_contiguous() and x.dtype == torch.float32
        self.kernels.rms_norm(residual.data_ptr(), x.data_ptr(), weight.data_ptr(), eps,
                              x.shape[0], x.shape[1], x.data_ptr())
        return x

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        assert gate_up.is_contiguous() and gate_up.dtype == torch.float32
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, width, dtype=gate_up.dtype)
        self.kernels.silu_mul(gate_up.data_ptr(), rows, width, out.data_ptr())
        return out

    def rope_and_cache(self, qkv: torch.Tensor, positions: torch.Tensor, table: RotaryTable,
                       shape: HeadShape, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slots: torch.Tensor, qk_norm: QKNorm | None = None,
                       scales: torch.Tensor | None = None) -> None:
        assert qkv.stride(1) == 1 and qkv.dtype == torch.float32
        q, k, v = split_qkv(qkv, shape)
        if qk_norm is not None:
            q.copy_(rms_norm_reference(q, qk_norm.q_weight, qk_norm.eps))
            k.copy_(rms_norm_reference(k, qk_norm.k_weight, qk_norm.eps))
        if self._rows is None or self._rows[0] is not positions:
            self._rows = (positions, table.cos.index_select(0, positions),
                          table.sin.index_select(0, positions))
        _, cos, sin = self._rows
        dim = shape.head_dim
        for part, heads in ((q, shape.heads), (k, shape.kv_heads)):
            self.kernels.rotary(part.data_ptr(), qkv.stride(0), qkv.shape[0], heads, dim,
                                cos.data_ptr(), sin.data_ptr(), dim)
        if fp8_kv.is_fp8(k_cache):
            fp8_kv.write(k_cache, v_cache, slots, k, v, scales)
        else:
            self._write(k_cache, v_cache, slots, k, v)

    def _write(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor) -> None:
        """k and v [T, Hkv, D] (rows strided, views into the step's qkv) into the float32
        caches at `slots`: a row copy each, where torch's index_copy_ took 2-3x as long (1028
        rows to random slots, one thread: 2 x 32 floats 77 us against 23, 2 x 64 237 against
        105; Intel Xeon, AVX-512)."""
        assert k_cache.dtype == torch.float32 and k_cache.is_contiguous()
        assert v_cache.is_contiguous() and k_cache.shape == v_cache.shape
        assert k.shape[1:] == k_cache.shape[1:] and v.shape == k.shape
        assert k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == k.shape[2]
        index = slots if slots.dtype == torch.int64 else slots.long()
        index = index.contiguous()
        rows = k.shape[0]
        done = self.kernels.cache_write(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                                        rows, k.shape[1] * k.shape[2], index.data_ptr(),
                                        k_cache.shape[0], k_cache.data_ptr(), v_cache.data_ptr())
        if done != rows:
            raise IndexError(f"cache slot {int(index[-1 - done])} out of range for a cache of "
                             f"{k_cache.shape[0]} slots")
