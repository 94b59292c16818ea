"""The fp8 quantizer and linear layer (engine_core/quant/fp8.py) against references written
plainly here: e4m3's values enumerated from its 256 codes, each number rounded to the nearest
(ties to the even code), scales amax / 448 per row, saturation at ±448; the fp8 GEMM path
(torch._scaled_mm, which this CPU also runs) against the product of the dequantized operands."""

from __future__ import annotations

import pytest
import torch

from engine_core.quant.fp8 import (
    FP8,
    Fp8Linear,
    dequantize,
    quantize_activations,
    quantize_rows,
    scaled_mm,
)

CODES = torch.arange(256, dtype=torch.uint8)
VALUES = CODES.view(FP8).float()  # every e4m3 code's value (two are NaN)
FINITE = ~VALUES.isnan()


def nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Each entry of x (inside ±448) rounded to the nearest e4m3 value, a tie to the code
    whose last mantissa bit is 0."""
    values, codes = VALUES[FINITE], CODES[FINITE]
    out = torch.empty_like(x)
    for i, v in enumerate(x.reshape(-1).tolist()):
        distance = (values - v).abs()
        best = distance.min()
        tied = (distance == best).nonzero().reshape(-1)
        even = [j for j in tied.tolist() if int(codes[j]) % 2 == 0]
        out.reshape(-1)[i] = values[even[0] if even else int(tied[0])]
    return out


def reference_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales = torch.tensor([max(float(row.abs().max()), 1e-12) / 448.0 for row in w])
    scaled = (w / scales[:, None]).clamp(-448.0, 448.0)
    return nearest_e4m3(scaled), scales


def test_rows_quantize_to_the_nearest_e4m3_with_amax_over_448():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 40, generator=gen) * torch.tensor([1e-3, 0.1, 1, 10, 300, 5e4])[:, None]
    w[2, :8] = torch.tensor([0.5, -0.5, 1e-9, -1e-9, 3.0, 2.5, -2.5, 0.0]) * w[2].abs().max()
    q, scales = quantize_rows(w)
    want_q, want_scales = reference_rows(w)
    assert q.dtype == FP8 and scales.dtype == torch.float32
    assert torch.allclose(scales, want_scales, rtol=1e-6, atol=0)
    assert torch.equal(q.float(), want_q)
    # each row's largest magnitude is exactly ±448 before scaling back
    assert torch.equal(q.float().abs().amax(1), torch.full((6,), 448.0))
    relative = (dequantize(q, scales, torch.float32) - w).abs() / w.abs().amax(1, keepdim=True)
    assert float(relative.max()) <= 2 ** -4  # half of e4m3's coarsest step at the top


def test_all_zero_rows_and_saturation():
    w = torch.zeros(3, 16)
    w[1] = 1.0
    q, scales = quantize_rows(w)
    assert torch.isfinite(scales).all() and (scales > 0).all()
    assert torch.equal(q[0].float(), torch.zeros(16)) and torch.equal(q[2].float(),
                                                                       torch.zeros(16))
    assert not q.float().isnan().any()
    # a static scale too small for the activations saturates at ±448 instead of overflowing
    x = torch.tensor([[1000.0, -1000.0, 1.0, 0.0]])
    xq, xs = quantize_activations(x, "static", torch.tensor(1.0))
    assert xq.float().tolist() == [[448.0, -448.0, 1.0, 0.0]] and xs.tolist() == [[1.0]]


@pytest.mark.parametrize("activations", ["token", "tensor", "static"])
def test_activation_scales(activations):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 32, generator=gen) * torch.tensor([0.01, 1, 3, 100, 0.5])[:, None]
    x[4] = 0.0
    q, scales = quantize_activations(x, activations, torch.tensor(0.25))
    assert scales.shape == (5, 1) and scales.dtype == torch.float32
    if activations == "token":
        want = torch.tensor([[max(float(r.abs().max()), 1e-12) / 448] for r in x])
    elif activations == "tensor":
        want = torch.full((5, 1), float(x.abs().max()) / 448)
    else:
        want = torch.full((5, 1), 0.25)
    assert torch.allclose(scales, want, rtol=1e-6, atol=0)
    assert torch.equal(q.float(), nearest_e4m3((x / want).clamp(-448, 448)))


@pytest.mark.parametrize("activations", ["token", "static"])
def test_scaled_mm_is_the_product_of_the_dequantized_operands(activations):
    """The GPU's path, run here by torch's CPU _scaled_mm: x's fp8 rows times the weight's,
    each side's rowwise scale applied, bf16 out."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(48, 64, generator=gen)
    x = torch.randn(7, 64, generator=gen).to(torch.bfloat16)
    q, scales = quantize_rows(w)
    static = torch.tensor(0.01)
    out = scaled_mm(x, q, scales, activations, static, torch.bfloat16)
    xq, xs = quantize_activations(x, activations, static)
    want = (xq.float() * xs) @ (q.float() * scales[:, None]).T
    assert out.dtype == torch.bfloat16 and out.shape == (7, 48)
    assert torch.allclose(out.float(), want, rtol=2 ** -7, atol=1e-3)
    # and near the full-precision product: what fp8 costs
    exact = x.float() @ w.T
    assert float((out.float() - exact).norm() / exact.norm()) < 0.08


@pytest.mark.parametrize("on_gemm", [False, True])
def test_fp8_linear(on_gemm):
    gen = torch.Generator().manual_seed(3)
    w, bias = torch.randn(32, 16, generator=gen), torch.randn(32, generator=gen)
    layer = Fp8Linear(16, 32, True, "token", on_gemm)
    q, scales = quantize_rows(w)
    with torch.no_grad():
        layer.weight.copy_(q)
        layer.weight_scale.copy_(scales)
        layer.bias.copy_(bias)  # type: ignore[union-attr]
    dtype = torch.bfloat16 if on_gemm else torch.float32
    x = torch.randn(2, 3, 16, generator=gen).to(dtype)
    out = layer(x)
    assert out.shape == (2, 3, 32) and out.dtype == dtype
    if on_gemm:
        want = scaled_mm(x.reshape(6, 16), q, scales, "token", None, dtype)
        want += bias  # in place, into bf16, as the layer adds it
        assert torch.equal(out.reshape(6, 32), want)
    else:  # the CPU's: exactly the dequantized weight's product, activations unrounded
        dequantized = q.float() * scales[:, None]
        assert torch.equal(out, torch.nn.functional.linear(x, dequantized, bias))
