"""The sampler on synthetic logits: the draw follows the distribution, truncations cut it.

Logits reach the sampler through an LM head: `head_for(logits)` is a one-dimensional head whose
weight column is the logits row, so `ones @ weight.T` gives them back exactly.
"""

from __future__ import annotations

import functools
import math
import re
from concurrent.futures import Future

import numpy as np
import torch

from engine_core.layers.lm_head import BLOCK, LMHead
from engine_core.sample.logits_ops import draw_plain
from engine_core.sample.sampler import Sampler, token_logprobs
from engine_core.sched.request import Request
from engine_core.structured.grammar import RequestGrammar
from engine_core.structured.masks import TokenMasker
from shared.messages import SamplingParams, StructuredOutput
from tests.unit.engine_core.heads import engine_kernels
from tests.unit.engine_core.sample.batches import batch_of

PROBS = torch.tensor([0.1, 0.2, 0.3, 0.4])


def head_for(logits: torch.Tensor, **kwargs) -> LMHead:
    return LMHead(logits[:, None].clone(), kernels=engine_kernels(), **kwargs)


def sample(logits: torch.Tensor, reqs: list[Request], seed: int = 0, **head) -> torch.Tensor:
    out = Sampler(head_for(logits, **head))(torch.ones(len(reqs), 1),
                                            batch_of(reqs, len(logits), seed))
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
    from engine_core.sample.logits_ops import inverse_cdf

    w = torch.zeros(3, 1000)
    w[:, 10], w[:, 500], w[:, 999] = 1.0, 2.0, 1.0
    u = torch.tensor([0.0, 0.3, 0.9999999])
    assert inverse_cdf(w, u).tolist() == [10, 500, 999]
    dense = torch.rand(4, 777)
    cdf = dense.cumsum(-1)
    u = torch.rand(4)
    expected = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)[:, 0]
    assert (inverse_cdf(dense, u) - expected).abs().max() <= 1  # float rounding only


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
    out = Sampler(head)(hidden, batch_of(reqs, 900, seed=3))
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


def test_plain_draws_follow_softmax_over_the_allowed_and_greedy_takes_the_first_maximum():
    """draw_plain (the fast path's exact masked draws over a few candidates): sampled rows
    follow softmax(vals / T) over their finite entries and never draw a -inf one; greedy
    rows, and a row that allows nothing, take the first of equal maxima; a seed repeats."""
    row = np.array([0.5, -np.inf, 1.5, -1.0, -np.inf, 1.5], dtype=np.float32)
    for temp in (1.0, 0.7):
        reqs = [Request(f"r{i}", [1], SamplingParams(temperature=temp)) for i in range(20000)]
        cols = draw_plain(np.tile(row, (len(reqs), 1)), batch_of(reqs, 6), range(len(reqs)))
        got = np.bincount(cols, minlength=len(row)) / len(cols)
        expected = torch.softmax(torch.from_numpy(row) / temp, -1).numpy()
        assert np.abs(got - expected).max() < 0.01, temp
        assert got[1] == got[4] == 0.0  # never a disallowed one
    rows = np.stack([row, row, np.full_like(row, -np.inf)])
    greedy = [Request(f"g{i}", [1], SamplingParams(temperature=0.0)) for i in range(3)]
    assert draw_plain(rows, batch_of(greedy, 6), range(3)).tolist() == [2, 2, 0]

    def seeded(sampler_seed: int, others: int) -> list[int]:
        """Eight draws of a request with seed 7, after `others` unseeded rows."""
        reqs = [Request(f"o{i}", [1], SamplingParams(temperature=1.0)) for i in range(others)]
        reqs.append(Request("s", [1], SamplingParams(temperature=1.0, seed=7)))
        batch = batch_of(reqs, 6, seed=sampler_seed)
        return [int(draw_plain(np.tile(row, (len(reqs), 1)), batch, range(len(reqs)))[-1])
                for _ in range(8)]

    assert seeded(1, 0) == seeded(2, 3)


# Constrained rows on synthetic logits: a 600-token vocabulary of distinct strings of a-f (token
# i spells i in base 6, digits as letters), some tokens "Z" instead, EOS last. "[a-f]+" allows
# every letter token (a broad mask: the fast path's draws are mostly allowed, some retried);
# "f+" allows three (a narrow mask: the exact draw over the allowed tokens alone).
VOCAB = 600
EOS = VOCAB - 1
ZS = [0, 7, 255, 256, 300, 400, 598]  # disallowed by both grammars, spread over the blocks


def _spelling(i: int) -> str:
    if i in ZS:
        return "Z"
    if i == EOS:
        return "</s>"
    digits = ""
    while True:
        digits = "abcdef"[i % 6] + digits
        i //= 6
        if not i:
            return digits


@functools.cache
def _compiled(regex: str):
    import xgrammar

    info = xgrammar.TokenizerInfo([_spelling(i) for i in range(VOCAB)], stop_token_ids=[EOS])
    return xgrammar.GrammarCompiler(info, max_threads=1).compile_regex(regex)


def constrained(n: int, regex: str, **params) -> list[Request]:
    """Requests under `regex`, their grammar compiled (as the scheduler sets it)."""
    params.setdefault("structured", StructuredOutput("regex", regex))
    reqs = []
    for i in range(n):
        req = Request(f"c{i}", [1], SamplingParams(**params))
        compiled: Future = Future()
        compiled.set_result(_compiled(regex))
        req.grammar = RequestGrammar(compiled)
        reqs.append(req)
    return reqs


def constrained_logits() -> torch.Tensor:
    """The Z tokens lead, so unconstrained draws are often refused; allowed mass is uneven."""
    logits = torch.linspace(-2.0, 1.0, VOCAB)
    logits[ZS] = torch.tensor([3.0, 2.5, 4.0, 1.0, 3.5, 2.0, 3.0])
    logits[[5, 35, 215]] = torch.tensor([0.5, 1.5, -1.0])  # "f", "ff", "fff"
    return logits


def allowed_mask(regex: str) -> torch.Tensor:
    spelled = [_spelling(i) for i in range(VOCAB)]
    return torch.tensor([re.fullmatch(regex, s) is not None for s in spelled])


def test_constrained_draws_follow_the_masked_distribution():
    """Broad and narrow masks, two temperatures: the fast path's frequencies match
    softmax(masked logits / T), as do the general path's (a zero logit bias sends rows there),
    and no draw is ever outside the mask."""
    logits = constrained_logits()
    for regex in ("[a-f]+", "f+"):
        allowed = allowed_mask(regex)
        for temp in (1.0, 0.7):
            expected = torch.softmax((logits / temp).masked_fill(~allowed, -math.inf), -1)
            for bias in ({}, {EOS: 0.0}):
                reqs = constrained(8000, regex, temperature=temp, logit_bias=bias)
                tokens = sample(logits, reqs, chunk=BLOCK, workers=2)
                assert bool(allowed[tokens].all()), (regex, temp, bias)
                got = torch.bincount(tokens, minlength=VOCAB).float() / len(tokens)
                assert (got - expected).abs().max() < 0.02, (regex, temp, bias)
                # each matcher advanced past its letter: the grammar may now end
                assert all(r.grammar is not None and r.grammar.accept(EOS) for r in reqs[:3])


def test_constrained_greedy_is_the_masked_argmax():
    """The raw argmax when allowed, else the best allowed token (the first of equal maxima),
    under a narrow mask (its allowed tokens read alone) and a broad one (its row masked)."""
    logits = constrained_logits()
    for regex in ("f+", "[a-f]+"):
        masked = logits.masked_fill(~allowed_mask(regex), -math.inf)
        got = sample(logits, constrained(2, regex, temperature=0.0)).tolist()
        assert got == [int(masked.argmax())] * 2 and int(logits.argmax()) not in got
    logits[35] = logits[5]  # a tie among the allowed: the lower id, as torch.argmax
    assert sample(logits, constrained(1, "f+", temperature=0.0)).tolist() == [5]
    logits[301] = 9.0  # a letter token, the raw argmax: the broad grammar accepts it as it is
    assert sample(logits, constrained(1, "[a-f]+", temperature=0.0)).tolist() == [301]


def test_a_token_the_grammar_accepts_as_drawn_needs_no_mask(monkeypatch):
    """The fast path: rows whose argmax their grammar accepts keep it, no mask filled; the rows
    refused get their masks in one fill, and the masked argmax."""
    fills: list[list[RequestGrammar]] = []
    real = TokenMasker.fill

    def counted(self, rows, vocab, constrained, grammars):
        fills.append(list(grammars))
        return real(self, rows, vocab, constrained, grammars)

    monkeypatch.setattr(TokenMasker, "fill", counted)
    logits = constrained_logits()
    logits[301] = 9.0  # a letter token leads: "[a-f]+" accepts it, "f+" does not
    reqs = constrained(2, "[a-f]+", temperature=0.0) + constrained(2, "f+", temperature=0.0)
    assert sample(logits, reqs).tolist() == [301, 301, 35, 35]  # "ff": the best "f+" allows
    assert fills == [[reqs[2].grammar, reqs[3].grammar]]


def test_a_token_the_mask_allows_but_the_matcher_refuses_is_drawn_again(monkeypatch):
    """xgrammar's mask may allow a token its matcher then refuses: here the matcher refuses
    "ff" (35), the best allowed token; the row is drawn again without it."""
    real = TokenMasker.accept

    def refusing(self, grammars, tokens):
        return [t != 35 and real(self, [g], [t])[0] for g, t in zip(grammars, tokens)]

    monkeypatch.setattr(TokenMasker, "accept", refusing)
    reqs = constrained(1, "f+", temperature=0.0)
    assert sample(constrained_logits(), reqs).tolist() == [5]
    assert reqs[0].grammar is not None and reqs[0].grammar.accept(EOS)  # advanced past "f"


def test_constrained_rows_keep_the_raw_logprobs_and_free_rows_their_draws():
    """Masking never touches the scan: a constrained row's logprob is log_softmax of the raw
    logits, and free rows in the same batch draw as they would alone (same seeds)."""
    logits = constrained_logits()
    free = [Request(f"f{i}", [1], SamplingParams(temperature=1.0, seed=i, logprobs=1))
            for i in range(4)]
    alone = Sampler(head_for(logits))(torch.ones(4, 1), batch_of(free, VOCAB))
    free = [Request(f"f{i}", [1], SamplingParams(temperature=1.0, seed=i, logprobs=1))
            for i in range(4)]
    mixed = constrained(3, "f+", temperature=1.0, logprobs=1) + free
    out = Sampler(head_for(logits))(torch.ones(7, 1), batch_of(mixed, VOCAB))
    assert out.token_ids[3:].tolist() == alone.token_ids.tolist()
    assert out.logprobs is not None
    raw = torch.log_softmax(logits, -1)[torch.from_numpy(out.token_ids[:3])]
    assert torch.allclose(torch.from_numpy(out.logprobs.logprobs[:3]), raw, atol=1e-5)


def test_read_masks_and_allows_read_the_bitmask():
    from engine_core.structured.masks import allows, read_masks

    bitmask = torch.zeros(3, 19, dtype=torch.int32)  # 608 bits for 600 tokens
    bitmask[0, 0] = 1 << 3
    bitmask[0, 18] = -(1 << 31) | 1 << 23  # bit 31 (token 607, past the vocabulary) and 599
    bitmask[2] = -1
    ids = read_masks(bitmask, VOCAB, 2.0).narrow  # no row is broad: all are unpacked
    assert ids.ids[0][ids.valid[0]].tolist() == [3, 599]
    assert not ids.valid[1].any()
    assert ids.ids[2][ids.valid[2]].tolist() == list(range(VOCAB))
    read = read_masks(bitmask, VOCAB, 0.25)
    assert read.broad == [False, False, True]
    assert read.narrow.ids[0][read.narrow.valid[0]].tolist() == [3, 599]
    assert not read.narrow.valid[1:].any()  # a broad row's tokens are not unpacked
    rows, tokens = [0, 0, 1, 2], [3, 4, 3, 599]
    assert allows(bitmask, rows, tokens).tolist() == [True, False, False, True]


def thinking(n: int, regex: str, **params) -> list[Request]:
    """Constrained requests still thinking: their end marker (token 7) not yet generated."""
    return constrained(n, regex, reasoning_end=[7], **params)


def test_a_thinking_row_draws_unconstrained_on_either_path(monkeypatch):
    """No mask, no matcher work while thinking (greedy: the raw argmax, which "f+" refuses),
    on the fast path and on the general one; after the marker, the masked argmax."""
    monkeypatch.setattr(TokenMasker, "fill", None)  # any mask filled would raise
    logits = constrained_logits()
    for bias in ({}, {EOS: 0.0}):
        reqs = thinking(2, "f+", temperature=0.0, logit_bias=bias)
        assert sample(logits, reqs).tolist() == [int(logits.argmax())] * 2
        assert all(r.grammar is not None and not r.grammar.accept(EOS) for r in reqs)  # fresh
    monkeypatch.undo()
    reqs = thinking(1, "f+", temperature=0.0)
    reqs[0].append_token(7)
    masked = logits.masked_fill(~allowed_mask("f+"), -math.inf)
    assert sample(logits, reqs).tolist() == [int(masked.argmax())]
