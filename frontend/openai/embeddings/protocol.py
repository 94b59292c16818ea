"""Schemas of /v1/embeddings, in OpenAI's shapes (with vLLM's extra request fields)."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

# OpenAI's four input forms: a string, strings, one tokenized input, tokenized inputs
EmbeddingInput = str | list[str | int | list[int]]


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """Unknown fields are ignored, as OpenAI's API does."""

    input: EmbeddingInput
    model: str | None = None
    encoding_format: str = "float"  # "float" | "base64" (float32, little-endian)
    dimensions: Annotated[int, Meta(ge=1)] | None = None  # a Matryoshka model's width
    user: str | None = None
    # vLLM's: keep each input's last k tokens (-1: the context length); special tokens
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None  # vLLM's: None is the server's --pooler-config


class EmbeddingData(msgspec.Struct):
    index: int
    embedding: list[float] | str  # str: base64 of float32 little-endian
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
    object: str = "list"
