"""The chunked LM head against whole-vocabulary torch reductions."""

from __future__ import annotations

import pytest
import torch

from engine_core.lm_head import BLOCK, ChunkPool, LMHead


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("vocab,chunk", [(1000, BLOCK), (1000, 4 * BLOCK), (256, BLOCK)])
def test_scan_matches_whole_vocabulary_reductions(workers: int, vocab: int, chunk: int):
    g = torch.Generator().manual_seed(vocab + chunk)
    hidden, weight = torch.randn(7, 16, generator=g), torch.randn(vocab, 16, generator=g)
    weight[500 % vocab] = weight[17]  # an exact tie: the first index wins, as torch.argmax
    head = LMHead(weight, workers=workers, chunk=chunk)
    rows, temps = torch.tensor([0, 3, 6]), torch.tensor([1.0, 0.5, 2.0])
    scan = head.scan(hidden, lse=True, top_k=5, sample_rows=rows, temperatures=temps)
    ref = hidden @ weight.T
    assert torch.allclose(scan.logits, ref, atol=1e-5)
    assert torch.equal(scan.argmax, scan.logits.argmax(-1))
    assert torch.allclose(scan.max, ref.max(-1).values, atol=1e-5)
    assert torch.allclose(scan.lse, ref.logsumexp(-1), atol=1e-5)
    assert torch.allclose(scan.top_vals, ref.topk(5).values, atol=1e-5)
    assert torch.equal(scan.top_ids, scan.logits.topk(5).indices)
    weights = ((ref[rows] - ref[rows].max(-1, keepdim=True).values) / temps[:, None]).exp()
    padded = torch.nn.functional.pad(weights, (0, -vocab % BLOCK))
    expected = padded.unflatten(1, (-1, BLOCK)).sum(-1)
    assert scan.block_sums.shape == expected.shape
    assert torch.allclose(scan.block_sums, expected, rtol=1e-5, atol=1e-7)


def test_count_above_and_softcap():
    hidden, weight = torch.randn(4, 8), torch.randn(900, 8) * 10
    head = LMHead(weight, softcap=5.0, workers=2, chunk=BLOCK)
    scan = head.scan(hidden)
    ref = torch.tanh(hidden @ weight.T / 5.0) * 5.0
    assert torch.allclose(scan.logits, ref, atol=1e-5)
    thr = ref[:, 123]
    counts = head.count_above(scan, torch.arange(4), thr)
    assert counts.tolist() == (scan.logits > scan.logits[:, 123:124]).sum(-1).tolist()
    assert torch.allclose(head.logits(hidden), scan.logits)


def test_pool_runs_every_index_once_and_reraises():
    pool = ChunkPool(3)
    assert pool.map(lambda i: i * i, 50) == [i * i for i in range(50)]

    def boom(i: int) -> int:
        if i == 7:
            raise ValueError("chunk 7")
        return i

    with pytest.raises(ValueError, match="chunk 7"):
        pool.map(boom, 20)
    assert pool.map(lambda i: i, 5) == list(range(5))  # still usable afterwards


def test_head_with_bias_takes_the_linear_path():
    """A bias keeps the [vocab, hidden] weight and F.linear (the path CUDA heads take)."""
    hidden, weight, bias = torch.randn(3, 8), torch.randn(600, 8), torch.randn(600)
    head = LMHead(weight, bias=bias, workers=2, chunk=BLOCK)
    scan = head.scan(hidden, lse=True, top_k=2)
    ref = hidden @ weight.T + bias
    assert torch.allclose(scan.logits, ref, atol=1e-5)
    assert torch.allclose(scan.lse, ref.logsumexp(-1), atol=1e-5)
    assert torch.equal(scan.argmax, ref.argmax(-1))
