"""The chunked LM head, on its compiled kernels and on its torch path, against
whole-vocabulary torch reductions."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine_core.layers.lm_head import BLOCK, LMHead
from tests.unit.engine_core.heads import engine_kernels

PATHS = [pytest.param(True, id="native"), pytest.param(False, id="torch")]


def kernels_for(native_path: bool):
    """The compiled kernels for the native path (skipped where they do not build), else None."""
    if not native_path:
        return None
    kernels = engine_kernels()
    if kernels is None:
        pytest.skip("no LM-head kernels here: the head keeps its torch path")
    return kernels


def test_native_kernels_build_where_there_is_a_compiler():
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: the head keeps its torch path")
    assert engine_kernels() is not None
    assert LMHead(torch.randn(300, 8), kernels=engine_kernels()).backend == "native"
    # loading them leaves the process's float environment alone (no flush-to-zero)
    assert (torch.tensor([1e-40]) * 1.0).item() != 0.0


@pytest.mark.parametrize("native_path", PATHS)
@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("rows,vocab,chunk", [(7, 1000, BLOCK), (13, 1000, 4 * BLOCK),
                                              (1, 256, BLOCK), (20, 1031, 2 * BLOCK)])
def test_scan_matches_whole_vocabulary_reductions(native_path: bool, workers: int, rows: int,
                                                  vocab: int, chunk: int):
    g = torch.Generator().manual_seed(vocab + chunk + rows)
    hidden, weight = torch.randn(rows, 16, generator=g), torch.randn(vocab, 16, generator=g)
    weight[500 % vocab] = weight[17]  # an exact tie: the first index wins, as torch.argmax
    head = LMHead(weight, workers=workers, chunk=chunk, kernels=kernels_for(native_path))
    assert head.backend == ("native" if native_path else "torch")
    sampled = torch.arange(0, rows, 3)
    temps = torch.tensor([1.0, 0.5, 2.0, 0.7, 1.3, 1.0, 0.9])[:len(sampled)]
    scan = head.scan(hidden, lse=True, top_k=5, sample_rows=sampled, temperatures=temps)
    ref = hidden @ weight.T
    assert torch.allclose(scan.logits, ref, atol=1e-5)
    assert torch.equal(scan.argmax, scan.logits.argmax(-1))
    assert torch.allclose(scan.max, ref.max(-1).values, atol=1e-5)
    assert torch.allclose(scan.lse, ref.logsumexp(-1), atol=1e-5)
    assert torch.allclose(scan.top_vals, ref.topk(5).values, atol=1e-5)
    assert torch.equal(scan.top_ids, scan.logits.topk(5).indices)
    weights = ((ref[sampled] - ref[sampled].max(-1, keepdim=True).values) / temps[:, None]).exp()
    padded = torch.nn.functional.pad(weights, (0, -vocab % BLOCK))
    expected = padded.unflatten(1, (-1, BLOCK)).sum(-1)
    assert scan.block_sums.shape == expected.shape
    assert torch.allclose(scan.block_sums, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("native_path", PATHS)
@pytest.mark.parametrize("lse", [True, False])
def test_draw_sums_at_unit_temperature(native_path: bool, lse: bool):
    """Every sampled row at T = 1: with the logsumexp asked for, its sums serve the draw."""
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(5, 8, generator=g), torch.randn(700, 8, generator=g)
    head = LMHead(weight, workers=2, chunk=BLOCK, kernels=kernels_for(native_path))
    rows = torch.tensor([1, 4])
    scan = head.scan(hidden, lse=lse, sample_rows=rows, temperatures=torch.ones(2))
    ref = (hidden @ weight.T)[rows]
    weights = (ref - ref.max(-1, keepdim=True).values).exp()
    weights = torch.nn.functional.pad(weights, (0, -700 % BLOCK))
    assert torch.allclose(scan.block_sums, weights.unflatten(1, (-1, BLOCK)).sum(-1), rtol=1e-5)
    assert (scan.lse is None) != lse


@pytest.mark.parametrize("native_path", PATHS)
def test_count_above(native_path: bool):
    g = torch.Generator().manual_seed(9)
    hidden, weight = torch.randn(9, 8, generator=g), torch.randn(1500, 8, generator=g)
    head = LMHead(weight, workers=2, chunk=2 * BLOCK, kernels=kernels_for(native_path))
    scan = head.scan(hidden)
    rows = torch.tensor([8, 2, 5])
    thr = scan.logits[rows, torch.tensor([3, 700, 1499])]
    expected = (scan.logits[rows] > thr[:, None]).sum(-1)
    assert head.count_above(scan, rows, thr).tolist() == expected.tolist()
    most = torch.tensor([8, 0, 3, 5, 6, 1])  # most rows, out of order: counted through views
    thr = scan.logits[most, most * 150]
    expected = (scan.logits[most] > thr[:, None]).sum(-1)
    assert head.count_above(scan, most, thr).tolist() == expected.tolist()
    every = torch.arange(9)
    thr = scan.logits[every, every * 100]
    expected = (scan.logits > thr[:, None]).sum(-1)
    assert head.count_above(scan, every, thr).tolist() == expected.tolist()


def test_softcap_takes_the_torch_path():
    hidden, weight = torch.randn(4, 8), torch.randn(900, 8) * 10
    head = LMHead(weight, softcap=5.0, workers=2, chunk=BLOCK, kernels=engine_kernels())
    assert head.backend == "torch"
    scan = head.scan(hidden, lse=True)
    ref = torch.tanh(hidden @ weight.T / 5.0) * 5.0
    assert torch.allclose(scan.logits, ref, atol=1e-5)
    assert torch.allclose(scan.lse, ref.logsumexp(-1), atol=1e-5)


def test_head_with_bias_takes_the_linear_path():
    """A bias keeps the [vocab, hidden] weight and F.linear (the path CUDA heads take)."""
    hidden, weight, bias = torch.randn(3, 8), torch.randn(600, 8), torch.randn(600)
    head = LMHead(weight, bias=bias, workers=2, chunk=BLOCK, kernels=engine_kernels())
    assert head.backend == "torch"
    scan = head.scan(hidden, lse=True, top_k=2)
    ref = hidden @ weight.T + bias
    assert torch.allclose(scan.logits, ref, atol=1e-5)
    assert torch.allclose(scan.lse, ref.logsumexp(-1), atol=1e-5)
    assert torch.equal(scan.argmax, ref.argmax(-1))
