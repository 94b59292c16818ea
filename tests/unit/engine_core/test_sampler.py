"""The sampler on synthetic logits: the draw follows the distribution, truncations cut it.

Logits reach the sampler through an LM head: `head_for(logits)` is a one-dimensional head whose
weight column is the logits row, so `ones @ weight.T` gives them back exactly.
"""

from __future__ import annotations

import math

import torch

from engine_core.lm_head import BLOCK, LMHead
from engine_core.request import Request
from engine_core.sampler import Sampler, token_logprobs
from shared.messages import SamplingParams
from tests.unit.engine_core.heads import engine_kernels

PROBS = torch.tensor([0.1, 0.2, 0.3, 0.4])


def head_for(logits: torch.Tensor, **kwargs) -> LMHead:
    return LMHead(logits[:, None].clone(), kernels=engine_kernels(), **kwargs)


def sample(logits: torch.Tensor, reqs: list[Request], seed: int = 0, **head) -> torch.Tensor:
    out = Sampler([], seed=seed)(head_for(logits, **head), torch.ones(len(reqs), 1), reqs)
    return torch.from_numpy(out.token_ids)


def draw(n: int, **params) -> torch.Tensor:
    reqs = [Request(f"r{i}", [1], SamplingParams(**params)) for i in range(n)]
    return sample(PROBS.log(), reqs)


def freqs(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=4).float() / len(tokens)


def test_draw_follows_the_distribution():
    f = freqs(draw(20000, temperature=1.0))
    assert torch.allclose(f, PROBS, atol=0.015), f


def test_temperature_sharpens():
    f = freqs(draw(20000, temperature=0.5))
    expected = PROBS**2 / (PROBS**2).sum()
    assert torch.allclose(f, expected, atol=0.015), f


def test_top_k_top_p_min_p_cut_the_tail():
    assert set(draw(2000, top_k=2).tolist()) == {2, 3}
    assert set(draw(2000, top_p=0.65).tolist()) == {2, 3}  # 0.4 + 0.3 covers 0.65
    assert set(draw(2000, min_p=0.6).tolist()) == {2, 3}  # floor 0.24
    assert draw(50, temperature=0.0).tolist() == [3] * 50


def test_seeded_rows_repeat_whatever_the_batch():
    seeded = Request("s", [1], SamplingParams(temperature=1.0, seed=42))
    alone = []
    for _ in range(5):
        alone += sample(PROBS.log(), [seeded], seed=1).tolist()
    seeded = Request("s", [1], SamplingParams(temperature=1.0, seed=42))
    crowd = []
    for step in range(5):
        others = [Request(f"o{i}", [1], SamplingParams(temperature=1.0)) for i in range(step + 2)]
        crowd.append(int(sample(PROBS.log(), others + [seeded], seed=step)[-1]))
    assert alone == crowd


def test_token_logprobs_match_log_softmax():
    hidden, weight = torch.randn(5, 8), torch.randn(700, 8)
    tokens = torch.tensor([0, 7, 699, 3, 3])
    head = LMHead(weight, chunk=BLOCK, workers=2, kernels=engine_kernels())  # 3 chunks, 1 partial
    out = token_logprobs(head, hidden, tokens, 4)
    ref = torch.log_softmax(hidden @ weight.T, -1)
    assert torch.allclose(torch.from_numpy(out.logprobs), ref[torch.arange(5), tokens], atol=1e-6)
    ranks = (ref > ref[torch.arange(5), tokens][:, None]).sum(-1) + 1
    assert out.ranks.tolist() == ranks.tolist()
    assert torch.allclose(torch.from_numpy(out.top_logprobs), ref.topk(4).values, atol=1e-6)
    assert math.isclose(float(torch.from_numpy(out.top_logprobs[0]).exp().sum()),
                        float(ref[0].topk(4).values.exp().sum()), rel_tol=1e-5)


def test_inverse_cdf_finds_the_right_bucket_and_skips_zero_weights():
    from engine_core.sampler import inverse_cdf

    w = torch.zeros(3, 1000)
    w[:, 10], w[:, 500], w[:, 999] = 1.0, 2.0, 1.0
    u = torch.tensor([[0.0], [0.3], [0.9999999]])
    assert inverse_cdf(w, u, block=64).tolist() == [10, 500, 999]
    dense = torch.rand(4, 777)
    cdf = dense.cumsum(-1)
    u = torch.rand(4, 1)
    expected = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]
    assert (inverse_cdf(dense, u, block=100) - expected).abs().max() <= 1  # float rounding only


def test_block_path_follows_the_distribution_across_chunks():
    """Sampled rows over several vocabulary chunks (a partial last block): frequencies match
    softmax(logits / T); with a seed, repeats match whatever the batch."""
    vocab = 600
    logits = torch.full((vocab,), -30.0)
    hot = torch.tensor([3, 255, 256, 300, 511, 599])
    logits[hot] = torch.tensor([0.5, 1.0, 0.0, 2.0, 1.5, 1.0])
    for temp in (1.0, 0.7):
        reqs = [Request(f"r{i}", [1], SamplingParams(temperature=temp)) for i in range(20000)]
        tokens = sample(logits, reqs, chunk=BLOCK, workers=2)
        expected = torch.softmax(logits / temp, -1)[hot]
        got = torch.bincount(tokens, minlength=vocab)[hot].float() / len(tokens)
        assert torch.allclose(got, expected, atol=0.015), (temp, got, expected)


def test_sampled_rows_get_their_tokens_logprob_and_rank():
    """Logprobs of sampled (not argmax) tokens: value, rank and top-k against log_softmax,
    over several chunks, mixed with a greedy row and a row on the general (top-p) path."""
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(6, 8, generator=g), torch.randn(900, 8, generator=g)
    params = [SamplingParams(temperature=1.0, logprobs=3)] * 4 + [
        SamplingParams(temperature=0.0, logprobs=3), SamplingParams(top_p=0.9, logprobs=3)]
    reqs = [Request(f"r{i}", [1], p) for i, p in enumerate(params)]
    head = LMHead(weight, chunk=BLOCK, workers=2, kernels=engine_kernels())
    out = Sampler([], seed=3)(head, hidden, reqs)
    ref = torch.log_softmax(hidden @ weight.T, -1)
    tokens = torch.from_numpy(out.token_ids)
    chosen = ref[torch.arange(6), tokens]
    assert out.logprob_rows.tolist() == list(range(6))
    assert torch.allclose(torch.from_numpy(out.logprobs.logprobs), chosen, atol=1e-5)
    assert out.logprobs.ranks.tolist() == ((ref > chosen[:, None]).sum(-1) + 1).tolist()
    top = torch.from_numpy(out.logprobs.top_logprobs)
    assert torch.allclose(top, ref.topk(3).values, atol=1e-5)
    assert int(tokens[4]) == int(ref[4].argmax()) and out.logprobs.ranks[4] == 1
    assert (out.logprobs.ranks[:4] > 1).any()  # some sampled token was not the argmax
