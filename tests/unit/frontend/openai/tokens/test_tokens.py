"""/tokenize, /detokenize and /tokenizer_info through aiohttp against the fake engine, in the
shapes lm-evaluation-harness's remote tokenizer reads."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests.unit.fake_engine import (
    BOS,
    EOS,
    FakeEngine,
    cached_tokenizer,
    tokenizer_folder,
)

Client = TestClient  # type: ignore[type-arg]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好 🎉"}]


@pytest.fixture
def tokenizer() -> Any:
    return cached_tokenizer(tokenizer_folder())


async def post(client: Client, path: str, status: int = 200, **body: Any) -> dict[str, Any]:
    resp = await client.post(path, json=body)
    assert resp.status == status, await resp.text()
    return dict(await resp.json())


async def test_tokenize_prompt(client: Client, tokenizer: Any) -> None:
    body = await post(client, "/tokenize", prompt="Hello world")
    assert body == {"count": 3, "max_model_len": 256, "tokens": [BOS, 9906, 1917]}
    bare = await post(client, "/tokenize", prompt="Hello world", add_special_tokens=False,
                      return_token_strs=True, model="fake-model")
    assert bare["tokens"] == [9906, 1917] and bare["token_strs"] == ["Hello", "Ġworld"]


async def test_tokenize_messages_applies_the_template_once(client: Client, tokenizer: Any) -> None:
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    expected = tokenizer.encode(rendered, add_special_tokens=False)
    body = await post(client, "/tokenize", messages=MESSAGES)
    assert body["tokens"] == expected and body["tokens"].count(BOS) == 1
    assert body["count"] == len(expected)
    bare = await post(client, "/tokenize", messages=MESSAGES, add_generation_prompt=False)
    assert expected[: bare["count"]] == bare["tokens"] and bare["count"] < body["count"]


async def test_detokenize_round_trip(client: Client) -> None:
    text = "Party 🎉 你好, world"
    ids = (await post(client, "/tokenize", prompt=text, add_special_tokens=False))["tokens"]
    assert (await post(client, "/detokenize", tokens=ids))["prompt"] == text
    assert (await post(client, "/detokenize", tokens=[BOS, 9906]))["prompt"] == (
        "<｜begin▁of▁sentence｜>Hello"
    )


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/detokenize", {"tokens": [128256]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "a"}]}, "messages"),
        ("/tokenize", {"messages": []}, "messages"),
    ],
)
async def test_bad_requests(client: Client, path: str, body: dict[str, Any], param: str) -> None:
    error = (await post(client, path, status=400, **body))["error"]
    assert error["param"] == param, error


async def test_unknown_model_is_404(client: Client) -> None:
    await post(client, "/tokenize", status=404, prompt="a", model="nope")
    await post(client, "/detokenize", status=404, tokens=[1], model="nope")


async def test_tokenizer_info(client: Client, engine: FakeEngine, tokenizer: Any) -> None:
    resp = await client.get("/tokenizer_info")
    assert resp.status == 200
    info = await resp.json()
    assert info["eos_token"] == "<｜end▁of▁sentence｜>" == info["pad_token"]
    assert info["bos_token"] == "<｜begin▁of▁sentence｜>"
    assert info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == 256 and info["tokenizer_path"] == engine.ready.tokenizer
    assert isinstance(info["tokenizer_class"], str)


async def test_lm_eval_remote_tokenizer_calls(client: Client) -> None:
    """What lm-eval's RemoteTokenizer does: eos id by encoding eos_token without specials."""
    info = await (await client.get("/tokenizer_info")).json()
    for token, token_id in ((info["eos_token"], EOS), (info["bos_token"], BOS)):
        body = await post(client, "/tokenize", prompt=token, add_special_tokens=False)
        assert body["tokens"] == [token_id]
    assert isinstance((await post(client, "/detokenize", tokens=[9906]))["prompt"], str)
