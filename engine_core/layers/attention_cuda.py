"""Paged attention on CUDA, never on the math kernel: FlashAttention varlen and a Triton decode.

The portable path (attention.py) masks SDPA, which on CUDA with grouped-query heads lands on
the fp32 math kernel, and copies every decode's whole context each layer. Here, per layer:
- the step's new K/V go into their cache slots (as the portable path);
- prefill chunks: one call of torch's built-in FlashAttention-2 varlen kernel
  (`aten._flash_attention_forward` with cumulative lengths: packed, no mask, grouped-query
  heads as they are) over every chunk of the step. FlashAttention aligns its causal mask to
  the bottom right, so a chunk that follows a cached prefix or an earlier chunk attends to its
  whole context with no mask. Chunks that start their sequence read the step's own K/V; when
  any chunk has context, each chunk's context is gathered from the cache (one index_select);
- decodes: a Triton kernel reads each sequence's keys and values through its block table in
  place, one program per sequence and query head, online softmax over tiles of TILE keys.
  Without Triton, decodes join the varlen call as one-token chunks (contexts gathered).
FlashAttention runs in bf16 and fp16 only: the platform picks this path for those dtypes
(engine_core/worker/platform.py). The step's metadata is planned on the host with array ops
(`plan`) and uploaded without a sync (host_link.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, no_type_check

import numpy as np
import torch

from engine_core.layers.attention import cache_slots
from engine_core.layers.host_link import HostLink

try:
    import triton
    import triton.language as tl
except ImportError:  # the decode kernel is only jitted where Triton is installed
    triton = tl = None  # type: ignore[assignment]

TILE = 64  # keys per iteration of the decode kernel


class VarlenPlan(NamedTuple):
    """Chunks of one varlen call, on the host."""

    rows: np.ndarray  # int64 packed-batch rows of the queries, chunk after chunk
    kv_slots: np.ndarray | None  # int64 cache slots of each chunk's context; None: own K/V
    cu_q: np.ndarray  # int32 [n + 1] cumulative query lengths
    cu_k: np.ndarray  # int32 [n + 1] cumulative context lengths
    max_q: int
    max_k: int


class DecodePlan(NamedTuple):
    """Single-token decodes read in place through their block tables, on the host."""

    rows: np.ndarray  # int64 [Bd]
    block_table: np.ndarray  # int32 [Bd, nb]
    seq_lens: np.ndarray  # int32 [Bd] context lengths, the new token included


def plan(starts: np.ndarray, num_new: np.ndarray, block_table: np.ndarray, block_size: int,
         paged_decode: bool) -> tuple[VarlenPlan | None, DecodePlan | None]:
    """Which rows of the step go to the varlen call and which to the paged decode.

    starts[i], num_new[i]: sequence i computes positions [starts[i], starts[i] + num_new[i]),
    its rows following those of sequence i - 1; block_table [B, max_blocks]. With
    `paged_decode`, single-token rows go to the decode kernel, else to the varlen call."""
    offsets = np.cumsum(num_new) - num_new
    is_decode = (num_new == 1) if paged_decode else np.zeros(len(num_new), dtype=bool)
    dec = np.nonzero(is_decode)[0]
    decode = None
    if len(dec):
        lens = starts[dec] + 1
        width = -(-int(lens.max()) // block_size)
        decode = DecodePlan(offsets[dec].astype(np.int64),
                            block_table[dec, :width].astype(np.int32), lens.astype(np.int32))
    chunks = np.nonzero(~is_decode)[0]
    if not len(chunks):
        return None, decode
    q, ctx = num_new[chunks], starts[chunks] + num_new[chunks]
    rows = np.repeat(offsets[chunks], q) + np.arange(int(q.sum())) - np.repeat(
        np.cumsum(q) - q, q)
    kv = None
    if bool(starts[chunks].any()):
        kv, _ = cache_slots(block_table, chunks, np.zeros(len(chunks), np.int64), ctx,
                            block_size)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (q, ctx))
    varlen = VarlenPlan(rows.astype(np.int64), None if kv is None else kv.astype(np.int64),
                        cu_q, cu_k, int(q.max()), int(ctx.max()))
    return varlen, decode


class Varlen(NamedTuple):
    rows: torch.Tensor
    kv_slots: torch.Tensor | None
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


class Decode(NamedTuple):
    rows: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor


class Kernels(NamedTuple):
    """varlen(q, k, v, batch, scale) -> out [Tq, H, D]: causal, bottom-right aligned;
    decode(q, k_cache, v_cache, batch, scale, block_size) -> out [Bd, H, D], or None."""

    varlen: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Varlen, float], torch.Tensor]
    decode: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Decode, float, int],
                     torch.Tensor] | None


@dataclass
class CudaAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    block_size: int
    varlen: Varlen | None
    decode: Decode | None
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [slots, Hkv, D] each
    kernels: Kernels


def build_metadata(starts: np.ndarray, num_new: np.ndarray, block_table: np.ndarray,
                   block_size: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                   link: HostLink, kernels: Kernels) -> tuple[CudaAttentionMetadata, np.ndarray]:
    """The step's metadata on the device (two uploads) and the packed tokens' positions."""
    slots, positions = cache_slots(block_table, np.arange(len(starts)), starts, num_new,
                                   block_size)
    varlen, decode = plan(starts, num_new, block_table, block_size, kernels.decode is not None)
    longs: list[np.ndarray] = [slots]
    ints: list[np.ndarray] = []
    if varlen is not None:
        longs += [varlen.rows] + ([] if varlen.kv_slots is None else [varlen.kv_slots])
        ints += [varlen.cu_q, varlen.cu_k]
    if decode is not None:
        longs.append(decode.rows)
        ints += [decode.block_table, decode.seq_lens]
    up64 = iter(link.upload_many(longs, np.int64))
    up32 = iter(link.upload_many(ints, np.int32) if ints else [])
    slot_mapping = next(up64)
    on_varlen = on_decode = None
    if varlen is not None:
        rows = next(up64)
        kv = None if varlen.kv_slots is None else next(up64)
        on_varlen = Varlen(rows, kv, next(up32), next(up32), varlen.max_q, varlen.max_k)
    if decode is not None:
        on_decode = Decode(next(up64), next(up32), next(up32))
    meta = CudaAttentionMetadata(slot_mapping, block_size, on_varlen, on_decode, kv_caches,
                                 kernels)
    return meta, positions


def cuda_paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: torch.Tensor | None,
                         scaling: float | None = None, dropout: float = 0.0,
                         tandem_meta: CudaAttentionMetadata | None = None, **_: object
                         ) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function: query [1, H, T, D], key/value [1, Hkv, T, D].

    Returns [1, T, H, D] as transformers expects."""
    assert tandem_meta is not None, "cuda_paged_attention needs tandem_meta"
    meta = tandem_meta
    k_cache, v_cache = meta.kv_caches[module.layer_idx]  # type: ignore[index]
    k_new, v_new = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
    k_cache.index_copy_(0, meta.slot_mapping, k_new)
    v_cache.index_copy_(0, meta.slot_mapping, v_new)
    q = query[0].transpose(0, 1)  # [T, H, D]
    out = q.new_empty(q.shape)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    if meta.varlen is not None:
        batch = meta.varlen
        qv = q.index_select(0, batch.rows)
        if batch.kv_slots is None:  # every chunk starts its sequence: the step's own K/V
            kv = k_new.index_select(0, batch.rows), v_new.index_select(0, batch.rows)
        else:
            kv = k_cache.index_select(0, batch.kv_slots), v_cache.index_select(0, batch.kv_slots)
        out.index_copy_(0, batch.rows, meta.kernels.varlen(qv, *kv, batch, scale))
    if meta.decode is not None:
        assert meta.kernels.decode is not None
        dec = meta.decode
        od = meta.kernels.decode(q.index_select(0, dec.rows), k_cache, v_cache, dec, scale,
                                 meta.block_size)
        out.index_copy_(0, dec.rows, od)
    return out.unsqueeze(0), None


# -- the CUDA kernels ---------------------------------------------------------------------
def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Varlen,
                 scale: float) -> torch.Tensor:
    """torch's FlashAttention-2 varlen forward (CUDA, bf16/fp16): causal, bottom-right."""
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, batch.cu_q, batch.cu_k, batch.max_q, batch.max_k, 0.0, True, False,
        scale=scale)
    return out[0]


def triton_paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        batch: Decode, scale: float, block_size: int,
                        kernel: Any = None) -> torch.Tensor:
    """The Triton decode kernel (`kernel`: a jitted `decode_kernel`, the cached one if None)."""
    kernel = kernel or _jitted_decode()
    out = torch.empty_like(q)
    rows, heads, dim = q.shape
    kernel[(rows, heads)](
        out, q, k_cache, v_cache, batch.block_table, batch.seq_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        batch.block_table.stride(0), out.stride(0), out.stride(1),
        GROUP=heads // k_cache.shape[1], BLOCK_SIZE=block_size, HEAD_DIM=dim,
        PAD_D=max(16, 1 << (dim - 1).bit_length()), TILE=TILE)
    return out


def cuda_kernels() -> Kernels:
    """FlashAttention varlen, with the Triton decode when Triton is installed."""
    return Kernels(flash_varlen, triton_paged_decode if triton is not None else None)


@functools.cache
def _jitted_decode() -> Any:
    return triton.jit(decode_kernel)


@no_type_check
def decode_kernel(out_ptr, q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, scale,
                  q_tok, q_head, kv_slot, kv_head, table_row, o_tok, o_head,
                  GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                  PAD_D: tl.constexpr, TILE: tl.constexpr):
    """One program per (decode, query head): the online softmax over the sequence's keys, TILE
    at a time, each key's slot read from the block table (jitted by Triton when first used)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_h = head // GROUP
    d = tl.arange(0, PAD_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + seq * q_tok + head * q_head + d, mask=d_ok, other=0.0).to(tl.float32)
    n = tl.load(lens_ptr + seq)
    m = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([PAD_D], tl.float32)
    offs = tl.arange(0, TILE)
    for start in range(0, n, TILE):
        pos = start + offs
        ok = pos < n
        block = tl.load(table_ptr + seq * table_row + pos // BLOCK_SIZE, mask=ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        at = slot[:, None] * kv_slot + kv_h * kv_head + d[None, :]
        mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + at, mask=mask, other=0.0).to(tl.float32)
        s = tl.where(ok, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        total = total * alpha + tl.sum(p, axis=0)
        v = tl.load(v_ptr + at, mask=mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    result = (acc / total).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + seq * o_tok + head * o_head + d, result, mask=d_ok)
