"""The sampler on synthetic logits: the draw follows the distribution, truncations cut it."""

from __future__ import annotations

import math

import torch

from engine_core.request import Request
from engine_core.sampler import Sampler, token_logprobs
from shared.messages import SamplingParams

PROBS = torch.tensor([0.1, 0.2, 0.3, 0.4])


def draw(n: int, **params) -> torch.Tensor:
    reqs = [Request(f"r{i}", [1], SamplingParams(**params)) for i in range(n)]
    logits = PROBS.log().repeat(n, 1)
    return torch.from_numpy(Sampler([], seed=0)(logits, reqs).token_ids)


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
        alone += Sampler([], seed=1)(PROBS.log()[None], [seeded]).token_ids.tolist()
    seeded = Request("s", [1], SamplingParams(temperature=1.0, seed=42))
    crowd = []
    for step in range(5):
        others = [Request(f"o{i}", [1], SamplingParams(temperature=1.0)) for i in range(step + 2)]
        out = Sampler([], seed=step)(PROBS.log().repeat(len(others) + 1, 1), others + [seeded])
        crowd.append(int(out.token_ids[-1]))
    assert alone == crowd


def test_token_logprobs_match_log_softmax():
    logits = torch.randn(5, 50)
    tokens = torch.tensor([0, 7, 49, 3, 3])
    out = token_logprobs(logits.clone(), tokens, 4)  # it consumes its input
    ref = torch.log_softmax(logits, -1)
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
