"""Request validation: every bad request is a 4xx in OpenAI's error shape, never a 500."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from frontend.errors import OpenAIError, from_validation_error
from frontend.openai.completions.endpoint import completion_fields
from frontend.openai.completions.protocol import CompletionRequest
from frontend.openai.protocol.base import decode_request, split_prompts
from frontend.openai.serving.plan import parse_logit_bias, read_sampling
from frontend.openai.serving.served_model import ServedModel
from shared.messages import SamplingParams
from tests.unit.fake_engine import FakeEngine, cached_tokenizer, tokenizer_folder

BAD = [
    ({}, "prompt"),
    ({"prompt": 3}, "prompt"),
    ({"prompt": ["a", 1]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [[1, -1]]}, "prompt"),
    ({"prompt": [128256]}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": "2"}, "logprobs"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"n": 1000}, "n"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"logit_bias": {"1": "a"}}, "logit_bias"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-5]}, "stop_token_ids"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"suffix": "x"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"echo": "yes"}, "echo"),
    ({"seed": "1"}, "seed"),
    ({"seed": 2**64}, "seed"),
]


def decode_completion_request(body: bytes) -> CompletionRequest:
    return decode_request(body, CompletionRequest)


def sampling_params(req: CompletionRequest, max_tokens: int, sample: int) -> SamplingParams:
    """What the planner gives sample `sample` of a prompt of `req` with this budget."""
    served = ServedModel(cached_tokenizer(tokenizer_folder()), "fake-model", 256, 128256)
    return read_sampling(req, completion_fields(req), served).params_for(max_tokens, sample)


async def error_of(resp: Any, status: int) -> dict[str, Any]:
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return dict(error)


@pytest.mark.parametrize(("fields", "param"), BAD, ids=[str(b[0]) for b in BAD])
async def test_bad_requests_are_400(
    client: Any, engine: FakeEngine, fields: dict[str, Any], param: str
) -> None:
    body = {"prompt": "Hello", **fields} if fields else {}
    error = await error_of(await client.post("/v1/completions", json=body), 400)
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", param, 400)
    assert engine.added == []


async def test_unknown_model_is_404(client: Any) -> None:
    resp = await client.post("/v1/completions", json={"model": "gpt-9", "prompt": "a"})
    error = await error_of(resp, 404)
    assert error["code"] == "model_not_found" and "gpt-9" in error["message"]


async def test_prompt_plus_max_tokens_too_long(client: Any) -> None:
    resp = await client.post("/v1/completions", json={"prompt": [5] * 250, "max_tokens": 10})
    error = await error_of(resp, 400)
    assert error["message"].startswith(
        "This model's maximum context length is 256 tokens. However, you requested 260 tokens "
        "(250 in the messages, 10 in the completion)."
    )


async def test_prompt_alone_too_long(client: Any) -> None:
    resp = await client.post("/v1/completions", json={"prompt": [5] * 256})
    error = await error_of(resp, 400)
    assert "maximum context length is 256" in error["message"] and "256 input" in error["message"]


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"", b'"text"'])
async def test_undecodable_bodies(client: Any, body: bytes) -> None:
    await error_of(await client.post("/v1/completions", data=body), 400)


async def test_unknown_route_and_method(client: Any) -> None:
    assert (await error_of(await client.get("/v1/nothing"), 404))["type"] == "NotFoundError"
    await error_of(await client.get("/v1/completions"), 405)


def test_prompt_forms() -> None:
    assert split_prompts("a") == ["a"]
    assert split_prompts(["a", "b"]) == ["a", "b"]
    assert split_prompts([1, 2]) == [[1, 2]]
    assert split_prompts([[1], [2, 3]]) == [[1], [2, 3]]
    for bad in ([], [1, "a"], [[1], 2]):
        with pytest.raises(OpenAIError):
            split_prompts(bad)  # type: ignore[arg-type]


def test_logit_bias_is_parsed_and_clamped() -> None:
    assert parse_logit_bias({"5": 300.0, "7": -1.5}) == {5: 100.0, 7: -1.5}
    assert parse_logit_bias({}) is None


def test_sampling_params_mapping() -> None:
    req = CompletionRequest(
        prompt="a", echo=True, logprobs=2, seed=10, top_k=-1, stop_token_ids=[3]
    )
    params = sampling_params(req, max_tokens=7, sample=2)
    assert (params.max_tokens, params.seed, params.logprobs, params.prompt_logprobs) == (
        7,
        12,
        2,
        2,
    )
    assert (params.top_k, params.stop_token_ids) == (-1, [3])
    plain = sampling_params(CompletionRequest(prompt="a", logprobs=2), 1, 0)
    assert plain.prompt_logprobs is None and plain.seed is None


def test_validation_error_names_the_field() -> None:
    with pytest.raises(msgspec.ValidationError) as info:
        decode_completion_request(b'{"prompt": "a", "n": -1}')
    error = from_validation_error(info.value)
    assert (error.status, error.param) == (400, "n") and "$.n" in error.message


def test_explicit_nulls_mean_defaults() -> None:
    req = decode_completion_request(
        b'{"prompt": "hi", "temperature": null, "n": null, "top_p": null, "stop": null}')
    assert (req.temperature, req.n, req.top_p, req.stop) == (1.0, 1, 1.0, None)
    with pytest.raises(msgspec.ValidationError):
        decode_completion_request(b'["not", "an", "object"]')
