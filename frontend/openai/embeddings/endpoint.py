"""POST /v1/embeddings: each input pooled by the engine into one vector (OpenAI's API).

Every input is one prompt-only engine request with `SamplingParams.pooling` (the server's
`--pooler-config`, a request's `dimensions` and vLLM's `normalize`); all are sent at once and
the answer lists their vectors in input order. The engine pools the final hidden states
(engine_core/sample/pooling.py) and sends each vector, float32, on its request's finish row: "float"
answers those values as JSON numbers, "base64" their little-endian bytes, as OpenAI's does.
"""

from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from frontend.engine.client import EngineDeadError
from frontend.engine.group import EngineGroup
from frontend.engine.stream import OutputStream
from frontend.errors import bad_request
from frontend.openai.embeddings.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from frontend.openai.protocol.base import decode_request, split_prompts
from frontend.openai.serving.choices import (
    EngineRequestError,
    engine_error,
    json_response,
    prepare,
)
from frontend.openai.serving.served_model import ServedModel
from shared.messages import FinishReason, Pooling, Ready, SamplingParams, read_floats

ENCODINGS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingPlan:
    """A request, checked: its id, its inputs' token ids, the pooling they all get."""

    id: str
    created: int
    inputs: list[list[int]]
    pooling: Pooling
    encoding: str
    lora: str | None = None  # the LoRA adapter the request names as its model


class ServingEmbeddings:
    """The /v1/embeddings endpoint for one engine group and one served model."""

    def __init__(self, client: EngineGroup, served: ServedModel, ready: Ready) -> None:
        self.client = client
        self.served = served
        self.pooler = ready.pooler
        self.hidden_size = ready.hidden_size
        self.matryoshka = ready.matryoshka_dimensions

    async def handle(self, request: web.Request) -> web.Response:
        plan = await prepare(await request.read(), self.read)
        vectors = await self.embed(plan)
        data = [EmbeddingData(i, _encoded(v, plan.encoding)) for i, v in enumerate(vectors)]
        tokens = sum(len(ids) for ids in plan.inputs)
        return json_response(EmbeddingResponse(plan.id, plan.created,
                                               plan.lora or self.served.name, data,
                                               EmbeddingUsage(tokens, tokens)))

    def read(self, body: bytes) -> EmbeddingPlan:
        """Decode, check and tokenize a request body; raises a 4xx."""
        req = decode_request(body, EmbeddingRequest)
        lora = self.served.adapter_of(req.model)
        if req.encoding_format not in ENCODINGS:
            raise bad_request(f"encoding_format {req.encoding_format!r}: float or base64",
                              "encoding_format")
        pooling = Pooling(self.pooler.kind,
                          self.pooler.normalize if req.normalize is None else req.normalize,
                          self._dimensions(req.dimensions))
        inputs = [self._input_ids(x, req) for x in split_prompts(req.input, "input")]
        return EmbeddingPlan(f"embd-{uuid.uuid4().hex}", int(time.time()), inputs, pooling,
                             req.encoding_format, lora)

    def _dimensions(self, dimensions: int | None) -> int:
        """A request's `dimensions` (0: the model's width), as vLLM allows it: only on a
        Matryoshka model, and only a width it names (any up to its own if it names none)."""
        if dimensions is None or dimensions == self.hidden_size:
            return 0
        if self.matryoshka is None:
            raise bad_request(f"Model \"{self.served.name}\" does not support Matryoshka "
                              "representation: dimensions cannot change its embeddings' width",
                              "dimensions")
        allowed = self.matryoshka or range(1, self.hidden_size + 1)
        if dimensions not in allowed:
            widths = (", ".join(map(str, self.matryoshka)) if self.matryoshka
                      else f"1 to {self.hidden_size}")
            raise bad_request(f"dimensions {dimensions}: this model allows {widths}",
                              "dimensions")
        return dimensions

    def _input_ids(self, text_or_ids: str | list[int], req: EmbeddingRequest) -> list[int]:
        if text_or_ids == "":  # (as OpenAI's: not the embedding of a lone BOS token)
            raise bad_request("input must not be an empty string", "input")
        ids = (self.served.tokenizer.encode(text_or_ids,
                                            add_special_tokens=req.add_special_tokens)
               if isinstance(text_or_ids, str) else text_or_ids)
        if not ids:
            raise bad_request("input must not be empty (an input has no tokens)", "input")
        self.served.check_ids(ids, "input")
        keep = req.truncate_prompt_tokens
        if keep is not None:
            keep = self.served.max_model_len if keep == -1 else keep
            if keep == 0:
                raise bad_request("truncate_prompt_tokens must be -1 or at least 1",
                                  "truncate_prompt_tokens")
            ids = ids[-keep:]
        if len(ids) > self.served.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.served.max_model_len} tokens. "
                f"However, you requested {len(ids)} tokens in the input for embedding "
                "generation. Please reduce the length of the input.", "input")
        return list(ids)

    async def embed(self, plan: EmbeddingPlan) -> list[bytes]:
        """Every input's vector (float32 bytes), in input order; raises OpenAIError."""
        params = SamplingParams(max_tokens=0, pooling=plan.pooling, lora=plan.lora)
        streams: list[OutputStream] = []
        try:
            for i, ids in enumerate(plan.inputs):
                streams.append(self.client.add(f"{plan.id}-{i}", ids, params))
            return [await _vector(stream) for stream in streams]
        except (EngineRequestError, EngineDeadError) as exc:
            raise engine_error(exc, "input") from None
        finally:
            unfinished = [rid for stream in streams for rid in stream.unfinished]
            if unfinished:
                self.client.abort(unfinished)


async def _vector(stream: OutputStream) -> bytes:
    """The vector of the stream's one pooling request, once it finished."""
    vector = b""
    while items := await stream.get():
        for item in items:
            if item.finish_reason is FinishReason.ERROR:
                raise EngineRequestError(item.error or "the engine refused the input")
            if item.finish_reason is not None:
                vector = item.embedding
    if not vector:
        raise EngineDeadError("the engine ended an embedding request without its vector")
    return vector


def _encoded(vector: bytes, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector).decode("ascii")
    return read_floats(vector)

