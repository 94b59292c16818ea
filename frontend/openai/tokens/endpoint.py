"""POST /tokenize, POST /detokenize, GET /tokenizer_info: the served tokenizer over HTTP.

The shapes are vLLM's, which lm-evaluation-harness's remote tokenizer
(`tokenizer_backend="remote"`) reads: it checks that /tokenizer_info answers with an
`eos_token` key, takes `eos_token`, `bos_token`, `pad_token` and `chat_template` from it,
encodes with `{"prompt": text, "add_special_tokens": false}` and reads `tokens`, decodes with
`{"tokens": ids}` and reads `prompt`.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from frontend.errors import bad_request
from frontend.openai.protocol.base import decode_request
from frontend.openai.serving.choices import json_response, prepare
from frontend.openai.serving.served_model import ServedModel
from frontend.openai.tokens.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)


class ServingTokens:
    """The tokenizer endpoints, for the served model's tokenizer."""

    def __init__(self, served: ServedModel, tokenizer_path: str) -> None:
        self.served = served
        self.tokenizer = served.tokenizer
        self.info = tokenizer_info(self.tokenizer, tokenizer_path, served.max_model_len)

    async def tokenize(self, request: web.Request) -> web.Response:
        return json_response(await prepare(await request.read(), self.tokenized))

    def tokenized(self, body: bytes) -> TokenizeResponse:
        req = decode_request(body, TokenizeRequest)
        self.served.check_model(req.model)
        ids = self.token_ids(req)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(len(ids), self.served.max_model_len, ids, strs)

    def token_ids(self, req: TokenizeRequest) -> list[int]:
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give either prompt (a string) or messages, not both", "prompt")
        if req.prompt is not None:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            return list(self.tokenizer.encode(req.prompt, add_special_tokens=special))
        text = self.served.render_chat(req.messages or [], req.add_generation_prompt)
        # add_special_tokens is false unless asked: the template already wrote BOS
        return list(self.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens)))

    async def detokenize(self, request: web.Request) -> web.Response:
        return json_response(await prepare(await request.read(), self.detokenized))

    def detokenized(self, body: bytes) -> DetokenizeResponse:
        req = decode_request(body, DetokenizeRequest)
        self.served.check_model(req.model)
        self.served.check_ids(req.tokens, "tokens")
        return DetokenizeResponse(self.tokenizer.decode(req.tokens))

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        return json_response(self.info)


def tokenizer_info(tokenizer: Any, path: str, max_model_len: int) -> dict[str, Any]:
    """The tokenizer's plain settings (as vLLM reports them), with the special tokens as
    strings, the chat template, and the served context length as model_max_length."""
    settings = getattr(tokenizer, "init_kwargs", {}) or {}
    info = {k: v for k, v in settings.items() if v is None or isinstance(v, (str, int, float))}
    info.update(
        tokenizer_class=getattr(tokenizer, "tokenizer_class", type(tokenizer).__name__),
        tokenizer_path=path,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        pad_token=tokenizer.pad_token,
        chat_template=getattr(tokenizer, "chat_template", None),
        model_max_length=max_model_len,
    )
    return info
