"""/v1/chat/completions through aiohttp against the fake engine (which "generates" the prompt's
own tokens, BOS left out, so the answer is the rendered chat itself)."""

from __future__ import annotations

import asyncio
from typing import Any

import jinja2
import pytest
from aiohttp.test_utils import TestClient

from frontend.errors import OpenAIError
from frontend.openai.protocol.chat import ChatMessage
from frontend.openai.serving.served_model import render_chat
from frontend.server import init_app
from frontend.text.tokenizer_loader import load_tokenizer
from shared.messages import read_ints
from tests.unit.fake_engine import (
    BOS,
    EOS,
    FakeEngine,
    cached_tokenizer,
    frontend_config,
    sse_events,
    tokenizer_folder,
)

Client = TestClient  # type: ignore[type-arg]
USER = [{"role": "user", "content": "Party 🎉 你好 and more words"}]


def template_ids(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    tokenizer = cached_tokenizer(tokenizer_folder())
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


async def chat(client: Client, status: int = 200, **body: Any) -> dict[str, Any]:
    resp = await client.post("/v1/chat/completions", json={"messages": USER, **body})
    assert resp.status == status, await resp.text()
    return dict(await resp.json())


async def stream(client: Client, **body: Any) -> list[Any]:
    """The SSE events: dicts, then the string "[DONE]"."""
    resp = await client.post(
        "/v1/chat/completions", json={"messages": USER, "stream": True, **body}
    )
    assert resp.status == 200, await resp.text()
    return sse_events(await resp.text())


def merge_chunks(events: list[Any]) -> list[dict[str, Any]]:
    """Streamed choices folded per index, in the non-streaming shape; checks the role first."""
    merged: dict[int, dict[str, Any]] = {}
    for event in events[:-1]:
        assert event["object"] == "chat.completion.chunk"
        for c in event["choices"]:
            if c["index"] not in merged:
                assert c["delta"] == {"role": "assistant", "content": ""}
                merged[c["index"]] = {"index": c["index"], "content": "", "logprobs": None,
                                      "finish_reason": None, "stop_reason": None}
                continue
            m = merged[c["index"]]
            assert "role" not in c["delta"] and m["finish_reason"] is None
            m["content"] += c["delta"]["content"]
            if c["logprobs"] is not None:
                m["logprobs"] = {"content": (m["logprobs"] or {"content": []})["content"]
                                 + c["logprobs"]["content"]}
            m["finish_reason"], m["stop_reason"] = c["finish_reason"], c["stop_reason"]
    return [merged[i] for i in sorted(merged)]


def flatten(choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"index": c["index"], "content": c["message"]["content"], "logprobs": c["logprobs"],
             "finish_reason": c["finish_reason"], "stop_reason": c["stop_reason"]}
            for c in choices]


async def test_answer_shape_and_prompt(client: Client, engine: FakeEngine) -> None:
    body = await chat(client, max_tokens=5)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "<｜User｜>Party 🎉"}
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    prompt = read_ints(engine.added[0].prompt_token_ids)
    assert prompt == template_ids(USER) and prompt.count(BOS) == 1 and prompt[0] == BOS
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 5,
                             "total_tokens": len(prompt) + 5}


CASES = [
    {"max_tokens": 8},
    {"max_tokens": 12, "logprobs": True},
    {"max_tokens": 12, "logprobs": True, "top_logprobs": 3, "n": 2},
    {"max_tokens": 30, "stop": ["你"], "logprobs": True, "top_logprobs": 1},
    {"max_tokens": 30, "stop": "你", "include_stop_str_in_output": True},
    {"max_tokens": 30, "stop_token_ids": [53901], "logprobs": True},
]


@pytest.mark.parametrize("grouping", [{}, {"merge_steps": 2}, {"stream_interval": 4}],
                         ids=["plain", "merge2", "interval4"])
@pytest.mark.parametrize("case", CASES)
async def test_stream_equals_non_stream(
    aiohttp_client: Any, engine: FakeEngine, case: dict[str, Any], grouping: dict[str, int]
) -> None:
    client = await aiohttp_client(init_app(frontend_config(engine, **grouping), cached_tokenizer))
    whole = await chat(client, **case)
    events = await stream(client, stream_options={"include_usage": True}, **case)
    assert events[-1] == "[DONE]"
    assert merge_chunks(events[:-1]) == flatten(whole["choices"])
    assert events[-2]["choices"] == [] and events[-2]["usage"] == whole["usage"]


async def test_logprobs_carry_every_tokens_bytes(client: Client) -> None:
    body = await chat(client, max_tokens=12, logprobs=True, top_logprobs=2)
    [choice] = body["choices"]
    entries = choice["logprobs"]["content"]
    assert any(e["token"].startswith("bytes:") for e in entries)  # 🎉 is split over tokens
    assert b"".join(bytes(e["bytes"]) for e in entries) == choice["message"]["content"].encode()
    for e in entries:
        assert len(e["top_logprobs"]) == 2
        for top in e["top_logprobs"]:
            assert set(top) == {"token", "logprob", "bytes"} and top["bytes"]
        assert e["top_logprobs"][0]["logprob"] == e["logprob"]  # the fake engine ranks it first


async def test_terminating_token_is_not_content(client: Client) -> None:
    history = [*USER, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "x"}]
    body = await chat(client, messages=history, logprobs=True, max_tokens=50)
    [choice] = body["choices"]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"].endswith("ok")
    entries = choice["logprobs"]["content"]
    assert body["usage"]["completion_tokens"] == len(entries) + 1  # EOS counted, not listed
    assert b"".join(bytes(e["bytes"]) for e in entries) == choice["message"]["content"].encode()
    kept = await chat(client, messages=history, logprobs=True, max_tokens=50,
                      stop_token_ids=[EOS], include_stop_str_in_output=True)
    assert len(kept["choices"][0]["logprobs"]["content"]) == len(entries) + 1


async def test_request_fields_reach_the_engine(client: Client, engine: FakeEngine) -> None:
    await chat(client, max_tokens=3, max_completion_tokens=5, n=2, seed=7, temperature=0.5,
               top_k=4, stop_token_ids=[13], logit_bias={"13": 2}, logprobs=True,
               top_logprobs=4, min_tokens=1, ignore_eos=True, user="u")
    params = [a.params for a in engine.added]
    assert [p.max_tokens for p in params] == [5, 5]
    assert sorted(p.seed or 0 for p in params) == [7, 8]
    p = params[0]
    assert (p.temperature, p.top_k, p.stop_token_ids, p.logit_bias) == (0.5, 4, [13], {13: 2.0})
    assert (p.logprobs, p.prompt_logprobs, p.min_tokens, p.ignore_eos) == (4, None, 1, True)


async def test_content_parts_developer_and_generation_prompt(
    client: Client, engine: FakeEngine
) -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    await chat(client, messages=[{"role": "developer", "content": "Rules."},
                                 {"role": "user", "content": parts}], max_tokens=1)
    await chat(client, messages=[{"role": "user", "content": "x"}], max_tokens=1,
               add_generation_prompt=False)
    prompts = [read_ints(a.prompt_token_ids) for a in engine.added]
    assert prompts[0] == template_ids([{"role": "system", "content": "Rules."},
                                       {"role": "user", "content": "a\nb"}])
    assert prompts[1] == template_ids([{"role": "user", "content": "x"}], False)


async def test_tool_messages(client: Client) -> None:
    messages = [*USER, {"role": "assistant", "content": "calling f"},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    body = await chat(client, messages=messages, max_tokens=2)
    assert body["usage"]["prompt_tokens"] == len(template_ids(messages))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"stop": ""}, "stop"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stop_token_ids": [10**7]}, "stop_token_ids"),
        ({"max_tokens": 1000}, "max_tokens"),
    ],
)
async def test_bad_requests(client: Client, body: dict[str, Any], param: str) -> None:
    error = (await chat(client, status=400, **body))["error"]
    assert error["type"] == "BadRequestError" and error["param"] == param, error


async def test_unknown_model_is_404(client: Client) -> None:
    assert (await chat(client, status=404, model="nope"))["error"]["code"] == "model_not_found"


async def test_engine_error_is_a_400(client: Client, engine: FakeEngine) -> None:
    engine.error_prompt_len = 2
    for extra in ({}, {"stream": True}):
        assert "can never fit" in (await chat(client, status=400, **extra))["error"]["message"]


async def test_stream_disconnect_aborts(client: Client, engine: FakeEngine) -> None:
    engine.step_delay = 0.02
    resp = await client.post(
        "/v1/chat/completions", json={"messages": USER, "n": 2, "max_tokens": 200, "stream": True}
    )
    assert (await resp.content.readline()).startswith(b"data: ")
    resp.close()
    deadline = asyncio.get_running_loop().time() + 2
    while len(engine.aborted) < 2 or engine.running:
        assert asyncio.get_running_loop().time() < deadline, "not aborted in time"
        await asyncio.sleep(0.01)


async def test_openai_client_library(client: Client) -> None:
    import openai

    api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    done = await api.chat.completions.create(
        model="fake-model",
        messages=USER,  # type: ignore[arg-type]
        max_tokens=2,
        logprobs=True,
        top_logprobs=1,
    )
    assert done.choices[0].message.content == "<｜User｜>Party"
    assert done.choices[0].logprobs and done.choices[0].logprobs.content
    chunks = [c async for c in await api.chat.completions.create(
        model="fake-model", messages=USER, max_tokens=2, stream=True  # type: ignore[arg-type]
    )]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "<｜User｜>Party"
    await api.close()


def test_template_problems_are_400s() -> None:
    class Tokenizer:
        def __init__(self, template: str | None) -> None:
            self.chat_template = template

        def apply_chat_template(self, *args: Any, **kwargs: Any) -> str:
            raise jinja2.TemplateError("Conversation roles must alternate")

    for template, words in ((None, "no chat template"), ("{{ x }}", "must alternate")):
        with pytest.raises(OpenAIError) as caught:
            render_chat(Tokenizer(template), [ChatMessage(role="user", content="hi")])
        assert caught.value.status == 400 and words in caught.value.message


@pytest.mark.parametrize("template, warned", [
    (None, True),  # the embedded model's own: DeepSeek-R1-Distill's never reads `tools`
    ("{% for t in tools or [] %}{{ t.function.name }}{% endfor %}"
     "{% for m in messages %}{{ m.content }}{% endfor %}", False),
])
async def test_auto_tool_choice_warns_when_the_template_never_shows_the_tools(
        aiohttp_client: Any, engine: FakeEngine, caplog: pytest.LogCaptureFixture,
        template: str | None, warned: bool) -> None:
    config = frontend_config(engine, enable_auto_tool_choice=True, tool_call_parser="hermes",
                             chat_template=template)
    with caplog.at_level("WARNING", logger="frontend.server"):  # a tokenizer of its own:
        await aiohttp_client(init_app(config, load_tokenizer))  # the template is set on it
    assert ("never reads `tools`" in caplog.text) == warned


@pytest.mark.parametrize("content", ['a "quoted" \\ 你好 🎉\n', "", "\u2028\x00"])
def test_content_chunk_bytes_are_msgspecs_encoding(content: str) -> None:
    import msgspec

    from frontend.openai.chat.endpoint import ContentChunks
    from frontend.openai.protocol.chat import ChatCompletionChunk, ChatStreamChoice, DeltaMessage

    chunks = ContentChunks("chatcmpl-\u00e9x", 1700000000, 'm"odel')
    for index in (0, 3, 0):
        choice = ChatStreamChoice(index, DeltaMessage(content=content))
        expected = msgspec.json.encode(
            ChatCompletionChunk("chatcmpl-\u00e9x", 1700000000, 'm"odel', [choice]))
        assert chunks.chunk(index, content) == expected
