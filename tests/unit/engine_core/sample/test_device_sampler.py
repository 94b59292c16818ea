"""The device sampler, run on the CPU (it is device-agnostic torch), against the CPU sampler:
the same tokens, logprobs and ranks on the same hidden states; the same draws from the same
uniform numbers; draws that follow the distribution; the edits (bias, min_tokens, penalties)
and grammar masks; one download a step."""

from __future__ import annotations

import math

import numpy as np
import torch

from engine_core.layers.host_link import HostLink
from engine_core.layers.lm_head import BLOCK, LMHead
from engine_core.sample.device_sampler import DeviceSampler, HeadWeights
from engine_core.sample.logits_ops import inverse_cdf, pick_block, pick_within
from engine_core.sample.sampler import Sampler
from engine_core.sched.request import Request
from shared.messages import SamplingParams
from tests.unit.engine_core.heads import engine_kernels
from tests.unit.engine_core.sample.batches import batch_of
from tests.unit.engine_core.sample.test_sampler import (
    EOS,
    PROBS,
    VOCAB,
    allowed_mask,
    constrained,
    constrained_logits,
    thinking,
)

CPU = torch.device("cpu")


class CountingLink(HostLink):
    """A CPU link that counts the downloads (the host syncs a CUDA step would make)."""

    def __init__(self) -> None:
        super().__init__(CPU, pinned=False, synchronize=lambda: None)
        self.downloads = 0

    def download_later(self, tensors):  # type: ignore[no-untyped-def]
        self.downloads += 1  # (download() goes through here too)
        return super().download_later(tensors)


def device_sampler(weight: torch.Tensor, link: HostLink | None = None) -> DeviceSampler:
    return DeviceSampler(HeadWeights(weight), link or CountingLink())


def sample_on_device(weight: torch.Tensor, hidden: torch.Tensor, reqs: list[Request],
                     seed: int = 0, link: HostLink | None = None):
    return device_sampler(weight, link)(hidden, batch_of(reqs, weight.shape[0], seed))


def both(weight: torch.Tensor, hidden: torch.Tensor, params: list[SamplingParams],
         seed: int = 0, eos: list[int] | None = None, prompt: list[int] | None = None):
    """The CPU sampler's and the device sampler's outputs for the same requests (made twice,
    so that seeded generators start alike)."""
    def batch():
        reqs = [Request(f"r{i}", prompt or [1], p) for i, p in enumerate(params)]
        return batch_of(reqs, weight.shape[0], seed, eos or [])

    head = LMHead(weight, chunk=BLOCK, workers=2, kernels=engine_kernels())
    cpu = Sampler(head)(hidden, batch())
    dev = device_sampler(weight)(hidden, batch())
    return cpu, dev


def random_head(rows: int, vocab: int = 900, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 16, generator=g), torch.randn(vocab, 16, generator=g)


def test_greedy_tokens_logprobs_and_ranks_equal_the_cpu_sampler():
    hidden, weight = random_head(8)
    params = [SamplingParams(temperature=0.0, logprobs=k) for k in (0, 1, 5, 20)] + [
        SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=3)] * 2
    cpu, dev = both(weight, hidden, params)
    assert dev.token_ids.tolist() == cpu.token_ids.tolist()
    assert dev.token_ids.dtype == np.int64
    assert dev.logprob_rows.tolist() == cpu.logprob_rows.tolist() == [0, 1, 2, 3, 5, 7]
    assert cpu.logprobs is not None and dev.logprobs is not None
    assert np.allclose(dev.logprobs.logprobs, cpu.logprobs.logprobs, atol=1e-5)
    assert dev.logprobs.ranks.tolist() == cpu.logprobs.ranks.tolist()
    assert dev.logprobs.top_ids.tolist() == cpu.logprobs.top_ids.tolist()
    assert np.allclose(dev.logprobs.top_logprobs, cpu.logprobs.top_logprobs, atol=1e-5)
    assert [a.dtype for a in dev.logprobs] == [a.dtype for a in cpu.logprobs]


def test_sampled_tokens_get_their_logprob_and_rank():
    hidden, weight = random_head(6)
    out = sample_on_device(weight, hidden, [
        Request(f"r{i}", [1], SamplingParams(temperature=1.0, logprobs=3)) for i in range(6)],
        seed=3)
    ref = torch.log_softmax(hidden @ weight.T, -1)
    chosen = ref[torch.arange(6), torch.from_numpy(out.token_ids)]
    assert out.logprobs is not None
    assert np.allclose(out.logprobs.logprobs, chosen.numpy(), atol=1e-5)
    assert out.logprobs.ranks.tolist() == ((ref > chosen[:, None]).sum(-1) + 1).tolist()
    assert (out.logprobs.ranks > 1).any()  # some draw was not the argmax


def test_seeded_draws_are_the_cpu_samplers_whatever_the_path():
    """The same uniform numbers, so the same tokens: plain, truncated and penalised rows."""
    hidden, weight = random_head(40, seed=11)
    for extra in ({}, {"top_p": 0.8}, {"top_k": 30, "min_p": 0.05}, {"temperature": 0.6},
                  {"repetition_penalty": 1.2, "frequency_penalty": 0.5}):
        params = [SamplingParams(**{"temperature": 1.0, "seed": 100 + i, **extra})
                  for i in range(40)]
        cpu, dev = both(weight, hidden, params, prompt=[3, 4, 5])
        assert dev.token_ids.tolist() == cpu.token_ids.tolist(), extra


def test_unseeded_draws_share_the_engine_generator_in_row_order():
    hidden, weight = random_head(30, seed=2)
    cpu, dev = both(weight, hidden, [SamplingParams(temperature=1.0)] * 30, seed=9)
    assert dev.token_ids.tolist() == cpu.token_ids.tolist()


def draw(n: int, logits: torch.Tensor = PROBS.log(), **params: float) -> torch.Tensor:
    reqs = [Request(f"r{i}", [1], SamplingParams(**params)) for i in range(n)]  # type: ignore[arg-type]
    return torch.from_numpy(sample_on_device(logits[:, None].clone(), torch.ones(n, 1),
                                             reqs).token_ids)


def test_draws_follow_the_distribution_and_truncation_cuts_it():
    f = torch.bincount(draw(20000, temperature=1.0), minlength=4).float() / 20000
    assert torch.allclose(f, PROBS, atol=0.015), f
    f = torch.bincount(draw(20000, temperature=0.5), minlength=4).float() / 20000
    assert torch.allclose(f, PROBS**2 / (PROBS**2).sum(), atol=0.015), f
    assert set(draw(2000, top_k=2).tolist()) == {2, 3}
    assert set(draw(2000, top_p=0.65).tolist()) == {2, 3}
    assert set(draw(2000, min_p=0.6).tolist()) == {2, 3}
    assert draw(50, temperature=0.0).tolist() == [3] * 50


def test_inverse_cdf_is_the_fast_paths_two_picks():
    """The device's inverse CDF (with gathers) and the CPU fast path's block pick then pick
    within the block, on the same weights: the same tokens."""
    g = torch.Generator().manual_seed(1)
    weights = torch.rand(16, 1000, generator=g) ** 4  # a partial last block
    weights[3] = 0.0
    weights[3, 999] = 1.0
    u = torch.rand(16, generator=g)
    u[0], u[1] = 0.0, 1.0 - 1e-7
    padded = torch.nn.functional.pad(weights, (0, 1024 - 1000)).view(16, 4, BLOCK)
    block, rest = pick_block(padded.sum(-1), u[:, None])
    two_picks = block * BLOCK + pick_within(padded[torch.arange(16), block], rest)
    assert inverse_cdf(weights, u).tolist() == two_picks.tolist()
    assert int(inverse_cdf(weights, u)[3]) == 999


def test_edits_bias_min_tokens_and_penalties_as_the_cpu_sampler():
    """Greedy rows whose argmax each edit moves: the same tokens as the CPU sampler's."""
    logits = torch.linspace(0.0, 2.0, 300)  # token 299 leads, 298 next
    weight = logits[:, None].clone()
    eos = [299]
    params = [
        SamplingParams(temperature=0.0, logit_bias={7: 5.0, 10_000: 1.0}),  # 7 wins; 10000 gone
        SamplingParams(temperature=0.0, min_tokens=2),  # EOS 299 banned: 298
        SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[299]),
        SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True),  # nothing banned: 299
        SamplingParams(temperature=0.0, repetition_penalty=2.0),  # 299 seen: halved
        SamplingParams(temperature=0.0, presence_penalty=1.0),  # no output yet: untouched
        SamplingParams(temperature=1.0, seed=1, logit_bias={5: 100.0}),
    ]
    cpu, dev = both(weight, torch.ones(len(params), 1), params, eos=eos, prompt=[299, 299, 3])
    assert dev.token_ids.tolist() == cpu.token_ids.tolist() == [7, 298, 298, 299, 298, 299, 5]


def test_frequency_and_presence_penalties_count_output_tokens():
    logits = torch.tensor([0.0, 1.0, 1.2, 1.25])
    reqs = []
    for p in (SamplingParams(temperature=0.0, frequency_penalty=0.2),
              SamplingParams(temperature=0.0, presence_penalty=0.2),
              SamplingParams(temperature=0.0, frequency_penalty=0.1, presence_penalty=0.01)):
        r = Request("r", [0], p)
        r.append_token(3)
        r.append_token(3)  # 1.25 - 2 * 0.2 | - 0.2 | - 0.2 - 0.01
        reqs.append(r)
    out = sample_on_device(logits[:, None].clone(), torch.ones(3, 1), reqs)
    assert out.token_ids.tolist() == [2, 2, 2]


def test_one_download_a_step():
    hidden, weight = random_head(5)
    link = CountingLink()
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(top_p=0.5, seed=1),
              SamplingParams(repetition_penalty=1.1, logit_bias={1: 1.0}),
              SamplingParams(temperature=0.7, logprobs=5, top_k=3), SamplingParams(min_p=0.2)]
    sample_on_device(weight, hidden, [Request(f"r{i}", [1, 2], p) for i, p in enumerate(params)],
                     link=link)
    assert link.downloads == 1


def test_constrained_greedy_is_the_masked_argmax_and_draws_stay_in_the_mask():
    logits = constrained_logits()
    weight = logits[:, None].clone()
    for regex in ("f+", "[a-f]+"):
        allowed = allowed_mask(regex)
        masked = logits.masked_fill(~allowed, -math.inf)
        reqs = constrained(2, regex, temperature=0.0, logprobs=1)
        out = sample_on_device(weight, torch.ones(2, 1), reqs)
        assert out.token_ids.tolist() == [int(masked.argmax())] * 2
        assert out.logprobs is not None  # raw logprobs, not the masked ones
        raw = torch.log_softmax(logits, -1)[int(masked.argmax())]
        assert np.allclose(out.logprobs.logprobs, float(raw), atol=1e-5)
        assert all(r.grammar is not None and r.grammar.accept(EOS) for r in reqs)  # advanced
        for temp in (1.0, 0.7):
            reqs = constrained(4000, regex, temperature=temp)
            tokens = torch.from_numpy(sample_on_device(weight, torch.ones(4000, 1),
                                                       reqs).token_ids)
            assert bool(allowed[tokens].all())
            expected = torch.softmax((logits / temp).masked_fill(~allowed, -math.inf), -1)
            got = torch.bincount(tokens, minlength=VOCAB).float() / len(tokens)
            assert (got - expected).abs().max() < 0.03, (regex, temp)


def test_a_token_the_matcher_refuses_is_banned_and_drawn_again(monkeypatch):
    from engine_core.structured.masks import TokenMasker

    real = TokenMasker.accept

    def refusing(self, grammars, tokens):  # type: ignore[no-untyped-def]
        return [t != 35 and real(self, [g], [t])[0] for g, t in zip(grammars, tokens)]

    monkeypatch.setattr(TokenMasker, "accept", refusing)
    logits = constrained_logits()  # under "f+", "ff" (35) is the best allowed token
    reqs = constrained(1, "f+", temperature=0.0, logprobs=0)
    link = CountingLink()
    out = sample_on_device(logits[:, None].clone(), torch.ones(1, 1), reqs, link=link)
    assert out.token_ids.tolist() == [5]
    assert out.logprobs is not None
    assert np.allclose(out.logprobs.logprobs, float(torch.log_softmax(logits, -1)[5]), atol=1e-5)
    assert link.downloads > 1  # the redraw costs syncs, only then


def test_profile_runs_the_costliest_step():
    hidden, weight = random_head(4)
    link = CountingLink()
    device_sampler(weight, link=link).profile(hidden)
    assert link.downloads == 1


def test_a_thinking_row_is_not_masked():
    logits = constrained_logits()
    reqs = thinking(2, "f+", temperature=0.0)
    out = sample_on_device(logits[:, None].clone(), torch.ones(2, 1), reqs)
    assert out.token_ids.tolist() == [int(logits.argmax())] * 2
