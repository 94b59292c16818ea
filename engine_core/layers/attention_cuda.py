"""Paged attention on CUDA, never on the math kernel: FlashAttention varlen and a Triton decode.

The portable path (attention.py) masks SDPA, which on CUDA with grouped-query heads lands on
the fp32 math kernel, and copies every decode's whole context each layer. Here, per layer:
- the step's new K and V go into their cache slots in one launch (triton_attention.py);
- prefill chunks: one call of torch's built-in FlashAttention-2 varlen kernel
  (`aten._flash_attention_forward` with cumulative lengths: packed, no mask, grouped-query
  heads as they are) over every chunk of the step. FlashAttention aligns its causal mask to
  the bottom right, so a chunk that follows a cached prefix or an earlier chunk attends to its
  whole context with no mask. Chunks that start their sequence read the step's own K/V; when
  any chunk has context, each chunk's context is gathered from the cache (one index_select).
  FlashAttention runs bf16 and fp16 only: in float32 the chunks go to SDPA one by one
  (`sdpa_varlen`), the decodes and the KV write still to the Triton kernels;
- decodes: the Triton kernel (triton_attention.py) reads each sequence's keys and values in
  place, through its row of the runner's persistent block table on the device, all the query
  heads of a KV head at once. Without Triton, decodes join the varlen call as one-token chunks.
A decode-only step's decodes are every row of the step (`Decode.rows` None): no gather, no
scatter, and nothing the host decides per step but the buffers' contents, so a CUDA graph can
replay it (engine_core/worker/cuda_graphs.py). The step's metadata is planned on the host with
array ops (`plan`) and uploaded without a sync (host_link.py), each array 16-byte aligned.
With an fp8 cache (quant/fp8_kv.py) the KV write quantizes and the decode kernel dequantizes in
place; the prefill chunks' gathered contexts (a copy of those slots, as in any dtype) are
dequantized as they are gathered, for FlashAttention, which reads the model's dtype, and the
step's own K/V, where they serve, are rounded as the cache holds them (fp8_kv.as_stored).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from engine_core.layers import triton_attention
from engine_core.layers.attention import cache_slots
from engine_core.layers.host_link import HostLink
from engine_core.quant import fp8_kv
from engine_core.quant.fp8_kv import KVScales


class VarlenPlan(NamedTuple):
    """Chunks of one varlen call, on the host."""

    rows: np.ndarray  # int64 packed-batch rows of the queries, chunk after chunk
    kv_slots: np.ndarray | None  # int64 cache slots of each chunk's context; None: own K/V
    cu_q: np.ndarray  # int32 [n + 1] cumulative query lengths
    cu_k: np.ndarray  # int32 [n + 1] cumulative context lengths
    max_q: int
    max_k: int
    first: int | None = None  # the first query row, when the rows are consecutive


class DecodePlan(NamedTuple):
    """Single-token decodes read in place through the block table, on the host."""

    rows: np.ndarray  # int64 [Bd] packed rows
    table_rows: np.ndarray  # int32 [Bd] each decode's row of the block table
    seq_lens: np.ndarray  # int32 [Bd] context lengths, the new token included
    first: int | None = None  # 0 when the decodes are the step's first rows


def plan(starts: np.ndarray, num_new: np.ndarray, table: np.ndarray, table_rows: np.ndarray,
         block_size: int, paged_decode: bool) -> tuple[VarlenPlan | None, DecodePlan | None]:
    """Which rows of the step go to the varlen call and which to the paged decode.

    starts[i], num_new[i]: sequence i computes positions [starts[i], starts[i] + num_new[i]),
    its rows following those of sequence i - 1; its blocks are row table_rows[i] of `table`
    [R, W]. With `paged_decode`, single-token rows go to the decode kernel, else to the
    varlen call."""
    offsets = np.cumsum(num_new) - num_new
    is_decode = (num_new == 1) if paged_decode else np.zeros(len(num_new), dtype=bool)
    dec = np.nonzero(is_decode)[0]
    # the scheduler's usual order, decodes then chunks: each side's rows are consecutive
    split = bool(is_decode[:len(dec)].all())
    decode = None
    if len(dec):
        decode = DecodePlan(offsets[dec].astype(np.int64), table_rows[dec].astype(np.int32),
                            (starts[dec] + 1).astype(np.int32), 0 if split else None)
    chunks = np.nonzero(~is_decode)[0]
    if not len(chunks):
        return None, decode
    q, ctx = num_new[chunks], starts[chunks] + num_new[chunks]
    rows = np.repeat(offsets[chunks], q) + np.arange(int(q.sum())) - np.repeat(
        np.cumsum(q) - q, q)
    kv = None
    if bool(starts[chunks].any()):
        kv, _ = cache_slots(table, table_rows[chunks], np.zeros(len(chunks), np.int64), ctx,
                            block_size)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (q, ctx))
    varlen = VarlenPlan(rows.astype(np.int64), None if kv is None else kv.astype(np.int64),
                        cu_q, cu_k, int(q.max()), int(ctx.max()), len(dec) if split else None)
    return varlen, decode


class Varlen(NamedTuple):
    rows: torch.Tensor | None  # the query rows; None: `first` and on, consecutive
    kv_slots: torch.Tensor | None
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    lengths: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())  # cu_q, cu_k on the host
    first: int = 0

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The chunks' rows of x (a slice where they are consecutive)."""
        if self.rows is None:
            return x[self.first:self.first + self.lengths[0][-1]]
        return x.index_select(0, self.rows)

    def put(self, out: torch.Tensor, values: torch.Tensor) -> None:
        if self.rows is None:
            out[self.first:self.first + len(values)] = values
        else:
            out.index_copy_(0, self.rows, values)


class Decode(NamedTuple):
    # [Bd] packed rows of the decodes; None: every row of the step, or (`leading`) its first Bd
    rows: torch.Tensor | None
    table: torch.Tensor  # [R, W] int32: the runner's persistent block table
    table_rows: torch.Tensor  # [Bd] int32: each decode's row of it
    seq_lens: torch.Tensor  # [Bd] int32: context lengths, the new token included
    splits: int = 1  # context splits of each decode (triton_attention.splits_for)
    leading: bool = False  # the decodes are the step's first rows, chunks after them


class Kernels(NamedTuple):
    """varlen(q, k, v, batch, scale) -> out [Tq, H, D]: causal, bottom-right aligned;
    decode(q, k_cache, v_cache, batch, scale, block_size, scales) -> out [Bd, H, D], or None;
    write_kv(key, value, k_cache, v_cache, slots, scales): the step's K/V into their slots.
    `scales`: the layer's row of fp8 scales (quant/fp8_kv.py), None with a cache in the model's
    dtype."""

    varlen: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Varlen, float], torch.Tensor]
    decode: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Decode, float, int,
                      torch.Tensor | None], torch.Tensor] | None
    write_kv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                        torch.Tensor | None], None] = triton_attention.write_kv_reference


@dataclass
class CudaAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int32: where each new token's K/V goes
    block_size: int
    varlen: Varlen | None
    decode: Decode | None
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [slots, Hkv, D] each
    kernels: Kernels
    kv_scales: KVScales | None = None  # an fp8 cache's scales (quant/fp8_kv.py)

    def scales(self, layer: int) -> torch.Tensor | None:
        """Layer `layer`'s row of fp8 scales, None without them."""
        return None if self.kv_scales is None else self.kv_scales.row(layer)


def build_metadata(starts: np.ndarray, num_new: np.ndarray, table: np.ndarray,
                   table_rows: np.ndarray, device_table: torch.Tensor, block_size: int,
                   kv_caches: list[tuple[torch.Tensor, torch.Tensor]], link: HostLink,
                   kernels: Kernels, kv_scales: KVScales | None = None
                   ) -> tuple[CudaAttentionMetadata, np.ndarray]:
    """The step's metadata on the device (two uploads) and the packed tokens' positions.
    `table` is the host's copy of `device_table`; sequence i's blocks are its row
    table_rows[i]."""
    slots, positions = cache_slots(table, table_rows, starts, num_new, block_size)
    varlen, decode = plan(starts, num_new, table, table_rows, block_size,
                          kernels.decode is not None)
    longs: list[np.ndarray] = []
    ints: list[np.ndarray] = [slots]  # int32, as a CUDA graph's: one kernel specialization
    consecutive = varlen is not None and varlen.first is not None
    if varlen is not None:
        longs += ([] if consecutive else [varlen.rows]) + (
            [] if varlen.kv_slots is None else [varlen.kv_slots])
        ints += [varlen.cu_q, varlen.cu_k]
    if decode is not None:
        ints += [decode.table_rows, decode.seq_lens]
        if varlen is not None and not consecutive:
            longs.append(decode.rows)
    up64 = iter(link.upload_many(longs, np.int64) if longs else [])
    up32 = iter(link.upload_many(ints, np.int32))
    slot_mapping = next(up32)
    on_varlen = on_decode = None
    if varlen is not None:
        rows = None if consecutive else next(up64)
        kv = None if varlen.kv_slots is None else next(up64)
        on_varlen = Varlen(rows, kv, next(up32), next(up32), varlen.max_q, varlen.max_k,
                           (tuple(varlen.cu_q.tolist()), tuple(varlen.cu_k.tolist())),
                           varlen.first or 0)
    if decode is not None:
        table_rows_d, lens = next(up32), next(up32)
        splits = triton_attention.splits_for(len(decode.rows), kv_caches[0][0].shape[1],
                                             int(decode.seq_lens.max()))
        on_decode = Decode(next(up64) if varlen is not None and not consecutive else None,
                           device_table, table_rows_d, lens, splits,
                           leading=varlen is not None and consecutive)
    meta = CudaAttentionMetadata(slot_mapping, block_size, on_varlen, on_decode, kv_caches,
                                 kernels, kv_scales)
    return meta, positions


def cuda_paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: torch.Tensor | None,
                         scaling: float | None = None, dropout: float = 0.0,
                         tandem_meta: CudaAttentionMetadata | None = None, **_: object
                         ) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function (the models it runs through transformers):
    query [1, H, T, D], key/value [1, Hkv, T, D]; the step's K/V written, then `attend`.

    Returns [1, T, H, D] as transformers expects."""
    assert tandem_meta is not None, "cuda_paged_attention needs tandem_meta"
    meta = tandem_meta
    layer: int = module.layer_idx  # type: ignore[assignment]
    k_cache, v_cache = meta.kv_caches[layer]
    k_new, v_new = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
    if meta.kv_scales is not None:
        meta.kv_scales.calibrate(layer, k_new, v_new)
    meta.kernels.write_kv(k_new, v_new, k_cache, v_cache, meta.slot_mapping, meta.scales(layer))
    q = query[0].transpose(0, 1)  # [T, H, D]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    return attend(layer, q, k_new, v_new, scale, meta).unsqueeze(0), None


def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           meta: CudaAttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
    """Layer `layer`'s attention of the step's queries q [T, H, D] over their contexts, the
    step's own keys and values k, v [T, Hkv, D] already in the cache; into `out` [T, H, D]
    when given. (The attention backend of Tandem's own models, engine_core/models/.)"""
    k_cache, v_cache = meta.kv_caches[layer]
    scales = meta.scales(layer)
    dec = meta.decode
    if dec is not None and dec.rows is None and not dec.leading:  # a decode-only step
        assert meta.kernels.decode is not None and meta.varlen is None
        result = meta.kernels.decode(q, k_cache, v_cache, dec, scale, meta.block_size, scales)
        return result if out is None else out.copy_(result)
    out = q.new_empty(q.shape) if out is None else out
    if meta.varlen is not None:
        batch = meta.varlen
        if batch.kv_slots is None:  # every chunk starts its sequence: the step's own K/V
            kv = (fp8_kv.as_stored(batch.take(k), k_cache, scales, 0),
                  fp8_kv.as_stored(batch.take(v), v_cache, scales, 1))
        else:  # the chunks' contexts gathered (an fp8 cache's dequantized as they come)
            kv = (fp8_kv.read(k_cache.index_select(0, batch.kv_slots), scales, 0, q.dtype),
                  fp8_kv.read(v_cache.index_select(0, batch.kv_slots), scales, 1, q.dtype))
        batch.put(out, meta.kernels.varlen(batch.take(q), *kv, batch, scale))
    if dec is not None:
        assert meta.kernels.decode is not None
        if dec.leading:  # the step's first rows: read and written in place
            count = len(dec.table_rows)
            out[:count] = meta.kernels.decode(q[:count], k_cache, v_cache, dec, scale,
                                              meta.block_size, scales)
        else:
            assert dec.rows is not None
            od = meta.kernels.decode(q.index_select(0, dec.rows), k_cache, v_cache, dec, scale,
                                     meta.block_size, scales)
            out.index_copy_(0, dec.rows, od)
    return out


# -- the kernels ----------------------------------------------------------------------------
def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Varlen,
                 scale: float) -> torch.Tensor:
    """torch's FlashAttention-2 varlen forward (CUDA, bf16/fp16): causal, bottom-right."""
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, batch.cu_q, batch.cu_k, batch.max_q, batch.max_k, 0.0, True, False,
        scale=scale)
    return out[0]


def sdpa_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Varlen,
                scale: float) -> torch.Tensor:
    """FlashAttention's varlen semantics by SDPA, chunk by chunk (any dtype: float32 on CUDA,
    the CPU's tests): per chunk, causal aligned to the bottom right. Reads the chunks' lengths
    from the host copy, so it never syncs."""
    out = torch.empty_like(q)
    cq, ck = batch.lengths
    for i in range(len(cq) - 1):
        qs, ks, vs = q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]]
        nq, nk = len(qs), len(ks)
        mask = None
        if nq > 1:
            mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
        o = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1),
                                           vs.transpose(0, 1), attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        out[cq[i]:cq[i + 1]] = o.transpose(0, 1)
    return out


def triton_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  batch: Decode, scale: float, block_size: int,
                  scales: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton paged decode (triton_attention.py)."""
    return triton_attention.paged_decode(q, k_cache, v_cache, batch.table, batch.table_rows,
                                         batch.seq_lens, scale, block_size, batch.splits, scales)


def reference_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     batch: Decode, scale: float, block_size: int,
                     scales: torch.Tensor | None = None) -> torch.Tensor:
    """The decode in torch ops of fixed shapes (triton_attention.paged_decode_reference): the
    CPU's stand-in for the Triton kernel, graph-safe."""
    return triton_attention.paged_decode_reference(q, k_cache, v_cache, batch.table,
                                                   batch.table_rows, batch.seq_lens, scale,
                                                   block_size, scales=scales)


def cuda_kernels(dtype: torch.dtype = torch.bfloat16, decode: bool = True,
                 kv_write: bool = True, device: torch.device | None = None) -> Kernels:
    """The CUDA path's kernels for `dtype`: FlashAttention varlen (SDPA chunk by chunk in
    float32), the Triton decode and KV write where Triton is installed and they are wanted
    (the platform turns one off when the device check found it broken). On the CPU (the
    device check's dry run, the tests) the same path runs with the kernels' references."""
    if device is not None and device.type == "cpu":
        return Kernels(sdpa_varlen, reference_decode if decode else None,
                       triton_attention.write_kv_reference)
    triton_ok = triton_attention.available()
    return Kernels(flash_varlen if dtype in (torch.bfloat16, torch.float16) else sdpa_varlen,
                   triton_decode if decode and triton_ok else None,
                   triton_attention.write_kv if kv_write and triton_ok
                   else triton_attention.write_kv_reference)
