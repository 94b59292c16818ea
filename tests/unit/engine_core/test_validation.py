"""The engine's boundary checks (engine_core/validation.py): the frontend's limits, again."""

from __future__ import annotations

import math

import msgspec
import pytest

from engine_core.validation import params_error, prompt_ids
from shared.messages import SamplingParams, ints

VOCAB = 1000


def test_a_good_request_passes() -> None:
    assert prompt_ids(ints([1, 2, 999]), VOCAB) == ([1, 2, 999], None)
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, min_p=0.1, logit_bias={5: -100},
                            stop_token_ids=[7], logprobs=20, prompt_logprobs=0, seed=-(2**63))
    assert params_error(params, VOCAB) is None


@pytest.mark.parametrize("buf, why", [
    (b"\x01\x00\x00", "whole number"),  # 3 bytes: not int32s (it crashed the engine)
    (b"", "empty"),
    (ints([1, 1000]), "[0, 1000)"),
    (ints([-1]), "[0, 1000)"),
])
def test_bad_prompts_are_refused(buf: bytes, why: str) -> None:
    _, error = prompt_ids(buf, VOCAB)
    assert error is not None and why in error


@pytest.mark.parametrize("field, value", [
    ("temperature", math.nan), ("temperature", -0.5), ("temperature", math.inf),
    ("top_p", math.nan), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 2**64 - 1),
    ("min_p", math.nan), ("min_p", 1.1),
    ("presence_penalty", math.nan), ("frequency_penalty", 3.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", math.inf),
    ("max_tokens", -1), ("min_tokens", -1),
    ("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 10**6),
    ("seed", 2**63),
    ("stop_token_ids", [-1_000_000_000]),  # it crashed the engine in step()
    ("stop_token_ids", [VOCAB]),
    ("logit_bias", {VOCAB: 1.0}), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {5: math.nan}), ("logit_bias", {5: 1e12}),
])
def test_bad_sampling_values_are_refused(field: str, value: object) -> None:
    params = msgspec.structs.replace(SamplingParams(), **{field: value})
    error = params_error(params, VOCAB)
    assert error is not None and field.split("_")[0] in error


def test_max_logprobs_lowers_the_limit() -> None:
    params = SamplingParams(logprobs=5)
    assert params_error(params, VOCAB) is None
    error = params_error(params, VOCAB, max_logprobs=4)
    assert error is not None and "between 0 and 4" in error
