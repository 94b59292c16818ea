"""Speculative decoding in the whole engine: drafts verified in one forward, exactly.

The tiny random models never repeat themselves, so an n-gram proposer finds nothing to propose
on them (tests/unit/engine_core/spec/ tests it on token lists). Here an oracle proposes: it
knows each request's true greedy continuation (from a run without speculation) and proposes it,
wrong at a chosen share of the positions, so that verification accepts, rejects and resamples
at every position of a draft. Against the engine without speculation and against Hugging
Face: greedy tokens equal, logprobs within the parity tolerance, under concurrency,
preemption and chunked prefill; penalties counted token by token; stop ids and max_tokens
inside an accepted run; the KV cache and the prefix cache keep no rejected token; the
counters; and, on a small vocabulary, draws whose distribution is the target's.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from typing import Any

import msgspec
import numpy as np
import pytest

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from shared.messages import SamplingParams, StructuredOutput
from shared.speculative import parse_speculative_config
from tests.engine.driver import Collected, run
from tests.engine.test_hf_parity import (
    ATOL,
    MAX_NEW,
    assert_drained,
    assert_parity,
    make_prompts,
)

# (speculation at every batch size: the tests' batches are larger than the default's bound)
NGRAM = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, '
                                 '"disable_by_batch_size": 1024}')


class Oracle:
    """Proposes each request's true continuation (`truth`: request id -> its tokens), a
    proposal's token wrong with probability `wrong` (then a token off by one)."""

    def __init__(self, core: EngineCore, truth: dict[str, list[int]], k: int = 4,
                 wrong: float = 0.3, seed: int = 0) -> None:
        self.truth, self.k, self.wrong = truth, k, wrong
        self.rng = random.Random(seed)
        self.by_tokens: dict[int, str] = {}
        self.core = core
        self.proposed = 0

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        req = next(r for r in self.core.scheduler.running if r.all_token_ids is tokens)
        true = self.truth.get(req.request_id, [])
        done = len(req.output_token_ids)
        drafts = true[done:done + min(self.k, limit)]
        drafts = [t + 1 if self.rng.random() < self.wrong else t for t in drafts]
        self.proposed += len(drafts)
        return drafts


def engine(model: Any, speculate: bool = True, **kw: Any) -> EngineCore:
    config = EngineConfig(model=str(model), **{"num_kv_blocks": 256, "block_size": 8, **kw},
                          speculative=NGRAM if speculate else None)
    return EngineCore(config)


def submit(core: EngineCore, prompts: list[list[int]], **params: Any) -> None:
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, SamplingParams(**{"max_tokens": 24, "temperature": 0.0,
                                                        "logprobs": 3, **params}))


def plain_run(model: Any, prompts: list[list[int]], **params: Any) -> dict[str, Collected]:
    core = engine(model, speculate=False)
    submit(core, prompts, **params)
    return run(core)


def speculative_run(model: Any, prompts: list[list[int]], truth: dict[str, Collected],
                    wrong: float = 0.3, engine_kw: dict[str, Any] | None = None,
                    **params: Any) -> tuple[EngineCore, dict[str, Collected], Oracle]:
    core = engine(model, **(engine_kw or {}))
    oracle = Oracle(core, {rid: c.token_ids for rid, c in truth.items()}, wrong=wrong)
    core.proposer = oracle  # type: ignore[assignment]
    submit(core, prompts, **params)
    return core, run(core), oracle


def assert_same(got: dict[str, Collected], want: dict[str, Collected]) -> None:
    assert got.keys() == want.keys()
    for rid, w in want.items():
        g = got[rid]
        assert g.token_ids == w.token_ids, rid
        assert g.logprobs == pytest.approx(w.logprobs, abs=ATOL), rid
        assert g.top_ids == w.top_ids and g.finish == w.finish, rid


def test_greedy_verification_equals_the_plain_engine_and_hf(tiny_llama, tokenizer, reference):
    prompts = make_prompts(tokenizer, n=12)
    want = plain_run(tiny_llama, prompts, max_tokens=MAX_NEW)
    core, got, oracle = speculative_run(tiny_llama, prompts, want, max_tokens=MAX_NEW)
    assert_same(got, want)
    assert_parity(got, prompts, reference)
    stats = core.stats()
    # (a proposal is verified unless the step budget cuts it, or its request ends first)
    assert oracle.proposed > 50
    assert 0.8 * oracle.proposed <= stats.spec_draft_tokens <= oracle.proposed
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens  # some of each
    per_pos = stats.spec_accepted_per_pos
    assert sum(per_pos) == stats.spec_accepted_tokens and per_pos == sorted(per_pos)[::-1]
    assert stats.steps < MAX_NEW + 1  # fewer steps than tokens: drafts were accepted
    assert_drained(core)


@pytest.mark.parametrize("setup", ["preemption", "chunked"])
def test_under_preemption_and_chunked_prefill(tiny_llama, tokenizer, setup):
    prompts = make_prompts(tokenizer, n=10)
    kw = {"num_kv_blocks": 14} if setup == "preemption" else {"max_num_batched_tokens": 20}
    want = plain_run(tiny_llama, prompts)
    core, got, _ = speculative_run(tiny_llama, prompts, want, engine_kw=kw)
    assert_same(got, want)
    stats = core.stats()
    assert (stats.preemptions if setup == "preemption" else stats.chunked_prefills) > 0
    assert stats.spec_accepted_tokens > 0
    assert_drained(core)


def test_penalties_count_every_accepted_token(tiny_qwen3):
    prompts = [[1000 + (i * 13 + j) % 97 for j in range(9 + i)] for i in range(6)]
    params = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.2}
    want = plain_run(tiny_qwen3, prompts, **params)
    core, got, _ = speculative_run(tiny_qwen3, prompts, want, wrong=0.2, **params)
    assert_same(got, want)
    assert core.stats().spec_accepted_tokens > 0


def test_stops_inside_an_accepted_run_emit_nothing_after(tiny_llama, tokenizer):
    prompts = make_prompts(tokenizer, n=6)
    free = plain_run(tiny_llama, prompts, ignore_eos=True)
    # a stop id that comes mid-way in each continuation, and max_tokens not a step's multiple
    stops = {rid: c.token_ids[7] for rid, c in free.items()}
    core = engine(tiny_llama)
    core.proposer = Oracle(core, {rid: c.token_ids for rid, c in free.items()},  # type: ignore[assignment]
                           wrong=0.0)
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=11, temperature=0.0,
                                                    ignore_eos=True,
                                                    stop_token_ids=[stops[f"r{i}"]]))
    got = run(core)
    for rid, c in free.items():
        first = c.token_ids.index(stops[rid])
        if first < 11:
            assert got[rid].token_ids == c.token_ids[:first + 1] and got[rid].finish == "stop"
        else:
            assert got[rid].token_ids == c.token_ids[:11] and got[rid].finish == "length"
    assert core.stats().spec_accepted_tokens > 0
    assert_drained(core)


def test_the_prefix_cache_keeps_only_accepted_tokens(tiny_llama, tokenizer):
    """Every block published (its KV-cache event) holds tokens of the request's final
    sequence, at their positions: never a rejected draft."""
    prompts = make_prompts(tokenizer, n=8)
    want = plain_run(tiny_llama, prompts)
    core = engine(tiny_llama)
    core.blocks.record_events()
    oracle = Oracle(core, {rid: c.token_ids for rid, c in want.items()}, wrong=0.5)
    core.proposer = oracle  # type: ignore[assignment]
    submit(core, prompts)
    got = run(core)
    assert_same(got, want)
    sequences = [p + got[f"r{i}"].token_ids for i, p in enumerate(prompts)]
    blocks = {tuple(s[i:i + 8]) for s in sequences for i in range(0, len(s) - 7, 8)}
    events = core.blocks.take_events()
    stored = [e for e in events if type(e).__name__ == "BlockStored"]
    assert stored
    for event in stored:
        for j in range(0, len(event.token_ids), 8):
            assert tuple(event.token_ids[j:j + 8]) in blocks
    assert_drained(core)


def test_seeded_draws_are_those_of_the_plain_engine(tiny_llama, tokenizer):
    """A seeded request's generator is rewound to one draw per emitted token: its tokens are
    the plain engine's (float noise between the two forwards could flip a draw on a boundary;
    the tiny model in float32 shows none)."""
    prompts = make_prompts(tokenizer, n=6)
    params = {"temperature": 0.9, "top_k": 40, "seed": 123}
    want = plain_run(tiny_llama, prompts, **params)
    core, got, _ = speculative_run(tiny_llama, prompts, want, wrong=0.3, **params)
    assert [got[r].token_ids for r in want] == [want[r].token_ids for r in want]
    assert core.stats().spec_accepted_tokens > 0


def test_rejection_sampling_keeps_the_targets_distribution(tiny_llama):
    """Unseeded draws at a high temperature over each position's top 3: the first three tokens
    of 600 requests of one prompt, with drafts and without, compared by a chi-square test on the
    joint (first, second) token and on the third. The drafts are far from the target: at each
    position the token the plain run drew least often. A wrong acceptance rule fails this
    (accepting every draft: checked by hand)."""
    from scipy.stats import chi2_contingency

    prompt = [128000, 791, 3363, 315, 9822, 374]
    n = 600
    params = SamplingParams(max_tokens=3, temperature=1.5, top_k=3, ignore_eos=True)

    def draws(proposals: list[int] | None, seed: int) -> list[tuple[int, ...]]:
        core = engine(tiny_llama, speculate=proposals is not None, seed=seed, max_num_seqs=128)
        if proposals is not None:
            class Rarest:
                def propose(self, tokens: list[int], limit: int) -> list[int]:
                    done = len(tokens) - len(prompt)
                    return proposals[done:done + min(2, limit)]

            core.proposer = Rarest()  # type: ignore[assignment]
        for i in range(n):
            core.add_request(f"s{i}", list(prompt), params)
        got = [tuple(c.token_ids) for c in run(core).values()]
        assert proposals is None or core.stats().spec_draft_tokens >= n
        return got

    plain = draws(None, 1)
    rarest = [Counter(t[j] for t in plain).most_common()[-1][0] for j in range(3)]
    spec = draws(rarest, 2)
    for pick in (lambda t: t[:2], lambda t: t[2:]):
        a, b = Counter(map(pick, plain)), Counter(map(pick, spec))
        keys = sorted(set(a) | set(b))
        table = np.array([[a[k] for k in keys], [b[k] for k in keys]]) + 0.5
        assert chi2_contingency(table).pvalue > 1e-3, (a, b)


# -- a draft model ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A second tiny Llama with the target's tokenizer: one layer, its own random weights."""
    from engine_core.worker.default_model import DEFAULT, ensure_model

    spec = dataclasses.replace(DEFAULT, name="tandem-tiny-llama-draft", num_layers=1, seed=7)
    return ensure_model(spec, tmp_path_factory.mktemp("draft"))


def draft_config(model: Any, k: int = 3) -> Any:
    return parse_speculative_config(f'{{"model": "{model}", "num_speculative_tokens": {k}, '
                                    '"disable_by_batch_size": 1024}')


@pytest.mark.parametrize("setup", ["roomy", "preemption", "chunked"])
def test_the_target_as_its_own_draft_accepts_every_token(tiny_llama, tokenizer, reference,
                                                         setup):
    """Greedy drafts of the target itself are its own tokens: every one accepted, the output
    the plain engine's and Hugging Face's, in a third of the steps or fewer."""
    prompts = make_prompts(tokenizer, n=10)
    kw = {"roomy": {}, "preemption": {"num_kv_blocks": 14},
          "chunked": {"max_num_batched_tokens": 24}}[setup]
    want = plain_run(tiny_llama, prompts, max_tokens=MAX_NEW)
    core = EngineCore(EngineConfig(model=str(tiny_llama),
                                   **{"num_kv_blocks": 256, "block_size": 8, **kw},
                                   speculative=draft_config(tiny_llama)))
    submit(core, prompts, max_tokens=MAX_NEW)
    got = run(core)
    assert_same(got, want)
    assert_parity(got, prompts, reference)
    stats = core.stats()
    assert stats.spec_draft_tokens > 0
    if setup == "roomy":
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens
    if setup == "preemption":
        assert stats.preemptions > 0
    if setup == "chunked":
        assert stats.chunked_prefills > 0
    assert_drained(core)


def test_another_draft_model_keeps_the_targets_tokens(tiny_llama, tiny_draft, tokenizer):
    prompts = make_prompts(tokenizer, n=8)
    want = plain_run(tiny_llama, prompts)
    core = EngineCore(EngineConfig(model=str(tiny_llama), num_kv_blocks=256, block_size=8,
                                   speculative=draft_config(tiny_draft, k=2)))
    submit(core, prompts)
    assert_same(run(core), want)
    assert core.stats().spec_draft_tokens > 0
    assert_drained(core)


def test_a_draft_with_another_vocabulary_is_refused(tiny_llama, tiny_qwen2):
    with pytest.raises(ValueError, match="vocabulary"):
        EngineCore(EngineConfig(model=str(tiny_llama), num_kv_blocks=64,
                                speculative=draft_config(tiny_qwen2)))


# -- structured outputs -----------------------------------------------------------------------
def constrained_cases() -> list[Any]:
    from tests.engine.test_structured import GRAMMAR, REGEX, SCHEMAS, json_constraint

    return [json_constraint(s) for s in SCHEMAS[:4]] + [
        StructuredOutput("regex", REGEX), StructuredOutput("grammar", GRAMMAR),
        StructuredOutput("json_object")]


def submit_constrained(core: EngineCore, prompt: list[int], cases: list[Any],
                       **params: Any) -> None:
    for i, constraint in enumerate(cases):
        core.add_request(f"r{i}", prompt, SamplingParams(
            **{"max_tokens": 48, "temperature": 0.0, "logprobs": 2, **params},
            structured=constraint))


def assert_in_grammar(core: EngineCore, cases: list[Any], got: dict[str, Collected]) -> None:
    from tests.engine.test_structured import accepted_prefix

    for i, constraint in enumerate(cases):
        result = got[f"r{i}"]
        assert result.finish in ("stop", "length"), result
        assert accepted_prefix(core, constraint, result.token_ids), i


@pytest.mark.parametrize("wrong", [0.0, 0.3])
def test_constrained_drafts_are_checked_by_the_grammar_and_rolled_back(tiny_llama, tokenizer,
                                                                        wrong):
    """Greedy constrained requests verifying drafts emit the plain engine's tokens: drafts the
    grammar refuses (an oracle's wrong token, one above the true one) are never accepted, those
    it allows but the target rejects are rolled back, and the grammar's own end (EOS) is the
    run's end; every output is one the grammar accepts."""
    cases = constrained_cases()
    prompt = list(tokenizer("Answer in the requested format:").input_ids)
    plain = engine(tiny_llama, speculate=False)
    submit_constrained(plain, prompt, cases)
    want = run(plain)
    core = engine(tiny_llama)
    oracle = Oracle(core, {rid: c.token_ids for rid, c in want.items()}, wrong=wrong)
    core.proposer = oracle  # type: ignore[assignment]
    submit_constrained(core, prompt, cases)
    got = run(core)
    assert_same(got, want)
    assert_in_grammar(core, cases, got)
    stats = core.stats()
    assert stats.spec_accepted_tokens > 0
    assert stats.steps < sum(len(c.token_ids) for c in want.values())
    if wrong:
        assert stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert_drained(core)


def test_sampled_constrained_requests_with_drafts_stay_in_their_grammar(tiny_llama, tokenizer,
                                                                        tiny_draft):
    """Sampled rows under their grammars' forks, drafted by the oracle and by a draft model that
    knows nothing of the grammar: every output is in its grammar, nothing leaks."""
    cases = constrained_cases()
    prompt = list(tokenizer("Answer in the requested format:").input_ids)
    params = {"temperature": 0.8, "seed": 5}
    plain = engine(tiny_llama, speculate=False)
    submit_constrained(plain, prompt, cases, **params)
    want = run(plain)
    core = engine(tiny_llama)
    core.proposer = Oracle(core, {rid: c.token_ids for rid, c in want.items()},  # type: ignore[assignment]
                           wrong=0.2)
    submit_constrained(core, prompt, cases, **params)
    got = run(core)
    assert_in_grammar(core, cases, got)
    assert core.stats().spec_accepted_tokens > 0
    assert_drained(core)
    drafted = EngineCore(EngineConfig(model=str(tiny_llama), num_kv_blocks=256, block_size=8,
                                      speculative=draft_config(tiny_draft, k=3)))
    submit_constrained(drafted, prompt, cases, **params)
    assert_in_grammar(drafted, cases, run(drafted))
    assert drafted.stats().spec_draft_tokens > 0
    assert_drained(drafted)


# -- overlapped steps -------------------------------------------------------------------------
@pytest.mark.parametrize("bound", [1024, 4])
def test_overlapped_steps_with_speculation(tiny_llama, tokenizer, bound):
    """--async-scheduling with speculation: a step whose requests may be proposed for, or that
    verifies drafts, completes before the next is scheduled, and steps overlap again while
    more than the bound run (here, bound 4: once the later requests arrive, until requests of
    different lengths have finished). Tokens and logprobs are the plain engine's either way."""
    prompts = make_prompts(tokenizer, n=10)
    lengths = {f"r{i}": 6 + 3 * i for i in range(len(prompts))}

    def submit_lengths(core: EngineCore, which: range) -> None:
        for i in which:
            core.add_request(f"r{i}", prompts[i], SamplingParams(
                max_tokens=lengths[f"r{i}"], temperature=0.0, logprobs=3))

    plain = engine(tiny_llama, speculate=False)
    submit_lengths(plain, range(len(prompts)))
    want = run(plain)
    spec = msgspec.structs.replace(NGRAM, disable_by_batch_size=bound)
    core = EngineCore(EngineConfig(model=str(tiny_llama), num_kv_blocks=256, block_size=8,
                                   async_scheduling=True, speculative=spec))
    assert core.async_scheduling
    core.proposer = Oracle(core, {r: c.token_ids for r, c in want.items()})  # type: ignore[assignment]
    submit_lengths(core, range(3))  # speculated, then joined mid-way by the rest
    overlapped = []

    def watch(core: EngineCore, step: int) -> None:
        if step == 4:
            submit_lengths(core, range(3, len(prompts)))
        inflight = core._inflight
        overlapped.append(inflight is not None and not inflight.blocking)

    got = run(core, on_step=watch)
    assert_same(got, want)
    assert core.stats().spec_accepted_tokens > 0
    assert any(overlapped) == (bound < len(prompts))
    assert_drained(core)


def test_a_model_that_copies_its_prompt_accepts_nearly_every_ngram_draft(tiny_llama, tmp_path):
    """tests/bench/spec_copy.py's copying model (a first-order chain over cycles of tokens)
    continues a prompt's cycle, so n-gram lookup proposes its true tokens: the output is the
    plain engine's and the chain's, in about a fifth of the steps."""
    from pathlib import Path

    from tests.bench.spec_copy import chain_model, chain_prompt, make_engine, timed

    cycles = chain_model(Path(tiny_llama), tmp_path / "chain", cycle=16)
    prompt = chain_prompt(cycles[0], 3, 24)
    plain = make_engine(tmp_path / "chain", None, 128)
    spec = make_engine(tmp_path / "chain", 4, 128)
    _, a = timed(plain, [prompt], 40, "p")
    _, b = timed(spec, [prompt], 40, "s")
    assert a["p0"] == b["s0"] == chain_prompt(cycles[0], 3 + 24, 40)
    stats = spec.stats()
    assert stats.spec_accepted_tokens >= 0.9 * stats.spec_draft_tokens > 0
    assert stats.steps <= 14  # a prefill, then 5 tokens a step


def test_a_draft_model_drafts_under_the_grammar(tiny_llama, tokenizer):
    """The target as its own draft, on greedy constrained requests: its drafts are its argmax
    under each request's grammar, so every one is accepted, and the outputs are the plain
    engine's."""
    cases = constrained_cases()
    prompt = list(tokenizer("Answer in the requested format:").input_ids)
    plain = engine(tiny_llama, speculate=False)
    submit_constrained(plain, prompt, cases)
    want = run(plain)
    core = EngineCore(EngineConfig(model=str(tiny_llama), num_kv_blocks=256, block_size=8,
                                   speculative=draft_config(tiny_llama, k=3)))
    submit_constrained(core, prompt, cases)
    got = run(core)
    assert_same(got, want)
    stats = core.stats()
    assert stats.spec_draft_tokens > 50
    # (a draft that ends the grammar, its EOS, is not accepted as a draft: Drafts.limits)
    assert stats.spec_accepted_tokens >= stats.spec_draft_tokens - 3 * len(cases)
    assert_drained(core)
