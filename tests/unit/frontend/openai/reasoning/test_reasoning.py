"""Reasoning outputs in chat through aiohttp against the fake engine, which "generates" the
prompt's own tokens (BOS left out): a user message holding "</think>" makes an answer with a
thinking part and an answer part, cut anywhere by max_tokens."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from frontend.options import add_frontend_args, frontend_argv
from frontend.server import init_app, parse_args
from frontend.text.tokenizer_loader import load_tokenizer
from shared.argv import normalize
from shared.messages import read_ints
from tests.unit.fake_engine import (
    FakeEngine,
    cached_tokenizer,
    frontend_config,
    sse_events,
    tokenizer_folder,
)

Client = TestClient  # type: ignore[type-arg]
THINK_END = 128014
SPLIT = [{"role": "user", "content": "思考 step 🎉</think>the answer 你好"}]
JSON_FORMAT = {"type": "json_schema",
               "json_schema": {"name": "x", "schema": {"type": "object"}}}


@pytest.fixture
async def plain(aiohttp_client: Any, engine: FakeEngine) -> Client:
    return await aiohttp_client(init_app(frontend_config(engine), cached_tokenizer))


@pytest.fixture
async def r1(aiohttp_client: Any, engine: FakeEngine) -> Client:
    config = frontend_config(engine, reasoning_parser="deepseek_r1")
    return await aiohttp_client(init_app(config, cached_tokenizer))


@pytest.fixture
async def aliased(aiohttp_client: Any, engine: FakeEngine) -> Client:
    config = frontend_config(engine, reasoning_parser="deepseek_r1",
                             reasoning_field_alias="reasoning_content")
    return await aiohttp_client(init_app(config, cached_tokenizer))


async def chat(client: Client, **body: Any) -> dict[str, Any]:
    resp = await client.post("/v1/chat/completions", json={"messages": SPLIT, **body})
    assert resp.status == 200, await resp.text()
    return dict(await resp.json())


async def streamed(client: Client, **body: Any) -> list[dict[str, Any]]:
    """Each choice's deltas joined: reasoning, content (None when no chunk had any), the
    logprobs entries, the finish reason; and the alias joined when chunks carry it."""
    resp = await client.post("/v1/chat/completions",
                             json={"messages": SPLIT, "stream": True, **body})
    assert resp.status == 200, await resp.text()
    events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    joined: dict[int, dict[str, Any]] = {}
    for event in events[:-1]:
        for c in event["choices"]:
            j = joined.setdefault(c["index"], {"reasoning": "", "content": None,
                                               "logprobs": [], "finish": None})
            delta = c["delta"]
            assert delta.get("content") != "" or set(delta) <= {"role", "content"}
            j["reasoning"] += delta.get("reasoning", "")
            if "reasoning_content" in delta:
                assert delta["reasoning_content"] == delta["reasoning"]
                j["alias"] = j.get("alias", "") + delta["reasoning_content"]
            if delta.get("content") and "role" not in delta:
                j["content"] = (j["content"] or "") + delta["content"]
            j["logprobs"] += (c["logprobs"] or {"content": []})["content"]
            j["finish"] = c["finish_reason"] or j["finish"]
    return [joined[i] for i in sorted(joined)]


def whole(choice: dict[str, Any]) -> dict[str, Any]:
    message = choice["message"]
    return {"reasoning": message["reasoning"] or "", "content": message["content"] or None,
            "logprobs": (choice["logprobs"] or {"content": []})["content"],
            "finish": choice["finish_reason"]}


async def test_the_answer_splits_at_the_first_end_of_thinking(r1: Client, plain: Client) -> None:
    """The template opened <think>: everything before the first </think> is reasoning, the
    rest content, the marker in neither; finish, usage and logprobs as without a parser."""
    args = dict(max_tokens=40, logprobs=True, top_logprobs=2)
    without = await chat(plain, **args)
    body = await chat(r1, **args)
    [choice], [bare] = body["choices"], without["choices"]
    text = bare["message"]["content"]
    reasoning, _, content = text.partition("</think>")
    assert choice["message"] == {"role": "assistant", "content": content, "reasoning": reasoning}
    assert reasoning.endswith("思考 step 🎉") and content.startswith("the answer 你好")
    assert (choice["finish_reason"], choice["logprobs"]) == (bare["finish_reason"],
                                                              bare["logprobs"])
    assert body["usage"] == without["usage"]


def marker_token() -> int:
    """Which generated token is </think> (the fake engine generates the prompt, BOS out)."""
    tokenizer = cached_tokenizer(tokenizer_folder())
    text = tokenizer.apply_chat_template(SPLIT, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))[1:].index(THINK_END) + 1


@pytest.mark.parametrize("cut", [-6, -1, 0, 1, 2, 30])
@pytest.mark.parametrize("extra", [{}, {"n": 2, "logprobs": True}, {"stop": ["answer"]}])
async def test_stream_equals_non_stream_for_both_fields(r1: Client, cut: int,
                                                        extra: dict[str, Any]) -> None:
    """max_tokens cut before, at and after the marker; with no </think> the content is null."""
    max_tokens = marker_token() + cut
    body = await chat(r1, max_tokens=max_tokens, **extra)
    expected = [whole(c) for c in body["choices"]]
    assert await streamed(r1, max_tokens=max_tokens, **extra) == expected
    for c in body["choices"]:
        assert "</think>" not in c["message"]["reasoning"]
        assert (c["message"]["content"] is None) == (cut < 0)


async def test_without_the_end_everything_is_reasoning(r1: Client) -> None:
    [choice] = (await chat(r1, max_tokens=4))["choices"]
    assert choice["message"]["content"] is None and choice["message"]["reasoning"]
    assert choice["finish_reason"] == "length"


async def test_the_alias_carries_the_same_text(aliased: Client) -> None:
    [choice] = (await chat(aliased, max_tokens=40))["choices"]
    assert choice["message"]["reasoning_content"] == choice["message"]["reasoning"]
    [joined] = await streamed(aliased, max_tokens=40)
    assert joined["alias"] == joined["reasoning"] == choice["message"]["reasoning"]


async def test_no_parser_no_reasoning_field(plain: Client) -> None:
    [choice] = (await chat(plain, max_tokens=40))["choices"]
    assert set(choice["message"]) == {"role", "content"} and "</think>" in choice["message"][
        "content"]


async def test_a_constrained_request_tells_the_engine_where_thinking_ends(
        r1: Client, plain: Client, engine: FakeEngine) -> None:
    await chat(r1, max_tokens=4, response_format=JSON_FORMAT)
    await chat(r1, max_tokens=4)
    await chat(plain, max_tokens=4, response_format=JSON_FORMAT)
    closed = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "<think>"},
              {"role": "user", "content": "no thinking</think>"}]
    resp = await r1.post("/v1/chat/completions", json={
        "messages": closed, "max_tokens": 4, "response_format": JSON_FORMAT,
        "add_generation_prompt": False})
    assert resp.status == 200
    gates = [a.params.reasoning_end for a in engine.added]
    assert gates == [[THINK_END], [], [], []]  # the last prompt closed the thinking itself
    [choice] = (await resp.json())["choices"]
    assert choice["message"]["reasoning"] is None and choice["message"]["content"]


async def test_history_may_carry_reasoning(r1: Client, engine: FakeEngine) -> None:
    """Accepted under either name, content null or not; R1's template drops it from the
    prompt (it keeps only what follows </think> of an assistant's content)."""
    for field in ("reasoning", "reasoning_content"):
        history = [{"role": "user", "content": "a"},
                   {"role": "assistant", "content": None, field: "SECRET"},
                   {"role": "user", "content": "b"}]
        resp = await r1.post("/v1/chat/completions",
                             json={"messages": history, "max_tokens": 2})
        assert resp.status == 200, await resp.text()
    tokenizer = cached_tokenizer(engine.ready.tokenizer)
    prompt = tokenizer.decode(read_ints(engine.added[-1].prompt_token_ids))
    assert "SECRET" not in prompt and prompt.count("<｜Assistant｜>") == 2


async def test_a_template_that_renders_reasoning_gets_it(aiohttp_client: Any,
                                                         engine: FakeEngine) -> None:
    template = ("{% for m in messages %}{{ m.role }}:{% if m.reasoning_content %}"
                "[{{ m.reasoning_content }}|{{ m.reasoning }}]{% endif %}{{ m.content }};"
                "{% endfor %}")
    config = frontend_config(engine, reasoning_parser="qwen3", chat_template=template)
    client = await aiohttp_client(init_app(config, load_tokenizer))  # its own: the template
    history = [{"role": "user", "content": "a"},
               {"role": "assistant", "content": "b", "reasoning": "thought"}]
    resp = await client.post("/v1/chat/completions", json={"messages": history, "max_tokens": 1})
    assert resp.status == 200, await resp.text()
    tokenizer = cached_tokenizer(engine.ready.tokenizer)
    prompt = tokenizer.decode(read_ints(engine.added[-1].prompt_token_ids))
    assert prompt == "user:a;assistant:[thought|thought]b;"


def test_the_flags_reach_the_frontend_config() -> None:
    """From `tandem serve`'s command line to its frontends' (and `tandem frontend`'s), vLLM's
    underscore spelling included; an alias without a parser is a usage error."""
    parser = argparse.ArgumentParser()
    add_frontend_args(parser)
    flags = ["--reasoning_parser", "qwen3", "--reasoning-field-alias", "reasoning_content",
             "--responses-store-size", "7"]
    passed_on = frontend_argv(parser.parse_args(normalize(flags, parser)))
    config = parse_args(["--engine", "tcp://127.0.0.1:1", *passed_on])
    assert (config.reasoning_parser, config.reasoning_field_alias,
            config.responses_store_size) == ("qwen3", "reasoning_content", 7)
    defaults = parse_args(["--engine", "tcp://127.0.0.1:1"])
    assert (defaults.reasoning_parser, defaults.responses_store_size) == (None, 0)
    for bad in (["--reasoning-field-alias", "reasoning_content"],
                ["--reasoning-parser", "granite"], ["--responses-store-size", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(["--engine", "tcp://127.0.0.1:1", *bad])
