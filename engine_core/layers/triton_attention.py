"""The Triton kernels of the CUDA attention: the fused KV-cache write and the paged decode.

- `kv_write_kernel`: one program per new token writes its K and V rows (every KV head) into
  their cache slot: one launch per layer instead of two `index_copy_`.
- `decode_kernel`: one program per (decode, KV head, split of the context) serves all the
  query heads of that KV head (GROUP of them, padded to 16 rows for `tl.dot`) from one read of
  each K/V tile: scores = Q·Kᵀ and the output += P·V are two `tl.dot`s, with the online
  softmax over tiles of TILE keys, each key's slot read through the block table in place. With
  more than one split, each writes its unnormalised output, running max and sum, and
  `combine_kernel` merges them; a split's share of the context is taken from the sequence's
  length in device memory, so the launch depends on the batch alone (a CUDA graph replays it).

An fp8 KV cache (quant/fp8_kv.py) is written and read by the same kernels: the write quantizes
(x / scale, saturated at ±448, cast to e4m3), the decode reads the e4m3 tiles as they are and
applies the layer's scales inside (K's to the scores, V's to the output); the scales are read
from device memory, never baked into a launch.

Fixed specializations, so nothing compiles again while serving: every integer argument that
varies with the step (splits) is kept out of Triton's specialization (`do_not_specialize`);
the strides are those of the cache and of the persistent block table, which never change;
pointers come from buffers allocated whole (16-byte aligned), never from views at odd offsets.
fp32 runs the same kernels, its `tl.dot`s in IEEE precision (not TF32), so exact parity tests
exercise them. Jitted on first use; the module imports without Triton.
"""

from __future__ import annotations

import functools
from typing import Any, no_type_check

import torch

from engine_core.quant import fp8_kv

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernels are only jitted where Triton is installed
    triton = tl = None  # type: ignore[assignment]

TILE = 64  # keys per iteration of the decode kernel
MIN_DOT = 16  # tl.dot's smallest dimension: a KV head's query heads are padded to it
MAX_SPLITS = 16  # context splits of one decode at most
SPLIT_KEYS = 512  # a split's keys at least, when the context decides (eager steps)


def available() -> bool:
    return triton is not None


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


# -- the KV-cache write ---------------------------------------------------------------------
def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor | None = None
             ) -> None:
    """key/value [T, Hkv, D] (any strides) into k_cache/v_cache [slots, Hkv, D] at `slots`
    [T] (int32 or int64), one launch; quantized with the layer's `scales` row (K's scale, V's)
    where the caches are fp8 (quant/fp8_kv.py)."""
    tokens, kv_heads, dim = key.shape
    if tokens == 0:
        return
    fp8 = fp8_kv.is_fp8(k_cache)
    assert scales is not None or not fp8, "an fp8 KV cache needs its layer's scales"
    _jitted("kv_write")[(tokens,)](
        key, value, k_cache, v_cache, slots, slots if scales is None else scales,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), k_cache.stride(0),
        k_cache.stride(1),
        KV_HEADS=kv_heads, HEAD_DIM=dim, PAD_H=_pow2(kv_heads), PAD_D=_pow2(dim, 16), FP8=fp8)


def write_kv_reference(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slots: torch.Tensor,
                       scales: torch.Tensor | None = None) -> None:
    """What `write_kv` does, in torch ops (the fallback, and the tests' reference)."""
    fp8_kv.write(k_cache, v_cache, slots, key, value, scales)


@no_type_check
def kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, scales_ptr, k_tok, k_head, v_tok,
                    v_head, c_slot, c_head, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    PAD_H: tl.constexpr, PAD_D: tl.constexpr, FP8: tl.constexpr):
    tok = tl.program_id(0)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    h = tl.arange(0, PAD_H)[:, None]
    d = tl.arange(0, PAD_D)[None, :]
    ok = (h < KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + tok * k_tok + h * k_head + d, mask=ok)
    v = tl.load(v_ptr + tok * v_tok + h * v_head + d, mask=ok)
    if FP8:  # x / scale, saturated at e4m3's ±448 (fp8_kv.quantize); the store casts
        k = tl.minimum(tl.maximum(k.to(tl.float32) / tl.load(scales_ptr), -448.0), 448.0)
        v = tl.minimum(tl.maximum(v.to(tl.float32) / tl.load(scales_ptr + 1), -448.0), 448.0)
    at = slot * c_slot + h * c_head + d
    tl.store(kc_ptr + at, k.to(kc_ptr.dtype.element_ty), mask=ok)
    tl.store(vc_ptr + at, v.to(vc_ptr.dtype.element_ty), mask=ok)


# -- the paged decode -----------------------------------------------------------------------
def splits_for(batch: int, kv_heads: int, max_context: int | None, sms: int = 132) -> int:
    """Context splits of each decode: enough programs to fill the GPU's `sms` at small batch,
    none at large batch; never splits shorter than SPLIT_KEYS keys of `max_context` (None: a
    captured graph, where any context may come, is split by the batch alone)."""
    wanted = max(1, min(MAX_SPLITS, -(-sms // max(1, batch * kv_heads))))
    if max_context is not None:
        wanted = min(wanted, max(1, -(-max_context // SPLIT_KEYS)))
    return wanted


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 table: torch.Tensor, table_rows: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, block_size: int, splits: int,
                 scales: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of single-token decodes q [B, H, D] over their paged contexts: decode i reads
    row table_rows[i] of `table` [R, W] (int32 block ids) for its seq_lens[i] keys. An fp8
    cache is read as it is, its `scales` (the layer's row: K's, V's) applied inside."""
    rows, heads, dim = q.shape
    fp8 = fp8_kv.is_fp8(k_cache)
    assert scales is not None or not fp8, "an fp8 KV cache needs its layer's scales"
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q)
    pad_d = _pow2(dim, 16)
    # the splits' partial results (a one-element stand-in with one split: the same dtypes
    # either way, so the kernel is specialized once)
    shape = (rows, heads, splits) if splits > 1 else (1, 1, 1)
    partial_o = torch.empty(*shape, pad_d, dtype=torch.float32, device=q.device)
    partial_ml = torch.empty(*shape, 2, dtype=torch.float32, device=q.device)
    ieee = q.dtype == torch.float32
    _jitted("decode")[(rows, kv_heads, splits)](
        out, q, k_cache, v_cache, table, table_rows, seq_lens, partial_o, partial_ml,
        partial_ml if scales is None else scales, scale, splits, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), table.stride(0), out.stride(0), out.stride(1),
        GROUP=group, PAD_G=_pow2(group, MIN_DOT), BLOCK_SIZE=block_size, HEAD_DIM=dim,
        PAD_D=pad_d, TILE=TILE, IEEE=ieee, FP8=fp8)
    if splits > 1:
        _jitted("combine")[(rows, heads)](
            out, partial_o, partial_ml, splits, out.stride(0), out.stride(1),
            HEAD_DIM=dim, PAD_D=pad_d, PAD_S=_pow2(MAX_SPLITS))
    return out


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           table: torch.Tensor, table_rows: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, block_size: int, splits: int = 1,
                           scales: torch.Tensor | None = None) -> torch.Tensor:
    """What `paged_decode` computes, in torch ops of fixed shapes (no host sync, nothing shaped
    by the data: a CUDA graph's stand-in can capture it): every row gathers its table row's
    whole width and masks what lies past its length. float32 arithmetic; an fp8 cache's rows
    dequantized as they are gathered (fp8_kv.read)."""
    rows, heads, _ = q.shape
    kv_heads = k_cache.shape[1]
    width = table.shape[1]
    blocks = table.index_select(0, table_rows.long()).long()  # [B, W]
    pos = torch.arange(width * block_size, device=q.device)
    slots = (blocks[:, pos // block_size] * block_size + pos % block_size)  # [B, W * bs]
    k = k_cache.index_select(0, slots.reshape(-1)).view(rows, -1, kv_heads, k_cache.shape[2])
    v = v_cache.index_select(0, slots.reshape(-1)).view(rows, -1, kv_heads, v_cache.shape[2])
    k = fp8_kv.read(k, scales, 0, torch.float32).float()
    v = fp8_kv.read(v, scales, 1, torch.float32).float()
    k = k.repeat_interleave(heads // kv_heads, dim=2)  # [B, L, H, D]
    v = v.repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bhd,blhd->bhl", q.float(), k) * scale
    valid = pos[None, :] < seq_lens.long()[:, None]  # [B, L]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    out = torch.einsum("bhl,blhd->bhd", scores.softmax(-1), v)
    return out.to(q.dtype)


@no_type_check
def decode_kernel(out_ptr, q_ptr, k_ptr, v_ptr, table_ptr, rows_ptr, lens_ptr, po_ptr, pml_ptr,
                  scales_ptr, scale, num_splits, q_tok, q_head, kv_slot, kv_head, table_row,
                  o_tok, o_head, GROUP: tl.constexpr, PAD_G: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr,
                  TILE: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr):
    seq = tl.program_id(0)
    kv_h = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, PAD_G)
    d = tl.arange(0, PAD_D)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_h * GROUP + g
    q = tl.load(q_ptr + seq * q_tok + heads[:, None] * q_head + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    n = tl.load(lens_ptr + seq)
    row = tl.load(rows_ptr + seq).to(tl.int64)
    # fp8: e4m3 entries are exact in the query's dtype; K's scale goes into the scores' scale,
    # V's into the output (on the accumulator: one multiply a row, not one an entry)
    v_scale = 1.0
    if FP8:
        scale = scale * tl.load(scales_ptr)
        v_scale = tl.load(scales_ptr + 1)
    per_split = tl.cdiv(tl.cdiv(n, num_splits), TILE) * TILE
    lo = split * per_split
    hi = tl.minimum(lo + per_split, n)
    m = tl.full([PAD_G], float("-inf"), tl.float32)
    total = tl.zeros([PAD_G], tl.float32)
    acc = tl.zeros([PAD_G, PAD_D], tl.float32)
    offs = tl.arange(0, TILE)
    for start in range(lo, hi, TILE):
        pos = start + offs
        ok = pos < hi
        block = tl.load(table_ptr + row * table_row + pos // BLOCK_SIZE, mask=ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        at = slot[:, None] * kv_slot + kv_h * kv_head + d[None, :]
        kv_ok = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + at, mask=kv_ok, other=0.0).to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + at, mask=kv_ok, other=0.0).to(q.dtype)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    acc = acc * v_scale
    out_ok = g_ok[:, None] & d_ok[None, :]
    if num_splits == 1:
        result = acc / total[:, None]
        tl.store(out_ptr + seq * o_tok + heads[:, None] * o_head + d[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=out_ok)
    else:
        base = (seq * GROUP * tl.num_programs(1) + heads) * num_splits + split  # [PAD_G]
        tl.store(po_ptr + base[:, None] * PAD_D + d[None, :], acc, mask=out_ok)
        tl.store(pml_ptr + base * 2, m, mask=g_ok)
        tl.store(pml_ptr + base * 2 + 1, total, mask=g_ok)


@no_type_check
def combine_kernel(out_ptr, po_ptr, pml_ptr, num_splits, o_tok, o_head, HEAD_DIM: tl.constexpr,
                   PAD_D: tl.constexpr, PAD_S: tl.constexpr):
    """Merge one (decode, query head)'s splits: their outputs weighted by exp(m_s - max m)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, PAD_S)
    d = tl.arange(0, PAD_D)
    s_ok = s < num_splits
    base = (seq * tl.num_programs(1) + head) * num_splits + s
    m = tl.load(pml_ptr + base * 2, mask=s_ok, other=float("-inf"))
    total = tl.load(pml_ptr + base * 2 + 1, mask=s_ok, other=0.0)
    acc = tl.load(po_ptr + base[:, None] * PAD_D + d[None, :], mask=s_ok[:, None], other=0.0)
    top = tl.max(m, axis=0)
    w = tl.where(s_ok, tl.exp(m - top), 0.0)
    result = tl.sum(acc * w[:, None], axis=0) / tl.sum(total * w, axis=0)
    tl.store(out_ptr + seq * o_tok + head * o_head + d, result.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


KERNELS: dict[str, tuple[Any, list[str]]] = {
    # name: (the kernel, its integer arguments kept out of Triton's specialization: those that
    # vary with the step's size)
    "kv_write": (kv_write_kernel, ["k_head", "v_head"]),
    "decode": (decode_kernel, ["num_splits", "q_head", "o_head"]),
    "combine": (combine_kernel, ["num_splits"]),
}


@functools.cache
def _jitted(name: str) -> Any:
    """The jitted kernel, once per process."""
    fn, fixed = KERNELS[name]
    return triton.jit(fn, do_not_specialize=fixed)
