"""Paged attention over one packed batch of prefill chunks and decodes.

The step's metadata (`AttentionMetadata`) is built once per step with array ops and shared
by every layer. Each layer writes the step's new K/V into its slots of the paged cache, then
attends:
- decodes (one query each): on the CPU in float32 (the "native" backend), one call of the
  compiled kernel (csrc/kernels.c `decode_attention`) that reads each row's context from the
  paged cache in place, each row to its own length; elsewhere one batched SDPA call over
  their contexts, gathered a whole cache block at a time (index_select of whole blocks, much
  faster than gathering slot by slot: docs/benchmarks.md) and padded to the longest with a
  mask;
- prefill chunks one SDPA call each, causal with the chunk's offset in its sequence. A chunk
  that starts its sequence attends to the step's own K/V, with no gather at all; a later chunk
  (after a cached prefix, or a chunked prompt's next part) gathers its context's blocks.
`attend` is the portable torch path (CPU, and CUDA fallback) for Tandem's own models, which
write the step's K/V themselves (ops.py, `rope_and_cache`); `paged_attention` wraps it for
the models that run through transformers' module tree (as its attention interface).

An fp8 cache (--kv-cache-dtype fp8, quant/fp8_kv.py) is quantized as it is written and the blocks
each call reads are dequantized after the gather (a first chunk's own K/V rounded as the cache
holds them): correctness, not speed (the compiled decode kernel reads float32 only, so an fp8
cache's decodes take the SDPA path).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine_core.layers import native
from engine_core.layers.chunk_pool import ChunkPool
from engine_core.quant import fp8_kv
from engine_core.quant.fp8_kv import KVScales


@dataclass
class PrefillChunk:
    rows: slice  # rows of the packed batch
    blocks: torch.Tensor | None  # [nb] cache blocks of positions 0..ctx-1; None: a sequence's
    # first chunk, which attends to the step's own K/V
    context: int  # ctx: positions attended to
    # [q, ctx] bool, True = attend; None when the chunk is the whole context
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    block_size: int
    decode_rows: torch.Tensor  # [Bd] rows of the packed batch that are single-token decodes
    decode_blocks: torch.Tensor  # [Bd * nb] each decode's context blocks, padded with block 0
    decode_context: torch.Tensor  # [Bd] int64: each decode's context length
    decode_max_context: int  # the longest of them (0 without decodes)
    # [Bd, 1, 1, nb * block_size] bool, for SDPA; None where `decode_kernels` run the decodes
    decode_mask: torch.Tensor | None
    prefills: list[PrefillChunk]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [slots, Hkv, D] each
    # the compiled CPU kernels: decode rows' attention, and prefill chunks' where it applies
    decode_kernels: native.Kernels | None = None
    kv_scales: KVScales | None = None  # an fp8 cache's scales (quant/fp8_kv.py)

    def scales(self, layer: int) -> torch.Tensor | None:
        """Layer `layer`'s row of fp8 scales, None without them."""
        return None if self.kv_scales is None else self.kv_scales.row(layer)
    # the threads a step's prefill chunks are shared over (their SDPA calls release the GIL):
    # the decoder linears' pool on the CPU; None: one after another
    pool: ChunkPool | None = None


def build_metadata(starts: np.ndarray, num_new: np.ndarray, block_table: np.ndarray,
                   block_size: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                   device: torch.device, decode_kernels: native.Kernels | None = None,
                   kv_scales: KVScales | None = None,
                   pool: ChunkPool | None = None) -> tuple[AttentionMetadata, np.ndarray]:
    """Metadata for one step. Returns it with the positions of the packed tokens.

    starts[i], num_new[i]: request i computes positions [starts[i], starts[i] + num_new[i]).
    block_table: [B, max_blocks] block ids (rows padded with 0). With `decode_kernels` (CPU,
    float32) the decodes run on their compiled kernel, which reads a float32 cache only: an
    fp8 cache's decodes take the SDPA path.
    """
    if kv_caches and fp8_kv.is_fp8(kv_caches[0][0]):
        decode_kernels = None
    if len(num_new) and bool((num_new == 1).all()):  # decodes only: row i is token i
        positions = starts
        slot_mapping = (block_table[np.arange(len(starts)), starts // block_size] * block_size
                        + starts % block_size)
        offsets = dec = np.arange(len(starts))
        is_decode = np.ones(len(starts), dtype=bool)
    else:
        offsets = np.cumsum(num_new) - num_new
        slot_mapping, positions = cache_slots(block_table, np.arange(len(starts)), starts,
                                              num_new, block_size)
        is_decode = num_new == 1
        dec = np.nonzero(is_decode)[0]
    ctx = starts[dec] + 1
    max_ctx = int(ctx.max()) if len(dec) else 0
    nblocks = -(-max_ctx // block_size) if len(dec) else 1
    # past a context: padding or spare, masked out (int64, as the compiled kernel reads them)
    dec_blocks = (block_table if len(dec) == len(block_table) else block_table[dec]
                  )[:, :nblocks].astype(np.int64)
    dec_mask = (None if decode_kernels is not None else
                torch.from_numpy(np.arange(nblocks * block_size)[None, :] < ctx[:, None]))

    prefills = []
    for i in np.nonzero(~is_decode)[0]:
        start, q = int(starts[i]), int(num_new[i])
        total = start + q
        rows = slice(int(offsets[i]), int(offsets[i]) + q)
        blocks = mask = None
        if start:
            blocks = torch.from_numpy(block_table[i, :-(-total // block_size)].copy()).to(device)
            mask = torch.from_numpy(np.arange(total)[None, :] <= (start + np.arange(q))[:, None])
            mask = mask.to(device)
        prefills.append(PrefillChunk(rows, blocks, total, mask))

    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        block_size=block_size,
        decode_rows=torch.from_numpy(offsets[dec]).to(device),
        decode_blocks=torch.from_numpy(dec_blocks.reshape(-1)).to(device),
        decode_context=torch.from_numpy(ctx.astype(np.int64)).to(device),
        decode_max_context=max_ctx,
        decode_mask=None if dec_mask is None else dec_mask[:, None, None, :].to(device),
        prefills=prefills,
        kv_caches=kv_caches,
        decode_kernels=decode_kernels,
        kv_scales=kv_scales,
        pool=pool,
    )
    return meta, positions


def cache_slots(block_table: np.ndarray, rows: np.ndarray, starts: np.ndarray,
                lengths: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The cache slots of positions [starts[i], starts[i] + lengths[i]) of the sequence in row
    `rows[i]` of `block_table`, all i one after the other; and those positions."""
    seq = np.repeat(np.arange(len(lengths)), lengths)
    offsets = np.cumsum(lengths) - lengths
    positions = starts[seq] + np.arange(int(lengths.sum())) - offsets[seq]
    slots = block_table[rows[seq], positions // block_size] * block_size + positions % block_size
    return slots, positions


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None,
                    scaling: float | None = None, dropout: float = 0.0,
                    tandem_meta: AttentionMetadata | None = None, **_: object
                    ) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function (the models it runs through transformers):
    query [1, H, T, D], key/value [1, Hkv, T, D]; the step's K/V written, then `attend`.

    Returns [1, T, H, D] as transformers expects.
    """
    assert tandem_meta is not None, "paged_attention needs tandem_meta"
    layer: int = module.layer_idx  # type: ignore[assignment]
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
    k_cache, v_cache = tandem_meta.kv_caches[layer]
    if tandem_meta.kv_scales is not None:
        tandem_meta.kv_scales.calibrate(layer, k, v)
    fp8_kv.write(k_cache, v_cache, tandem_meta.slot_mapping, k, v, tandem_meta.scales(layer))
    q = query[0].transpose(0, 1)  # [T, H, D]
    return attend(layer, q, k, v, scaling or q.shape[-1] ** -0.5, tandem_meta)[None], None


def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
    """Layer `layer`'s attention of the step's queries q [T, H, D] over their contexts, the
    step's own keys and values k, v [T, Hkv, D] already in the cache; into `out` [T, H, D]
    when given. (The attention backend of Tandem's own models, engine_core/models/.)"""
    k_cache, v_cache = meta.kv_caches[layer]
    scales = meta.scales(layer)
    out = torch.empty_like(q) if out is None else out
    blocks_k = k_cache.view(-1, meta.block_size, *k_cache.shape[1:])  # [blocks, bs, Hkv, D]
    blocks_v = v_cache.view(-1, meta.block_size, *v_cache.shape[1:])
    if len(meta.decode_rows) and meta.decode_kernels is not None:
        out[meta.decode_rows] = _decode_in_place(meta, q[meta.decode_rows].contiguous(), k_cache,
                                                 v_cache, scale)
    elif len(meta.decode_rows):
        bd = len(meta.decode_rows)
        qd = q[meta.decode_rows].unsqueeze(2)  # [Bd, H, 1, D]
        kd = blocks_k.index_select(0, meta.decode_blocks).view(bd, -1, *k_cache.shape[1:])
        vd = blocks_v.index_select(0, meta.decode_blocks).view(bd, -1, *v_cache.shape[1:])
        kd, vd = fp8_kv.read(kd, scales, 0, q.dtype), fp8_kv.read(vd, scales, 1, q.dtype)
        od = F.scaled_dot_product_attention(qd, kd.transpose(1, 2), vd.transpose(1, 2),
                                            attn_mask=meta.decode_mask, scale=scale,
                                            enable_gqa=True)
        out[meta.decode_rows] = od.squeeze(2)
    prefills = meta.prefills
    caches = (k_cache, v_cache, scales)
    kernels = meta.decode_kernels if _compiled_prefill(q, k_cache, scales, out) else None
    if meta.pool is not None and len(prefills) > 1:
        meta.pool.map(lambda i: _prefill(prefills[i], q, k, v, blocks_k, blocks_v, caches, scale,
                                         out, kernels), len(prefills))
    else:
        for chunk in prefills:
            _prefill(chunk, q, k, v, blocks_k, blocks_v, caches, scale, out, kernels)
    return out


def _compiled_prefill(q: torch.Tensor, k_cache: torch.Tensor, scales: torch.Tensor | None,
                      out: torch.Tensor) -> bool:
    """Whether the compiled kernel can run this layer's prefill chunks: float32 queries and
    cache (not fp8), head size a multiple of 32, each row's heads contiguous."""
    dim = q.shape[-1]
    return (q.dtype == torch.float32 and k_cache.dtype == torch.float32 and scales is None
            and dim % 32 == 0 and q.stride(-1) == 1 and q.stride(-2) == dim
            and out.stride(-1) == 1 and out.stride(-2) == dim)


def _prefill(chunk: PrefillChunk, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             blocks_k: torch.Tensor, blocks_v: torch.Tensor,
             caches: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], scale: float,
             out: torch.Tensor, kernels: native.Kernels | None = None) -> None:
    """One prefill chunk's attention, into its rows of `out` (chunks' rows never overlap, so
    chunks may run on several threads at once); `caches`: the layer's K and V caches and its
    fp8 scales (None: not fp8); `kernels`: the compiled causal kernel, where it applies
    (`_compiled_prefill`), else SDPA."""
    k_cache, v_cache, scales = caches
    qp = q[chunk.rows].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
    if chunk.blocks is None:  # the sequence's first chunk: its context is this step's K/V
        kp = fp8_kv.as_stored(k[chunk.rows], k_cache, scales, 0)  # [q, Hkv, D]
        vp = fp8_kv.as_stored(v[chunk.rows], v_cache, scales, 1)
    else:
        kp = blocks_k.index_select(0, chunk.blocks).flatten(0, 1)[:chunk.context]
        vp = blocks_v.index_select(0, chunk.blocks).flatten(0, 1)[:chunk.context]
        kp, vp = fp8_kv.read(kp, scales, 0, q.dtype), fp8_kv.read(vp, scales, 1, q.dtype)
    if kernels is not None:
        _prefill_in_place(kernels, q[chunk.rows], kp, vp, scale, out[chunk.rows])
        return
    op = F.scaled_dot_product_attention(qp, kp.transpose(0, 1).unsqueeze(0),
                                        vp.transpose(0, 1).unsqueeze(0),
                                        attn_mask=chunk.mask, is_causal=chunk.mask is None,
                                        scale=scale, enable_gqa=True)
    out[chunk.rows] = op[0].transpose(0, 1)


def _prefill_in_place(kernels: native.Kernels, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """A chunk's causal attention by the compiled kernel: queries q [n, H, D] over the context
    k, v [ctx, Hkv, D] whose last n positions are the queries' own, into out [n, H, D]. Each
    row's heads are contiguous; rows may be strided (views into the step's packed q, k, v)."""
    rows, heads, dim = q.shape
    context, kv_heads = k.shape[0], k.shape[1]
    assert k.stride(-1) == v.stride(-1) == 1 and k.stride(-2) == v.stride(-2) == dim
    padded = -(-context // 32) * 32
    scratch = torch.empty((dim + 8) * padded + dim * 8)  # keys transposed, a tile's q, scores
    kernels.prefill_attention(q.data_ptr(), q.stride(0), rows, k.data_ptr(), k.stride(0),
                              v.data_ptr(), v.stride(0), context, heads, kv_heads, dim, scale,
                              out.data_ptr(), out.stride(0), scratch.data_ptr())


def _decode_in_place(meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """The decode rows' attention ([Bd, H, D] queries, contiguous) by the compiled kernel,
    reading their contexts from the paged cache in place."""
    assert meta.decode_kernels is not None and q.is_contiguous() and q.dtype == torch.float32
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    rows, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    ldt = meta.decode_blocks.shape[0] // rows
    out = torch.empty_like(q)
    scratch = torch.empty(heads // kv_heads * meta.decode_max_context)
    meta.decode_kernels.decode_attention(
        q.data_ptr(), heads * dim, rows, k_cache.data_ptr(), v_cache.data_ptr(),
        meta.decode_blocks.data_ptr(), ldt, meta.decode_context.data_ptr(), meta.block_size,
        heads, kv_heads, dim, scale, out.data_ptr(), heads * dim, scratch.data_ptr())
    return out
