"""--generation-config auto: the model's sampling defaults fill the fields a request leaves
out, on both generation APIs; a field the request gives (even OpenAI's default) wins."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from frontend.openai.completions.protocol import CompletionRequest
from frontend.openai.protocol.base import decode_request
from frontend.server import init_app
from tests.unit.fake_engine import FakeEngine, cached_tokenizer, frontend_config

DEFAULTS: dict[str, int | float] = {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                    "repetition_penalty": 1.05}


def test_defaults_fill_only_what_the_body_leaves_out() -> None:
    body = b'{"prompt": "x", "temperature": 1.0, "top_p": null}'
    req = decode_request(body, CompletionRequest, DEFAULTS)
    assert (req.temperature, req.top_p, req.top_k, req.repetition_penalty) == (1.0, 0.8, 20, 1.05)
    plain = decode_request(body, CompletionRequest)
    assert (plain.top_p, plain.top_k, plain.repetition_penalty) == (1.0, 0, 1.0)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_the_engine_gets_the_models_defaults(aiohttp_client: Any, engine: FakeEngine,
                                                   path: str) -> None:
    engine.ready = msgspec.structs.replace(engine.ready, sampling_defaults=DEFAULTS)
    client = await aiohttp_client(init_app(frontend_config(engine), cached_tokenizer))
    body: dict[str, Any] = {"model": "fake-model", "max_tokens": 2, "top_k": 5}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = "Hello"
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    params = engine.added[-1].params
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (
        0.7, 0.8, 5, 1.05)
