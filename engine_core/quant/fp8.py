"""fp8 (float8_e4m3fn) linear layers: weights stored in one byte with fp32 scales per output
channel, and the product on the device's fp8 GEMM or, where there is none, dequantized.

A weight W [out, in] is held as q [out, in] in e4m3 and s [out] in fp32 with W ≈ q * s[:, None]
(`quantize_rows`: s = amax(row) / 448, the e4m3 range; a checkpoint's per-tensor scale is the
same scale on every row). Two ways to compute `x @ W.T`, chosen once at start-up by the
Platform (`Fp8Linear.scaled_mm`):
- `torch._scaled_mm` (CUDA, compute capability 8.9+, bf16 out): the activations are quantized
  too, per token (s_x = amax(row of x) / 448, `quantize_activations`) or with a checkpoint's
  static scale, and the GEMM runs fp8 x fp8 with rowwise scales (scale_a [M, 1], scale_b
  [1, N]), as vLLM's `--quantization fp8` does.
- elsewhere (the CPU): q * s dequantized for each product and a plain matmul in the model's
  dtype with the activations as they are: for correctness and tests, not speed.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_AMAX = 1e-12  # an all-zero row or token still gets a scale to divide by
# how a product's activations are quantized on the fp8 GEMM: per token at run time, one scale
# for the whole step at run time, or a checkpoint's static scale
Activations = Literal["token", "tensor", "static"]


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [out, in] e4m3, scales [out] fp32) with weight ≈ q * scales[:, None]: each row's
    largest magnitude maps to 448, values round to the nearest e4m3 (ties to even)."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=MIN_AMAX) / FP8_MAX
    return to_fp8(w / scales[:, None]), scales


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """x in e4m3, saturated at ±448 (a cast alone may give NaN beyond the range)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scales[:, None] in `dtype` (computed in fp32)."""
    return (q.float() * scales[:, None]).to(dtype)


def quantize_activations(x: torch.Tensor, activations: Activations,
                         static_scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, K] e4m3, scales [M, 1] fp32) for rows x [M, K]: per token (each row its own
    scale), per tensor (one for all rows) or with `static_scale`."""
    xf = x.float()
    if activations == "token":
        scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    elif activations == "tensor":
        scale = (xf.abs().amax().clamp(min=MIN_AMAX) / FP8_MAX).expand(x.shape[0], 1)
    else:
        assert static_scale is not None, "static activations need their checkpoint's scale"
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    return to_fp8(xf / scale), scale.contiguous()


def scaled_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
              activations: Activations, input_scale: torch.Tensor | None,
              out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] @ (q * scales[:, None]).T on the fp8 GEMM: x quantized as `activations` says,
    rowwise scales on both sides, `out_dtype` out ([M, N])."""
    xq, x_scales = quantize_activations(x, activations, input_scale)
    return torch._scaled_mm(xq, q.t(), scale_a=x_scales, scale_b=scales.view(1, -1),
                            out_dtype=out_dtype)


class Fp8Linear(nn.Module):
    """A decoder linear layer with an e4m3 weight [out, in] and fp32 scales [out] (the
    checkpoint's names: `weight`, `weight_scale`, and `input_scale` where the checkpoint
    quantizes activations statically); the bias, if any, in the model's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 activations: Activations, scaled_mm: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.activations: Activations = activations
        self.scaled_mm = scaled_mm  # the fp8 GEMM (the Platform's choice), else dequantized
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32),
                                         requires_grad=False)
        self.input_scale = (nn.Parameter(torch.empty((), dtype=torch.float32),
                                         requires_grad=False)
                            if activations == "static" else None)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.scaled_mm:
            out = scaled_mm(rows, self.weight, self.weight_scale, self.activations,
                            self.input_scale, x.dtype)
            if self.bias is not None:
                out += self.bias
        else:
            out = F.linear(rows, dequantize(self.weight, self.weight_scale, x.dtype), self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"activations={self.activations}, scaled_mm={self.scaled_mm}")
