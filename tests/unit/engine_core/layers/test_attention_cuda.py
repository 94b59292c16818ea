"""The CUDA attention path on the CPU: its plan (which rows go where, cumulative lengths, cache
slots, block tables), its wiring against the portable path with reference kernels in place of
FlashAttention, and the Triton decode kernel itself in Triton's interpreter."""

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

from engine_core.layers.attention import build_metadata as portable_metadata
from engine_core.layers.attention import paged_attention
from engine_core.layers.attention_cuda import (
    Decode,
    Kernels,
    Varlen,
    build_metadata,
    cuda_paged_attention,
    plan,
)
from engine_core.layers.host_link import HostLink

BS = 4
# Four sequences in one step: a decode at position 5, a fresh 3-token prompt, a 2-token chunk
# after 4 cached tokens, and a one-token prompt (a decode with no context).
STARTS = np.array([5, 0, 4, 0])
NUM_NEW = np.array([1, 3, 2, 1])
TABLE = np.array([[7, 2, 0], [3, 0, 0], [5, 9, 0], [4, 0, 0]])


def test_plan_sends_decodes_to_the_kernel_and_chunks_to_one_varlen_call():
    varlen, decode = plan(STARTS, NUM_NEW, TABLE, BS, paged_decode=True)
    assert decode is not None and varlen is not None
    assert decode.rows.tolist() == [0, 6]  # packed rows: [0], [1, 2, 3], [4, 5], [6]
    assert decode.seq_lens.tolist() == [6, 1]
    assert decode.block_table.tolist() == [[7, 2], [4, 0]]  # two blocks hold 6 tokens
    assert varlen.rows.tolist() == [1, 2, 3, 4, 5]
    assert varlen.cu_q.tolist() == [0, 3, 5] and varlen.cu_k.tolist() == [0, 3, 9]
    assert (varlen.max_q, varlen.max_k) == (3, 6)
    assert varlen.kv_slots is not None  # the second chunk has context: every context gathered
    assert varlen.kv_slots.tolist() == [12, 13, 14] + [20, 21, 22, 23, 36, 37]


def test_plan_without_the_decode_kernel_or_any_context():
    varlen, decode = plan(STARTS, NUM_NEW, TABLE, BS, paged_decode=False)
    assert decode is None and varlen is not None
    assert varlen.rows.tolist() == list(range(7))
    assert varlen.cu_q.tolist() == [0, 1, 4, 6, 7] and varlen.cu_k.tolist() == [0, 6, 9, 15, 16]
    fresh, _ = plan(np.array([0, 0]), np.array([2, 3]), TABLE[:2], BS, paged_decode=True)
    assert fresh is not None and fresh.kv_slots is None  # the step's own K/V serve
    assert fresh.cu_k.tolist() == fresh.cu_q.tolist() == [0, 2, 5]


def reference_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Varlen,
                     scale: float) -> torch.Tensor:
    """FlashAttention's varlen semantics: per chunk, causal aligned to the bottom right."""
    out = torch.empty_like(q)
    cq, ck = batch.cu_q.tolist(), batch.cu_k.tolist()
    for i in range(len(cq) - 1):
        qs, ks, vs = q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]]
        nq, nk = len(qs), len(ks)
        mask = torch.arange(nk)[None, :] <= (nk - nq + torch.arange(nq))[:, None]
        o = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1),
                                           vs.transpose(0, 1), attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        out[cq[i]:cq[i + 1]] = o.transpose(0, 1)
    return out


def reference_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     batch: Decode, scale: float, block_size: int) -> torch.Tensor:
    out = torch.empty_like(q)
    for i, n in enumerate(batch.seq_lens.tolist()):
        pos = torch.arange(n)
        slots = batch.block_table[i, pos // block_size].long() * block_size + pos % block_size
        o = F.scaled_dot_product_attention(q[i][:, None], k_cache[slots].transpose(0, 1),
                                           v_cache[slots].transpose(0, 1), scale=scale,
                                           enable_gqa=True)
        out[i] = o[:, 0]
    return out


def run_both(kernels: Kernels) -> None:
    """One layer's attention of the step above, the portable path against the CUDA path's
    wiring with `kernels`: same outputs, same caches."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    slots = 10 * BS
    cache = [(torch.randn(slots, kv_heads, dim, generator=g),
              torch.randn(slots, kv_heads, dim, generator=g))]
    tokens = int(NUM_NEW.sum())
    q = torch.randn(1, heads, tokens, dim, generator=g)
    k = torch.randn(1, kv_heads, tokens, dim, generator=g)
    v = torch.randn(1, kv_heads, tokens, dim, generator=g)
    layer = SimpleNamespace(layer_idx=0)
    caches = {name: [(kc.clone(), vc.clone()) for kc, vc in cache] for name in ("a", "b")}
    meta, positions = portable_metadata(STARTS, NUM_NEW, TABLE, BS, caches["a"],
                                        torch.device("cpu"))
    want, _ = paged_attention(layer, q, k, v, None, 0.3, tandem_meta=meta)  # type: ignore[arg-type]
    link = HostLink(torch.device("cpu"), pinned=False, synchronize=lambda: None)
    cmeta, cpositions = build_metadata(STARTS, NUM_NEW, TABLE, BS, caches["b"], link, kernels)
    got, _ = cuda_paged_attention(layer, q, k, v, None, 0.3,  # type: ignore[arg-type]
                                  tandem_meta=cmeta)
    assert cpositions.tolist() == positions.tolist()
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.equal(caches["a"][0][0], caches["b"][0][0])
    assert torch.equal(caches["a"][0][1], caches["b"][0][1])


def test_cuda_path_wiring_matches_the_portable_path():
    run_both(Kernels(reference_varlen, reference_decode))
    run_both(Kernels(reference_varlen, None))  # decodes as one-token varlen chunks


def test_triton_decode_kernel_in_the_interpreter():
    """The real decode kernel, jitted as the engine jits it, run by Triton's interpreter on the
    CPU inside the same step. The interpreter must be on before Triton is first imported, so
    the check runs in a fresh interpreter."""
    pytest.importorskip("triton")
    script = ("from tests.unit.engine_core.layers.test_attention_cuda import (run_both,\n"
              "    reference_varlen)\n"
              "from engine_core.layers.attention_cuda import Kernels, triton_paged_decode\n"
              "run_both(Kernels(reference_varlen, triton_paged_decode))\n")
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


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_decode_kernel_compiles_for_hopper(dtype: str, monkeypatch: pytest.MonkeyPatch):
    """Triton compiles the decode kernel for sm_90 (an H100/H200) without a GPU present."""
    triton = pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, said out loud
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine_core.layers.attention_cuda import decode_kernel

    ints = ["q_tok", "q_head", "kv_slot", "kv_head", "table_row", "o_tok", "o_head"]
    signature = {**{p: f"*{dtype}" for p in ("out_ptr", "q_ptr", "k_ptr", "v_ptr")},
                 "table_ptr": "*i32", "lens_ptr": "*i32", "scale": "fp32",
                 **{p: "i32" for p in ints}}
    constexprs = {"GROUP": 4, "BLOCK_SIZE": 16, "HEAD_DIM": 64, "PAD_D": 64, "TILE": 64}
    signature.update({name: "constexpr" for name in constexprs})
    source = ASTSource(triton.jit(decode_kernel), signature, constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert ".target sm_90" in compiled.asm["ptx"]
