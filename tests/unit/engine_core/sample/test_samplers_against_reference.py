"""Both samplers against one reference (reference.py) over the same `SamplingBatch` cases:
greedy, temperature, top-k, top-p, min-p, the repetition, frequency and presence penalties,
logit bias, min_tokens, seeds, logprobs with ranks, every one of them mixed in one batch, and
grammars. The CPU sampler runs the engine's own LM-head backend; the device sampler runs here
on the CPU (it is device-agnostic torch).

For each case the batch is built twice from the same requests (each sampler advances its
batch's generators and grammars): the two have the same uniform numbers, the samplers draw
the same tokens, and every token is the reference's but where the reference marks the row
fragile (a decision within float rounding of its edge; few, and counted). Logprobs, ranks and
top entries are the raw model's, within 1e-4.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from engine_core.layers.host_link import HostLink
from engine_core.layers.lm_head import BLOCK, LMHead
from engine_core.sample.device_sampler import DeviceSampler, HeadWeights
from engine_core.sample.interface import SamplerOutput, TokenSampler
from engine_core.sample.sampler import Sampler
from engine_core.sample.sampling_batch import SamplingBatch
from engine_core.sched.request import Request
from shared.messages import SamplingParams
from tests.unit.engine_core.heads import engine_kernels
from tests.unit.engine_core.sample.batches import batch_of
from tests.unit.engine_core.sample.reference import RefOutput, RefRow, reference
from tests.unit.engine_core.sample.test_sampler import EOS as GRAMMAR_EOS
from tests.unit.engine_core.sample.test_sampler import VOCAB as GRAMMAR_VOCAB
from tests.unit.engine_core.sample.test_sampler import (
    allowed_mask,
    constrained,
    constrained_logits,
)

VOCAB, HIDDEN, ROWS = 1000, 16, 36  # a partial last block of the vocabulary
SCALE = 0.4  # of the hidden states: logits ~N(0, 1.6), broad enough that truncation matters

# A case: row i's (params, prompt, outputs), given its raw logits (so that every edit matters).
Case = Callable[[int, torch.Tensor], RefRow]


def _ranked(raw: torch.Tensor) -> list[int]:
    return raw.argsort(descending=True).tolist()


def _greedy(i: int, raw: torch.Tensor) -> RefRow:
    return RefRow(SamplingParams(temperature=0.0), [1])


def _temperature(i: int, raw: torch.Tensor) -> RefRow:
    seed = i if i % 2 else None  # seeded and unseeded rows
    return RefRow(SamplingParams(temperature=(1.0, 0.5, 1.7)[i % 3], seed=seed), [1])


def _top_k(i: int, raw: torch.Tensor) -> RefRow:
    return RefRow(SamplingParams(temperature=1.0, top_k=(1, 5, 50)[i % 3], seed=i), [1])


def _top_p(i: int, raw: torch.Tensor) -> RefRow:
    return RefRow(SamplingParams(temperature=1.0, top_p=(0.3, 0.8, 0.95)[i % 3], seed=i), [1])


def _min_p(i: int, raw: torch.Tensor) -> RefRow:
    return RefRow(SamplingParams(temperature=1.0, min_p=(0.05, 0.3)[i % 2], seed=i), [1])


def _repetition(i: int, raw: torch.Tensor) -> RefRow:
    """The row's three best tokens and its worst seen in the prompt: a penalty > 1 pushes them
    down, one < 1 pulls them up."""
    ranked = _ranked(raw)
    params = SamplingParams(temperature=(0.0, 1.0)[i % 2], seed=i,
                            repetition_penalty=(1.8, 0.6)[i // 2 % 2])
    return RefRow(params, [*ranked[:3], ranked[-1]])


def _frequency_presence(i: int, raw: torch.Tensor) -> RefRow:
    ranked = _ranked(raw)
    params = SamplingParams(temperature=(0.0, 0.8)[i % 2], seed=i, frequency_penalty=0.6,
                            presence_penalty=(0.0, 0.5)[i // 2 % 2])
    return RefRow(params, [1], [ranked[0]] * 3 + [ranked[1]])


def _logit_bias(i: int, raw: torch.Tensor) -> RefRow:
    """The worst token lifted above the rest, the best pushed down, an id past the vocabulary
    ignored."""
    ranked = _ranked(raw)
    bias = {ranked[-1]: 30.0 + (i % 3), ranked[0]: -5.0, VOCAB + 5: 3.0}
    return RefRow(SamplingParams(temperature=(0.0, 1.0)[i % 2], seed=i, logit_bias=bias), [1])


def _min_tokens(i: int, raw: torch.Tensor) -> RefRow:
    """The row's best token is a stop token (or the batch's EOS): banned until min_tokens
    outputs, unless ignore_eos lets EOS through."""
    ranked = _ranked(raw)
    params = SamplingParams(temperature=(0.0, 1.0)[i % 2], seed=i, min_tokens=3,
                            stop_token_ids=[ranked[0]] if i % 3 == 0 else [],
                            ignore_eos=i % 3 == 2)
    return RefRow(params, [1], [5] * (i % 4))


def _logprobs(i: int, raw: torch.Tensor) -> RefRow:
    params = SamplingParams(temperature=(0.0, 1.0, 0.7)[i % 3], seed=i,
                            logprobs=(0, 1, 5, 20)[i % 4])
    return RefRow(params, [1])


CASES: dict[str, Case] = {
    "greedy": _greedy, "temperature": _temperature, "top_k": _top_k, "top_p": _top_p,
    "min_p": _min_p, "repetition": _repetition, "frequency_presence": _frequency_presence,
    "logit_bias": _logit_bias, "min_tokens": _min_tokens, "logprobs": _logprobs,
}


def _mixed(i: int, raw: torch.Tensor) -> RefRow:
    """Every case in one batch: row i is case i's row (the general path's rows among the
    fast path's)."""
    cases = list(CASES.values())
    row = cases[i % len(cases)](i, raw)
    return row._replace(params=_with_logprobs(row.params, i))


def _with_logprobs(params: SamplingParams, i: int) -> SamplingParams:
    return msgspec.structs.replace(params, logprobs=(None, 2, 0)[i % 3])


def _head(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, HIDDEN, generator=g) * SCALE, torch.randn(VOCAB, HIDDEN, generator=g)


class _OnDevice:
    """A sampler given its hidden states where its weights are."""

    def __init__(self, sampler: TokenSampler, device: torch.device) -> None:
        self.sampler, self.device = sampler, device

    def __call__(self, hidden: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        return self.sampler(hidden.to(self.device), batch)


def _samplers(weight: torch.Tensor) -> dict[str, _OnDevice]:
    """The CPU sampler on the engine's LM-head backend, the device sampler on the CPU, and
    where torch sees a GPU, the device sampler on it (so that a run there checks CUDA too)."""
    cpu = torch.device("cpu")
    head = LMHead(weight, chunk=BLOCK, workers=2, kernels=engine_kernels())
    link = HostLink(cpu, pinned=False, synchronize=lambda: None)
    samplers = {"cpu": _OnDevice(Sampler(head), cpu),
                "device": _OnDevice(DeviceSampler(HeadWeights(weight), link), cpu)}
    if torch.cuda.is_available():
        gpu = torch.device("cuda")
        link = HostLink(gpu, pinned=True, synchronize=torch.cuda.synchronize)
        samplers["cuda"] = _OnDevice(DeviceSampler(HeadWeights(weight.to(gpu)), link), gpu)
    return samplers


def _requests(rows: list[RefRow]) -> list[Request]:
    reqs = []
    for i, r in enumerate(rows):
        req = Request(f"r{i}", list(r.prompt), r.params)
        for t in r.outputs:
            req.append_token(t)
        reqs.append(req)
    return reqs


def _run(rows: list[RefRow], hidden: torch.Tensor, weight: torch.Tensor, eos: list[int],
         ) -> tuple[dict[str, SamplerOutput], SamplingBatch]:
    """Each sampler's output on a batch of its own, built alike; the first batch."""
    outputs, batches = {}, []
    for name, sampler in _samplers(weight).items():
        batch = batch_of(_requests(rows), VOCAB, seed=7, eos=eos)
        batches.append(batch)
        outputs[name] = sampler(hidden, batch)
    assert all(np.array_equal(batches[0].uniform, b.uniform) for b in batches)
    return outputs, batches[0]


def _check_logprobs(out: SamplerOutput, ref: RefOutput, rows: list[RefRow],
                    lps: torch.Tensor) -> None:
    asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    assert out.logprob_rows.tolist() == asked
    if not asked:
        assert out.logprobs is None
        return
    assert out.logprobs is not None
    tokens = torch.from_numpy(out.token_ids)
    for j, i in enumerate(asked):
        chosen = lps[i, tokens[i]]
        assert abs(float(out.logprobs.logprobs[j]) - float(chosen)) < 1e-4, i
        assert int(out.logprobs.ranks[j]) == int((lps[i] > chosen).sum()) + 1, i
        k = rows[i].params.logprobs or 0
        assert out.logprobs.top_ids[j, :k].tolist() == ref.top_ids[i].tolist(), i
        assert np.allclose(out.logprobs.top_logprobs[j, :k], ref.top_logprobs[i], atol=1e-4)


@pytest.mark.parametrize("case", [*CASES, "mixed"])
def test_both_samplers_are_the_reference(case: str) -> None:
    hidden, weight = _head()
    raw = hidden.double() @ weight.double().T
    make = _mixed if case == "mixed" else CASES[case]
    rows = [make(i, raw[i]) for i in range(ROWS)]
    eos = sorted({_ranked(raw[i])[0] for i in range(ROWS) if i % 3 != 0})  # (min_tokens)
    outputs, batch = _run(rows, hidden, weight, eos)
    ref = reference(raw, rows, batch.uniform, eos)
    fragile = ref.fragile
    assert fragile.sum() <= ROWS // 6, (case, np.flatnonzero(fragile))
    cpu = outputs["cpu"].token_ids
    assert cpu[~fragile].tolist() == ref.tokens[~fragile].tolist(), case
    for name, out in outputs.items():
        assert out.token_ids[~fragile].tolist() == cpu[~fragile].tolist(), (case, name)
    lps = torch.log_softmax(raw, -1)
    for out in outputs.values():
        _check_logprobs(out, ref, rows, lps)


def test_the_edits_change_what_is_drawn() -> None:
    """The cases are not vacuous: on the greedy rows, every edit moves the argmax somewhere."""
    hidden, weight = _head()
    raw = hidden.double() @ weight.double().T
    plain = raw.argmax(-1)
    for name in ("repetition", "frequency_presence", "logit_bias", "min_tokens"):
        rows = [CASES[name](i, raw[i]) for i in range(ROWS)]
        eos = sorted({_ranked(raw[i])[0] for i in range(ROWS) if i % 3 != 0})
        ref = reference(raw, rows, np.zeros(ROWS), eos)
        greedy = [i for i, r in enumerate(rows) if r.params.temperature == 0.0]
        assert (torch.from_numpy(ref.tokens[greedy]) != plain[greedy]).any(), name


def test_seeded_rows_draw_alike_whatever_shares_their_batch() -> None:
    """A seeded row's uniform number, so its token, is its own: alone or behind other rows,
    on either sampler."""
    hidden, weight = _head()
    params = SamplingParams(temperature=1.0, seed=42, top_p=0.9)
    alone = {name: int(s(hidden[:1], batch_of(_requests([RefRow(params, [1])]), VOCAB))
                       .token_ids[0]) for name, s in _samplers(weight).items()}
    crowd = [RefRow(SamplingParams(temperature=1.0), [1])] * 5 + [RefRow(params, [1])]
    stack = torch.cat([hidden[1:6], hidden[:1]])
    for name, s in _samplers(weight).items():
        out = s(stack, batch_of(_requests(crowd), VOCAB, seed=11))
        assert int(out.token_ids[-1]) == alone[name] == alone["cpu"], name


def test_grammars_greedy_is_the_references_masked_argmax_and_draws_stay_in_the_mask() -> None:
    """Constrained rows (a narrow and a broad grammar; greedy and seeded draws; with edits or
    truncation, on the CPU's general path; one still thinking) on both samplers: greedy rows
    are the reference's (the mask applied first), drawn rows stay in their mask, every
    matcher is advanced past its token, logprobs stay the raw model's."""
    logits = constrained_logits()
    masks = {"f+": allowed_mask("f+"), "[a-f]+": allowed_mask("[a-f]+")}
    plan: list[tuple[str, dict[str, Any]]] = [
        ("f+", {"temperature": 0.0, "logprobs": 2}),
        ("[a-f]+", {"temperature": 0.0, "logprobs": 0}),
        ("f+", {"temperature": 0.0, "logit_bias": {215: 9.0}}),
        ("[a-f]+", {"temperature": 0.0, "repetition_penalty": 3.0}),
        ("f+", {"temperature": 1.0, "seed": 5, "logprobs": 1}),
        ("[a-f]+", {"temperature": 0.8, "seed": 6}),
        ("[a-f]+", {"temperature": 1.0, "top_k": 40, "seed": 7})]
    rows = [RefRow(SamplingParams(**kw), [1], (), masks[regex]) for regex, kw in plan]
    rows.append(RefRow(SamplingParams(temperature=0.0), [1]))  # thinking: no mask yet
    weight = logits[:, None].clone()
    hidden = torch.ones(len(rows), 1)
    lps = torch.log_softmax(logits.double(), -1)
    for name, sampler in _samplers(weight).items():
        reqs = [constrained(1, regex, **kw)[0] for regex, kw in plan]
        reqs += constrained(1, "f+", reasoning_end=[7], temperature=0.0)  # still thinking
        batch = batch_of(reqs, GRAMMAR_VOCAB)
        assert batch.constrained == list(range(len(plan)))
        out = sampler(hidden, batch)
        ref = reference(logits[None].expand(len(rows), -1), rows, batch.uniform)
        tokens = out.token_ids.tolist()
        greedy = [i for i, r in enumerate(rows) if r.params.temperature == 0.0]
        assert [tokens[i] for i in greedy] == ref.tokens[greedy].tolist(), name
        assert not bool(masks["f+"][tokens[-1]])  # the thinking row's, unmasked
        for i, (regex, _) in enumerate(plan):
            assert bool(masks[regex][tokens[i]]), (name, i)
            grammar = reqs[i].grammar
            assert grammar is not None and grammar.accept(GRAMMAR_EOS), (name, i)  # advanced
        assert out.logprobs is not None and out.logprob_rows.tolist() == [0, 1, 4]
        for j, i in enumerate(out.logprob_rows.tolist()):
            assert abs(float(out.logprobs.logprobs[j]) - float(lps[tokens[i]])) < 1e-4
