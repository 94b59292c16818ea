"""Speculative decoding and structured outputs at --tensor-parallel-size 2 (gloo, the CPU).

- n-gram speculation on a model that copies its prompt (tests/bench/spec_copy.py's chain, with
  the attention and MLP outputs scaled down rather than zeroed, so the sharded products and
  their all-reduces still move every logit, and some requests leave the chain): greedy tokens
  and logprobs equal Hugging Face's, drafts accepted and rejected.
- a draft model (another tiny Llama, and the target as its own draft): tokens and logprobs
  Hugging Face's, the acceptance counters those of the same draft at one rank, and the draft
  loaded by rank 0 alone (the worker's log never names it).
- constrained outputs (JSON schemas, json_object, regex, choice, EBNF): greedy tokens equal one
  rank's, logprobs within the parity tolerance, each output valid (or a prefix the grammar
  accepts when cut by max_tokens); the same with n-gram speculation on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from shared.messages import SamplingParams, StructuredOutput
from shared.speculative import parse_speculative_config
from tests.bench.spec_copy import chain_model, chain_prompt
from tests.engine.driver import Collected, run
from tests.engine.test_hf_parity import ATOL, MAX_NEW, assert_drained, make_prompts
from tests.engine.test_speculative import Oracle, assert_same, draft_config, tiny_draft
from tests.engine.test_structured import (
    CHOICES,
    GRAMMAR,
    REGEX,
    SCHEMAS,
    _arithmetic,
    accepted_prefix,
    json_constraint,
    text_of,
)

__all__ = ["tiny_draft"]  # the fixture, shared with test_speculative.py
COPY_NEW = 24  # tokens generated per request in the copying model's runs
# o_proj and down_proj of the copying model at this share of the base model's: small enough
# that most prompts are still continued along their chain, large enough that one is not
COPY_SCALE = 0.72  # (measured: 0.7-0.75 one of four leaves its chain; 0.6 none, 0.8 two)
LOOKUP_ONE = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, '
                                      '"prompt_lookup_max": 3, "prompt_lookup_min": 1, '
                                      '"disable_by_batch_size": 1024}')
COPY_NGRAM = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, '
                                      '"prompt_lookup_max": 4, "prompt_lookup_min": 2, '
                                      '"disable_by_batch_size": 1024}')


def tp_engine(model: Any, tp: int = 2, **kw: Any) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model), tensor_parallel_size=tp,
                                   **{"num_kv_blocks": 128, "block_size": 8, **kw}))


def close(core: EngineCore) -> None:
    if core.runner.workers is not None:
        core.runner.workers.stop()


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], new: int) -> tuple[list[int], list[float]]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [float(torch.log_softmax(step[0].float(), -1)[t])
                    for step, t in zip(out.logits, tokens)]


def assert_hf(got: dict[str, Collected], prompts: list[list[int]], model: Any,
              new: int) -> None:
    for i, prompt in enumerate(prompts):
        tokens, lps = hf_greedy(model, prompt, new)
        assert got[f"r{i}"].token_ids == tokens, f"prompt {i}: tokens differ from HF"
        assert got[f"r{i}"].logprobs == pytest.approx(lps, abs=ATOL), f"prompt {i}"


def submit(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> None:
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                    logprobs=3))


# -- n-gram -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def copying(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[Path, list[list[int]]]:
    """The copying model (its folder) and one prompt per cycle, each walking its cycle once
    and some more."""
    folder = tmp_path_factory.mktemp("copy") / "chain"
    cycles = chain_model(tiny_llama, folder, cycle=16)
    base, tensors = load_file(str(tiny_llama / "model.safetensors")), load_file(
        str(folder / "model.safetensors"))
    for name in tensors:
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            tensors[name] = base[name] * COPY_SCALE
    save_file(tensors, str(folder / "model.safetensors"))
    return folder, [chain_prompt(cycles[i], i, 20 + 3 * i) for i in range(4)]


def test_ngram_speculation_gives_hf_tokens(copying):
    folder, prompts = copying
    core = tp_engine(folder, speculative=COPY_NGRAM)
    try:
        submit(core, prompts, COPY_NEW)
        got = run(core)
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        assert_hf(got, prompts, hf, COPY_NEW)
        stats = core.stats()
        # some requests follow their chain (drafts accepted), one leaves it (drafts rejected)
        assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens, stats
        assert stats.spec_accepted_per_pos[-1] > 0  # whole proposals accepted
        assert_drained(core)
    finally:
        close(core)


# -- a draft model ----------------------------------------------------------------------------
@pytest.mark.parametrize("draft", ["another", "itself"])
def test_a_draft_model_on_rank_zero_gives_hf_tokens(tiny_llama, tiny_draft, tokenizer,
                                                    reference, capfd, draft):
    model = tiny_draft if draft == "another" else tiny_llama
    prompts = make_prompts(tokenizer, n=8)
    results, counters = {}, {}
    for tp in (1, 2):
        core = tp_engine(tiny_llama, tp, speculative=draft_config(model, k=3))
        try:
            submit(core, prompts, MAX_NEW)
            results[tp] = run(core)
            stats = core.stats()
            counters[tp] = (stats.spec_draft_tokens, stats.spec_accepted_tokens)
            assert_drained(core)
        finally:
            close(core)
    assert_hf(results[2], prompts, reference.model, MAX_NEW)
    assert_same(results[2], results[1])
    drafted, accepted = counters[2]
    assert counters[1] == counters[2]  # the same drafts, verified alike
    assert drafted > 0 and (accepted == drafted if draft == "itself" else accepted < drafted)
    worker_log = [line for line in capfd.readouterr().err.splitlines() if "tp-worker1" in line]
    assert any("engine_core.worker.model_runner" in line for line in worker_log)
    assert not any("draft model" in line for line in worker_log)


# -- structured outputs -----------------------------------------------------------------------
def constraints() -> dict[str, tuple[StructuredOutput, Any]]:
    """Each constraint and a check of a whole output's text (True, or raises)."""
    cases: dict[str, tuple[StructuredOutput, Any]] = {
        f"json{i}": (json_constraint(s),
                     lambda t, s=s: jsonschema.validate(json.loads(t), s) is None)
        for i, s in enumerate(SCHEMAS)}
    cases["json_object"] = (StructuredOutput("json_object"),
                            lambda t: isinstance(json.loads(t), dict))
    cases["regex"] = (StructuredOutput("regex", REGEX),
                      lambda t: re.fullmatch(REGEX, t) is not None)
    cases["choice"] = (StructuredOutput("choice", json.dumps(CHOICES)), lambda t: t in CHOICES)
    cases["grammar"] = (StructuredOutput("grammar", GRAMMAR), _arithmetic)
    return cases


def constrained_run(core: EngineCore, prompt: list[int]) -> dict[str, Collected]:
    for name, (constraint, _) in constraints().items():
        core.add_request(name, prompt, SamplingParams(max_tokens=64, temperature=0.0,
                                                      logprobs=2, structured=constraint))
    return run(core)


def assert_valid(core: EngineCore, tokenizer: Any, got: dict[str, Collected]) -> None:
    for name, (constraint, check) in constraints().items():
        result = got[name]
        assert result.finish in ("stop", "length"), name
        assert accepted_prefix(core, constraint, result.token_ids), name
        if result.finish == "stop":
            assert check(text_of(tokenizer, result)), name
    assert sum(r.finish == "stop" for r in got.values()) >= len(got) * 3 // 4


def test_constrained_outputs_equal_one_ranks(tiny_llama, tokenizer):
    prompt = list(tokenizer("Answer in the requested format:").input_ids)
    one = tp_engine(tiny_llama, 1)
    want = constrained_run(one, prompt)
    core = tp_engine(tiny_llama)
    try:
        got = constrained_run(core, prompt)
        assert_same(got, want)
        assert_valid(core, tokenizer, got)
        assert_drained(core)
    finally:
        close(core)


def test_constrained_outputs_with_ngram_speculation(tiny_llama, tokenizer):
    """The random model repeats only single tokens (whitespace, digits), so n-gram lookup of one
    token proposes drafts that verification rejects; then an oracle's drafts (the true
    continuation, wrong at 30% of the positions) are accepted, refused by the grammar or
    rolled back, on the same engine."""
    prompt = list(tokenizer("Answer in the requested format:").input_ids)
    want = constrained_run(tp_engine(tiny_llama, 1), prompt)
    core = tp_engine(tiny_llama, speculative=LOOKUP_ONE)
    try:
        got = constrained_run(core, prompt)
        assert_same(got, want)
        assert_valid(core, tokenizer, got)
        ngram = core.stats()
        assert ngram.spec_draft_tokens > 0, ngram
        core.proposer = Oracle(core, {rid: c.token_ids for rid, c in want.items()},  # type: ignore[assignment]
                               wrong=0.3)
        got = constrained_run(core, prompt)
        assert_same(got, want)
        assert_valid(core, tokenizer, got)
        stats = core.stats()
        drafted = stats.spec_draft_tokens - ngram.spec_draft_tokens
        accepted = stats.spec_accepted_tokens - ngram.spec_accepted_tokens
        assert 0 < accepted < drafted, stats
        assert_drained(core)
    finally:
        close(core)
