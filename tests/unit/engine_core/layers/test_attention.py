"""The CPU's attention on the compiled kernels against the portable torch path on the same
step: decodes reading the paged cache in place (against gathered blocks, padded, one SDPA
call), and prefill chunks by the causal kernel (against SDPA per chunk)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine_core.layers.attention import _compiled_prefill, attend, build_metadata, paged_attention
from engine_core.quant.fp8_kv import write as write_kv
from tests.unit.engine_core.heads import kernels_or_skip


@pytest.mark.parametrize(("heads", "kv_heads", "dim"),
                         [(4, 4, 8), (14, 2, 64), (8, 1, 32), (4, 2, 128)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decodes_in_place_match_the_gathered_path(heads: int, kv_heads: int, dim: int,
                                                   block_size: int) -> None:
    """Decodes at contexts 1, a block's edges and long ones, beside a prefill chunk after a
    cached prefix and a fresh prompt (which still take the torch path): the same outputs, and
    the cache written alike."""
    rng = np.random.default_rng(0)
    starts = np.array([0, 3, block_size - 1, block_size, 150, 5, 0, 2 * block_size])
    num_new = np.array([1, 1, 1, 1, 1, 4, 3, 1])  # rows 5 and 6: prefill chunks
    width = -(-int((starts + num_new).max()) // block_size)
    blocks = rng.permutation(np.arange(1, len(starts) * width + 1))
    table = blocks.reshape(len(starts), width)  # every block distinct, none is block 0
    tokens = int(num_new.sum())
    torch.manual_seed(0)
    query = torch.randn(1, heads, tokens, dim)
    key, value = torch.randn(1, kv_heads, tokens, dim), torch.randn(1, kv_heads, tokens, dim)
    outs, caches = [], []
    for compiled in (None, kernels_or_skip()):
        generator = torch.Generator().manual_seed(1)  # the same earlier context in both
        slots = (len(starts) * width + 1) * block_size
        cache = [(torch.randn(slots, kv_heads, dim, generator=generator),
                  torch.randn(slots, kv_heads, dim, generator=generator))]
        meta, _ = build_metadata(starts, num_new, table, block_size, cache,
                                 torch.device("cpu"), compiled)
        assert (meta.decode_mask is None) == (compiled is not None)
        out, _ = paged_attention(SimpleNamespace(layer_idx=0), query, key, value, None,
                                 scaling=dim ** -0.5, tandem_meta=meta)
        outs.append(out)
        caches.append(cache[0])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_a_decode_reads_only_its_own_context() -> None:
    """Values past a row's context (the rest of its last block) and in other rows' blocks
    change nothing: the kernel stops at each row's own length, with no padding."""
    block_size, heads, dim = 4, 2, 8
    starts, num_new = np.array([5, 1]), np.array([1, 1])
    table = np.array([[1, 2], [3, 0]])
    torch.manual_seed(0)
    query, key, value = (torch.randn(1, heads, 2, dim) for _ in range(3))
    outs = []
    for poison in (0.0, 1e4):
        cache = [(torch.randn(16, heads, dim, generator=torch.Generator().manual_seed(2)),
                  torch.randn(16, heads, dim, generator=torch.Generator().manual_seed(3)))]
        for k_or_v in cache[0]:
            k_or_v[2 * block_size + 2:3 * block_size] += poison  # row 0's block 2 past ctx 6
            k_or_v[3 * block_size + 2:] += poison  # row 1's block 3 past its context of 2
            k_or_v[:block_size] += poison  # block 0, nobody's
        meta, _ = build_metadata(starts, num_new, table, block_size, cache,
                                 torch.device("cpu"), kernels_or_skip())
        outs.append(paged_attention(SimpleNamespace(layer_idx=0), query, key, value, None,
                                    scaling=0.5, tandem_meta=meta)[0])
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 32), (14, 2, 64), (4, 4, 128)])
def test_prefill_chunks_on_the_kernel_match_sdpa(heads: int, kv_heads: int, dim: int) -> None:
    """Prefill chunks by the compiled causal kernel, q, k and v strided views into one packed
    projection as Tandem's models make them: a fresh prompt, a chunk after a cached prefix,
    single-token and tile-edge lengths, beside a decode; the same as the SDPA path."""
    block_size = 16
    starts = np.array([0, 40, 0, 7, 100, 0])
    num_new = np.array([37, 25, 1, 9, 1, 8])  # row 4: a decode
    width = -(-int((starts + num_new).max()) // block_size)
    table = np.random.default_rng(0).permutation(np.arange(1, len(starts) * width + 1))
    table = table.reshape(len(starts), width)
    tokens = int(num_new.sum())
    torch.manual_seed(0)
    packed = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    q = packed[:, :heads * dim].view(tokens, heads, dim)
    k = packed[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = packed[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    outs = []
    for compiled in (None, kernels_or_skip()):
        generator = torch.Generator().manual_seed(1)
        slots = (len(starts) * width + 1) * block_size
        cache = [(torch.randn(slots, kv_heads, dim, generator=generator),
                  torch.randn(slots, kv_heads, dim, generator=generator))]
        meta, _ = build_metadata(starts, num_new, table, block_size, cache,
                                 torch.device("cpu"), compiled)
        write_kv(cache[0][0], cache[0][1], meta.slot_mapping, k, v, None)
        assert _compiled_prefill(q, cache[0][0], None, torch.empty_like(q))
        outs.append(attend(0, q, k, v, dim ** -0.5, meta))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
