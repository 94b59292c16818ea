"""Schemas of the tokenizer endpoints (/tokenize, /detokenize), in vLLM's shapes."""

from __future__ import annotations

import msgspec

from frontend.openai.protocol.chat import ChatMessage


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
