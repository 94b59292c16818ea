"""POST /tokenize, POST /detokenize, GET /tokenizer_info: the served tokenizer over HTTP.

The shapes are vLLM's, which lm-evaluation-harness's remote tokenizer
(`tokenizer_backend="remote"`) reads: it checks that /tokenizer_info answers with an
`eos_token` key, takes `eos_token`, `bos_token`, `pad_token` and `chat_template` from it,
encodes with `{"prompt": text, "add_special_tokens": false}` and reads `tokens`, decodes with
`{"tokens": ids}` and reads `prompt`.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from frontend.errors import bad_request
from frontend.protocol import decode_request
from frontend.protocol_chat import ChatMessage, check_message
from frontend.serving_chat import render_chat
from frontend.serving_completions import ServingCompletions


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """Either `prompt` (a string) or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # Default: true for a prompt; false for messages, whose template writes BOS itself.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(msgspec.Struct, omit_defaults=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class ServingTokens:
    """The tokenizer endpoints, for the tokenizer and model that ServingCompletions serves."""

    def __init__(self, completions: ServingCompletions, tokenizer_path: str) -> None:
        self.completions = completions
        self.tokenizer = completions.tokenizer
        self.info = tokenizer_info(self.tokenizer, tokenizer_path, completions.max_model_len)

    async def tokenize(self, request: web.Request) -> web.Response:
        req: TokenizeRequest = decode_request(await request.read(), TokenizeRequest)
        self.completions.check_model(req.model)
        ids = self.token_ids(req)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return json_response(
            TokenizeResponse(len(ids), self.completions.max_model_len, ids, strs)
        )

    def token_ids(self, req: TokenizeRequest) -> list[int]:
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give either prompt (a string) or messages, not both", "prompt")
        if req.prompt is not None:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            return list(self.tokenizer.encode(req.prompt, add_special_tokens=special))
        messages = req.messages or []
        if not messages:
            raise bad_request("messages must hold at least one message", "messages")
        for i, message in enumerate(messages):
            check_message(i, message)
        text = render_chat(self.tokenizer, messages, req.add_generation_prompt)
        # add_special_tokens is false unless asked: the template already wrote BOS
        return list(self.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens)))

    async def detokenize(self, request: web.Request) -> web.Response:
        req: DetokenizeRequest = decode_request(await request.read(), DetokenizeRequest)
        self.completions.check_model(req.model)
        self.completions.check_ids(req.tokens, "tokens")
        return json_response(DetokenizeResponse(self.tokenizer.decode(req.tokens)))

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        return json_response(self.info)


def tokenizer_info(tokenizer: Any, path: str, max_model_len: int) -> dict[str, Any]:
    """The tokenizer's plain settings (as vLLM reports them), with the special tokens as
    strings, the chat template, and the served context length as model_max_length."""
    settings = getattr(tokenizer, "init_kwargs", {}) or {}
    info = {k: v for k, v in settings.items() if v is None or isinstance(v, (str, int, float))}
    info.update(
        tokenizer_class=type(tokenizer).__name__,
        tokenizer_path=path,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        pad_token=tokenizer.pad_token,
        chat_template=getattr(tokenizer, "chat_template", None),
        model_max_length=max_model_len,
    )
    return info


def json_response(payload: Any) -> web.Response:
    return web.Response(body=msgspec.json.encode(payload), content_type="application/json")
