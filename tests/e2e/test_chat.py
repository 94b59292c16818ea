"""/v1/chat/completions and the tokenizer endpoints end to end through `tandem serve` (one
server for the module), with the openai SDK as the client.

For each case the streamed and the non-streamed answers agree (text, logprob tokens, logprob
values within 1e-4), the `bytes` of the content tokens join to the message's UTF-8, and
prompt_tokens is the chat template's own token count (one BOS, not two).
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from tests.e2e.server import Server

ATOL = 1e-4
MESSAGES: list[Any] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say something about 你好 and 🎉, please."},
]


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = Server(tiny_llama, tmp_path_factory.mktemp("chat"), "--max-model-len", "512")
    yield srv.wait_healthy()
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_llama))


@dataclass
class Answer:
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    raw: bytes = b""
    finish_reason: str | None = None

    def absorb(self, text: str | None, logprobs: Any, finish_reason: str | None) -> None:
        self.text += text or ""
        for entry in (logprobs.content or []) if logprobs is not None else []:
            self.tokens.append(entry.token)
            self.logprobs.append(entry.logprob)
            self.raw += bytes(entry.bytes)
        self.finish_reason = finish_reason or self.finish_reason


def ask(client: openai.OpenAI, stream: bool, **kw: Any) -> tuple[dict[int, Answer], Any]:
    kw = {"model": "m", "messages": MESSAGES, "temperature": 0, **kw}
    answers: dict[int, Answer] = {}
    if not stream:
        resp = client.chat.completions.create(**kw)
        for c in resp.choices:
            answers.setdefault(c.index, Answer()).absorb(
                c.message.content, c.logprobs, c.finish_reason
            )
        return answers, resp.usage
    usage = None
    for chunk in client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw
    ):
        for c in chunk.choices:
            answers.setdefault(c.index, Answer()).absorb(
                c.delta.content, c.logprobs, c.finish_reason
            )
        usage = chunk.usage or usage
    return answers, usage


def assert_same(a: Answer, b: Answer) -> None:
    assert (a.text, a.tokens, a.finish_reason) == (b.text, b.tokens, b.finish_reason)
    assert a.logprobs == pytest.approx(b.logprobs, abs=ATOL)


def template_count(tokenizer: Any, messages: list[Any]) -> int:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return len(ids["input_ids"])


@pytest.mark.parametrize(
    "kw",
    [
        {"max_tokens": 24, "logprobs": True, "top_logprobs": 3},
        {"max_completion_tokens": 12, "n": 2, "temperature": 1.0, "seed": 5, "logprobs": True},
    ],
)
def test_stream_equals_non_stream(client: openai.OpenAI, tokenizer: Any, kw: dict) -> None:
    plain, usage = ask(client, False, **kw)
    streamed, s_usage = ask(client, True, **kw)
    n = kw.get("n", 1)
    assert sorted(plain) == sorted(streamed) == list(range(n))
    assert usage.prompt_tokens == s_usage.prompt_tokens == template_count(tokenizer, MESSAGES)
    assert usage.completion_tokens == s_usage.completion_tokens
    for i in range(n):
        assert_same(plain[i], streamed[i])
        assert plain[i].raw.decode(errors="replace") == plain[i].text and plain[i].text
        assert len(plain[i].tokens) == kw.get("max_tokens", kw.get("max_completion_tokens"))


def test_stop_string_cuts_the_greedy_answer(client: openai.OpenAI) -> None:
    greedy, _ = ask(client, False, max_tokens=24)
    text = greedy[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"need a visible stop string in {text!r}"
    for stream in (False, True):
        cut, _ = ask(client, stream, max_tokens=24, stop=[stop])
        assert cut[0].text == text[: text.index(stop)] and cut[0].finish_reason == "stop"


def test_bad_requests(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(
            model="m", messages=[{"role": "narrator", "content": "hi"}]  # type: ignore[misc]
        )
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="m", messages=MESSAGES, top_logprobs=2)


def call(server: Server, path: str, body: dict | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{server.url}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def test_tokenize_round_trip(server: Server, tokenizer: Any) -> None:
    text = "Party 🎉 你好, world"
    ids = call(server, "/tokenize", {"prompt": text})["tokens"]
    assert ids == tokenizer(text).input_ids and ids.count(tokenizer.bos_token_id) == 1
    assert call(server, "/detokenize", {"tokens": ids[1:]}) == {"prompt": text}
    chat = call(server, "/tokenize", {"model": "m", "messages": MESSAGES})
    assert chat["count"] == template_count(tokenizer, MESSAGES) and chat["max_model_len"] == 512
    info = call(server, "/tokenizer_info")
    assert info["eos_token"] == tokenizer.eos_token and info["model_max_length"] == 512
    assert info["chat_template"] == tokenizer.chat_template
