"""The kernels stage, first after the build (about 10 s): each CUDA attention kernel alone,
against its reference, and timed, before any engine depends on it.

- `flash_varlen` (FlashAttention-2 varlen: the prefill chunks), here on one-token chunks, the
  shape decodes take when they fall back to it, against SDPA chunk by chunk in float32;
- `triton_decode` (the paged decode, all of a KV head's query heads from one read) against the
  fixed-shape torch reference in float32;
- `write_kv` (K and V into their slots in one launch) against `index_copy_`, exactly;
- the layers' small ops (`TritonOps`: `add_rms_norm`, `silu_mul`, `rope_cache`, the last with
  Qwen3's q/k norms) against `TorchOps`, transformers' arithmetic, relative to the values'
  scale, on one token per decode of the case;

each at (decodes, context) of `Sizes.kernel_cases`: (64, 1k), (1, 32k) and (3, 1061) on the GPU, in
bf16, the model's heads (32 query / 8 KV, head dim 64), blocks of 16 scattered in the cache.
A kernel that fails (an error, or outside its tolerance) switches every later stage (and the
served engine) to its fallback through the platform's environment variable: the decode to
the varlen call (TANDEM_TRITON_DECODE=0), the write to torch ops (TANDEM_TRITON_KV_WRITE=0),
a broken FlashAttention to the portable attention (TANDEM_ATTENTION=portable), a broken layer
op to torch's ops (TANDEM_TRITON_OPS=0). So they still measure something.

In the dry run the Triton kernels run in Triton's interpreter, in a fresh process (it must be
on before Triton is imported), in float32 at tiny sizes; FlashAttention, CUDA-only, is replaced
by its SDPA stand-in: the stage's wiring and the references are what it rehearses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine_core.layers import attention_cuda, triton_attention
from engine_core.layers.attention_cuda import Decode, Varlen
from engine_core.layers.ops import HeadShape, QKNorm, TorchOps
from engine_core.layers.rotary import RotaryTable
from engine_core.layers.triton_ops import TritonOps
from tests.device.context import Context

BLOCK = 16
FALLBACKS = {"flash_varlen": ("TANDEM_ATTENTION", "portable"),
             "triton_decode": ("TANDEM_TRITON_DECODE", "0"),
             "write_kv": ("TANDEM_TRITON_KV_WRITE", "0"),
             **{name: ("TANDEM_TRITON_OPS", "0") for name in ("add_rms_norm", "silu_mul",
                                                             "rope_cache")}}
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def kernels(ctx: Context) -> dict[str, Any]:
    spec = ctx.sizes.spec
    shape = (spec.num_heads, spec.num_kv_heads, spec.hidden_size // spec.num_heads)
    if ctx.device == "cuda":
        results = check_all("cuda", torch.bfloat16, shape, ctx.sizes.kernel_cases)
    else:
        results = interpreted(shape, ctx.sizes.kernel_cases)
    fallbacks = {}
    for name, record in results.items():
        if not record["ok"]:
            variable, value = FALLBACKS[name]
            os.environ[variable] = value
            fallbacks[name] = f"{variable}={value}"
    return {"kernels": results, "fallbacks": fallbacks, "passed": not fallbacks}


def interpreted(shape: tuple[int, int, int],
                cases: tuple[tuple[int, int], ...]) -> dict[str, Any]:
    """The checks on the CPU, in a fresh interpreter with TRITON_INTERPRET=1."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "tests.device.check_kernels", json.dumps(
        {"shape": shape, "cases": cases})], env=env, capture_output=True, text=True,
        timeout=240, cwd=Path(__file__).parents[2], check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the interpreted kernel checks failed:\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def check_all(device: str, dtype: torch.dtype, shape: tuple[int, int, int],
              cases: tuple[tuple[int, int], ...]) -> dict[str, Any]:
    cpu = device == "cpu"
    checks: dict[str, Callable[[Any], tuple[float, Callable[[], object]]]] = {
        "flash_varlen": check_varlen, "triton_decode": check_decode, "write_kv": check_write,
        "add_rms_norm": check_norm, "silu_mul": check_silu, "rope_cache": check_rope}
    out: dict[str, Any] = {}
    for name, check in checks.items():
        record: dict[str, Any] = {"ok": True, "cases": []}
        for batch, context in cases:
            case = Case(device, dtype, *shape, batch, context, cpu)
            try:
                start = time.perf_counter()
                error, launch = check(case)
                # (on the CPU, in the interpreter, the check's own run is the time)
                ms = time_ms(launch, device) if not cpu else 1e3 * (time.perf_counter() - start)
                ok = error <= TOLERANCE[dtype]
                record["cases"].append({"batch": batch, "context": context, "max_error": error,
                                        "ms": ms, "ok": ok})
                record["ok"] &= ok
            except Exception as exc:  # recorded: the stage switches to the fallback
                record["cases"].append({"batch": batch, "context": context,
                                        "error": f"{type(exc).__name__}: {exc}"[:500]})
                record["ok"] = False
        out[name] = record
    return out


class Case:
    """`batch` decodes of `context` keys each, over blocks scattered in a random cache."""

    def __init__(self, device: str, dtype: torch.dtype, heads: int, kv_heads: int, dim: int,
                 batch: int, context: int, cpu: bool) -> None:
        g = torch.Generator().manual_seed(batch * 7 + context)
        width = -(-context // BLOCK)
        blocks = torch.randperm(batch * width, generator=g).view(batch, width).int()
        self.table = torch.cat([torch.zeros(1, width, dtype=torch.int32), blocks]).to(device)
        self.rows = torch.arange(1, batch + 1, dtype=torch.int32, device=device)
        self.lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        slots = batch * width * BLOCK
        self.k = torch.randn(slots, kv_heads, dim, generator=g).to(device, dtype)
        self.v = torch.randn(slots, kv_heads, dim, generator=g).to(device, dtype)
        self.q = torch.randn(batch, heads, dim, generator=g).to(device, dtype)
        self.scale = dim ** -0.5
        self.batch, self.context, self.cpu = batch, context, cpu

    def decode(self, splits: int | None = None) -> Decode:
        n = splits or triton_attention.splits_for(self.batch, self.k.shape[1], self.context)
        return Decode(None, self.table, self.rows, self.lens, n)

    def reference(self) -> torch.Tensor:
        return triton_attention.paged_decode_reference(
            self.q.float(), self.k.float(), self.v.float(), self.table, self.rows, self.lens,
            self.scale, BLOCK)


def check_decode(case: Case) -> tuple[float, Callable[[], object]]:
    def launch() -> torch.Tensor:
        return attention_cuda.triton_decode(case.q, case.k, case.v, case.decode(), case.scale,
                                            BLOCK)

    got = launch().float()
    return float((got - case.reference()).abs().max()), launch


def check_varlen(case: Case) -> tuple[float, Callable[[], object]]:
    """One-token chunks over each decode's gathered context."""
    pos = torch.arange(case.context, device=case.q.device)
    blocks = case.table[case.rows.long()].long()
    slots = (blocks[:, pos // BLOCK] * BLOCK + pos % BLOCK).reshape(-1)
    k, v = case.k.index_select(0, slots), case.v.index_select(0, slots)
    cu_q = torch.arange(case.batch + 1, dtype=torch.int32, device=case.q.device)
    cu_k = cu_q * case.context
    batch = Varlen(cu_q, None, cu_q, cu_k, 1, case.context,
                   (tuple(cu_q.tolist()), tuple(cu_k.tolist())))
    kernel = attention_cuda.sdpa_varlen if case.cpu else attention_cuda.flash_varlen

    def launch() -> torch.Tensor:
        return kernel(case.q, k, v, batch, case.scale)

    got = launch().float()
    return float((got - case.reference()).abs().max()), launch


def check_write(case: Case) -> tuple[float, Callable[[], object]]:
    """The decodes' new K/V (as the layer passes them: strided views) into their slots."""
    tokens = case.batch
    key = case.q[:, :case.k.shape[1]].transpose(0, 1).contiguous().transpose(0, 1)
    value = key * 2
    slots = (case.table[case.rows.long(), 0].long() * BLOCK + 3).int()
    k, v = case.k.clone(), case.v.clone()
    want_k, want_v = case.k.clone(), case.v.clone()
    triton_attention.write_kv_reference(key[:tokens], value[:tokens], want_k, want_v, slots)

    def launch() -> None:
        triton_attention.write_kv(key, value, k, v, slots)

    launch()
    error = float(max((k.float() - want_k.float()).abs().max(),
                      (v.float() - want_v.float()).abs().max()))
    return error, launch


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def check_norm(case: Case) -> tuple[float, Callable[[], object]]:
    """RMSNorm with the residual add, over rows of the model's width."""
    x = case.q.reshape(case.batch, -1)
    residual, weight = x.flip(0).contiguous(), x[0] * 2
    want_residual = residual.clone()
    want = TorchOps().add_rms_norm(x.clone(), want_residual, weight, 1e-5)
    ops = TritonOps()

    def launch() -> torch.Tensor:
        return ops.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)

    got_residual = residual.clone()
    got = ops.add_rms_norm(x.clone(), got_residual, weight, 1e-5)
    return max(_relative(got, want), _relative(got_residual, want_residual)), launch


def check_silu(case: Case) -> tuple[float, Callable[[], object]]:
    """SiLU(gate) x up over rows of twice the model's width (its MLP's, scaled down)."""
    gate_up = torch.cat([case.q.reshape(case.batch, -1)] * 2, dim=1) * 3
    ops = TritonOps()
    return _relative(ops.silu_mul(gate_up), TorchOps().silu_mul(gate_up)), \
        lambda: ops.silu_mul(gate_up)


def check_rope(case: Case) -> tuple[float, Callable[[], object]]:
    """The rotary embedding (and Qwen3's q/k norms) of a token per decode, its K/V written."""
    heads, kv_heads, dim = case.q.shape[1], case.k.shape[1], case.q.shape[2]
    shape = HeadShape(heads, kv_heads, dim)
    g = torch.Generator().manual_seed(case.batch)
    qkv = torch.randn(case.batch, shape.qkv_width, generator=g).to(case.q)
    positions = (case.lens - 1).int()
    angles = torch.arange(case.context, dtype=torch.float32)[:, None] * torch.rand(
        dim // 2, generator=g)
    emb = torch.cat((angles, angles), dim=-1).to(case.q.device)
    table = RotaryTable(emb.cos().contiguous(), emb.sin().contiguous())
    slots = (case.table[case.rows.long(), 0].long() * BLOCK + 5).int()
    norm = QKNorm(case.q[0, 0] + 1, case.q[0, 1] + 1, 1e-6)
    error = 0.0
    for ops_norm in (None, norm):
        results = []
        for ops in (TorchOps(), TritonOps()):
            q, k, v = qkv.clone(), case.k.clone(), case.v.clone()
            ops.rope_and_cache(q, positions, table, shape, k, v, slots, ops_norm)
            results.append((q, k[slots.long()], v[slots.long()]))
        error = max([error] + [_relative(b, a) for a, b in zip(*results)])
    ops, work = TritonOps(), qkv.clone()
    return error, lambda: ops.rope_and_cache(work, positions, table, shape, case.k, case.v,
                                             slots, norm)


def time_ms(launch: Callable[[], object], device: str, runs: int = 20) -> float:
    """Median milliseconds of one launch, by CUDA events."""
    launch()
    times = []
    for _ in range(runs):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        launch()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return float(np.median(times))


if __name__ == "__main__":  # the interpreted run: python -m tests.device.check_kernels JSON
    args = json.loads(sys.argv[1])
    dry_cases = ((2, 48), (1, 80), (3, 37))  # the interpreter runs each program in Python
    heads, kv_heads, dim = args["shape"]
    print(json.dumps(check_all("cpu", torch.float32, (heads, kv_heads, dim), dry_cases)))
