"""Sampling options and finish conditions on the real tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from shared.messages import SamplingParams
from tests.engine.driver import run


@pytest.fixture(scope="module")
def core(tiny_llama: Path) -> EngineCore:
    return EngineCore(EngineConfig(model=str(tiny_llama), num_kv_blocks=256, max_model_len=64))


@pytest.fixture(scope="module")
def prompt(tiny_llama: Path) -> list[int]:
    return AutoTokenizer.from_pretrained(str(tiny_llama))("Once upon a time, in a land").input_ids


def one(core: EngineCore, prompt: list[int], **params):
    core.add_request("x", prompt, SamplingParams(**params))
    return run(core)["x"]


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(core, prompt):
    params = dict(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    alone = one(core, prompt, **params).token_ids
    for i in range(7):  # different company: other prompts, other seeds, unseeded rows
        core.add_request(f"o{i}", prompt[: 3 + i], SamplingParams(max_tokens=5 + i, temperature=0.8,
                                                                  seed=i if i % 2 else None))
    core.add_request("again", prompt, SamplingParams(**params))
    crowd = run(core)["again"].token_ids
    assert alone == crowd
    other_seed = one(core, prompt, **{**params, "seed": 99}).token_ids
    assert other_seed != alone


def test_temperature_sampling_differs_from_greedy(core, prompt):
    greedy = one(core, prompt, max_tokens=12, temperature=0.0).token_ids
    hot = one(core, prompt, max_tokens=12, temperature=2.0, seed=7).token_ids
    assert hot != greedy


def test_top_k_1_is_greedy(core, prompt):
    greedy = one(core, prompt, max_tokens=8, temperature=0.0).token_ids
    assert one(core, prompt, max_tokens=8, temperature=1.5, top_k=1, seed=3).token_ids == greedy


def test_logit_bias_forces_a_token(core, prompt):
    out = one(core, prompt, max_tokens=4, temperature=0.0, logit_bias={42: 100.0})
    assert out.token_ids == [42, 42, 42, 42]


def test_stop_token_ids_and_min_tokens(core, prompt):
    greedy = one(core, prompt, max_tokens=8, temperature=0.0).token_ids
    stop = greedy[2]
    out = one(core, prompt, max_tokens=8, temperature=0.0, stop_token_ids=[stop])
    assert out.token_ids == greedy[:3] and out.finish == "stop" and out.stop_token_id == stop
    later = one(core, prompt, max_tokens=8, temperature=0.0, stop_token_ids=[stop], min_tokens=4)
    assert stop not in later.token_ids[:4] and len(later.token_ids) >= 4


def test_eos_and_ignore_eos(core, prompt):
    eos = core.facts.eos_token_ids[0]
    forced = one(core, prompt, max_tokens=6, temperature=0.0, logit_bias={eos: 100.0})
    assert forced.token_ids == [eos] and forced.finish == "stop" and forced.stop_token_id is None
    ignored = one(core, prompt, max_tokens=6, temperature=0.0, logit_bias={eos: 100.0},
                  ignore_eos=True)
    assert ignored.token_ids == [eos] * 6 and ignored.finish == "length"


def test_penalties_change_repetitive_output(core, prompt):
    plain = one(core, prompt, max_tokens=16, temperature=0.0).token_ids
    penalised = one(core, prompt, max_tokens=16, temperature=0.0, repetition_penalty=5.0,
                    frequency_penalty=2.0, presence_penalty=2.0).token_ids
    assert len(set(penalised)) >= len(set(plain))
    unpenalised = one(core, prompt, max_tokens=16, temperature=0.0, repetition_penalty=1.0)
    assert unpenalised.token_ids == plain


def test_max_tokens_zero_is_prefill_only(core, prompt):
    before = core.stats().generation_tokens
    out = one(core, prompt, max_tokens=0, prompt_logprobs=2)
    assert out.token_ids == [] and out.finish == "length"
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt) - 1
    assert core.stats().generation_tokens == before


def test_max_model_len_finishes(core, prompt):
    out = one(core, prompt, max_tokens=1000, temperature=0.0, ignore_eos=True)
    assert out.finish == "length" and len(prompt) + len(out.token_ids) == 64


def test_refusals_are_clear(core, prompt):
    core.add_request("long", list(range(1, 80)), SamplingParams(max_tokens=1))
    core.add_request("vocab", [10**7], SamplingParams(max_tokens=1))
    results = run(core)
    long = results["long"]
    assert long.finish == "error" and "maximum context length is 64" in long.message
    assert results["vocab"].finish == "error" and "token ids" in results["vocab"].message


def test_request_larger_than_the_whole_cache_is_refused(tiny_llama, prompt):
    small = EngineCore(EngineConfig(model=str(tiny_llama), num_kv_blocks=2, block_size=8))
    small.add_request("big", prompt, SamplingParams(max_tokens=50))
    out = run(small)["big"]
    assert out.finish == "error" and "KV cache" in out.message
    assert small.stats().free_blocks == 2


def test_top_logprobs_are_sorted_and_ranked(core, prompt):
    out = one(core, prompt, max_tokens=4, temperature=0.0, logprobs=5)
    for ids, rank, tok in zip(out.top_ids, out.ranks, out.token_ids):
        assert len(ids) == 5 and ids[0] == tok and rank == 1
    assert torch.tensor(out.logprobs).le(0).all()
