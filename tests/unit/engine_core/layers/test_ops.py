"""The decoder layers' small ops (ops.py, triton_ops.py): the torch reference against
transformers' own modules, the CPU kernels and the Triton kernels (in Triton's interpreter)
against the reference, the Triton kernels compiled for sm_90, and the platform's choice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from engine_core.config import EngineConfig
from engine_core.layers import triton_ops
from engine_core.layers.ops import HeadShape, NativeOps, QKNorm, TorchOps, split_qkv
from engine_core.layers.rotary import RotaryTable
from engine_core.quant import fp8_kv
from engine_core.worker.platform import Platform
from tests.unit.engine_core.heads import kernels_or_skip

CPU = EngineConfig(model="m", device="cpu")
SHAPE = HeadShape(heads=6, kv_heads=2, head_dim=32)


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rope_case(dtype: torch.dtype = torch.float32, rows: int = 9, shape: HeadShape = SHAPE,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, RotaryTable, torch.Tensor]:
    """Packed QKV rows, their positions, a table over 40 positions and their cache slots."""
    g = _g(seed)
    qkv = (torch.randn(rows, shape.qkv_width, generator=g) * 2).to(dtype)
    positions = torch.randperm(40, generator=g)[:rows]
    angles = torch.arange(40)[:, None] * torch.rand(shape.head_dim // 2, generator=g)
    emb = torch.cat((angles, angles), dim=-1)
    slots = torch.randperm(3 * rows, generator=g)[:rows].int()
    return qkv, positions, RotaryTable(emb.cos(), emb.sin()), slots


def run_rope(ops, qkv, positions, table, slots, shape=SHAPE, qk_norm=None, scales=None):
    """The op on a copy of qkv and fresh caches (fp8 with `scales`): (qkv after, k cache,
    v cache)."""
    qkv = qkv.clone()
    dtype = qkv.dtype if scales is None else fp8_kv.FP8
    caches = [torch.zeros(3 * qkv.shape[0], shape.kv_heads, shape.head_dim, dtype=dtype)
              for _ in range(2)]
    ops.rope_and_cache(qkv, positions, table, shape, *caches, slots, qk_norm, scales)
    return qkv, *caches


def assert_fp8_caches(got, want_plain, slots, shape=SHAPE, interpreter=False):
    """`got` (qkv after, fp8 caches) holds what `want_plain` (the same op into caches of the
    model's dtype) does, K and V quantized with scales 0.05 and 0.02 (FP8_SCALES)."""
    from tests.unit.engine_core.quant.test_fp8_kv import assert_e4m3_of

    qkv, k_cache, v_cache = got
    want_qkv, want_k, want_v = want_plain
    assert torch.equal(qkv, want_qkv)
    index = slots.long()
    assert_e4m3_of(k_cache[index], want_k[index], 0.05, interpreter)
    assert_e4m3_of(v_cache[index], want_v[index], 0.02, interpreter)
    others = torch.ones(len(k_cache), dtype=torch.bool)
    others[index] = False
    assert not k_cache[others].view(torch.uint8).any()


FP8_SCALES = torch.tensor([0.05, 0.02, 1.0, 1.0])


# -- the reference is transformers' arithmetic -------------------------------------------------
def test_reference_norms_are_transformers_rmsnorm_bit_for_bit():
    for dtype in (torch.float32, torch.bfloat16):
        norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
        with torch.no_grad():
            norm.weight.normal_(generator=_g(1))
        x, residual = (torch.randn(13, 96, generator=_g(2)) * 3).to(dtype), \
            torch.randn(13, 96, generator=_g(3)).to(dtype)
        assert torch.equal(TorchOps().rms_norm(x, norm.weight, 1e-5), norm(x))
        stream = residual.clone()
        out = TorchOps().add_rms_norm(x, stream, norm.weight, 1e-5)
        assert torch.equal(stream, residual + x) and torch.equal(out, norm(residual + x))


def test_reference_rope_is_transformers_rotary_and_writes_the_cache():
    qkv, positions, table, slots = rope_case()
    got, k_cache, v_cache = run_rope(TorchOps(), qkv, positions, table, slots)
    q, k, v = split_qkv(qkv, SHAPE)
    cos, sin = table.cos[positions][None], table.sin[positions][None]  # [1, T, D]
    q_ref, k_ref = apply_rotary_pos_emb(q[None].transpose(1, 2), k[None].transpose(1, 2),
                                        cos, sin)
    q_got, k_got, v_got = split_qkv(got, SHAPE)
    assert torch.equal(q_got, q_ref[0].transpose(0, 1))
    assert torch.equal(k_got, k_ref[0].transpose(0, 1)) and torch.equal(v_got, v)
    assert torch.equal(k_cache[slots.long()], k_got) and torch.equal(v_cache[slots.long()], v)
    others = torch.ones(len(k_cache), dtype=torch.bool)
    others[slots.long()] = False
    assert not k_cache[others].any() and not v_cache[others].any()


def test_reference_qk_norm_is_each_heads_rmsnorm_before_the_rotation():
    qkv, positions, table, slots = rope_case()
    weights = [torch.randn(SHAPE.head_dim, generator=_g(s)) for s in (4, 5)]
    normed = qkv.clone()
    q, k, _ = split_qkv(normed, SHAPE)
    for part, weight in zip((q, k), weights):
        norm = LlamaRMSNorm(SHAPE.head_dim, eps=1e-6)
        norm.weight.data = weight
        part.copy_(norm(part))
    want = run_rope(TorchOps(), normed, positions, table, slots)
    got = run_rope(TorchOps(), qkv, positions, table, slots,
                   qk_norm=QKNorm(weights[0], weights[1], 1e-6))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_the_fp8_cache_write_quantizes_the_rotated_keys_and_the_values():
    qkv, positions, table, slots = rope_case()
    qkv[0, -SHAPE.head_dim:] = 100.0  # values past 448 * 0.02: saturated
    want = run_rope(TorchOps(), qkv, positions, table, slots)
    assert_fp8_caches(run_rope(TorchOps(), qkv, positions, table, slots, scales=FP8_SCALES),
                      want, slots)


# -- the CPU kernels ----------------------------------------------------------------------------
def test_native_ops_match_the_reference():
    native, ref = NativeOps(kernels_or_skip()), TorchOps()
    x, residual = torch.randn(17, 80, generator=_g(6)) * 3, torch.randn(17, 80, generator=_g(7))
    weight = torch.randn(80, generator=_g(8))
    torch.testing.assert_close(native.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5),
                               rtol=1e-6, atol=1e-6)
    a, b = residual.clone(), residual.clone()
    out = native.add_rms_norm(x.clone(), a, weight, 1e-5)
    torch.testing.assert_close(out, ref.add_rms_norm(x.clone(), b, weight, 1e-5),
                               rtol=1e-6, atol=1e-6)
    assert torch.equal(a, b)  # the residual stream: the same sum
    gate_up = torch.randn(5, 2 * 333, generator=_g(9)) * 8
    torch.testing.assert_close(native.silu_mul(gate_up), ref.silu_mul(gate_up),
                               rtol=1e-6, atol=0)  # a few ulp, relative everywhere
    qkv, positions, table, slots = rope_case()
    norm = QKNorm(torch.randn(32, generator=_g(10)), torch.randn(32, generator=_g(11)), 1e-6)
    for qk_norm in (None, norm):
        for got, want in zip(run_rope(native, qkv, positions, table, slots, qk_norm=qk_norm),
                             run_rope(ref, qkv, positions, table, slots, qk_norm=qk_norm)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # into an fp8 cache: what the native rotation gives, quantized
    assert_fp8_caches(run_rope(native, qkv, positions, table, slots, scales=FP8_SCALES),
                      run_rope(native, qkv, positions, table, slots), slots)


def test_native_cache_write_refuses_a_slot_out_of_range():
    """The compiled row copy checks each slot against the cache (as index_copy_ did): one past
    the end, or negative, is an IndexError naming it."""
    native = NativeOps(kernels_or_skip())
    qkv, positions, table, slots = rope_case()
    for bad_slot in (3 * len(slots), -1):
        bad = slots.clone()
        bad[4] = bad_slot
        with pytest.raises(IndexError, match=f"cache slot {bad_slot} out of range"):
            run_rope(native, qkv, positions, table, bad)


def test_native_silu_mul_at_the_edges():
    """Large |gate| (below -88.7 e^-gate overflows: the kernel takes e^-|gate|), 0 and -0, and
    37 columns: whole vectors and a tail of 5, with 8 or 16 floats a vector."""
    native, ref = NativeOps(kernels_or_skip()), TorchOps()
    gate = torch.tensor([0.0, -0.0, 1e-3, -1e-3, 1e-30, -1e-30, 0.5, -0.5, 3.0, -3.0, 20.0, -20.0,
                         86.0, -86.0, 87.0, -87.0, 88.0, -88.0, 90.0, -90.0, 100.0, -100.0, 1e4,
                         -1e4, 1e30, -1e30])
    gate = torch.cat([gate, torch.linspace(-40, 40, 37 - len(gate))])
    up = torch.randn(4, 37, generator=_g(12)) * 3
    gate_up = torch.cat([gate.expand(4, 37), up], dim=1).contiguous()
    got, want = native.silu_mul(gate_up), ref.silu_mul(gate_up)
    assert not got.isnan().any()
    # below -87 the kernel gives -0 where torch gives -0 or, down to -88.7, a few 1e-37
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-35)
    zeros = got[:, :2], want[:, :2]  # from 0 and -0: zeros of the same signs
    assert not zeros[0].any() and torch.equal(zeros[0].signbit(), zeros[1].signbit())


# -- the Triton kernels, in the interpreter -----------------------------------------------------
INTERPRETED = """
import torch
from engine_core.layers.ops import HeadShape, QKNorm, TorchOps
from engine_core.layers.triton_ops import TritonOps
from tests.unit.engine_core.layers.test_ops import (FP8_SCALES, assert_fp8_caches, rope_case,
    run_rope)

# the interpreter rounds to bfloat16 by truncation, a GPU to nearest: in bfloat16 a result may
# be a few units in the last place of the values' scale apart (a wrong head, half or row is off
# by the scale itself)
def close(got, want):
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=8 * 2**-8 * scale)


triton, ref = TritonOps(), TorchOps()
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for width in (96, 2048):  # a padded block; a Llama-3.2-1B row
        x = (torch.randn(7, width, generator=g) * 3).to(dtype)
        residual = torch.randn(7, width, generator=g).to(dtype)
        weight = torch.randn(width, generator=g).to(dtype)
        close(triton.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5))
        a, b = residual.clone(), residual.clone()
        out = triton.add_rms_norm(x.clone(), a, weight, 1e-5)
        close(out, ref.add_rms_norm(x.clone(), b, weight, 1e-5))
        close(a, b)
    # rows of a wider buffer (a piecewise graph's), columns over two programs
    buffer = (torch.randn(9, 2 * 1500, generator=g) * 4).to(dtype)
    close(triton.silu_mul(buffer[:6]), ref.silu_mul(buffer[:6]))
    for shape in (HeadShape(6, 2, 32), HeadShape(5, 1, 48)):  # padded heads, a head dim of 48
        qkv, positions, table, slots = rope_case(dtype, shape=shape)
        norm = QKNorm(torch.randn(shape.head_dim, generator=g).to(dtype),
                      torch.randn(shape.head_dim, generator=g).to(dtype), 1e-6)
        for qk_norm in (None, norm):
            got = run_rope(triton, qkv, positions, table, slots, shape, qk_norm)
            want = run_rope(ref, qkv, positions, table, slots, shape, qk_norm)
            for a, b in zip(got, want):
                close(a, b)
        # into an fp8 cache: the kernel's own rotation (as its model-dtype run wrote it),
        # quantized (the interpreter's cast: test_fp8_kv.assert_e4m3_of)
        plain = run_rope(triton, qkv, positions, table, slots, shape, norm)
        fp8 = run_rope(triton, qkv, positions, table, slots, shape, norm, FP8_SCALES)
        assert_fp8_caches(fp8, plain, slots, shape, interpreter=True)
print("interpreted ok")
"""


def test_triton_ops_in_the_interpreter():
    """The real kernels, jitted as the engine jits them, run by Triton's interpreter on the CPU
    against the reference, in float32 and bfloat16 (a fresh interpreter: the interpreter must
    be on before Triton is first imported)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).parents[4])
    assert done.returncode == 0 and "interpreted ok" in done.stdout, done.stderr[-3000:]


def kernel_signatures(dtype: str) -> dict[str, tuple[dict[str, str], dict[str, object]]]:
    """Each kernel's argument types for `dtype`, and its constexprs as the engine sets them for
    a Llama-3.2-1B shape (hidden 2048, intermediate 8192, 32 heads / 8 KV heads of 64).
    "bf16-fp8": a bf16 model over an fp8 (e4m3) cache."""
    model, _, fp8 = dtype.partition("-")
    dtype, cache = model, "fp8e4nv" if fp8 else model
    norm = {"x_ptr": f"*{dtype}", "r_ptr": f"*{dtype}", "w_ptr": f"*{dtype}",
            "o_ptr": f"*{dtype}", "x_row": "i32", "r_row": "i32", "o_row": "i32",
            "width": "i32", "eps": "fp32"}
    silu = {"x_ptr": f"*{dtype}", "o_ptr": f"*{dtype}", "width": "i32", "x_row": "i32",
            "o_row": "i32"}
    rope = {"qkv_ptr": f"*{dtype}", "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
            "kc_ptr": f"*{cache}", "vc_ptr": f"*{cache}", "slots_ptr": "*i32",
            "qw_ptr": f"*{dtype}", "kw_ptr": f"*{dtype}", "scales_ptr": "*fp32",
            "qkv_row": "i32", "table_row": "i32", "c_slot": "i32", "c_head": "i32",
            "eps": "fp32"}
    return {
        "rms_norm": (norm, {"HAS_RES": True, "BLOCK": 2048}),
        "silu_mul": (silu, {"BLOCK": triton_ops.SILU_BLOCK}),
        "rope_cache": (rope, {"HEADS": 32, "KV_HEADS": 8, "HEAD_DIM": 64, "HALF": 32,
                              "PAD_H": 32, "PAD_KV": 8, "PAD_HALF": 32, "QK_NORM": True,
                              "FP8": bool(fp8)}),
    }


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32", "bf16-fp8"])
@pytest.mark.parametrize("name", ["rms_norm", "silu_mul", "rope_cache"])
def test_triton_ops_compile_for_hopper(dtype: str, name: str):
    """Triton compiles each kernel for sm_90 (an H100/H200) to PTX and a cubin, no GPU here."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, fixed = triton_ops.KERNELS[name]
    signature, constexprs = kernel_signatures(dtype)[name]
    signature = {**signature, **{c: "constexpr" for c in constexprs}}
    source = ASTSource(triton.jit(fn, do_not_specialize=fixed), signature, constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert ".target sm_90" in compiled.asm["ptx"] and compiled.asm.get("cubin")
    if dtype.endswith("fp8") and name == "rope_cache":  # quantized as fp8_kv.quantize
        assert "cvt.rn.satfinite.e4m3x2.f32" in compiled.asm["ptx"]


# -- the platform's choice --------------------------------------------------------------------
def test_the_platform_runs_the_cpu_kernels_in_float32_unless_told_not_to():
    kernels_or_skip()
    assert type(Platform.detect(CPU, environ={}).layer_ops()) is NativeOps
    assert type(Platform.detect(CPU, environ={"TANDEM_FUSED": "0"}).layer_ops()) is TorchOps
    assert type(Platform.detect(CPU, environ={"TANDEM_NATIVE": "0"}).layer_ops()) is TorchOps
    bf16 = EngineConfig(model="m", device="cpu", dtype="bfloat16")
    assert type(Platform.detect(bf16, environ={}).layer_ops()) is TorchOps
    with pytest.raises(ValueError, match="TANDEM_FUSED"):
        Platform.detect(CPU, environ={"TANDEM_FUSED": "yes"})
