"""Structured outputs end to end through `tandem serve` on the random-weight tiny model, with the
openai SDK, plain and with speculative decoding: every kind of constraint on both APIs,
stream == non-stream, the offset contract with echo, bad constraints as 400s, and a mixed
burst that leaves the engine empty."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pydantic
import pytest

from tests.e2e.server import Server

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"enum": ["x", "y", "z"]}}}}
REGEX = r"[A-Z][a-z]{2,5}( [0-9]{1,3}){1,2}"
CHOICES = ["alpha", "beta", "gamma ray"]
GRAMMAR = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | root'

KINDS: dict[str, tuple[dict[str, Any], Any]] = {
    "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": SCHEMA, "strict": True}}},
        lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    "json_object": ({"response_format": {"type": "json_object"}},
                    lambda t: isinstance(json.loads(t), dict)),
    "json": ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
             lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None and "\n" not in t),
    "regex": ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
    "choice": ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
    "grammar": ({"structured_outputs": {"grammar": GRAMMAR}},
                lambda t: re.fullmatch(r"[(),a-c]+", t) and t.count("(") == t.count(")")),
}


# twice: plain, and verifying drafts under the grammars (speculative decoding, the model as its
# own draft, so most drafts are accepted and each step brings a request several tokens)
@pytest.fixture(scope="module", params=["plain", "speculative"])
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory, request):
    flags = [] if request.param == "plain" else [
        "--speculative-config", json.dumps({"model": str(tiny_llama),
                                            "num_speculative_tokens": 3})]
    srv = Server(tiny_llama, tmp_path_factory.mktemp("structured"), "--max-model-len", "512",
                 *flags)
    yield srv.wait_healthy()
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=60)


def completion(client: openai.OpenAI, stream: bool, **body: Any) -> dict[str, Any]:
    """One completions choice as {text, tokens, logprobs, offsets, finish}, streamed or not."""
    extra = {k: body.pop(k) for k in ("response_format", "structured_outputs") if k in body}
    args = dict(model="m", max_tokens=100, logprobs=2, extra_body=extra, **body)
    out: dict[str, Any] = {"text": "", "tokens": [], "logprobs": [], "offsets": [],
                           "finish": None}
    chunks = client.completions.create(stream=True, **args) if stream else [
        client.completions.create(**args)]
    for chunk in chunks:
        for c in chunk.choices:
            out["text"] += c.text
            if c.logprobs is not None:
                out["tokens"] += c.logprobs.tokens
                out["logprobs"] += c.logprobs.token_logprobs
                out["offsets"] += c.logprobs.text_offset
            out["finish"] = c.finish_reason or out["finish"]
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_completions_each_kind_valid_and_stream_equals_non_stream(client, kind):
    fields, check = KINDS[kind]
    for seed, temperature in ((0, 0.0), (1, 0.9), (2, 1.3)):
        args = dict(prompt="Output:", seed=seed, temperature=temperature, **fields)
        whole = completion(client, False, **json.loads(json.dumps(args)))
        streamed = completion(client, True, **json.loads(json.dumps(args)))
        assert whole["text"] == streamed["text"] and whole["tokens"] == streamed["tokens"]
        assert whole["offsets"] == streamed["offsets"] and whole["finish"] == streamed["finish"]
        assert whole["logprobs"] == pytest.approx(streamed["logprobs"], abs=1e-4)
        assert whole["finish"] in ("stop", "length")
        if whole["finish"] == "stop":
            assert check(whole["text"]), whole["text"]


def test_echo_keeps_the_offset_contract(client):
    fields, check = KINDS["regex"]
    for stream in (False, True):
        out = completion(client, stream, prompt="Output:", echo=True, temperature=0.0, **fields)
        assert out["text"].startswith("Output:") and check(out["text"][len("Output:"):])
        assert out["offsets"][0] == 0 and out["offsets"] == sorted(out["offsets"])
        assert len(out["tokens"]) == len(out["offsets"])
        for token, offset in zip(out["tokens"], out["offsets"]):
            if token.startswith("<｜"):  # BOS and EOS own no text
                continue
            assert out["text"][offset:].startswith(token)


@pytest.mark.parametrize("kind", list(KINDS))
def test_chat_each_kind_valid_and_stream_equals_non_stream(client, kind):
    fields, check = KINDS[kind]
    messages: Any = [{"role": "user", "content": "Reply in the format."}]
    args = dict(model="m", messages=messages, max_tokens=100, temperature=0.0,
                extra_body=fields)
    whole = client.chat.completions.create(**args).choices[0]
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert (whole.message.content, whole.finish_reason) == (text, finish)
    if finish == "stop":
        assert check(text), text


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=99)


def test_sdk_parse_with_a_pydantic_model(client):
    parsed = client.chat.completions.parse(
        model="m", messages=[{"role": "user", "content": "Who?"}], response_format=Person,
        max_tokens=120, temperature=0.0)
    choice = parsed.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)


@pytest.mark.parametrize("fields", [
    {"structured_outputs": {"regex": "(unclosed"}},
    {"structured_outputs": {"grammar": "root ::= undefined_rule"}},
    {"structured_outputs": {"json": {"type": "no-such-type"}}},
    {"response_format": {"type": "json_schema",
                         "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
    {"structured_outputs": {"regex": "a", "choice": ["a"]}},
    {"response_format": {"type": "yaml"}},
])
def test_bad_constraints_are_400s(client, fields):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            list(client.completions.create(model="m", prompt="x", max_tokens=5, stream=stream,
                                           extra_body=fields)) if stream else \
                client.completions.create(model="m", prompt="x", max_tokens=5,
                                          extra_body=fields)
        body: Any = err.value.body
        assert body["param"] in ("structured_outputs", "response_format", "type"), body


def test_mixed_burst_leaves_nothing_behind(server, client):
    async_client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none",
                                      max_retries=0, timeout=60)
    kinds = [*KINDS.values(), ({}, None)]

    async def one(i: int) -> str | None:
        fields = kinds[i % len(kinds)][0]
        args = dict(model="m", prompt=f"Item {i}:", max_tokens=10 + i % 50, seed=i,
                    temperature=(i % 3) * 0.6, n=1 + i % 2, extra_body=fields)
        if i % 2:
            answer = await async_client.completions.create(**args)
            return answer.choices[0].finish_reason
        async for _ in await async_client.completions.create(stream=True, **args):
            pass
        return None

    async def burst() -> None:
        await asyncio.gather(*(one(i) for i in range(40)))
        await async_client.close()

    asyncio.run(burst())
    with urllib.request.urlopen(f"{server.url}/metrics") as resp:
        metrics = resp.read().decode()
    assert re.search(r"^vllm:num_requests_running\S* 0(\.0)?$", metrics, re.M), metrics
    assert re.search(r"^vllm:num_requests_waiting\S* 0(\.0)?$", metrics, re.M)
    usage = re.search(r"^vllm:kv_cache_usage_perc\S* (\S+)$", metrics, re.M)
    assert usage is not None and float(usage.group(1)) == 0.0


def test_the_speculative_server_accepted_drafts_under_its_grammars(server, request):
    """(Runs last in its module.) The speculative server's constrained requests verified
    drafts and accepted many: the draft model drafts under each request's grammar (its argmax
    under the mask), so its drafts are the target's greedy tokens; sampled requests accept
    fewer. (Drafting blind to the grammar, 12 of 3244 draft tokens were accepted.)"""
    if request.node.callspec.params["server"] != "speculative":
        pytest.skip("only the speculative server speculates")
    with urllib.request.urlopen(f"{server.url}/metrics") as response:
        text = response.read().decode()
    totals = {name: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith(name + "{"))
              for name in ("vllm:spec_decode_num_draft_tokens_total",
                           "vllm:spec_decode_num_accepted_tokens_total")}
    drafted = totals["vllm:spec_decode_num_draft_tokens_total"]
    assert drafted > 100
    assert totals["vllm:spec_decode_num_accepted_tokens_total"] > drafted / 4, totals
