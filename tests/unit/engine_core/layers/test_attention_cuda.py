"""The CUDA attention path on the CPU: its plan (which rows go where, cumulative lengths, cache
slots, block-table rows), its wiring against the portable path with reference kernels in place
of FlashAttention, the Triton kernels themselves (decode, KV write) in Triton's interpreter
against their references, and their compilation to sm_90 PTX."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine_core.layers import triton_attention
from engine_core.layers.attention import build_metadata as portable_metadata
from engine_core.layers.attention import paged_attention
from engine_core.layers.attention_cuda import (
    Decode,
    Kernels,
    Varlen,
    build_metadata,
    cuda_paged_attention,
    plan,
    reference_decode,
    sdpa_varlen,
)
from engine_core.layers.host_link import HostLink
from engine_core.quant import fp8_kv
from engine_core.quant.fp8_kv import KVScales

BS = 4
# Four sequences in one step: a decode at position 5, a fresh 3-token prompt, a 2-token chunk
# after 4 cached tokens, and a one-token prompt (a decode with no context).
STARTS = np.array([5, 0, 4, 0])
NUM_NEW = np.array([1, 3, 2, 1])
TABLE = np.array([[7, 2, 0], [3, 0, 0], [5, 9, 0], [4, 0, 0]])
# the same blocks as rows of a persistent table, in another order, with a spare row
PERSISTENT = np.array([[0, 0, 0], [5, 9, 0], [4, 0, 0], [7, 2, 0], [3, 0, 0]], dtype=np.int32)
ROWS = np.array([3, 4, 1, 2])


def test_plan_sends_decodes_to_the_kernel_and_chunks_to_one_varlen_call():
    varlen, decode = plan(STARTS, NUM_NEW, PERSISTENT, ROWS, BS, paged_decode=True)
    assert decode is not None and varlen is not None
    assert decode.rows.tolist() == [0, 6]  # packed rows: [0], [1, 2, 3], [4, 5], [6]
    assert decode.seq_lens.tolist() == [6, 1]
    assert decode.table_rows.tolist() == [3, 2]  # read in place, never uploaded
    assert varlen.rows.tolist() == [1, 2, 3, 4, 5]
    assert varlen.cu_q.tolist() == [0, 3, 5] and varlen.cu_k.tolist() == [0, 3, 9]
    assert (varlen.max_q, varlen.max_k) == (3, 6)
    assert varlen.kv_slots is not None  # the second chunk has context: every context gathered
    assert varlen.kv_slots.tolist() == [12, 13, 14] + [20, 21, 22, 23, 36, 37]


def test_plan_without_the_decode_kernel_or_any_context():
    varlen, decode = plan(STARTS, NUM_NEW, PERSISTENT, ROWS, BS, paged_decode=False)
    assert decode is None and varlen is not None
    assert varlen.rows.tolist() == list(range(7))
    assert varlen.cu_q.tolist() == [0, 1, 4, 6, 7] and varlen.cu_k.tolist() == [0, 6, 9, 15, 16]
    fresh, _ = plan(np.array([0, 0]), np.array([2, 3]), PERSISTENT, ROWS[:2], BS,
                    paged_decode=True)
    assert fresh is not None and fresh.kv_slots is None  # the step's own K/V serve
    assert fresh.cu_k.tolist() == fresh.cu_q.tolist() == [0, 2, 5]


def reference_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Varlen,
                     scale: float) -> torch.Tensor:
    """FlashAttention's varlen semantics (SDPA chunk by chunk, the float32 CUDA path's)."""
    return sdpa_varlen(q, k, v, batch, scale)


def loop_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                batch: Decode, scale: float, block_size: int,
                scales: torch.Tensor | None = None) -> torch.Tensor:
    """The decode spelt out, one sequence at a time: the reference of the references. An fp8
    cache's entries times their scale (`scales`: K's, V's)."""
    out = torch.empty_like(q)
    if scales is not None:
        k_cache, v_cache = k_cache.float() * scales[0], v_cache.float() * scales[1]
    for i, (row, n) in enumerate(zip(batch.table_rows.tolist(), batch.seq_lens.tolist())):
        pos = torch.arange(n)
        slots = batch.table[row, pos // block_size].long() * block_size + pos % block_size
        o = F.scaled_dot_product_attention(q[i][:, None], k_cache[slots].transpose(0, 1),
                                           v_cache[slots].transpose(0, 1), scale=scale,
                                           enable_gqa=True)
        out[i] = o[:, 0]
    return out


DECODES_FIRST = [0, 3, 1, 2]  # the scheduler's usual order: each side's rows consecutive


def run_both(kernels: Kernels, order: list[int] | None = None, fp8: bool = False) -> None:
    """One layer's attention of the step above (its sequences in `order`), the portable path
    against the CUDA path's wiring with `kernels`: same outputs, same caches (with `fp8`, an
    fp8 cache and its scales)."""
    order = order or [0, 1, 2, 3]
    starts, num_new, table, rows = STARTS[order], NUM_NEW[order], TABLE[order], ROWS[order]
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    slots = 10 * BS
    cache = [(torch.randn(slots, kv_heads, dim, generator=g),
              torch.randn(slots, kv_heads, dim, generator=g))]
    scales = None
    if fp8:
        scales = KVScales(torch.tensor([[0.02, 0.01, 1.0, 1.0]]))
        cache = [(fp8_kv.quantize(kc, torch.tensor(0.02)),
                  fp8_kv.quantize(vc, torch.tensor(0.01))) for kc, vc in cache]
    tokens = int(NUM_NEW.sum())
    q = torch.randn(1, heads, tokens, dim, generator=g)
    k = torch.randn(1, kv_heads, tokens, dim, generator=g)
    v = torch.randn(1, kv_heads, tokens, dim, generator=g)
    layer = SimpleNamespace(layer_idx=0)
    caches = {name: [(kc.clone(), vc.clone()) for kc, vc in cache] for name in ("a", "b")}
    meta, positions = portable_metadata(starts, num_new, table, BS, caches["a"],
                                        torch.device("cpu"), kv_scales=scales)
    want, _ = paged_attention(layer, q, k, v, None, 0.3, tandem_meta=meta)  # type: ignore[arg-type]
    link = HostLink(torch.device("cpu"), pinned=False, synchronize=lambda: None)
    cmeta, cpositions = build_metadata(starts, num_new, PERSISTENT, rows,
                                       torch.from_numpy(PERSISTENT), BS, caches["b"], link,
                                       kernels, scales)
    consecutive = order == DECODES_FIRST or kernels.decode is None  # (all rows varlen)
    assert cmeta.varlen is not None and (cmeta.varlen.rows is None) == consecutive
    got, _ = cuda_paged_attention(layer, q, k, v, None, 0.3,  # type: ignore[arg-type]
                                  tandem_meta=cmeta)
    assert cpositions.tolist() == positions.tolist()
    assert torch.allclose(got, want, atol=1e-5)
    for a, b in zip(caches["a"][0], caches["b"][0]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if fp8:  # the step's K/V went in quantized
        assert torch.equal(caches["b"][0][0][cmeta.slot_mapping.long()].view(torch.uint8),
                           fp8_kv.quantize(k[0].transpose(0, 1), torch.tensor(0.02)
                                             ).view(torch.uint8))


@pytest.mark.parametrize("order", [None, DECODES_FIRST], ids=["mixed", "decodes-first"])
@pytest.mark.parametrize("fp8", [False, True], ids=["float32", "fp8"])
def test_cuda_path_wiring_matches_the_portable_path(order, fp8):
    run_both(Kernels(reference_varlen, loop_decode), order, fp8)
    run_both(Kernels(reference_varlen, reference_decode), order, fp8)  # the graph-safe stand-in
    run_both(Kernels(reference_varlen, None), order, fp8)  # decodes as one-token varlen chunks


def test_plan_of_decodes_then_chunks_takes_consecutive_rows():
    varlen, decode = plan(STARTS[DECODES_FIRST], NUM_NEW[DECODES_FIRST], PERSISTENT,
                          ROWS[DECODES_FIRST], BS, paged_decode=True)
    assert decode is not None and varlen is not None
    assert decode.first == 0 and decode.rows.tolist() == [0, 1]
    assert varlen.first == 2 and varlen.rows.tolist() == [2, 3, 4, 5, 6]


def random_cache(blocks: int, kv_heads: int, dim: int, dtype: torch.dtype = torch.float32,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(blocks * BS, kv_heads, dim, generator=g).to(dtype),
            torch.randn(blocks * BS, kv_heads, dim, generator=g).to(dtype))


def decode_case(lens: list[int], heads: int = 8, kv_heads: int = 2, dim: int = 32,
                splits: int = 1, dtype: torch.dtype = torch.float32
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Decode]:
    """Decodes of the given context lengths over shuffled blocks of a random cache, each in a
    row of a persistent table wider than any needs (rows not in order). `dtype` fp8: the
    cache's (a float32 cache cast to e4m3), the queries float32."""
    width = max(-(-n // BS) for n in lens) + 2
    rng = np.random.default_rng(1)
    blocks = rng.permutation(len(lens) * width).reshape(len(lens), width).astype(np.int32)
    table = np.zeros((len(lens) + 3, width), dtype=np.int32)
    rows = rng.permutation(len(lens) + 3)[:len(lens)]
    table[rows] = blocks
    kc, vc = random_cache(len(lens) * width, kv_heads, dim, dtype)
    q_dtype = torch.float32 if dtype == fp8_kv.FP8 else dtype
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(2)).to(q_dtype)
    batch = Decode(None, torch.from_numpy(table), torch.from_numpy(rows.astype(np.int32)),
                   torch.tensor(lens, dtype=torch.int32), splits)
    return q, kc, vc, batch


def test_the_graph_safe_decode_matches_the_loop():
    q, kc, vc, batch = decode_case([1, 5, 16, 37, 64, 100])
    got = reference_decode(q, kc, vc, batch, 0.2, BS)
    assert torch.allclose(got, loop_decode(q, kc, vc, batch, 0.2, BS), atol=1e-5)


def test_the_graph_safe_decode_reads_an_fp8_cache():
    q, kc, vc, batch = decode_case([1, 5, 16, 37, 64, 100], dtype=fp8_kv.FP8)
    scales = torch.tensor([0.5, 2.0, 1.0, 1.0])
    got = reference_decode(q, kc, vc, batch, 0.2, BS, scales)
    assert torch.allclose(got, loop_decode(q, kc, vc, batch, 0.2, BS, scales), atol=1e-5)
    # the scales are used: without them, another result
    assert not torch.allclose(got, loop_decode(q, kc.float(), vc.float(), batch, 0.2, BS),
                              atol=1e-2)


def test_reference_kv_write_puts_k_and_v_in_their_slots():
    kc, vc = random_cache(4, 2, 8)
    key = torch.randn(1, 2, 3, 8)[0].transpose(0, 1)  # [T, Hkv, D] as the layer passes it
    value = torch.randn(1, 2, 3, 8)[0].transpose(0, 1)
    slots = torch.tensor([9, 2, 14], dtype=torch.int32)
    triton_attention.write_kv_reference(key, value, kc, vc, slots)
    assert torch.equal(kc[[9, 2, 14]], key) and torch.equal(vc[[9, 2, 14]], value)


INTERPRETED = """
import torch
from engine_core.layers import triton_attention as ta
from engine_core.layers.attention_cuda import reference_decode, triton_decode
from tests.unit.engine_core.layers.test_attention_cuda import (BS, decode_case, loop_decode,
    random_cache)

# the decode: every split count, a long context, grouped heads of 4 and 8, head dims 32 and 64
for lens, heads, kv, dim, splits in (([1, 5, 16, 37, 64, 100], 8, 2, 32, 1),
                                     ([3, 70, 200], 8, 2, 32, 3),
                                     ([300], 8, 1, 64, 4), ([129, 2], 4, 1, 64, 16)):
    q, kc, vc, batch = decode_case(lens, heads, kv, dim, splits)
    got = triton_decode(q, kc, vc, batch, 0.2, BS)
    want = loop_decode(q, kc, vc, batch, 0.2, BS)
    err = (got - want).abs().max().item()
    assert err < 1e-5, (lens, splits, err)
    assert torch.allclose(reference_decode(q, kc, vc, batch, 0.2, BS), want, atol=1e-5)

# the decode over an fp8 cache: e4m3 tiles, the layer's scales applied in the kernel
scales = torch.tensor([0.5, 2.0, 1.0, 1.0])
for lens, heads, kv, dim, splits in (([1, 5, 16, 37, 64, 100], 8, 2, 32, 1),
                                     ([3, 70, 200], 8, 2, 32, 3), ([300], 8, 1, 64, 4)):
    q, kc, vc, batch = decode_case(lens, heads, kv, dim, splits, dtype=torch.float8_e4m3fn)
    got = triton_decode(q, kc, vc, batch, 0.2, BS, scales)
    want = loop_decode(q, kc, vc, batch, 0.2, BS, scales)
    err = (got - want).abs().max().item()
    assert err < 1e-5, ("fp8", lens, splits, err)

# the KV write: K and V of every head into scattered slots, the layer's strided views
kc, vc = random_cache(6, 2, 32)
want_k, want_v = kc.clone(), vc.clone()
key = torch.randn(1, 2, 5, 32)[0].transpose(0, 1)
value = torch.randn(1, 2, 5, 32)[0].transpose(0, 1)
slots = torch.tensor([17, 3, 20, 11, 0], dtype=torch.int32)
ta.write_kv(key, value, kc, vc, slots)
ta.write_kv_reference(key, value, want_k, want_v, slots)
assert torch.equal(kc, want_k) and torch.equal(vc, want_v)

# the fp8 KV write: x / scale, saturated at 448 (values far past it), cast; against the
# same steps in torch, cast by the interpreter (its cast is not exact: see assert_e4m3_of)
from tests.unit.engine_core.quant.test_fp8_kv import assert_e4m3_of
kc8, vc8 = (torch.zeros(6 * BS, 2, 32, dtype=torch.float8_e4m3fn) for _ in range(2))
value = value * 1000
ta.write_kv(key, value, kc8, vc8, slots, scales)
for cache, x, s in ((kc8, key, 0.5), (vc8, value, 2.0)):
    assert_e4m3_of(cache[slots.long()], x, s, interpreter=True)
assert float(vc8.float().abs().max()) == 448.0
untouched = torch.ones(len(kc8), dtype=torch.bool)
untouched[slots.long()] = False
assert int(kc8[untouched].view(torch.uint8).count_nonzero()) == 0
print("interpreted ok")
"""


def test_triton_kernels_in_the_interpreter():
    """The real kernels, jitted as the engine jits them, run by Triton's interpreter on the
    CPU in float32 against their references. The interpreter must be on before Triton is
    first imported, so the check runs in a fresh interpreter."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).parents[4])
    assert done.returncode == 0 and "interpreted ok" in done.stdout, done.stderr[-3000:]


def test_the_wiring_with_the_triton_decode_in_the_interpreter():
    pytest.importorskip("triton")
    script = ("from tests.unit.engine_core.layers.test_attention_cuda import (run_both,\n"
              "    reference_varlen)\n"
              "from engine_core.layers import triton_attention as ta\n"
              "from engine_core.layers.attention_cuda import Kernels, triton_decode\n"
              "run_both(Kernels(reference_varlen, triton_decode, ta.write_kv))\n")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).parents[4])
    assert done.returncode == 0, done.stderr[-3000:]


def test_flash_varlen_call_matches_the_ops_schema():
    """FlashAttention is CUDA-only; its meta kernel checks the call (arguments, shapes)."""
    from engine_core.layers.attention_cuda import flash_varlen

    meta = torch.device("meta")
    q = torch.empty(10, 8, 64, dtype=torch.bfloat16, device=meta)
    kv = torch.empty(14, 2, 64, dtype=torch.bfloat16, device=meta)
    cu = torch.empty(3, dtype=torch.int32, device=meta)
    out = flash_varlen(q, kv, kv, Varlen(cu, None, cu, cu, 6, 9), 0.125)
    assert out.shape == q.shape and out.dtype == torch.bfloat16



def kernel_signatures(dtype: str, cache: str | None = None
                      ) -> dict[str, tuple[dict[str, str], dict[str, object]]]:
    """Each kernel's argument types for `dtype` (the cache's `cache`, fp8e4nv for an fp8
    cache; default `dtype`), and its constexprs as the engine sets them for a Llama-3.2-1B
    shape (32 heads / 8 KV heads, head dim 64, blocks of 16)."""
    cache = cache or dtype
    fp8 = cache == "fp8e4nv"
    ints = ["q_tok", "q_head", "kv_slot", "kv_head", "table_row", "o_tok", "o_head"]
    decode = {"out_ptr": f"*{dtype}", "q_ptr": f"*{dtype}", "k_ptr": f"*{cache}",
              "v_ptr": f"*{cache}", "table_ptr": "*i32", "rows_ptr": "*i32",
              "lens_ptr": "*i32", "po_ptr": "*fp32", "pml_ptr": "*fp32", "scales_ptr": "*fp32",
              "scale": "fp32", "num_splits": "i32", **{p: "i32" for p in ints}}
    write = {"k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "kc_ptr": f"*{cache}",
             "vc_ptr": f"*{cache}", "slots_ptr": "*i32",
             "scales_ptr": "*fp32" if fp8 else "*i32",
             **{p: "i32" for p in ("k_tok", "k_head", "v_tok", "v_head", "c_slot", "c_head")}}
    combine = {"out_ptr": f"*{dtype}", "po_ptr": "*fp32", "pml_ptr": "*fp32",
               "num_splits": "i32", "o_tok": "i32", "o_head": "i32"}
    return {
        "decode": (decode, {"GROUP": 4, "PAD_G": 16, "BLOCK_SIZE": 16, "HEAD_DIM": 64,
                            "PAD_D": 64, "TILE": triton_attention.TILE,
                            "IEEE": dtype == "fp32", "FP8": fp8}),
        "kv_write": (write, {"KV_HEADS": 8, "HEAD_DIM": 64, "PAD_H": 8, "PAD_D": 64,
                             "FP8": fp8}),
        "combine": (combine, {"HEAD_DIM": 64, "PAD_D": 64, "PAD_S": 16}),
    }


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32", "bf16-fp8"])
@pytest.mark.parametrize("name", ["decode", "kv_write", "combine"])
def test_kernels_compile_for_hopper(dtype: str, name: str, monkeypatch: pytest.MonkeyPatch):
    """Triton compiles each kernel for sm_90 (an H100/H200) to PTX and, with the ptxas it
    ships, to a cubin, without a GPU present; the decode's dots are tensor-core MMAs.
    bf16-fp8: a bf16 model over an fp8 (e4m3) cache."""
    triton = pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, said out loud
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, fixed = triton_attention.KERNELS[name]
    model, _, cache = dtype.partition("-")
    signature, constexprs = kernel_signatures(model, "fp8e4nv" if cache else None)[name]
    signature = {**signature, **{c: "constexpr" for c in constexprs}}
    source = ASTSource(triton.jit(fn, do_not_specialize=fixed), signature, constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    ptx = compiled.asm["ptx"]
    assert ".target sm_90" in ptx and compiled.asm.get("cubin")
    if name == "decode" and dtype != "fp32":
        assert "mma" in ptx or "wgmma" in ptx  # tl.dot on the tensor cores
    if cache and name == "kv_write":  # the hardware's rounding, saturated (fp8_kv.quantize)
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    if cache and name == "decode":  # e4m3 tiles converted in registers, as they are read
        assert "e4m3x2" in ptx
