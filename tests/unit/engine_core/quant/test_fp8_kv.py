"""The fp8 KV cache's quantizer against a plain reference (e4m3fn decoded from its bit fields by
hand, rounding to the nearest value, ties to the even code), its cache write and read, the
scales' calculation and the checkpoint's scales."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from engine_core.quant import fp8_kv


def e4m3_values() -> list[float]:
    """Every finite non-negative e4m3fn value, by code 0..126 (bias 7, no infinities, code 127
    is NaN): subnormals m/8 * 2^-6, normals (1 + m/8) * 2^(e - 7)."""
    values = []
    for code in range(127):
        e, m = code >> 3, code & 7
        values.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return values


def reference_quantize(x: float, scale: float) -> float:
    """x / scale saturated at 448 and rounded to the nearest e4m3 value, ties to the even
    code (float64 arithmetic on float32 inputs)."""
    y = min(max(x / scale, -448.0), 448.0)
    table = e4m3_values()
    best = min(range(len(table)), key=lambda c: (abs(abs(y) - table[c]), c % 2))
    return -table[best] if y < 0 else table[best]


def assert_e4m3_of(got: torch.Tensor, x: torch.Tensor, scale: float,
                   interpreter: bool = False) -> None:
    """`got` (e4m3) is x / scale quantized: byte for byte `reference_quantize`'s. With
    `interpreter` (Triton's, on the CPU): its own float32 -> e4m3 cast rounds some values
    wrongly (1.99 to 1.0 where rounding carries into the next power of two, some subnormals a
    step off: Triton 3.9), so there the kernel's steps (the division, the saturation, the
    slots) are checked against the same steps in torch followed by the interpreter's own cast.
    The GPU's cast is the hardware's cvt.rn.satfinite (test_attention_cuda's PTX check)."""
    y = (x.float() / scale).clamp(-448.0, 448.0)
    if interpreter:
        want = interpreted_cast(y.flatten().contiguous()).float()
    else:
        want = torch.tensor([reference_quantize(v, scale) for v in x.float().flatten().tolist()])
    have = got.float().flatten()
    assert torch.equal(have, want), (have[have != want][:8], want[have != want][:8])


def interpreted_cast(y: torch.Tensor) -> torch.Tensor:
    """float32 y [n] cast to e4m3 by a Triton kernel (in the interpreter, where it runs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast(y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(out_ptr + i, tl.load(y_ptr + i, mask=i < n).to(out_ptr.dtype.element_ty),
                 mask=i < n)

    out = torch.empty(len(y), dtype=fp8_kv.FP8)
    cast[(1,)](y, out, len(y), BLOCK=triton.next_power_of_2(len(y)))
    return out


def test_quantize_matches_the_hand_written_e4m3():
    values = e4m3_values()
    midpoints = [(a + b) / 2 for a, b in zip(values, values[1:])]  # ties
    xs = (values + midpoints + [v * 1.01 for v in values] + [0.0, -0.0, 1e-9, 447.9, 448.0,
          464.0, 480.0, 500.0, 1e6, 3.3, -3.3, -1e6])
    xs += [-x for x in xs]
    x = torch.tensor(xs, dtype=torch.float32)
    for scale in (1.0, 0.05, 0.37, 4.0):
        s = torch.tensor(scale)
        got = fp8_kv.quantize(x, s).float().tolist()
        want = [reference_quantize(float(xi), float(torch.tensor(scale))) for xi in x.tolist()]
        assert got == want, scale


def test_saturation_zeros_and_no_nan():
    x = torch.tensor([1e30, -1e30, 449.0, -449.0, 0.0, -0.0, float("inf")])
    q = fp8_kv.quantize(x, torch.tensor(1.0))
    assert q.dtype == torch.float8_e4m3fn
    assert q.float().tolist()[:6] == [448.0, -448.0, 448.0, -448.0, 0.0, 0.0]
    assert not bool(q.float().isnan().any())


def test_dequantize_and_the_round_trip_error():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * 3
    scale = x.abs().max() / 448
    back = fp8_kv.dequantize(fp8_kv.quantize(x, scale), scale, torch.float32)
    # e4m3 keeps 3 mantissa bits: a normal value within 2^-4 of itself, relatively
    normal = x.abs() > 2 ** -6 * scale
    assert bool(((back - x).abs()[normal] <= x.abs()[normal] * 2 ** -4).all())
    assert bool(((back - x).abs() <= scale * 2 ** -10 + x.abs() * 2 ** -4).all())
    assert fp8_kv.dequantize(fp8_kv.quantize(x, scale), scale, torch.bfloat16).dtype == \
        torch.bfloat16


def test_write_quantizes_into_an_fp8_cache_and_read_gives_it_back():
    kc = torch.zeros(10, 2, 4, dtype=fp8_kv.FP8)
    vc = torch.zeros(10, 2, 4, dtype=fp8_kv.FP8)
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4) * 100
    scales = torch.tensor([0.5, 0.25, 1.0, 1.0])
    slots = torch.tensor([7, 0, 3], dtype=torch.int32)
    fp8_kv.write(kc, vc, slots, k, v, scales)
    assert torch.equal(kc[[7, 0, 3]].view(torch.uint8),
                       fp8_kv.quantize(k, torch.tensor(0.5)).view(torch.uint8))
    assert torch.equal(vc[[7, 0, 3]].view(torch.uint8),
                       fp8_kv.quantize(v, torch.tensor(0.25)).view(torch.uint8))
    assert int(kc[[1, 2, 4, 5, 6, 8, 9]].view(torch.uint8).count_nonzero()) == 0
    got = fp8_kv.read(kc[[7, 0, 3]], scales, 0, torch.float32)
    assert torch.allclose(got, k, rtol=2 ** -4, atol=2 ** -9 * 0.5)
    plain = torch.zeros(10, 2, 4)
    fp8_kv.write(plain, plain.clone(), slots, k, v, None)  # a model-dtype cache: as it is
    assert torch.equal(plain[[7, 0, 3]], k)
    assert fp8_kv.read(plain, None, 0, torch.float32) is plain


def test_calibration_sets_each_layers_scales_once_armed():
    scales = fp8_kv.KVScales.build(2, torch.device("cpu"), calculate=True)
    k, v = torch.tensor([[1.0, -40.0]]), torch.tensor([[5.0, 2.0]])
    scales.calibrate(0, k, v)  # not armed: nothing
    assert scales.values[0].tolist() == [1.0, 1.0, 1.0, 1.0]
    assert scales.arm() and not scales.arm()  # once only
    scales.calibrate(1, k, v)
    scales.disarm()
    scales.calibrate(0, k * 10, v * 10)
    assert scales.values[1, :2].tolist() == pytest.approx([40.0 / 200, 5.0 / 100])
    assert scales.values[0].tolist() == [1.0, 1.0, 1.0, 1.0]
    given = fp8_kv.KVScales.build(2, torch.device("cpu"), torch.tensor([[0.1, 0.2]] * 2),
                                    calculate=True)
    assert not given.arm()  # the checkpoint's scales win over the calculation


def test_checkpoint_scales_as_vllm_reads_them(tmp_path: Path):
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
               "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
               "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([0.1, 0.3]),
               "model.layers.1.self_attn.v_proj.output_scale": torch.tensor(2.0),
               "model.layers.1.mlp.down_proj.weight": torch.zeros(2, 2)},
              str(tmp_path / "model.safetensors"))
    scheme = {"quantization_config": {"kv_cache_scheme": {"num_bits": 8, "type": "float",
                                                          "strategy": "tensor"}}}
    (tmp_path / "config.json").write_text(json.dumps(scheme))
    config = SimpleNamespace(**scheme)
    got = fp8_kv.checkpoint_scales(str(tmp_path), config, 2)
    assert got is not None
    assert got.flatten().tolist() == pytest.approx([0.5, 0.25, 0.3, 2.0])  # per head: largest
    with pytest.raises(ValueError, match="not for"):
        fp8_kv.checkpoint_scales(str(tmp_path), config, 3)
    int8 = SimpleNamespace(quantization_config={"kv_cache_scheme": {"num_bits": 8,
                                                                     "type": "int"}})
    with pytest.raises(ValueError, match="8-bit float"):
        fp8_kv.checkpoint_scales(str(tmp_path), int8, 2)
    assert fp8_kv.checkpoint_scales(str(tmp_path / "none"), SimpleNamespace(), 2) is None
